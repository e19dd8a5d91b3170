"""The independent reference (tests/_loss_reference.py) checked against finite differences,
and the server's loss functions (engine level, no process) checked against the reference.

Finite differences: central, eps 1e-6 in float64; tolerance rtol 1e-6 / atol 1e-7
(truncation error ~eps^2 * third derivative; no position sits on a clip kink).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _loss_reference import finite_difference, policy_inputs, reference
from test_losses_golden import CONFIGS


def _p(lengths, seed):
    rng = np.random.default_rng(seed)
    return [rng.uniform(-6.0, -0.05, size=n) for n in lengths]


def _inputs(case, p, seed):
    _, _, opts, _ = CONFIGS[case]
    opts = dict(opts)
    empty_last = opts.pop("empty_last", False)
    inputs = policy_inputs(p, seed, **opts)
    if empty_last:
        inputs[-1]["mask"] = np.zeros(len(p[-1]), np.float32)
    return inputs


@pytest.mark.parametrize("case", list(CONFIGS))
def test_reference_gradient_matches_finite_differences(case):
    loss_fn, params, _, lengths = CONFIGS[case]
    p = _p(lengths, 1)
    inputs = _inputs(case, p, 2)
    _, grads = reference(loss_fn, params, inputs, p)
    fd = finite_difference(loss_fn, params, inputs, p)
    for g, f in zip(grads, fd):
        np.testing.assert_allclose(g, f, rtol=1e-6, atol=1e-7)
    assert any(np.abs(g).max() > 0 for g in grads)


@pytest.mark.parametrize("case", list(CONFIGS))
def test_engine_loss_functions_match_reference(case):
    """The server's per-sample loss math (autograd) vs the reference (value and dL/dp)."""
    from together_train_server.engines import loss_specs, losses

    loss_fn, params, _, lengths = CONFIGS[case]
    p = _p(lengths, 3)
    inputs = _inputs(case, p, 4)
    spec = loss_specs.LOSS_SPECS[loss_fn]
    full = {q.name: q.default for q in spec.params if q.default is not None}
    full.update(params)
    batch = losses.batch_stats([{"target_tokens": np.zeros(len(pi)), **inp} for pi, inp in zip(p, inputs)])
    total, grads = 0.0, []
    for pi, inp in zip(p, inputs):
        lp = torch.tensor(pi, dtype=torch.float64, requires_grad=True)
        res = losses.compute_loss(loss_fn, lp, {k: torch.as_tensor(v, dtype=torch.float64) for k, v in inp.items()}, full, batch)
        s = res.elementwise.sum()
        s.backward()
        total += float(s.detach())
        grads.append(lp.grad.numpy())
    want, want_grads = reference(loss_fn, params, inputs, p)
    np.testing.assert_allclose(total, want, rtol=1e-10, atol=1e-12)
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-12)
