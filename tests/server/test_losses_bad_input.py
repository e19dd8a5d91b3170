"""Every bad policy-loss / custom_forward_backward request: a clear INVALID_ARGUMENT naming the
field (and sample), and the session's accumulated gradient left exactly as it was.

Technique of test_e2e_bad_input.py: a session accumulates one good batch, receives the bad
request, then takes an optim_step whose pre-clip gradient norm must equal the baseline's.
"""

from __future__ import annotations

import numpy as np
import pytest

import together_train as tt
from together_train import errors

VOCAB = 49152


def good_batch() -> list[tt.Sample]:
    rng = np.random.default_rng(0)
    toks = rng.integers(0, VOCAB, size=(2, 9))
    return [tt.Sample(model_input=t[:-1], loss_fn_inputs={"target_tokens": t[1:], "weights": np.ones(8, np.float32)})
            for t in toks]


def policy_batch(n=6, **extra) -> list[tt.Sample]:
    rng = np.random.default_rng(1)
    t = rng.integers(0, VOCAB, size=n + 1)
    inputs = {"target_tokens": t[1:], "logprobs": np.full(n, -10.0, np.float32),
              "advantages": np.linspace(-1, 1, n).astype(np.float32)}
    inputs.update(extra)
    return [tt.Sample(model_input=t[:-1], loss_fn_inputs=inputs)]


def second_bad(**extra) -> list[tt.Sample]:
    """A good policy sample, then one with `extra` in its loss_fn_inputs (errors must name sample 1)."""
    good, bad = policy_batch()[0], policy_batch(**extra)[0]
    common = {k: v for k, v in extra.items() if k == "sequence_ratio_mask"}  # gspo requires it on both
    return [tt.Sample(model_input=good.model_input, loss_fn_inputs={**good.loss_fn_inputs, **common}), bad]


_SRM = np.array([0, 1, 1, 1, 1, 1], np.float32)


def targets_only(n=6) -> list[tt.Sample]:
    t = np.arange(1, n + 2)
    return [tt.Sample(model_input=t[:-1], loss_fn_inputs={"target_tokens": t[1:]})]


@pytest.fixture(scope="module")
def baseline(resource):
    s = resource.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
    try:
        s.forward_backward(good_batch(), "cross_entropy").result(timeout=120)
        return s.optim_step(tt.AdamParams(learning_rate=1e-3)).result(timeout=120).grad_norm
    finally:
        s.stop()


def fb(loss, cfg=None, batch=None):
    return lambda s: s.forward_backward(batch or policy_batch(), loss, cfg, validate=False)


def custom(samples, grads):
    return lambda s: s.custom_forward_backward(samples, grads, validate=False)


# case -> (request, error class, sample_index, key, words in the message)
CASES = {
    "unknown_param": (fb("ppo", {"clip_lo": 0.8}), errors.InvalidArgumentError, None, "clip_lo", "unknown parameter"),
    "param_of_other_loss": (fb("ppo", {"beta": 0.1}), errors.InvalidArgumentError, None, "beta", "parameter of dro, grpo"),
    "param_for_is": (fb("importance_sampling", {"clip_high_threshold": 1.2}), errors.InvalidArgumentError, None,
                     "clip_high_threshold", "takes no parameters"),
    "ppo_low_above_one": (fb("ppo", {"clip_low_threshold": 1.2}), errors.InvalidArgumentError, None,
                          "clip_low_threshold", "(0, 1]"),
    "ppo_low_zero": (fb("ppo", {"clip_low_threshold": 0.0}), errors.InvalidArgumentError, None,
                     "clip_low_threshold", "(0, 1]"),
    "ppo_high_below_one": (fb("ppo", {"clip_high_threshold": 0.9}), errors.InvalidArgumentError, None,
                           "clip_high_threshold", ">= 1"),
    "grpo_high_below_one": (fb("grpo", {"clip_high_threshold": 0.5}), errors.InvalidArgumentError, None,
                            "clip_high_threshold", ">= 1"),
    "cispo_low_negative": (fb("cispo", {"clip_low_threshold": -0.1}), errors.InvalidArgumentError, None,
                           "clip_low_threshold", "[0, 1]"),
    "dro_missing_beta": (fb("dro", {}), errors.InvalidArgumentError, None, "beta", "requires parameter 'beta'"),
    "dro_negative_beta": (fb("dro", {"beta": -1.0}), errors.InvalidArgumentError, None, "beta", ">= 0"),
    "grpo_bad_aggregation": (fb("grpo", {"aggregation": "mean"}), errors.InvalidArgumentError, None,
                             "aggregation", "one of"),
    "grpo_bad_ratio_type": (fb("grpo", {"ratio_type": "seq"}), errors.InvalidArgumentError, None,
                            "ratio_type", "one of"),
    "grpo_horizon_missing": (fb("grpo", {"aggregation": "fixed_horizon"}), errors.InvalidArgumentError, None,
                             "horizon", "horizon > 0"),
    "grpo_horizon_fraction": (fb("grpo", {"aggregation": "fixed_horizon", "horizon": 2.5}),
                              errors.InvalidArgumentError, None, "horizon", "integer"),
    "grpo_kl_without_reference": (fb("grpo", {"beta": 0.1}), errors.InvalidArgumentError, 0,
                                  "reference_logprobs", "beta > 0"),
    "policy_missing_advantages": (fb("ppo", None, [tt.Sample(model_input=[1, 2], loss_fn_inputs={
        "target_tokens": [2, 3], "logprobs": np.zeros(2, np.float32)})]), errors.InvalidArgumentError, 0,
        "advantages", "missing required"),
    "policy_nan_mask": (fb("ppo", None, policy_batch(mask=np.array([1, np.nan, 1, 1, 1, 1], np.float32))),
                        errors.InvalidArgumentError, 0, "mask", "non-finite"),
    "policy_short_weights": (fb("grpo", None, policy_batch(weights=np.ones(5, np.float32))),
                             errors.InvalidArgumentError, 0, "weights", "as long as model_input"),
    "ratio_overflow": (fb("importance_sampling", None, [tt.Sample(
        model_input=[1, 2, 3], loss_fn_inputs={"target_tokens": [2, 3, 4], "logprobs": np.full(3, -3e38, np.float32),
                                               "advantages": np.ones(3, np.float32)})]),
                       errors.InvalidArgumentError, None, None, "not finite"),
    # Tinker's per-token clip thresholds (loss_fn_inputs) obey the parameter's bounds at every position.
    "ppo_per_token_low_zero": (fb("ppo", None, second_bad(clip_low_threshold=np.array([.8, .8, 0, .8, .8, .8], np.float32))),
                               errors.InvalidArgumentError, 1, "clip_low_threshold", "(0, 1] at every position"),
    "cispo_per_token_low_negative": (fb("cispo", None, second_bad(clip_low_threshold=np.full(6, -0.5, np.float32))),
                                     errors.InvalidArgumentError, 1, "clip_low_threshold", "got -0.5 at position 0"),
    "gspo_per_token_high_below_one": (fb("gspo", None, second_bad(sequence_ratio_mask=_SRM, clip_high_threshold=np.array(
        [1.2, 1.2, 1.2, 1.2, 0.95, 1.2], np.float32))), errors.InvalidArgumentError, 1, "clip_high_threshold",
        ">= 1 at every position"),
    "per_token_clip_for_is": (fb("importance_sampling", None, policy_batch(clip_low_threshold=np.full(6, .8, np.float32))),
                              errors.InvalidArgumentError, 0, "clip_low_threshold", "unknown loss_fn_inputs key"),
    "gspo_missing_ratio_mask": (fb("gspo"), errors.InvalidArgumentError, 0, "sequence_ratio_mask", "missing required"),
    "gspo_empty_ratio_mask": (fb("gspo", None, second_bad(sequence_ratio_mask=np.zeros(6, np.float32))),
                              errors.InvalidArgumentError, 0, "sequence_ratio_mask", "marks no position"),
    "gspo_low_above_one": (fb("gspo", {"clip_low_threshold": 1.5}, policy_batch(sequence_ratio_mask=_SRM)),
                           errors.InvalidArgumentError, None, "clip_low_threshold", "(0, 1]"),
    "stable_reinforce_refused": (fb("stable_reinforce"), errors.UnimplementedError, None, "loss_fn",
                                 "'stable_reinforce' is not implemented by this resource: Tinker's StableReinforce"),
    "custom_count": (custom(targets_only(), [np.ones(6, np.float32)] * 2), errors.InvalidArgumentError, None,
                     "gradients", "one per sample"),
    "custom_length": (custom(targets_only(), [np.ones(5, np.float32)]), errors.InvalidArgumentError, 0,
                      "gradients", "shape"),
    "custom_nan": (custom(targets_only(), [np.array([1, 2, np.inf, 0, 0, 0], np.float32)]),
                   errors.InvalidArgumentError, 0, "gradients", "non-finite"),
    "custom_int": (custom(targets_only(), [np.ones(6, np.int64)]), errors.InvalidArgumentError, 0, "gradients", "float32"),
    "custom_no_targets": (custom([tt.Sample(model_input=[1, 2, 3], loss_fn_inputs={})], [np.ones(3, np.float32)]),
                          errors.InvalidArgumentError, 0, "target_tokens", "missing required"),
    "custom_extra_key": (custom([tt.Sample(model_input=[1, 2, 3], loss_fn_inputs={
        "target_tokens": [2, 3, 4], "weights": np.ones(3, np.float32)})], [np.ones(3, np.float32)]),
        errors.InvalidArgumentError, 0, "weights", "unknown loss_fn_inputs key"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_request_is_refused_and_changes_nothing(resource, baseline, case):
    call, cls, index, key, words = CASES[case]
    s = resource.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
    try:
        s.forward_backward(good_batch(), "cross_entropy").result(timeout=120)
        with pytest.raises(cls) as info:
            call(s).result(timeout=120)
        err = info.value
        assert err.sample_index == index
        assert err.key == key
        assert words in str(err)
        assert not err.retryable
        out = s.optim_step(tt.AdamParams(learning_rate=1e-3)).result(timeout=120)
        assert out.grad_norm == pytest.approx(baseline, rel=1e-6)
    finally:
        s.stop()


def test_per_token_clip_thresholds_override_the_config(session):
    """Per-token bounds replace loss_fn_config's at their positions: a per-token pair equal to the config
    gives the config's loss; a different one gives the loss with those bounds."""
    cfg = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    base = session.forward(policy_batch(n=6), "ppo", cfg).result(timeout=120).loss
    same = session.forward(policy_batch(n=6, clip_low_threshold=np.full(6, .9, np.float32),
                                        clip_high_threshold=np.full(6, 1.1, np.float32)), "ppo", {}).result(timeout=120).loss
    wide = session.forward(policy_batch(n=6, clip_low_threshold=np.full(6, .05, np.float32)), "ppo", cfg).result(timeout=120).loss
    assert same == pytest.approx(base, rel=1e-6)
    # p ~ -10.8 (random tiny model) vs q = -10: ratios ~0.45 < 0.9, so with A < 0 the low bound decides
    assert wide != pytest.approx(base, rel=1e-3)


def test_cispo_low_threshold_zero_is_accepted(session):
    out = session.forward(policy_batch(), "cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 1.0}).result(timeout=120)
    assert np.isfinite(out.loss)
