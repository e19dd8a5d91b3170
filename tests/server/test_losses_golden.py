"""Golden value-and-gradient tests of every policy loss through a real resource (docs/design.md §4).

For each loss and parameter setting, on a batch of samples of different
lengths with negative, zero and positive advantages, ratios inside and
outside the clip range on both sides, masked positions and fractional
weights (sampler logprobs ``q`` are built from the true ``p`` of a forward
with return_logprobs, then offset):

* the server's loss, per-token logprobs, elementwise losses and metrics equal
  the independent reference in ``_loss_reference.py``;
* ``forward_backward(loss)`` + ``optim_step`` on one session gives the same
  adapter weights as ``custom_forward_backward(reference gradient)`` + the
  same ``optim_step`` on a second session with the same seed.

Tolerances (fp32 server, float64 reference): loss and metrics rtol 1e-5 /
atol 1e-5; weights atol 2e-7. The two paths feed dL/dp computed in float32 by
autograd vs. the float64 reference rounded to float32 (equal to a few ulps);
several losses give bit-identical weights, the others differ by <= ~1e-7
where a parameter's gradient nearly cancels (its float32 rounding noise,
~3e-8, is then a visible fraction of it). AdamW's eps=1e-2 bounds how much
an update amplifies that noise (d update / d g <= lr / eps = 1), as in
test_e2e_training.py; updates are ~1e-3..1e-2.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

import together_train as tt
from _loss_reference import policy_inputs, reference

VOCAB = 49152
ADAM = tt.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.99, eps=1e-2)

# (loss, params, policy_inputs options, sample lengths)
CONFIGS = {
    "is": ("importance_sampling", {}, {}, (9, 4, 14)),
    "is_plain": ("importance_sampling", {}, {"weights": False, "mask": False}, (6, 11)),
    "ppo": ("ppo", {}, {}, (9, 4, 14)),
    "ppo_tight": ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, {}, (12, 7, 3)),
    "cispo": ("cispo", {}, {}, (9, 4, 14)),
    "cispo_clip": ("cispo", {"clip_low_threshold": 0.5, "clip_high_threshold": 3.0}, {}, (12, 7, 3)),
    "dro": ("dro", {"beta": 0.1}, {}, (9, 4, 14)),
    "dro_beta0": ("dro", {"beta": 0.0}, {"weights": False}, (6, 11)),
    "grpo": ("grpo", {}, {}, (9, 4, 14)),
    "grpo_seqmean": ("grpo", {"aggregation": "sequence_mean"}, {"empty_last": True}, (9, 4, 14, 5)),
    "grpo_horizon": ("grpo", {"aggregation": "fixed_horizon", "horizon": 16}, {}, (9, 4, 14)),
    "gspo": ("grpo", {"ratio_type": "sequence", "clip_low_threshold": 0.97, "clip_high_threshold": 1.03,
                      "aggregation": "sequence_mean"}, {}, (9, 4, 14, 6)),
    "gspo_kl": ("grpo", {"ratio_type": "sequence", "beta": 0.05}, {"reference_logprobs": True}, (9, 4, 14)),
    "grpo_kl_horizon": ("grpo", {"beta": 0.1, "aggregation": "fixed_horizon", "horizon": 20},
                        {"reference_logprobs": True, "weights": False}, (12, 7, 3)),
    # Tinker's own loss names: gspo (GSPO-token, sequence ratio over sequence_ratio_mask) and
    # per-token clip thresholds in loss_fn_inputs (override loss_fn_config position by position).
    "tinker_gspo": ("gspo", {}, {"sequence_ratio_mask": True}, (9, 11, 13, 9, 7, 6)),  # s < 0.8 and > 1.2 occur
    "tinker_gspo_tight": ("gspo", {"clip_low_threshold": 0.97, "clip_high_threshold": 1.03},
                          {"sequence_ratio_mask": True}, (9, 4, 14, 6, 11)),
    "tinker_gspo_per_token": ("gspo", {}, {"sequence_ratio_mask": True, "mask": False,
                                           "per_token_clip": ((0.9, 0.95, 0.99), (1.01, 1.05, 1.1))},
                              (9, 4, 14, 6, 11)),
    "ppo_per_token": ("ppo", {}, {"per_token_clip": ((0.7, 0.8, 0.9), (1.1, 1.2, 1.5))}, (9, 4, 14)),
    "cispo_per_token": ("cispo", {"clip_high_threshold": 9.0},
                        {"per_token_clip": ((0.0, 0.5, 0.9), (1.5, 2.0, 4.0))}, (9, 4, 14)),
}


def _tokens(lengths, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=n + 1) for n in lengths]


def _adapter(info) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in load_file(str(Path(info.path) / "adapter_model.safetensors")).items()}


def _new_session(resource):
    return resource.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))


def true_logprobs(session, toks) -> list[np.ndarray]:
    samples = [tt.Sample(model_input=t[:-1], loss_fn_inputs={"target_tokens": t[1:], "weights": np.zeros(len(t) - 1, np.float32)})
               for t in toks]
    return session.forward(samples, "cross_entropy", return_logprobs=True).result(timeout=120).logprobs


def build(toks, p, seed, opts):
    opts = dict(opts)
    empty_last = opts.pop("empty_last", False)
    inputs = policy_inputs(p, seed, **opts)
    if empty_last:
        inputs[-1]["mask"] = np.zeros(len(p[-1]), np.float32)
    samples = [tt.Sample(model_input=t[:-1], loss_fn_inputs={"target_tokens": t[1:], **inp}) for t, inp in zip(toks, inputs)]
    return samples, inputs


@pytest.mark.parametrize("case", list(CONFIGS))
def test_loss_and_update_match_reference(resource, case):
    loss_fn, params, opts, lengths = CONFIGS[case]
    seed = sorted(CONFIGS).index(case)
    a, b = _new_session(resource), _new_session(resource)
    try:
        toks = _tokens(lengths, seed)
        p = true_logprobs(a, toks)
        samples, inputs = build(toks, p, seed, opts)
        fb = a.forward_backward(samples, loss_fn, params, return_logprobs=True, return_elementwise_loss=True)
        fb = fb.result(timeout=120)
        want, grads = reference(loss_fn, params, inputs, p)

        np.testing.assert_allclose(fb.loss, want, rtol=1e-5, atol=1e-5)
        assert fb.metrics["loss:sum"] == pytest.approx(fb.loss, rel=1e-6, abs=1e-7)
        np.testing.assert_allclose(sum(float(e.astype(np.float64).sum()) for e in fb.elementwise_loss), fb.loss,
                                   rtol=1e-5, atol=1e-5)
        for got, exp, n in zip(fb.logprobs, p, lengths):
            assert got.shape == (n,) and got.dtype == np.float32
            np.testing.assert_allclose(got, exp, rtol=0, atol=1e-6)  # every position, masked or not
        selected = [(inp.get("weights", 1.0) * inp.get("mask", 1.0)) * np.ones(len(inp["logprobs"])) != 0 for inp in inputs]
        assert fb.metrics["num_tokens:sum"] == sum(int(s.sum()) for s in selected)
        if loss_fn == "gspo" or loss_fn != "grpo" or params.get("ratio_type", "token") == "token":
            if loss_fn == "gspo":  # the sample's sequence ratio at each of its selected tokens
                seq = [np.full(len(pi), np.exp((pi.astype(np.float64) - inp["logprobs"])[inp["sequence_ratio_mask"] != 0].mean()))
                       for pi, inp in zip(p, inputs)]
            else:
                seq = [np.exp(pi.astype(np.float64) - inp["logprobs"]) for pi, inp in zip(p, inputs)]
            r = np.concatenate([x[s] for x, s in zip(seq, selected)])
            assert fb.metrics["ratio:mean"] == pytest.approx(r.mean(), rel=1e-5)
            if "clip_low_threshold" in params or loss_fn in ("ppo", "grpo", "gspo") or "clip_low_threshold" in inputs[0]:
                defaults = {"cispo": (0.0, 4.0)}.get(loss_fn, (0.8, 1.2))
                lo = np.concatenate([inp.get("clip_low_threshold", np.full(len(s), params.get("clip_low_threshold", defaults[0])))[s]
                                     for inp, s in zip(inputs, selected)])
                hi = np.concatenate([inp.get("clip_high_threshold", np.full(len(s), params.get("clip_high_threshold", defaults[1])))[s]
                                     for inp, s in zip(inputs, selected)])
                assert fb.metrics["clip_low_frac:mean"] == pytest.approx((r < lo).mean())
                assert fb.metrics["clip_high_frac:mean"] == pytest.approx((r > hi).mean())
                assert 0 < fb.metrics["clip_low_frac:mean"] and 0 < fb.metrics["clip_high_frac:mean"]
        if "reference_logprobs" in inputs[0]:
            x = np.concatenate([(inp["reference_logprobs"] - pi.astype(np.float64))[s] for pi, inp, s in zip(p, inputs, selected)])
            assert fb.metrics["kl:mean"] == pytest.approx((np.exp(x) - x - 1).mean(), rel=1e-4)

        targets_only = [tt.Sample(model_input=s.model_input, loss_fn_inputs={"target_tokens": s.loss_fn_inputs["target_tokens"]})
                        for s in samples]
        cfb = b.custom_forward_backward(targets_only, [g.astype(np.float32) for g in grads]).result(timeout=120)
        surrogate = sum(float(np.dot(g, pi.astype(np.float64))) for g, pi in zip(grads, p))
        np.testing.assert_allclose(cfb.loss, surrogate, rtol=1e-5, atol=1e-5)  # reported loss = sum g·p

        oa = a.optim_step(ADAM).result(timeout=120)
        ob = b.optim_step(ADAM).result(timeout=120)
        assert oa.grad_norm > 0
        np.testing.assert_allclose(oa.grad_norm, ob.grad_norm, rtol=1e-5)
        wa = _adapter(a.save_weights(f"golden-{case}").result(timeout=120))
        wb = _adapter(b.save_weights(f"golden-{case}").result(timeout=120))
        assert wa.keys() == wb.keys()
        moved = 0.0
        diff = max(float(np.abs(wa[k] - wb[k]).max()) for k in wa)
        print(case, "max weight difference", diff)
        for k in wa:
            np.testing.assert_allclose(wa[k], wb[k], rtol=0, atol=2e-7, err_msg=k)
            moved = max(moved, float(np.abs(wa[k]).max()) if "lora_B" in k else 0.0)
        assert moved > 1e-4  # the step did move the weights
    finally:
        a.stop()
        b.stop()


def test_forward_returns_the_same_loss_without_touching_gradients(resource):
    loss_fn, params, opts, lengths = CONFIGS["ppo"]
    s = _new_session(resource)
    try:
        toks = _tokens(lengths, 99)
        p = true_logprobs(s, toks)
        samples, inputs = build(toks, p, 99, opts)
        fwd = s.forward(samples, loss_fn, params, return_elementwise_loss=True).result(timeout=120)
        np.testing.assert_allclose(fwd.loss, reference(loss_fn, params, inputs, p)[0], rtol=1e-5, atol=1e-5)
        assert fwd.logprobs is None and len(fwd.elementwise_loss) == len(lengths)
        assert s.optim_step(ADAM).result(timeout=120).grad_norm == 0.0
    finally:
        s.stop()
