"""Helpers shared by the checkpoint and session tests (batches, reading saved tensors)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

import together_train as tt

LORA = dict(rank=4, alpha=8.0, seed=0)
# eps well above fp32 gradient noise (see tests/server/test_e2e_training.py), weight decay on.
ADAM = tt.AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.95, eps=1e-4, weight_decay=0.1)


def make_batch(seed: int, vocab: int, lengths=(10, 6)) -> list[tt.Sample]:
    """Random token samples with weights of several signs."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        tokens = rng.integers(0, vocab, size=n + 1)
        weights = rng.choice([0.0, 1.0, 0.5, -0.25], size=n).astype(np.float32)
        out.append(tt.Sample(model_input=tokens[:-1], loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights}))
    return out


def train(session, seeds, vocab: int, adam: tt.AdamParams = ADAM) -> list[float]:
    """One forward_backward + optim_step per seed, pipelined; waits for all; returns the losses."""
    futs, steps = [], []
    for seed in seeds:
        futs.append(session.forward_backward(make_batch(seed, vocab), loss_fn="cross_entropy"))
        steps.append(session.optim_step(adam))
    for f in steps:
        f.result(timeout=120)
    return [f.result(timeout=120).loss for f in futs]


def state_tensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of a training checkpoint (param::, opt::, rng::)."""
    return load_file(str(Path(path) / "trainer_state.safetensors"))


def params_of(path) -> dict[str, torch.Tensor]:
    return {k[len("param::"):]: v for k, v in state_tensors(path).items() if k.startswith("param::")}


def assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
