"""Engine-level loss behaviour: micro-batching equals the unsplit request, a failure mid-way
restores the accumulated gradient (TorchTrainerEngine in-process on a tiny model).

Tolerances: loss rtol 1e-5 / atol 1e-6, gradients atol 1e-6 (micro-batches pad to a
different length and sum in a different order; fp32).
"""

from __future__ import annotations

import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from _loss_reference import policy_inputs
from _models import tiny_model
from together_train_server.engines.types import LoraConfig, Sample


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from together_train_server.engines.torch_trainer import TorchTrainerEngine

    d = tiny_model(tmp_path_factory.mktemp("tiny") / "llama")
    whole = TorchTrainerEngine(d)                          # default budget: one forward
    whole.max_padding_fraction = 1.0                       # (any padding: the unsplit request)
    split = TorchTrainerEngine(d, micro_batch_tokens=20)   # every sample alone or in pairs
    split.max_padding_fraction = 1.0
    return whole, split


def _batch(engine, lengths, seed, **opts):
    rng = np.random.default_rng(seed)
    toks = [rng.integers(0, engine.vocab_size, n + 1) for n in lengths]
    ce = [Sample(t[:-1], {"target_tokens": t[1:], "weights": np.ones(len(t) - 1, np.float32)}) for t in toks]
    engine.create_adapter("probe", LoraConfig(rank=4, alpha=8.0, seed=0))
    p = engine.forward("probe", ce, "cross_entropy", return_logprobs=True).logprobs
    engine.drop_adapter("probe")
    inputs = policy_inputs(p, seed, **opts)
    return [Sample(t[:-1], {"target_tokens": t[1:], **inp}) for t, inp in zip(toks, inputs)]


def _grads(engine, aid):
    """Accumulated gradients by parameter name without peft's internal adapter name."""
    return {re.sub(r"\.ad\d+\.", ".", n): p.grad.clone()
            for n, p in engine.trainable_parameters(aid).items() if p.grad is not None}


@pytest.mark.parametrize("loss_fn, params, opts", [
    ("ppo", {}, {}),
    ("grpo", {"aggregation": "token_mean"}, {}),
    ("grpo", {"aggregation": "sequence_mean", "ratio_type": "sequence", "beta": 0.1}, {"reference_logprobs": True}),
    ("grpo", {"aggregation": "fixed_horizon", "horizon": 12}, {}),
])
def test_micro_batches_equal_the_unsplit_request(engines, loss_fn, params, opts):
    whole, split = engines
    lengths = (9, 4, 14, 6, 3)
    batch = _batch(whole, lengths, 5, **opts)
    from together_train_server.engines.trainer_batching import micro_batches

    assert len(micro_batches(lengths, split.micro_batch_tokens, split.max_padding_fraction)) >= 3
    assert len(micro_batches(lengths, whole.micro_batch_tokens, whole.max_padding_fraction)) == 1
    outs, grads = [], []
    for eng in (whole, split):
        eng.create_adapter("mb", LoraConfig(rank=4, alpha=8.0, seed=0))
        # a first request, then a second: accumulation across requests too
        eng.forward("mb", batch[:2], loss_fn, params, backward=True)
        outs.append(eng.forward("mb", batch, loss_fn, params, backward=True, return_logprobs=True, return_elementwise=True))
        grads.append(_grads(eng, "mb"))
        eng.drop_adapter("mb")
    a, b = outs
    np.testing.assert_allclose(a.loss, b.loss, rtol=1e-5, atol=1e-6)
    for k in a.metrics:
        np.testing.assert_allclose(a.metrics[k], b.metrics[k], rtol=1e-5, atol=1e-6, err_msg=k)
    for x, y in zip(a.logprobs + a.elementwise_loss, b.logprobs + b.elementwise_loss):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for k in grads[0]:
        torch.testing.assert_close(grads[0][k], grads[1][k], rtol=1e-5, atol=1e-6)


def test_failure_in_a_later_micro_batch_restores_the_gradient(engines):
    _, split = engines
    batch = _batch(split, (9, 4, 14), 6)
    split.create_adapter("fail", LoraConfig(rank=4, alpha=8.0, seed=0))
    try:
        split.forward("fail", batch, "ppo", backward=True)
        before = _grads(split, "fail")
        bad = [Sample(s.model_input, dict(s.inputs)) for s in batch]
        bad[-1].inputs["logprobs"] = np.full(len(bad[-1].model_input), -3e38, np.float32)  # r overflows to inf
        bad[-1].inputs["advantages"] = np.ones(len(bad[-1].model_input), np.float32)
        bad[-1].inputs.pop("mask"), bad[-1].inputs.pop("weights")
        with pytest.raises(FloatingPointError):
            split.forward("fail", bad, "importance_sampling", backward=True)
        after = _grads(split, "fail")
        assert before.keys() == after.keys()
        for k in before:
            torch.testing.assert_close(after[k], before[k], rtol=0, atol=0)
        # with no gradient accumulated yet, a failure leaves none
        split.zero_grad("fail")
        with pytest.raises(FloatingPointError):
            split.forward("fail", bad, "importance_sampling", backward=True)
        assert not _grads(split, "fail")
    finally:
        split.drop_adapter("fail")
