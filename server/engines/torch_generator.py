"""Generator engine: sampling and scoring with transformers + peft and a KV cache (CPU default).

One base model holds one named peft adapter per key (a session's pushed
weights). ``generate`` runs its own decode loop over a ``DynamicCache``: the
prompt is prefilled once, the cache is repeated for the ``num_samples``
streams, and all streams decode together (finished streams leave the batch).
Thread-safe: every public method holds an internal lock.

Sampling semantics (DESIGN §7):

* logprobs of sampled tokens are of the temperature-scaled distribution
  ``log softmax(logits / T)`` *before* top-k/top-p truncation; at T = 0
  (greedy) they are of the T = 1 distribution ``log softmax(logits)``.
* prompt logprobs, top-k prompt logprobs and ``compute_logprobs`` are
  untempered (T = 1), like training logprobs.
* stop strings are matched on the completion decoded with special tokens
  kept; the returned tokens end with the token that completed the stop
  string (the stop string's tokens are *included*, unlike vLLM's text, which
  drops the string). Stop token ids and EOS are included in ``tokens`` too.
* the i-th stream draws from its own ``torch.Generator`` seeded from
  ``(seed, i)`` (numpy ``SeedSequence``), so the same seed gives the same
  tokens and the streams of one request differ.
"""

from __future__ import annotations

import os
import secrets
import threading
from contextlib import nullcontext
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .lora import default_target_modules, make_lora_config, quiet_peft
from .model_loading import load_causal_lm, resolve_model_dir
from .types import GenOutput, GenParams, GenSequence, LoraSpec

__all__ = ["TorchGeneratorEngine", "stream_seed"]


def stream_seed(seed: int, index: int) -> int:
    """64-bit seed of stream ``index`` of a request seeded with ``seed`` (any int)."""
    ss = np.random.SeedSequence([int(seed) & 0xFFFFFFFFFFFFFFFF, int(index)])
    return int(ss.generate_state(1, dtype=np.uint64)[0] & 0x7FFFFFFFFFFFFFFF)


def _lora_shape_key(spec: LoraSpec, targets: Sequence[str]) -> tuple:
    # same key => same parameter shapes => tensors can be overwritten in place
    return (int(spec.rank), tuple(sorted(spec.target_modules or targets)), bool(spec.train_unembed))


class TorchGeneratorEngine:
    """Sampling and scoring engine over a frozen causal LM with named LoRA adapters.

    Args:
        model_dir: local Hugging Face directory, or ``None``/``"embedded"``.
        dtype: ``"float32"`` | ``"bfloat16"`` | ``"float16"`` (logprobs are
            computed in float32 from the logits).
        device: torch device string.

    Attributes:
        model_id, vocab_size, max_seq_len (prompt + completion tokens), dtype,
        eos_token_ids (from generation_config, else the tokenizer), tokenizer.

    Raises:
        FileNotFoundError: model directory missing.
    """

    def __init__(self, model_dir: str | os.PathLike | None, *, dtype: str = "float32",
                 device: str = "cpu") -> None:
        path = resolve_model_dir(model_dir)
        self.model_dir = path
        self.device = torch.device(device)
        self.dtype = dtype
        self._base, self.tokenizer = load_causal_lm(path, dtype=dtype, device=device)
        cfg = self._base.config
        self.model_id = path.name
        self.vocab_size = int(self._base.get_output_embeddings().weight.shape[0])
        self.max_seq_len = int(getattr(cfg, "max_position_embeddings", 0) or 2048)
        self.lora_target_modules = default_target_modules(self._base)
        eos = getattr(self._base.generation_config, "eos_token_id", None)
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(
            int(e) for e in ([] if eos is None else (eos if isinstance(eos, (list, tuple)) else [eos])))
        self._lock = threading.RLock()
        self._peft = None
        self._adapters: dict[str, tuple[str, tuple]] = {}   # key -> (peft name, shape key)
        self._counter = 0
        self._pending_delete: list[str] = []   # peft cannot delete its last adapter

    # ------------------------------------------------------------------ adapters
    @property
    def adapter_keys(self) -> list[str]:
        """Keys of the loaded adapters."""
        with self._lock:
            return list(self._adapters)

    def load_adapter(self, key: str, spec: LoraSpec, tensors: dict[str, torch.Tensor]) -> None:
        """Load (or replace) the adapter ``key`` from PEFT state-dict tensors.

        ``tensors`` uses the keys of ``peft.get_peft_model_state_dict`` (as
        produced by ``TorchTrainerEngine.adapter_tensors``). When ``key``
        exists with the same LoRA shape (rank, targets, train_unembed) the
        tensors are copied in place; otherwise a new adapter replaces it.
        The tensors are checked (exact key set, shapes, finite values) before
        anything changes.

        Raises:
            ValueError: invalid spec, missing/unexpected keys, shape mismatch,
                non-finite values. The previous adapter under ``key`` is kept.
        """
        from peft import get_peft_model, get_peft_model_state_dict

        with self._lock, torch.no_grad():
            shape_key = _lora_shape_key(spec, self.lora_target_modules)
            old = self._adapters.get(key)
            if old is not None and old[1] == shape_key:
                self._check_tensors(get_peft_model_state_dict(self._peft, adapter_name=old[0],
                                                              save_embedding_layers=False), tensors)
                self._copy_tensors(old[0], tensors)
                return
            config = make_lora_config(spec, self.lora_target_modules, str(self.model_dir))
            self._counter += 1
            name = f"gen{self._counter}"
            with quiet_peft():
                if self._peft is None:
                    self._peft = get_peft_model(self._base, config, adapter_name=name)
                else:
                    self._peft.add_adapter(name, config)
            try:
                expected = get_peft_model_state_dict(self._peft, adapter_name=name,
                                                     save_embedding_layers=False)
                self._check_tensors(expected, tensors)
                self._copy_tensors(name, tensors)
            except Exception:
                self._pending_delete.append(name)
                self._flush_pending_deletes()
                raise
            self._adapters[key] = (name, shape_key)
            if old is not None:
                self._pending_delete.append(old[0])
            self._flush_pending_deletes()

    @staticmethod
    def _check_tensors(expected: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
        missing = sorted(set(expected) - set(tensors))
        extra = sorted(set(tensors) - set(expected))
        if missing or extra:
            raise ValueError(f"adapter tensors do not match the LoRA config: missing {missing[:3]}"
                             f"{'...' if len(missing) > 3 else ''}, unexpected {extra[:3]}"
                             f"{'...' if len(extra) > 3 else ''}")
        for k, ref in expected.items():
            t = tensors[k]
            if tuple(t.shape) != tuple(ref.shape):
                raise ValueError(f"adapter tensor {k}: shape {tuple(t.shape)} != {tuple(ref.shape)}")
            if not torch.isfinite(t).all():
                raise ValueError(f"adapter tensor {k}: non-finite values")

    def _copy_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict

        res = set_peft_model_state_dict(self._peft, tensors, adapter_name=name)
        unexpected = getattr(res, "unexpected_keys", None) or []
        if unexpected:
            raise ValueError(f"adapter tensors not loaded: {unexpected[:3]}")

    def drop_adapter(self, key: str) -> None:
        """Remove the adapter ``key``. Raises KeyError if unknown."""
        with self._lock:
            try:
                name, _ = self._adapters.pop(key)
            except KeyError:
                raise KeyError(f"unknown adapter {key!r}") from None
            self._pending_delete.append(name)
            self._flush_pending_deletes()

    def _flush_pending_deletes(self) -> None:
        live = [n for n, _ in self._adapters.values()]
        for name in list(self._pending_delete):
            if not live:
                break  # peft needs one adapter; deleted after the next load
            if name in self._peft.active_adapters:
                self._peft.set_adapter(live[0])
            self._peft.delete_adapter(name)
            self._pending_delete.remove(name)

    def _model_ctx(self, adapter: str | None):
        """(model, context manager) that runs with ``adapter`` (None = base model)."""
        if adapter is None:
            if self._peft is None:
                return self._base, nullcontext()
            return self._peft, self._peft.disable_adapter()
        try:
            name, _ = self._adapters[adapter]
        except KeyError:
            raise KeyError(f"unknown adapter {adapter!r}") from None
        if self._peft.active_adapters != [name]:
            self._peft.set_adapter(name)
        return self._peft, nullcontext()

    # ------------------------------------------------------------------ validation
    def _check_tokens(self, tokens: Sequence[int], what: str) -> None:
        if len(tokens) == 0:
            raise ValueError(f"{what}: empty")
        if len(tokens) > self.max_seq_len:
            raise ValueError(f"{what}: {len(tokens)} tokens > max_seq_len {self.max_seq_len}")
        arr = np.asarray(tokens, dtype=np.int64)
        if arr.min() < 0 or arr.max() >= self.vocab_size:
            raise ValueError(f"{what}: token id out of range [0, {self.vocab_size})")

    @staticmethod
    def _check_params(p: GenParams, num_samples: int, top_k_prompt: int) -> None:
        if int(p.max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1, got {p.max_tokens}")
        if not (p.temperature >= 0 and np.isfinite(p.temperature)):
            raise ValueError(f"temperature must be finite and >= 0, got {p.temperature}")
        if p.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {p.top_k}")
        if not 0 < p.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p.top_p}")
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if top_k_prompt < 0:
            raise ValueError(f"top_k_prompt_logprobs must be >= 0, got {top_k_prompt}")
        if any(not s for s in p.stop):
            raise ValueError("stop strings must be non-empty")

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompt: list[int],
        params: GenParams,
        num_samples: int = 1,
        adapter: str | None = None,
        prompt_logprobs: bool = False,
        top_k_prompt_logprobs: int = 0,
    ) -> GenOutput:
        """Sample ``num_samples`` completions of ``prompt``.

        Stops a stream at (first match wins, checked after each token): a
        stop token id or EOS (unless ``ignore_eos``) → ``"stop"``; a stop
        string in the decoded completion → ``"stop"``; ``max_tokens`` new
        tokens or the model's context (``len(prompt) + len(tokens) ==
        max_seq_len``) → ``"length"``.

        Args:
            prompt: token ids, ``1 <= len(prompt) < max_seq_len``.
            params: see :class:`GenParams`.
            num_samples: number of streams (>= 1).
            adapter: adapter key, or None for the base model.
            prompt_logprobs: return ``log p(prompt[i+1] | prompt[:i+1])`` (untempered).
            top_k_prompt_logprobs: also the k most likely tokens per prompt position.

        Returns:
            GenOutput with one GenSequence per stream (logprobs in nats).

        Raises:
            KeyError: unknown adapter. ValueError: bad prompt or parameters.
        """
        self._check_tokens(prompt, "prompt")
        if len(prompt) >= self.max_seq_len:
            raise ValueError(f"prompt: {len(prompt)} tokens leave no room below max_seq_len "
                             f"{self.max_seq_len}")
        self._check_params(params, num_samples, top_k_prompt_logprobs)
        with self._lock, torch.inference_mode():
            model, ctx = self._model_ctx(adapter)
            with ctx:
                return self._generate(model, list(map(int, prompt)), params, int(num_samples),
                                      prompt_logprobs, int(top_k_prompt_logprobs))

    def _generate(self, model, prompt, p: GenParams, n: int, want_plp: bool, top_k_plp: int) -> GenOutput:
        from transformers.cache_utils import DynamicCache

        want_all = want_plp or top_k_plp > 0
        cache = DynamicCache(config=self._base.config)
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        out = model(input_ids=ids, cache=cache, use_cache=True,
                    logits_to_keep=0 if want_all else 1)
        logits = out.logits[0].float()                       # [L or 1, V]
        plp = topk = None
        if want_all and len(prompt) > 1:
            logp = torch.log_softmax(logits[:-1], dim=-1)    # [L-1, V]
            tgt = torch.tensor(prompt[1:], device=logp.device)
            if want_plp:
                plp = logp.gather(-1, tgt[:, None]).squeeze(-1).cpu().tolist()
            if top_k_plp > 0:
                v, i = torch.topk(logp, min(top_k_plp, logp.shape[-1]), dim=-1)
                topk = list(zip(i.cpu().tolist(), v.cpu().tolist()))
        elif want_all:
            plp = [] if want_plp else None
            topk = [] if top_k_plp > 0 else None
        next_logits = logits[-1:].expand(n, -1)              # one prefill, shared by all streams
        if n > 1:
            cache.batch_repeat_interleave(n)

        base_seed = p.seed if p.seed is not None else secrets.randbits(63)
        gens = [torch.Generator(device="cpu").manual_seed(stream_seed(base_seed, i)) for i in range(n)]
        budget = min(int(p.max_tokens), self.max_seq_len - len(prompt))
        stop_ids = set(int(t) for t in p.stop_token_ids)
        if not p.ignore_eos:
            stop_ids |= set(self.eos_token_ids)
        max_stop = max((len(s) for s in p.stop), default=0)

        tokens: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[float]] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n
        texts = [""] * n
        active = list(range(n))                              # stream index of each batch row
        for _ in range(budget):
            toks, tok_lps = self._sample(next_logits, p, [gens[s] for s in active])
            keep_rows = []
            for row, s in enumerate(active):
                t = toks[row]
                tokens[s].append(t)
                lps[s].append(tok_lps[row])
                if t in stop_ids:
                    reasons[s] = "stop"
                elif p.stop:
                    text = self.tokenizer.decode(tokens[s], skip_special_tokens=False)
                    start = max(0, len(texts[s]) - max_stop - 8)
                    texts[s] = text
                    if any(x in text[start:] for x in p.stop):
                        reasons[s] = "stop"
                if reasons[s] is None:
                    keep_rows.append(row)
            if not keep_rows or len(tokens[active[0]]) >= budget:
                break
            if len(keep_rows) < len(active):
                cache.batch_select_indices(torch.tensor(keep_rows, device=self.device))
                active = [active[r] for r in keep_rows]
            step_ids = torch.tensor([[tokens[s][-1]] for s in active], dtype=torch.long,
                                    device=self.device)
            next_logits = model(input_ids=step_ids, cache=cache, use_cache=True).logits[:, -1].float()
        seqs = [GenSequence(tokens=tokens[s], logprobs=lps[s], stop_reason=reasons[s] or "length")
                for s in range(n)]
        return GenOutput(sequences=seqs, prompt_logprobs=plp, top_k_prompt_logprobs=topk)

    @staticmethod
    def _sample(logits: torch.Tensor, p: GenParams, gens: list[torch.Generator]):
        """Pick one token per row of ``logits`` [B, V] (float32); returns (ids, logprobs)."""
        if p.temperature == 0:
            logp = torch.log_softmax(logits, dim=-1)
            ids = torch.argmax(logits, dim=-1)
            return ids.tolist(), logp.gather(-1, ids[:, None]).squeeze(-1).tolist()
        logp = torch.log_softmax(logits / float(p.temperature), dim=-1)   # reported distribution
        masked = logp
        if p.top_k and p.top_k < logp.shape[-1]:
            kth = torch.topk(masked, int(p.top_k), dim=-1).values[:, -1:]
            masked = masked.masked_fill(masked < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_lp, order = torch.sort(masked, dim=-1, descending=True)
            probs = torch.softmax(sorted_lp, dim=-1)
            # drop a token when the mass before it already reaches top_p (keeps >= 1 token)
            drop = (torch.cumsum(probs, dim=-1) - probs) >= float(p.top_p)
            sorted_lp = sorted_lp.masked_fill(drop, float("-inf"))
            masked = torch.full_like(masked, float("-inf")).scatter(-1, order, sorted_lp)
        probs = torch.softmax(masked, dim=-1)
        ids = [int(torch.multinomial(probs[r], 1, generator=g)) for r, g in enumerate(gens)]
        idx = torch.tensor(ids, device=logits.device)
        return ids, logp.gather(-1, idx[:, None]).squeeze(-1).tolist()

    # ------------------------------------------------------------------ scoring
    def compute_logprobs(self, sequences: list[list[int]], adapter: str | None = None) -> list[np.ndarray]:
        """Untempered ``log p(tokens[i+1] | tokens[:i+1])`` for each sequence.

        One right-padded batch forward with an attention mask.

        Returns:
            per sequence a float32 array of length ``len(tokens) - 1`` (nats).

        Raises:
            KeyError: unknown adapter. ValueError: empty batch or sequence,
            token out of range, sequence longer than ``max_seq_len``.
        """
        if not sequences:
            raise ValueError("empty batch")
        for i, s in enumerate(sequences):
            self._check_tokens(s, f"sequence {i}")
        lens = [len(s) for s in sequences]
        ids = torch.zeros((len(sequences), max(lens)), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(sequences):
            ids[i, : lens[i]] = torch.as_tensor(list(map(int, s)))
            mask[i, : lens[i]] = 1
        with self._lock, torch.inference_mode():
            model, ctx = self._model_ctx(adapter)
            with ctx:
                logits = model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                               use_cache=False).logits
            out = []
            for i, n in enumerate(lens):
                logp = torch.log_softmax(logits[i, : n - 1].float(), dim=-1)
                tgt = ids[i, 1:n].to(logp.device)
                out.append(logp.gather(-1, tgt[:, None]).squeeze(-1).cpu().numpy().astype(np.float32))
            return out
