"""The math of every served loss (torch, docs/design.md §4); what each loss takes is `engines.loss_specs`.

Losses are **sums over tokens**; the
server never averages, except ``grpo``, whose ``aggregation`` parameter names
the normaliser explicitly (below).

Notation (per position ``t`` of one sample ``i``): ``p`` = current,
untempered logprob of the target token (nats), ``q`` = sampler logprob
(``loss_fn_inputs["logprobs"]``, of the temperature-scaled distribution the
tokens were drawn from), ``r = exp(p - q)``, ``A`` = advantage,
``ref`` = reference-policy logprob, ``stopgrad`` = no gradient flows through.

Selection (policy losses: importance_sampling, ppo, cispo, dro, gspo, grpo):
``m_t = weights_t * mask_t`` (each defaults to 1 when absent; any finite real
is accepted). ``m_t`` multiplies the token's term: ``l_t = m_t * term_t``, so
a fractional value scales that token's loss and its gradient linearly, and 0
removes it. A position is *selected* when ``m_t != 0``; token counts, the
ratio/clip/KL metrics, the GSPO sequence ratio and grpo's normalisers use the
selected positions (counts, not sums of ``m``). The per-token ``logprobs``
output is the true ``p`` at every position, selected or not.

Per-token clip thresholds (ppo, cispo, gspo): Tinker's optional ``loss_fn_inputs``
``clip_low_threshold`` / ``clip_high_threshold`` (float32 ``[n]``) replace the
parameters of the same name at every position; each value obeys the
parameter's range (``LossSpec.check_inputs``).

``gspo`` is Tinker's GSPO-token: the sequence ratio ``s`` over the positions its
required ``sequence_ratio_mask`` marks, with a stop-gradient so that each token
carries ``s``'s value and its own logprob's gradient; grpo's
``ratio_type="sequence"`` instead differentiates through the mean over the
selected positions (both use ``_sequence_log_ratio``). ``stable_reinforce`` is
listed, not served (``available=False``): its objective needs Tinker's
sampler-side stability records and is not published.

``elementwise_loss`` is each position's share of the request's loss, and the
reported loss is always the sum of ``elementwise_loss`` over all samples and
positions (for grpo the normaliser is inside each term).

GRPO aggregations (one request = the samples of one forward_backward call;
``G`` = number of samples in the request, ``n_i`` = selected positions of
sample ``i``, ``N = sum_i n_i``, ``G+`` = samples with ``n_i > 0``):

* ``token_mean``: ``L = sum_{i,t} m l / N`` (DAPO's token-level mean, Yu et
  al. 2025, arXiv:2503.14476, eq. 8).
* ``sequence_mean``: ``L = (1/G+) sum_i (1/n_i) sum_t m l`` (the original
  GRPO objective, Shao et al. 2024, arXiv:2402.03300, eq. 3; samples with no
  selected position are left out of the mean).
* ``fixed_horizon``: ``L = sum_{i,t} m l / (G * horizon)`` (Dr. GRPO, Liu et
  al. 2025, arXiv:2503.20783, which replaces 1/|o_i| by a constant, the
  generation budget; ``horizon`` must be given, > 0).

The normalisers are computed over the whole request before any
micro-batching, so a split request gives the unsplit result. Gradients of
several requests add up (each request normalised on its own).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from .loss_specs import LOSS_SPECS

__all__ = [
    "LossResult",
    "BatchStats",
    "batch_stats",
    "selection",
    "cross_entropy",
    "importance_sampling",
    "ppo",
    "cispo",
    "dro",
    "grpo",
    "gspo",
    "custom",
    "compute_loss",
    "finalize_metrics",
]


@dataclass
class LossResult:
    """Loss of one sample.

    Attributes:
        elementwise: float32 ``[n]`` tensor (differentiable), the loss at each
            position; the sample's loss is its sum.
        metrics: named scalars, each a *sum* over the sample's positions
            (summed across samples by the engine, then turned into means by
            ``finalize_metrics``). Keys starting with ``_`` are internal
            accumulators.
    """

    elementwise: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class BatchStats:
    """Request-wide counts the grpo normalisers need (computed before micro-batching).

    Attributes:
        num_samples: samples in the request (G).
        num_selected: selected positions over the request (N = sum_i n_i).
        num_nonempty: samples with at least one selected position (G+).
    """

    num_samples: int
    num_selected: int
    num_nonempty: int


def selection(inputs: Mapping[str, Any], n: int) -> Any:
    """``m = weights * mask`` (float32 ``[n]``, ones where absent); works on numpy or torch."""
    m = None
    for k in ("weights", "mask"):
        if k in inputs:
            m = inputs[k] if m is None else m * inputs[k]
    return m


def batch_stats(inputs_per_sample: Sequence[Mapping[str, Any]]) -> BatchStats:
    """Counts over a request's samples (numpy or torch ``loss_fn_inputs`` dicts)."""
    total, nonempty = 0, 0
    for inp in inputs_per_sample:
        n = len(inp["target_tokens"])
        m = selection(inp, n)
        k = n if m is None else int((m != 0).sum())
        total += k
        nonempty += k > 0
    return BatchStats(len(inputs_per_sample), total, nonempty)


def _sel(logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(m float [n], selected bool [n])."""
    m = selection(inputs, logprobs.shape[0])
    if m is None:
        m = torch.ones_like(logprobs)
    m = m.to(logprobs.dtype)
    return m, m != 0


def _ratio_metrics(r: torch.Tensor, sel: torch.Tensor, lo: Any = None, hi: Any = None) -> dict[str, float]:
    """Metric sums over selected positions; ``lo``/``hi``: float or per-position ``[n]`` bounds."""
    r = r.detach()
    out = {"num_tokens:sum": float(sel.sum()), "_ratio:sum": float(r[sel].sum())}
    if lo is not None:
        lo, hi = torch.as_tensor(lo, dtype=r.dtype).expand_as(r), torch.as_tensor(hi, dtype=r.dtype).expand_as(r)
        out["_clip_low:count"] = float((r[sel] < lo[sel]).sum())
        out["_clip_high:count"] = float((r[sel] > hi[sel]).sum())
    return out


def _clip_bounds(logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any],
                 lo_default: float, hi_default: float) -> tuple[Any, Any]:
    """(lo, hi): the per-token ``loss_fn_inputs`` thresholds where given (``[n]`` tensors), else the
    parameters (floats)."""
    lo: Any = float(params.get("clip_low_threshold", lo_default))
    hi: Any = float(params.get("clip_high_threshold", hi_default))
    if "clip_low_threshold" in inputs:
        lo = inputs["clip_low_threshold"].to(logprobs.dtype)
    if "clip_high_threshold" in inputs:
        hi = inputs["clip_high_threshold"].to(logprobs.dtype)
    return lo, hi


def _clamp(x: torch.Tensor, lo: Any, hi: Any) -> torch.Tensor:
    """clamp with float or ``[n]`` tensor bounds (torch.clamp takes both kinds, not mixed)."""
    if isinstance(lo, torch.Tensor) or isinstance(hi, torch.Tensor):
        lo = torch.as_tensor(lo, dtype=x.dtype).expand_as(x)
        hi = torch.as_tensor(hi, dtype=x.dtype).expand_as(x)
    return torch.clamp(x, lo, hi)


def _sequence_log_ratio(d: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """Mean of the log-ratios ``d = p - q`` over ``members`` (bool ``[n]``): log of GSPO's
    sequence ratio (Zheng et al. 2025, arXiv:2507.18071, eq. 7). 0 when there are none."""
    return (d * members.to(d.dtype)).sum() / max(int(members.sum()), 1)


def cross_entropy(logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor],
                  params: Mapping[str, Any] | None = None, batch: BatchStats | None = None) -> LossResult:
    """Weighted negative log-likelihood, ``l_t = -w_t * p_t`` (docs/design.md §4).

    Args:
        logprobs: ``[n]`` float32 logprobs ``p_t`` of the target tokens
            (differentiable).
        inputs: ``weights`` ``[n]`` (any real values; negative allowed).
        params, batch: unused.

    Returns:
        elementwise ``[n]`` loss; metrics (sums) ``loss:sum``,
        ``num_tokens:sum`` (positions with nonzero weight), ``weight:sum``.
    """
    w = inputs["weights"].to(logprobs.dtype)
    elementwise = -w * logprobs
    return LossResult(
        elementwise,
        {
            "loss:sum": float(elementwise.detach().sum()),
            "num_tokens:sum": float((w != 0).sum()),
            "weight:sum": float(w.sum()),
        },
    )


def importance_sampling(logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor],
                        params: Mapping[str, Any] | None = None, batch: BatchStats | None = None) -> LossResult:
    """Importance-weighted policy gradient, ``l_t = -m_t * r_t * A_t``, ``r_t = exp(p_t - q_t)``.

    Gradient: ``dl_t/dp_t = -m_t * r_t * A_t``. Sum over tokens.

    Args:
        logprobs: ``[n]`` float32 ``p`` (differentiable).
        inputs: ``logprobs`` (q), ``advantages`` (A), optional ``weights``/``mask``, each ``[n]``.

    Returns:
        elementwise ``[n]``; metric sums ``loss:sum``, ``num_tokens:sum`` (selected), ratio sum.
    """
    m, sel = _sel(logprobs, inputs)
    r = torch.exp(logprobs - inputs["logprobs"].to(logprobs.dtype))
    el = -m * r * inputs["advantages"].to(logprobs.dtype)
    return LossResult(el, {"loss:sum": float(el.detach().sum()), **_ratio_metrics(r, sel, None, None)})


def ppo(logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor],
        params: Mapping[str, Any] | None = None, batch: BatchStats | None = None) -> LossResult:
    """PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347, eq. 7), summed over tokens.

    ``l_t = -m_t * min(r_t A_t, clip(r_t, lo, hi) A_t)``; ``lo``/``hi`` are
    absolute ratio bounds (``clip_low_threshold``/``clip_high_threshold``).
    Where the clipped branch is the minimum (r > hi with A > 0, r < lo with
    A < 0) the gradient is 0.

    Returns:
        elementwise ``[n]``; metric sums ``loss:sum``, ``num_tokens:sum``,
        ratio sum and counts of selected tokens with r < lo / r > hi.
    """
    lo, hi = _clip_bounds(logprobs, inputs, params or {}, 0.8, 1.2)
    m, sel = _sel(logprobs, inputs)
    a = inputs["advantages"].to(logprobs.dtype)
    r = torch.exp(logprobs - inputs["logprobs"].to(logprobs.dtype))
    el = -m * torch.minimum(r * a, _clamp(r, lo, hi) * a)
    return LossResult(el, {"loss:sum": float(el.detach().sum()), **_ratio_metrics(r, sel, lo, hi)})


def cispo(logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor],
          params: Mapping[str, Any] | None = None, batch: BatchStats | None = None) -> LossResult:
    """CISPO (MiniMax-M1, arXiv:2506.13585, eq. 4), summed over tokens.

    ``l_t = -m_t * stopgrad(clip(r_t, lo, hi)) * A_t * p_t``; gradient
    ``dl_t/dp_t = -m_t * clip(r_t, lo, hi) * A_t`` (every token keeps a gradient).

    Returns:
        elementwise ``[n]``; metric sums as ``ppo``.
    """
    lo, hi = _clip_bounds(logprobs, inputs, params or {}, 0.0, 4.0)
    m, sel = _sel(logprobs, inputs)
    a = inputs["advantages"].to(logprobs.dtype)
    r = torch.exp(logprobs.detach() - inputs["logprobs"].to(logprobs.dtype))
    el = -m * _clamp(r, lo, hi) * a * logprobs
    return LossResult(el, {"loss:sum": float(el.detach().sum()), **_ratio_metrics(r, sel, lo, hi)})


def dro(logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor],
        params: Mapping[str, Any] | None = None, batch: BatchStats | None = None) -> LossResult:
    """DRO, ``l_t = -m_t * (p_t A_t - 0.5 beta (p_t - q_t)^2)``, summed over tokens.

    Gradient ``dl_t/dp_t = -m_t * (A_t - beta (p_t - q_t))``.

    Returns:
        elementwise ``[n]``; metric sums ``loss:sum``, ``num_tokens:sum``, ratio sum.
    """
    beta = float((params or {})["beta"])
    m, sel = _sel(logprobs, inputs)
    q = inputs["logprobs"].to(logprobs.dtype)
    a = inputs["advantages"].to(logprobs.dtype)
    d = logprobs - q
    el = -m * (logprobs * a - 0.5 * beta * d * d)
    return LossResult(el, {"loss:sum": float(el.detach().sum()),
                           **_ratio_metrics(torch.exp(d.detach()), sel, None, None)})


def grpo(logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor],
         params: Mapping[str, Any] | None = None, batch: BatchStats | None = None) -> LossResult:
    """GRPO / GSPO / Dr. GRPO with an optional k3 KL to a reference (see the module docstring).

    Per position: ``l_t = m_t * (-min(rho_t A_t, clip(rho_t, lo, hi) A_t) + beta * k3_t)``
    with ``rho_t = r_t`` (``ratio_type="token"``) or ``rho_t = s = exp(mean_{s in S}(p_s - q_s))``
    over the sample's selected positions S (``"sequence"``, GSPO, Zheng et al.
    2025, arXiv:2507.18071, eq. 7; the gradient flows through the mean to every
    selected position), and ``k3_t = exp(ref_t - p_t) - (ref_t - p_t) - 1``
    (Schulman 2020, "Approximating KL divergence"; as in Shao et al. 2024 eq. 4),
    added only when ``beta > 0``. ``elementwise_t = l_t / D``, ``D`` the
    aggregation's normaliser from ``batch`` (sequence_mean: ``n_i * G+``).

    Args:
        batch: request-wide counts (required).

    Returns:
        elementwise ``[n]`` (already normalised: the request's loss is the
        sum of every sample's elementwise); metric sums ``loss:sum``,
        ``num_tokens:sum``, ratio sum, clip counts, and the k3 KL sum over
        selected positions when ``reference_logprobs`` is given.
    """
    params = params or {}
    if batch is None:
        raise ValueError("grpo needs the request's BatchStats")
    lo, hi = float(params.get("clip_low_threshold", 0.8)), float(params.get("clip_high_threshold", 1.2))
    beta = float(params.get("beta", 0.0))
    m, sel = _sel(logprobs, inputs)
    a = inputs["advantages"].to(logprobs.dtype)
    d = logprobs - inputs["logprobs"].to(logprobs.dtype)
    n_sel = int(sel.sum())
    if params.get("ratio_type", "token") == "sequence":
        rho = torch.exp(_sequence_log_ratio(d, sel)).expand_as(d)
    else:
        rho = torch.exp(d)
    term = -torch.minimum(rho * a, torch.clamp(rho, lo, hi) * a)
    metrics = _ratio_metrics(rho, sel, lo, hi)
    if "reference_logprobs" in inputs:
        x = inputs["reference_logprobs"].to(logprobs.dtype) - logprobs
        k3 = torch.exp(x) - x - 1
        metrics["_kl:sum"] = float(k3.detach()[sel].sum())
        if beta > 0:
            term = term + beta * k3
    agg = params.get("aggregation", "token_mean")
    if agg == "token_mean":
        denom = float(max(batch.num_selected, 1))
    elif agg == "sequence_mean":
        denom = float(max(n_sel, 1) * max(batch.num_nonempty, 1))
    elif agg == "fixed_horizon":
        denom = float(batch.num_samples * int(params["horizon"]))
    else:
        raise ValueError(f"unknown aggregation {agg!r}")
    el = m * term / denom
    metrics["loss:sum"] = float(el.detach().sum())
    return LossResult(el, metrics)


def gspo(logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor],
         params: Mapping[str, Any] | None = None, batch: BatchStats | None = None) -> LossResult:
    """GSPO-token as Tinker documents it, summed over tokens (no normaliser).

    ``s = exp(mean_{t in M}(p_t - q_t))`` over ``M = {t: sequence_ratio_mask_t != 0}``
    (Zheng et al. 2025, arXiv:2507.18071, eq. 7); every token's ratio
    ``s_t = stopgrad(s) * exp(p_t - stopgrad(p_t))`` has the value ``s`` and the gradient
    of its own logprob only (GSPO-token, eq. 13), and
    ``l_t = -m_t * min(s_t A_t, clip(s_t, lo_t, hi_t) A_t)``. Hence
    ``dl_t/dp_t = -m_t * A_t * s`` unless the clipped branch is the minimum (then 0).
    Unlike grpo's ``ratio_type="sequence"``, no gradient flows through the mean, and
    ``M`` comes from ``sequence_ratio_mask``, not from weights/mask.

    Args:
        logprobs: ``[n]`` float32 ``p`` (differentiable).
        inputs: ``logprobs`` (q), ``advantages`` (A), ``sequence_ratio_mask``, optional
            ``weights``/``mask`` (m) and per-token ``clip_low_threshold``/``clip_high_threshold``.

    Returns:
        elementwise ``[n]``; metric sums ``loss:sum``, ``num_tokens:sum``, the sequence
        ratio summed over selected tokens and clip counts of it.
    """
    lo, hi = _clip_bounds(logprobs, inputs, params or {}, 0.8, 1.2)
    m, sel = _sel(logprobs, inputs)
    a = inputs["advantages"].to(logprobs.dtype)
    # s in float64, then rounded once: every token of the sample shares it, so a float32
    # rounding error in the mean would push all their gradients the same way (measured: up to
    # 5e-7 per token against the float64 reference, <= 6e-8 (one float32 ulp) this way).
    d = logprobs.detach().double() - inputs["logprobs"].double()
    s = torch.exp(_sequence_log_ratio(d, inputs["sequence_ratio_mask"] != 0)).to(logprobs.dtype)
    rho = s * torch.exp(logprobs - logprobs.detach())  # value s, d rho_t / d p_t = s
    el = -m * torch.minimum(rho * a, _clamp(rho, lo, hi) * a)
    return LossResult(el, {"loss:sum": float(el.detach().sum()), **_ratio_metrics(rho, sel, lo, hi)})


def custom(logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor],
           params: Mapping[str, Any] | None = None, batch: BatchStats | None = None) -> LossResult:
    """Client-differentiated loss: ``l_t = g_t * p_t`` with ``g = inputs["gradients"]``.

    Backpropagating ``sum_t l_t`` sends exactly ``g_t`` into ``dL/dp_t``; the
    reported loss is ``sum_t g_t * p_t`` (a surrogate, not the client's L).

    Returns:
        elementwise ``[n]``; metric sums ``loss:sum``, ``num_tokens:sum`` (positions with g != 0).
    """
    g = inputs["gradients"].to(logprobs.dtype)
    el = g * logprobs
    return LossResult(el, {"loss:sum": float(el.detach().sum()), "num_tokens:sum": float((g != 0).sum())})


_LOSS_FNS: dict[str, Callable[..., LossResult]] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "grpo": grpo,
    "gspo": gspo,
    "custom": custom,
}


def compute_loss(name: str, logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor],
                 params: Mapping[str, Any] | None = None, batch: BatchStats | None = None) -> LossResult:
    """Compute the loss ``name`` for one sample.

    Args:
        name: loss name.
        logprobs: ``[n]`` float32 differentiable target-token logprobs.
        inputs: the sample's ``loss_fn_inputs`` as tensors.
        params: parameters, defaults filled.
        batch: request-wide counts (``batch_stats``; grpo needs them).

    Raises:
        KeyError: unknown loss. NotImplementedError: declared but not available.
    """
    if name not in LOSS_SPECS:
        raise KeyError(f"unknown loss {name!r}; known: {sorted(LOSS_SPECS)}")
    fn = _LOSS_FNS.get(name)
    if fn is None or not LOSS_SPECS[name].available:
        raise NotImplementedError(f"loss {name!r} is not available in this release")
    return fn(logprobs, inputs, params or {}, batch)


def finalize_metrics(acc: Mapping[str, float]) -> dict[str, float]:
    """Turn metric sums accumulated over a request into the reported metrics.

    Sums keep their ``:sum`` keys (``loss:sum``, ``num_tokens:sum``,
    ``weight:sum``). Internal sums become means over the request's selected
    tokens (``num_tokens:sum``; unweighted): ``ratio:mean`` (the ratio the
    loss used: r_t, or the sequence ratio for grpo's ``sequence``),
    ``clip_low_frac:mean`` / ``clip_high_frac:mean`` (fraction of selected
    tokens whose ratio lies below ``lo`` / above ``hi``, whatever the sign of
    A), ``kl:mean`` (k3 estimate of KL(policy || reference) per selected token;
    grpo with reference_logprobs).
    """
    out = {k: float(v) for k, v in acc.items() if not k.startswith("_")}
    n = float(acc.get("num_tokens:sum", 0.0))
    names = {"_ratio:sum": "ratio:mean", "_clip_low:count": "clip_low_frac:mean",
             "_clip_high:count": "clip_high_frac:mean", "_kl:sum": "kl:mean"}
    for k, new in names.items():
        if k in acc:
            out[new] = float(acc[k]) / n if n > 0 else 0.0
    return out
