"""Picking the next token of each batch row from its logits under `SamplingParams` (pure tensor math).

`TorchGeneratorEngine` groups its rows by `sampling_key`, draws each group with `sample_tokens`, and for
requests that asked for ``top_logprobs`` records the untempered distribution with `record_top_logprobs`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .decode_requests import DecodeRow
from .types import SamplingParams

__all__ = ["sample_tokens", "sampling_key", "record_top_logprobs"]


def sampling_key(p: SamplingParams) -> SamplingParams:
    """What `sample_tokens` reads of `p` (the temperature and the token filters), as a key grouping the batch's
    rows: every other field (length, seed, stops, the grammar: masked before grouping, what is reported) is
    cleared, so a new filter field groups by itself."""
    return dataclasses.replace(p, max_tokens=1, seed=None, stop=(), stop_token_ids=(), ignore_eos=False, constraint=None,
                               top_logprobs=None)


def sample_tokens(logits: torch.Tensor, p: SamplingParams,
                  gens: list[torch.Generator]) -> tuple[list[int], list[float]]:
    """Pick one token per row of ``logits`` [B, V] (float32), row i from ``gens[i]``; returns (ids, logprobs)."""
    if p.temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)
        ids = torch.argmax(logits, dim=-1)
        return ids.tolist(), logp.gather(-1, ids[:, None]).squeeze(-1).tolist()
    temp = float(p.temperature)              # x / 1.0 == x: no [B, V] division at T = 1
    logp = torch.log_softmax(logits if temp == 1.0 else logits / temp, dim=-1)   # reported distribution
    masked = logp
    if p.min_p > 0.0:  # vLLM's order: temperature, min_p, then top-k / top-p
        floor = logp.max(dim=-1, keepdim=True).values + float(np.log(p.min_p))
        masked = masked.masked_fill(masked < floor, float("-inf"))
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
    # Inverse-CDF draw, one uniform per row from that stream's generator (vectorised:
    # per-row torch.multinomial costs ~30 ms a row on a 49k vocabulary on CPU).
    # x lies in (0, total], so the first index whose cumulative weight reaches x
    # has positive weight: masked-out tokens are never drawn.
    cdf = torch.cumsum(torch.exp(masked), dim=-1)                      # [B, V] unnormalised
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in gens]).to(cdf.device)
    x = ((1.0 - u) * cdf[:, -1].double()).to(cdf.dtype)
    idx = torch.searchsorted(cdf, x[:, None]).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)
    return idx.tolist(), logp.gather(-1, idx[:, None]).squeeze(-1).tolist()


def record_top_logprobs(rows: list[DecodeRow], report: list[int], untempered: torch.Tensor, toks: list[int]) -> None:
    """Append, for the rows `report` (their request set ``params.top_logprobs``), the sampled token's
    untempered logprob and the k most likely tokens' (``untempered`` = log_softmax of their logits
    [len(report), V], float32; ``toks`` the tokens sampled for every row)."""
    ids = torch.tensor([toks[i] for i in report], device=untempered.device)
    chosen = untempered.gather(-1, ids[:, None]).squeeze(-1).tolist()
    kmax = min(max(rows[i].req.params.top_logprobs or 0 for i in report), untempered.shape[-1])
    vals, idx = torch.topk(untempered, kmax, dim=-1) if kmax else (untempered[:, :0], ids[:, None][:, :0])
    vals_l, idx_l = vals.tolist(), idx.tolist()
    for j, i in enumerate(report):
        req, s = rows[i].req, rows[i].stream
        k = req.params.top_logprobs or 0
        assert req.ulps is not None and req.tops is not None
        req.ulps[s].append(chosen[j])
        req.tops[s].append((idx_l[j][:k], vals_l[j][:k]))
