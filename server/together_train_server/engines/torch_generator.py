"""Generator engine: sampling and scoring with transformers + peft and a KV cache (CPU default).

Implements `interfaces.GeneratorEngine` (checks and ``generate``: `generator_base`).

Continuous batching
-------------------
One scheduler thread owns the model. ``generate`` (or ``submit``) validates
a request, pins the adapter it will use and queues it; between two decode
steps the scheduler

1. runs queued adapter loads/drops and ``compute_logprobs`` calls,
2. admits waiting requests (FIFO, while the batch holds fewer than
   ``max_batch_rows`` streams): their prompts are prefilled together in one
   left-padded forward (a request asking for prompt logprobs is prefilled on
   its own, as it needs the logits of every prompt position), the prompt
   cache row is repeated for the request's ``num_samples`` streams and the
   rows join the running batch,
3. samples one token for every row from its pending logits (rows grouped by
   their sampling parameters; each stream draws from its own generator),
   drops finished rows (their prompt + completion blocks go to the prefix
   cache), and
4. runs one decode forward over the remaining rows.

Per-row cache handling: the batch is one ``DynamicCache`` of shape
``[rows, heads, T, head_dim]`` plus a 0/1 ``attention_mask`` ``[rows, T]``
and a per-row position counter. Rows are *left-padded*: when rows of
different lengths meet (admission), the shorter side gets zero key/value
columns on the left, masked out, and every row keeps its own ``position_ids``
(the number of its real tokens), so a padded row computes what it would
alone. Columns that are padding for every row are trimmed after rows leave.
Numerically the batched and the unbatched paths differ only in matmul
shapes (last-bit differences; a test bounds them at 1e-5 and checks equal
tokens).

Adapters (`torch_adapters.PeftAdapters`): rows of one batch may use
different adapters (peft mixed-adapter inference, one forward); a request
pins the adapter version current when it is submitted, so weights never
change inside a sequence and ``GenOutput.adapter_version`` names the
version that produced every token of the request.

Sampling semantics (docs/design.md §7):

* logprobs of sampled tokens are of the temperature-scaled distribution
  ``log softmax(logits / T)`` *before* top-k/top-p truncation; at T = 0
  (greedy) they are of the T = 1 distribution ``log softmax(logits)``.
* a constrained request (``params.constraint``, engines/grammar.py) has the logits of the
  tokens its grammar forbids set to -inf before all of the above: its logprobs are those of
  that masked distribution, the one actually sampled.
* prompt logprobs, top-k prompt logprobs and ``compute_logprobs`` are
  untempered (T = 1), like training logprobs; so are the logprobs a request
  with ``params.top_logprobs`` set reports at each sampled position (the
  sampled token's and the k most likely, ``GenSequence.untempered_logprobs`` /
  ``top_logprobs``): taken from the row's logits in the same decode step,
  before the grammar mask, temperature and filters.
* stop strings are matched on the completion decoded with special tokens
  kept; the returned tokens end with the token that completed the stop
  string (the stop string's tokens are *included*, unlike vLLM's text, which
  drops the string). Stop token ids and EOS are included in ``tokens`` too.
* the i-th stream draws from its own ``torch.Generator`` seeded from
  ``(seed, i)`` (numpy ``SeedSequence``): one float64 uniform per token,
  inverted through the row's cumulative distribution, so the same seed gives
  the same tokens and the streams of one request differ, whatever else is
  batched.

Threads: the scheduler thread applies the torch thread count that was set
when the engine was built (``torch.set_num_threads`` in the replica
process), so the replica's thread budget holds for it too.
"""

from __future__ import annotations

import functools
import os
import secrets
import threading
from collections import deque
from concurrent.futures import Future, InvalidStateError
from typing import Any, Callable

import numpy as np
import torch

from .chunked_logprobs import chunk_rows, head_input, prompt_logprobs
from .grammar import GrammarMasks
from .generator_base import GeneratorEngineBase, GenRequest, eos_ids, stop_token_ids, stream_seed
from .kv_cache import make_growing
from .lora import default_target_modules
from .model_loading import load_causal_lm, resolve_model_dir
from .decode_requests import DecodeRequest, DecodeRow
from .prefix_cache import DEFAULT_BLOCK_SIZE, DEFAULT_PREFIX_CACHE_MB, PrefixCache, past_cache, supports_prefix_cache
from .request_prefix_cache import RequestPrefixCache
from .token_sampling import record_top_logprobs, sample_tokens, sampling_key
from .torch_adapters import BASE, PeftAdapters
from .types import GenOutput, GenSequence, SamplingParams

__all__ = ["TorchGeneratorEngine", "stream_seed"]



class TorchGeneratorEngine(PeftAdapters, GeneratorEngineBase):
    """Sampling and scoring engine over a frozen causal LM with named LoRA adapters.

    Args:
        model_dir: local Hugging Face directory, or ``None``/``"embedded"``.
        dtype: ``"float32"`` | ``"bfloat16"`` | ``"float16"`` (logprobs are
            computed in float32 from the logits).
        device: torch device string.
        max_batch_rows: streams decoded together at most (a request with more
            ``num_samples`` than this still runs, alone).
        max_prefill_tokens: padded prompt tokens per batched prefill forward.
        prefix_cache_mb: bound of the prefix cache in MiB (keys/values of prompts and of
            prompts + completions kept across requests, see ``prefix_cache.py``); 0 disables it.
            Models with sliding-window layers run without it.
        prefix_block_size: tokens per cached block; hits are multiples of it.

    Attributes:
        model_id, vocab_size, max_seq_len (prompt + completion tokens), dtype,
        eos_token_ids (from generation_config, else the tokenizer), tokenizer.

    Raises:
        FileNotFoundError: model directory missing.
    """

    def __init__(self, model_dir: str | os.PathLike | None, *, dtype: str = "float32",
                 device: str = "cpu", max_batch_rows: int = 256, max_prefill_tokens: int = 8192,
                 prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
                 prefix_block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        path = resolve_model_dir(model_dir)
        self.model_dir = path
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_batch_rows = int(max_batch_rows)
        self.max_prefill_tokens = int(max_prefill_tokens)
        self._base, self.tokenizer = load_causal_lm(path, dtype=dtype, device=device)
        cfg = self._base.config
        self.model_id = path.name
        self.vocab_size = int(self._base.get_output_embeddings().weight.shape[0])
        self.max_seq_len = int(getattr(cfg, "max_position_embeddings", 0) or 2048)
        self.lora_target_modules = default_target_modules(self._base)
        eos = getattr(self._base.generation_config, "eos_token_id", None)
        self.eos_token_ids: tuple[int, ...] = eos_ids(self.tokenizer.eos_token_id if eos is None else eos)
        self._num_threads = torch.get_num_threads()
        self._grammars = GrammarMasks(self.tokenizer, self.vocab_size, self.eos_token_ids)
        # _state guards the key -> adapter map, pins and the queues; the model itself
        # is only touched by the scheduler thread.
        self._state = threading.RLock()
        self._wake = threading.Condition(self._state)
        self._init_adapters()
        self._waiting: deque[DecodeRequest] = deque()
        self._tasks: deque[tuple[Callable[[], Any], Future]] = deque()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._sched_ident: int | None = None
        # batch state (scheduler thread only)
        self._rows: list[DecodeRow] = []
        self._cache = None
        self._mask: torch.Tensor | None = None       # int64 [rows, T]
        self._pos: torch.Tensor | None = None        # int64 [rows] position of the next token
        self._logits: torch.Tensor | None = None     # float32 [rows, V] pending logits
        self.stats = {"decode_steps": 0, "max_rows": 0, "prefills": 0, "prompt_tokens": 0, "cache_hit_tokens": 0,
                      "sampled_tokens": 0, "cached_sequences": 0}
        self.prefix_cache: PrefixCache | None = None
        if prefix_cache_mb < 0:
            raise ValueError(f"prefix_cache_mb must be >= 0, got {prefix_cache_mb}")
        if prefix_cache_mb > 0 and supports_prefix_cache(cfg):
            self.prefix_cache = PrefixCache(int(prefix_cache_mb * 2**20), prefix_block_size)
        self._prefix = RequestPrefixCache(self.prefix_cache, self.stats) if self.prefix_cache is not None else None

    # ------------------------------------------------------------------ scheduler plumbing
    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="torch-generator", daemon=True)
            self._thread.start()

    def _run_task(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the scheduler thread between two decode steps; returns its result."""
        if threading.get_ident() == self._sched_ident:
            return fn()
        fut: Future = Future()
        with self._wake:
            if self._closed:
                raise RuntimeError("generator engine is closed")
            self._tasks.append((fn, fut))
            self._ensure_thread()
            self._wake.notify()
        return fut.result()

    def close(self) -> None:
        """Stop the scheduler; queued and running requests fail with RuntimeError."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        self._sched_ident = threading.get_ident()
        torch.set_num_threads(self._num_threads)
        while True:
            with self._wake:
                while not (self._closed or self._tasks or self._waiting or self._rows):
                    self._wake.wait()
                if self._closed:
                    break
                tasks = list(self._tasks)
                self._tasks.clear()
            for fn, fut in tasks:
                try:
                    fut.set_result(fn())
                except BaseException as e:
                    fut.set_exception(e)
            try:
                with torch.inference_mode():
                    self._admit()
                    if self._rows:
                        self._step()
            except BaseException as e:
                self._fail_all(e)
        err = RuntimeError("generator engine is closed")
        with self._wake:
            waiting, self._waiting = list(self._waiting), deque()
            tasks, self._tasks = list(self._tasks), deque()
        for r in waiting:
            r.future.set_exception(err)
        for _, fut in tasks:
            fut.set_exception(err)
        self._fail_all(err)

    def _fail_all(self, err: BaseException) -> None:
        reqs = {id(r.req): r.req for r in self._rows}
        self._reset_batch()
        for req in reqs.values():
            self._finish(req, err)

    def _reset_batch(self) -> None:
        self._rows, self._cache, self._mask, self._pos, self._logits = [], None, None, None, None

    def _enqueue(self, r: GenRequest) -> Future:
        """`submit` (see `interfaces.GeneratorEngine.submit`) on this engine: ``on_token`` is called on the
        scheduler thread as each token is sampled; a cancelled request is not prefilled if still queued,
        and its rows leave the batch at the next decode step."""
        prompt, p, n, adapter, on_token = r.prompt, r.params, r.num_samples, r.adapter, r.on_token
        base_seed = p.seed if p.seed is not None else secrets.randbits(63)
        stop_ids = stop_token_ids(p, self.eos_token_ids)
        req = DecodeRequest(
            prompt=prompt, params=p, n=n, adapter=None, want_plp=r.prompt_logprobs,
            top_k_plp=r.top_k_prompt_logprobs, future=Future(),
            gens=[torch.Generator(device="cpu").manual_seed(stream_seed(base_seed, i)) for i in range(n)],
            budget=min(int(p.max_tokens), self.max_seq_len - len(prompt)),
            stop_ids=frozenset(stop_ids), max_stop=max((len(s) for s in p.stop), default=0),
            tokens=[[] for _ in range(n)], lps=[[] for _ in range(n)], reasons=[None] * n,
            ulps=[[] for _ in range(n)] if p.top_logprobs is not None else None,
            tops=[[] for _ in range(n)] if p.top_logprobs is not None else None,
            texts=[""] * n, open_streams=n, on_token=on_token,
            matchers=self._grammars.matchers(p.constraint, n) if p.constraint is not None else None,
        )
        with self._wake:
            if self._closed:
                raise RuntimeError("generator engine is closed")
            req.adapter = self._resolve(adapter)
            if req.adapter is not None:
                req.adapter.refs += 1
            self._waiting.append(req)
            self._ensure_thread()
            self._wake.notify()
        return req.future

    # ------------------------------------------------------------------ scheduler steps
    def _admit(self) -> None:
        """Move waiting requests into the batch (prefill), FIFO, within max_batch_rows."""
        while True:
            group: list[DecodeRequest] = []
            with self._state:
                rows = len(self._rows)
                longest = 0
                while self._waiting:
                    r = self._waiting[0]
                    if r.future.cancelled():         # its caller is gone (see submit): never prefilled
                        self._waiting.popleft()
                        self._finish(r)
                        continue
                    if rows > 0 and rows + r.n > self.max_batch_rows:
                        break
                    if r.want_plp or r.top_k_plp > 0:
                        if group:
                            break            # prefilled alone, next round
                        group.append(self._waiting.popleft())
                        rows += r.n
                        break
                    longest2 = max(longest, len(r.prompt))
                    if group and longest2 * (len(group) + 1) > self.max_prefill_tokens:
                        break
                    group.append(self._waiting.popleft())
                    longest = longest2
                    rows += r.n
            if not group:
                return
            for part in (self._prefix.split_shared(group) if self._prefix is not None else [group]):
                try:
                    self._prefill(part)
                except BaseException as e:
                    for r in part:
                        self._finish(r, e)

    def _prefill(self, group: list[DecodeRequest]) -> None:
        """Prefill ``group`` in one forward and join its rows to the batch.

        With the prefix cache, row ``i`` reuses ``c_i`` cached prompt tokens
        (whole blocks, at most ``len(prompt) - 1``): the forward's past holds
        them in the last ``c_i`` of ``P = max c_i`` columns, its input the
        remaining ``s_i`` tokens right-aligned in ``S = max s_i`` columns;
        masked zeros fill the gaps and each row's ``position_ids`` count its
        real tokens, so row ``i`` computes what its full prefill would (up to
        matmul-shape rounding). The new whole blocks are then cached.
        """
        from transformers.cache_utils import DynamicCache

        self.stats["prefills"] += 1
        want_all = len(group) == 1 and (group[0].want_plp or group[0].top_k_plp > 0)
        pc = None if want_all else self._prefix    # prompt logprobs need every position's logits: no reuse
        hits = [pc.lookup(r) if pc is not None else [] for r in group]
        bs = pc.block_size if pc is not None else 1
        past = [len(h) * bs for h in hits]
        P = max(past)
        S = max(len(r.prompt) - c for r, c in zip(group, past))
        ids = torch.zeros((len(group), S), dtype=torch.long)
        mask = torch.zeros((len(group), P + S), dtype=torch.long)
        for i, (r, c) in enumerate(zip(group, past)):
            r.hit = c
            s = len(r.prompt) - c
            ids[i, S - s:] = torch.as_tensor(r.prompt[c:])
            mask[i, P - c:P] = 1
            mask[i, P + S - s:] = 1
            self.stats["prompt_tokens"] += len(r.prompt)
            self.stats["cache_hit_tokens"] += c
        names = [r.adapter.name if r.adapter is not None else BASE for r in group]
        cache = DynamicCache(config=self._base.config) if P == 0 else past_cache(self._base.config, hits, P)
        make_growing(cache)                      # decode steps append in place, no torch.cat per step
        kw: dict[str, Any] = {}
        if mask.min() == 0 or P > 0:
            kw = {"attention_mask": mask.to(self.device),
                  "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)[:, P:].to(self.device)}

        # The head sees the last position only, as a contiguous [G, 1, H] (head_input): transformers'
        # logits_to_keep=1 hands it a strided view, which costs a copy of the head weight per row.
        scorer = functools.partial(self._score_prompt, group[0]) if want_all else None
        with head_input((self._peft if self._peft is not None else self._base), scorer, keep_last=True):
            out = self._forward(names, input_ids=ids.to(self.device), cache=cache, use_cache=True, **kw)
        if self._prefix is not None:
            self._prefix.store_prompts(group, cache, P + S)
        last = out.logits.float()[:, -1]                         # [G, V]
        # one cache row per stream
        rep = torch.tensor([i for i, r in enumerate(group) for _ in range(r.n)], device=self.device)
        if len(rep) != len(group) or not torch.equal(rep.cpu(), torch.arange(len(group))):
            for layer in cache.layers:
                layer.keys = layer.keys.index_select(0, rep)
                layer.values = layer.values.index_select(0, rep)
        new_rows = [DecodeRow(r, s) for r in group for s in range(r.n)]
        new_mask = mask.to(self.device).index_select(0, rep)
        new_pos = torch.tensor([len(row.req.prompt) for row in new_rows], dtype=torch.long, device=self.device)
        new_logits = last.index_select(0, rep)
        self._merge(new_rows, cache, new_mask, new_pos, new_logits)

    def _score_prompt(self, r: DecodeRequest, head: torch.nn.Module, hidden: torch.Tensor) -> None:
        """Set ``r``'s prompt logprobs (and top-k) from its prefill's ``hidden`` [1, L, H], the head applied in
        chunks of positions (chunked_logprobs): no [L, V] logits."""
        if len(r.prompt) > 1:
            tgt = torch.tensor(r.prompt[1:], device=hidden.device)
            lp, v, i = prompt_logprobs(head, hidden[0, :-1], tgt, rows=chunk_rows(self.vocab_size),
                                       top_k=r.top_k_plp)
            if r.want_plp:
                r.plp = lp.cpu().tolist()
            if r.top_k_plp > 0:
                r.topk = list(zip(i.cpu().tolist(), v.cpu().tolist()))
        else:
            r.plp = [] if r.want_plp else None
            r.topk = [] if r.top_k_plp > 0 else None

    def _merge(self, rows: list[DecodeRow], cache, mask: torch.Tensor, pos: torch.Tensor,
               logits: torch.Tensor) -> None:
        """Append rows (with their cache, mask [n, T'], positions, pending logits) to the batch."""
        if not self._rows:
            self._rows, self._cache, self._mask, self._pos, self._logits = list(rows), cache, mask, pos, logits
            return
        T, Tn = self._mask.shape[1], mask.shape[1]

        def lpad(t: torch.Tensor, by: int) -> torch.Tensor:  # pad dim -2 (cache) on the left
            if by == 0:
                return t
            shape = list(t.shape)
            shape[-2] = by
            return torch.cat([t.new_zeros(shape), t], dim=-2)

        for mine, theirs in zip(self._cache.layers, cache.layers):
            mine.keys = torch.cat([lpad(mine.keys, max(0, Tn - T)), lpad(theirs.keys, max(0, T - Tn))], 0)
            mine.values = torch.cat([lpad(mine.values, max(0, Tn - T)), lpad(theirs.values, max(0, T - Tn))], 0)
        self._mask = torch.cat([lpad(self._mask[..., None], max(0, Tn - T))[..., 0],
                                lpad(mask[..., None], max(0, T - Tn))[..., 0]], 0)
        self._pos = torch.cat([self._pos, pos])
        self._logits = torch.cat([self._logits, logits])
        self._rows.extend(rows)

    def _step(self) -> None:
        """Sample a token for every row, drop finished rows, decode the rest one position."""
        rows = self._rows
        self.stats["max_rows"] = max(self.stats["max_rows"], len(rows))
        self.stats["sampled_tokens"] += len(rows)  # one token per row below (a cancelled row's last)
        toks, lps = self._sample_rows(rows)
        keep: list[int] = []
        done: list[DecodeRequest] = []
        for i, row in enumerate(rows):
            req, s = row.req, row.stream
            req.tokens[s].append(toks[i])
            req.lps[s].append(lps[i])
            if req.on_token is not None:
                try:
                    req.on_token(s, toks[i], lps[i])
                except Exception:
                    req.on_token = None
            req.reasons[s] = self._stop_reason(req, s, toks[i])
            if req.reasons[s] is None:
                keep.append(i)
            else:
                req.open_streams -= 1
                if req.open_streams == 0:
                    done.append(req)
        if len(keep) < len(rows):
            toks = self._drop_finished(rows, keep, toks)
        for req in done:
            self._finish(req)
        if self._rows:
            self._decode(toks)

    def _sample_rows(self, rows: list[DecodeRow]) -> tuple[list[int], list[float]]:
        """One token per row from the pending logits, and its (tempered) logprob; rows grouped by sampling
        parameters (same params => same math as the unbatched path)."""
        groups: dict[SamplingParams, list[int]] = {}
        for i, row in enumerate(rows):
            groups.setdefault(sampling_key(row.req.params), []).append(i)
        report = [i for i, row in enumerate(rows) if row.req.ulps is not None]
        if report:  # before the grammar mask below
            untempered = torch.log_softmax(self._logits if len(report) == len(rows) else self._logits[report], dim=-1)
        else:
            untempered = None
        if any(row.req.matchers for row in rows):  # constrained rows: forbidden tokens' logits to -inf
            self._grammars.mask_(self._logits, [r.req.matchers[r.stream] if r.req.matchers else None for r in rows])
        toks = [0] * len(rows)
        lps = [0.0] * len(rows)
        for idx in groups.values():
            p = rows[idx[0]].req.params
            sel = self._logits if len(idx) == len(rows) else self._logits[idx]
            t, lp = sample_tokens(sel, p, [rows[i].req.gens[rows[i].stream] for i in idx])
            for j, i in enumerate(idx):
                toks[i], lps[i] = t[j], lp[j]
        if untempered is not None:
            record_top_logprobs(rows, report, untempered, toks)
        return toks, lps

    def _stop_reason(self, req: DecodeRequest, s: int, t: int) -> str | None:
        """Why stream ``s`` of ``req`` ends after its token ``t`` (already appended), or None to go on."""
        p = req.params
        if req.future.cancelled():               # its caller is gone: free the rows now
            return "cancelled"
        if t in req.stop_ids:
            return "stop"
        if req.matchers is not None and not self._grammars.advance(req.matchers[s], t):
            return "stop"                        # the grammar is finished (or broken): nothing may follow
        if p.stop:
            text = self.tokenizer.decode(req.tokens[s], skip_special_tokens=False)
            start = max(0, len(req.texts[s]) - req.max_stop - 8)
            req.texts[s] = text
            if any(x in text[start:] for x in p.stop):
                return "stop"
        return "length" if len(req.tokens[s]) >= req.budget else None

    def _decode(self, toks: list[int]) -> None:
        """Feed each remaining row its sampled token (``toks``, in row order): one forward, one position."""
        n = len(self._rows)
        self._mask = torch.cat([self._mask, self._mask.new_ones((n, 1))], 1)
        kw: dict[str, Any] = {}
        if self._mask.min() == 0:
            kw["attention_mask"] = self._mask
        kw["position_ids"] = self._pos[:, None]
        names = [r.req.adapter.name if r.req.adapter is not None else BASE for r in self._rows]
        ids = torch.tensor(toks, dtype=torch.long, device=self.device)[:, None]
        out = self._forward(names, input_ids=ids, cache=self._cache, use_cache=True, **kw)
        self._logits = out.logits[:, -1].float()
        self._pos = self._pos + 1
        self.stats["decode_steps"] += 1

    def _drop_finished(self, rows: list[DecodeRow], keep: list[int], toks: list[int]) -> list[int]:
        """Cache the finished rows' prompt + completion blocks, then keep only the rows `keep` (indices into
        `rows`) in the KV cache, mask and positions, trimming columns that are padding for every remaining row.
        Returns the remaining rows' sampled tokens, in the new row order."""
        if self._prefix is not None:
            self._prefix.store_finished(rows, keep, self._cache, self._mask)
        if not keep:
            self._reset_batch()
            return []
        k = torch.tensor(keep, device=self.device)
        for layer in self._cache.layers:
            layer.keys = layer.keys.index_select(0, k)
            layer.values = layer.values.index_select(0, k)
        self._mask = self._mask.index_select(0, k)
        self._pos = self._pos.index_select(0, k)
        self._rows = [rows[i] for i in keep]
        first = int(self._mask.any(0).nonzero()[0])
        if first > 0:
            for layer in self._cache.layers:
                layer.keys = layer.keys[:, :, first:].contiguous()
                layer.values = layer.values[:, :, first:].contiguous()
            self._mask = self._mask[:, first:]
        return [toks[i] for i in keep]

    def _finish(self, req: DecodeRequest, err: BaseException | None = None) -> None:
        self._unpin(req.adapter)
        if req.future.done():
            return
        try:  # the caller may cancel the future at any moment (InvalidStateError then)
            if err is not None:
                req.future.set_exception(err)
                return
            seqs = [GenSequence(tokens=req.tokens[s], logprobs=req.lps[s], stop_reason=req.reasons[s] or "length",
                                untempered_logprobs=req.ulps[s] if req.ulps is not None else None,
                                top_logprobs=req.tops[s] if req.tops is not None else None)
                    for s in range(req.n)]
            req.future.set_result(GenOutput(
                sequences=seqs, prompt_logprobs=req.plp, top_k_prompt_logprobs=req.topk,
                adapter_version=req.adapter.version if req.adapter is not None else None,
                prompt_cache_hit_tokens=req.hit))
        except InvalidStateError:
            pass

    # ------------------------------------------------------------------ scoring
    def compute_logprobs(self, sequences: list[list[int]], adapter: str | None = None) -> list[np.ndarray]:
        """Untempered ``log p(tokens[i+1] | tokens[:i+1])`` for each sequence.

        One right-padded batch forward with an attention mask, run between two
        decode steps with the adapter current at that moment.

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

        def run() -> list[np.ndarray]:
            with self._state:
                a = self._resolve(adapter)
            out: list[np.ndarray] = []

            def score(head: torch.nn.Module, hidden: torch.Tensor) -> None:   # the head in chunks: no [T, V]
                for i, n in enumerate(lens):
                    tgt = ids[i, 1:n].to(hidden.device)
                    lp, _, _ = prompt_logprobs(head, hidden[i, : n - 1], tgt, rows=chunk_rows(self.vocab_size))
                    out.append(lp.cpu().numpy().astype(np.float32))

            with torch.inference_mode(), head_input((self._peft if self._peft is not None else self._base), score):
                self._forward([a.name if a is not None else BASE], input_ids=ids.to(self.device),
                              attention_mask=mask.to(self.device), use_cache=False)
            return out

        return self._run_task(run)

