"""Independent reference of every policy loss (docs/design.md §4): value and dL/dp, float64 numpy.

Written from the formulas, not from the server code: plain loops over samples
and positions, explicit branch logic for the clipped minimum, analytic
gradients with respect to the per-token logprobs ``p``. `finite_difference`
checks the analytic gradients numerically.

Conventions (the documented server semantics): ``m = weights * mask`` (ones
when absent) multiplies each token's term; selected = ``m != 0``; grpo
normalises by the aggregation's denominator over the request.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

DEFAULTS = {
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {},
    "grpo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, "beta": 0.0, "ratio_type": "token",
             "aggregation": "token_mean", "horizon": 0},
    "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
}


def _bounds(prm, inp, n):
    """Per-position (lo, hi): Tinker's per-token clip thresholds in loss_fn_inputs override the config."""
    lo = np.asarray(inp["clip_low_threshold"], np.float64) if "clip_low_threshold" in inp \
        else np.full(n, float(prm["clip_low_threshold"]))
    hi = np.asarray(inp["clip_high_threshold"], np.float64) if "clip_high_threshold" in inp \
        else np.full(n, float(prm["clip_high_threshold"]))
    return lo, hi


def _m(inp: Mapping[str, np.ndarray], n: int) -> np.ndarray:
    m = np.ones(n)
    for k in ("weights", "mask"):
        if k in inp:
            m = m * np.asarray(inp[k], np.float64)
    return m


def _clipped_min(rho: float, a: float, lo: float, hi: float) -> tuple[float, float]:
    """(min(rho*a, clip(rho)*a), d/d rho of it)."""
    unclipped = rho * a
    c = min(max(rho, lo), hi)
    clipped = c * a
    if unclipped <= clipped:
        return unclipped, a
    return clipped, (a if lo < rho < hi else 0.0)


def reference(name: str, params: Mapping[str, Any], inputs: Sequence[Mapping[str, np.ndarray]],
              p: Sequence[np.ndarray]) -> tuple[float, list[np.ndarray]]:
    """Loss (float) and per-sample dL/dp ([n_i] float64) of loss `name` on logprobs `p`."""
    prm = {**DEFAULTS[name], **params}
    total = 0.0
    grads = []
    # request-wide counts for grpo
    sel_counts = [int((_m(inp, len(pi)) != 0).sum()) for inp, pi in zip(inputs, p)]
    G = len(inputs)
    N = sum(sel_counts)
    Gp = sum(1 for c in sel_counts if c > 0)
    for idx, (inp, pi) in enumerate(zip(inputs, p)):
        pi = np.asarray(pi, np.float64)
        n = len(pi)
        q = np.asarray(inp["logprobs"], np.float64)
        a = np.asarray(inp["advantages"], np.float64)
        m = _m(inp, n)
        g = np.zeros(n)
        if name == "importance_sampling":
            for t in range(n):
                r = math.exp(pi[t] - q[t])
                total += -m[t] * r * a[t]
                g[t] = -m[t] * r * a[t]
        elif name == "ppo":
            lo, hi = _bounds(prm, inp, n)
            for t in range(n):
                r = math.exp(pi[t] - q[t])
                v, dv = _clipped_min(r, a[t], lo[t], hi[t])
                total += -m[t] * v
                g[t] = -m[t] * dv * r
        elif name == "cispo":
            lo, hi = _bounds(prm, inp, n)
            for t in range(n):
                c = min(max(math.exp(pi[t] - q[t]), lo[t]), hi[t])
                total += -m[t] * c * a[t] * pi[t]
                g[t] = -m[t] * c * a[t]
        elif name == "dro":
            beta = prm["beta"]
            for t in range(n):
                d = pi[t] - q[t]
                total += -m[t] * (pi[t] * a[t] - 0.5 * beta * d * d)
                g[t] = -m[t] * (a[t] - beta * d)
        elif name == "grpo":
            lo, hi, beta = prm["clip_low_threshold"], prm["clip_high_threshold"], prm["beta"]
            agg = prm["aggregation"]
            ni = sel_counts[idx]
            if agg == "token_mean":
                D = max(N, 1)
            elif agg == "sequence_mean":
                D = max(ni, 1) * max(Gp, 1)
            else:
                D = G * prm["horizon"]
            sel = m != 0
            if prm["ratio_type"] == "sequence":
                s = math.exp(sum(pi[t] - q[t] for t in range(n) if sel[t]) / max(ni, 1))
                ds_total = 0.0  # sum_t m_t/D * d(-min)/ds
                for t in range(n):
                    v, dv = _clipped_min(s, a[t], lo, hi)
                    total += m[t] * (-v) / D
                    ds_total += m[t] * (-dv) / D
                for t in range(n):
                    if sel[t]:
                        g[t] += ds_total * s / max(ni, 1)
            else:
                for t in range(n):
                    r = math.exp(pi[t] - q[t])
                    v, dv = _clipped_min(r, a[t], lo, hi)
                    total += m[t] * (-v) / D
                    g[t] += m[t] * (-dv) * r / D
            if beta > 0:
                ref = np.asarray(inp["reference_logprobs"], np.float64)
                for t in range(n):
                    x = ref[t] - pi[t]
                    total += m[t] * beta * (math.exp(x) - x - 1) / D
                    g[t] += m[t] * beta * (1 - math.exp(x)) / D
        elif name == "gspo":
            # Tinker's GSPO-token: every token carries the value of s = exp(mean over the
            # sequence_ratio_mask positions of p - q) and the gradient of its own p only:
            # d s_t / d p_t = s, nothing through the mean.
            lo, hi = _bounds(prm, inp, n)
            members = [t for t in range(n) if float(inp["sequence_ratio_mask"][t]) != 0]
            s = math.exp(sum(pi[t] - q[t] for t in members) / len(members))
            for t in range(n):
                v, dv = _clipped_min(s, a[t], lo[t], hi[t])
                total += -m[t] * v
                g[t] = -m[t] * dv * s
        else:
            raise KeyError(name)
        grads.append(g)
    return total, grads


def _cispo_frozen(params, inputs, p0):
    """CISPO's value with stopgrad(clip(r)) frozen at p0: the function its gradient differentiates."""
    prm = {**DEFAULTS["cispo"], **params}

    def value(p):
        total = 0.0
        for inp, pi0, pi in zip(inputs, p0, p):
            m = _m(inp, len(pi))
            lo, hi = _bounds(prm, inp, len(pi))
            for t in range(len(pi)):
                c = min(max(math.exp(pi0[t] - float(inp["logprobs"][t])), lo[t]), hi[t])
                total += -m[t] * c * float(inp["advantages"][t]) * pi[t]
        return total

    return value


def _gspo_frozen(params, inputs, p0):
    """GSPO-token's value with stopgrad(s) and stopgrad(p_t) frozen at p0:
    s_t(p) = s(p0) * exp(p_t - p0_t), the function its gradient differentiates."""
    prm = {**DEFAULTS["gspo"], **params}

    def value(p):
        total = 0.0
        for inp, pi0, pi in zip(inputs, p0, p):
            n = len(pi)
            m = _m(inp, n)
            lo, hi = _bounds(prm, inp, n)
            q = np.asarray(inp["logprobs"], np.float64)
            members = [t for t in range(n) if float(inp["sequence_ratio_mask"][t]) != 0]
            s0 = math.exp(sum(pi0[t] - q[t] for t in members) / len(members))
            for t in range(n):
                st = s0 * math.exp(pi[t] - pi0[t])
                a = float(inp["advantages"][t])
                total += -m[t] * min(st * a, min(max(st, lo[t]), hi[t]) * a)
        return total

    return value


def finite_difference(name: str, params, inputs, p, eps: float = 1e-6) -> list[np.ndarray]:
    """Central differences of `reference`'s value with respect to each p_t (for cispo and gspo, of
    the value with the stop-gradient factors held at the base point, which is what they differentiate)."""
    if name in ("cispo", "gspo"):
        frozen = (_cispo_frozen if name == "cispo" else _gspo_frozen)(params, inputs, [np.array(x, np.float64) for x in p])
        assert abs(frozen(p) - reference(name, params, inputs, p)[0]) < 1e-9
        value = frozen
    else:
        def value(pp):
            return reference(name, params, inputs, pp)[0]
    out = []
    for i, pi in enumerate(p):
        g = np.zeros(len(pi))
        for t in range(len(pi)):
            plus = [np.array(x, np.float64) for x in p]
            minus = [np.array(x, np.float64) for x in p]
            plus[i][t] += eps
            minus[i][t] -= eps
            g[t] = (value(plus) - value(minus)) / (2 * eps)
        out.append(g)
    return out


def policy_inputs(p: Sequence[np.ndarray], seed: int, *, weights: bool = True, mask: bool = True,
                  reference_logprobs: bool = False, sequence_ratio_mask: bool = False,
                  per_token_clip: tuple[Sequence[float], Sequence[float]] | None = None) -> list[dict[str, np.ndarray]]:
    """Inputs around the true logprobs ``p``: sampler logprobs ``q = p - log(ratio)`` with
    ratios inside and outside every clip range on both sides, advantages of both signs and
    zero, masked positions, fractional weights. Kinks (ratio exactly at a bound) are avoided.

    ``sequence_ratio_mask``: add one (1 on a random ~70% of positions, never position 0,
    never empty), independent of weights/mask. ``per_token_clip=(lows, highs)``: add per-position
    ``clip_low_threshold``/``clip_high_threshold`` drawn from those values.
    """
    rng = np.random.default_rng(seed)
    ratios = np.array([0.3, 0.7, 0.85, 0.95, 1.0, 1.05, 1.15, 1.35, 2.0, 5.0])
    advs = np.array([-1.5, -0.5, 0.0, 0.5, 1.0, 2.0])
    out = []
    sel_masks = []
    for pi in p:
        n = len(pi)
        mk = (rng.random(n) > 0.25).astype(np.float32)
        mk[0] = 0.0  # e.g. a prompt position
        w = rng.choice([1.0, 0.5, 2.0, 0.0], size=n, p=[0.4, 0.25, 0.25, 0.1]).astype(np.float32)
        sel = np.ones(n, bool)
        if mask:
            sel &= mk != 0
        if weights:
            sel &= w != 0
        sel_masks.append((mk, w, sel))
    # Every ratio and advantage value lands on selected positions first (tiled over the
    # batch), so each clip side and each advantage sign is exercised where it counts.
    n_sel = sum(int(s.sum()) for _, _, s in sel_masks)
    r_sel = iter(rng.permutation(np.resize(ratios, n_sel)))
    a_sel = iter(rng.permutation(np.resize(advs, n_sel)))
    for pi, (mk, w, sel) in zip(p, sel_masks):
        n = len(pi)
        r = rng.choice(ratios, size=n)
        a = rng.choice(advs, size=n)
        for t in np.flatnonzero(sel):
            r[t], a[t] = next(r_sel), next(a_sel)
        inp = {
            "logprobs": (np.asarray(pi, np.float64) - np.log(r)).astype(np.float32),
            "advantages": a.astype(np.float32),
        }
        if mask:
            inp["mask"] = mk
        if weights:
            inp["weights"] = w
        if reference_logprobs:
            inp["reference_logprobs"] = (np.asarray(pi, np.float64) + rng.normal(0, 0.3, n)).astype(np.float32)
        if sequence_ratio_mask:
            srm = (rng.random(n) > 0.3).astype(np.float32)
            srm[0] = 0.0
            srm[-1] = 1.0
            inp["sequence_ratio_mask"] = srm
        if per_token_clip is not None:
            inp["clip_low_threshold"] = rng.choice(per_token_clip[0], size=n).astype(np.float32)
            inp["clip_high_threshold"] = rng.choice(per_token_clip[1], size=n).astype(np.float32)
        out.append(inp)
    return out
