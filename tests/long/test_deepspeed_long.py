"""ZeRO-3 LoRA on long samples (issue 21): chunked head and activation checkpointing on every ZeRO stage.

Two CPU ranks (gloo) of ``_deepspeed_helpers.long_script`` against the
single-process TorchTrainerEngine on a tiny Llama with a 4,096-position
context. The request's samples (2,100, 30, 40, 50 and 20 tokens) are split
3/2 across the ranks, so rank 0 runs three micro-batches (the long one: 13
head chunks of 170 positions, over the 2,048 padded tokens of checkpointing
``auto``) and rank 1 two plus a one-token pad forward. Under ZeRO-3 every
layer's weights are all-gathered each time it runs; the ranks stay in step
because the head weight is gathered once per micro-batch and checkpointing
is decided for all ranks at once. A deadlock would leave the run hanging:
``launch`` kills it after ``TIMEOUT`` s and the test fails.

Tolerances (float32): per-token logprobs 2e-5 absolute (``z_y - logsumexp(z)``
over 49,152 logits of magnitude ~11: ``log2(V) * eps32 * |lse|``, as
tests/engines/test_long_context.py); losses 1e-5 relative; the pre-clip gradient norm
1e-5 relative and each AdamW moment within 1e-4 of its tensor's largest
element (``n * eps32`` for the ~1.3e5 products behind each LoRA gradient
element: 2,240 tokens x hidden 64 summed in another order, Higham §4.2).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("deepspeed")
sys.path.insert(0, os.path.dirname(__file__))
import _deepspeed_helpers as H

from _models import tiny_model

TIMEOUT = 400


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(tiny_model(tmp_path_factory.mktemp("dslong") / "tiny_long", max_positions=4096))


@pytest.fixture(scope="module")
def ref(model, tmp_path_factory):
    from together_train_server.engines.torch_trainer import TorchTrainerEngine

    return H.long_script(TorchTrainerEngine(model), str(tmp_path_factory.mktemp("ref") / "ck"))


def test_zero3_long_samples_chunked_and_checkpointed_equal_torch(model, ref, tmp_path):
    ds = H.launch(model, 3, str(tmp_path / "rec.pt"), str(tmp_path / "ck"), driver=H.long_script, timeout=TIMEOUT)
    chunked, mode, rows = ds["worker"]
    assert chunked and mode == "auto" and rows == 170, ds["worker"]
    # rank 0's micro-batches: the long one first (checkpointed), then its two short ones (not); the
    # single process runs the long one and four short ones
    assert ds["checkpointed"] == [True, False, False], ds["checkpointed"]
    assert ref["checkpointed"] == [True, False, False, False], ref["checkpointed"]
    for key in ("loss", "f_loss", "norm"):
        print(key, ds[key], ref[key])
        assert ds[key] == pytest.approx(ref[key], rel=1e-5), (key, ds[key], ref[key])
    for key in ("lp", "f_lp"):
        assert [len(x) for x in ds[key]] == list(H.LONG_LENS)
        for i, (a, b) in enumerate(zip(ds[key], ref[key])):
            err = float(np.abs(a - b).max())
            assert err <= 2e-5, f"{key} sample {i}: max |diff| {err:.3g} > 2e-5"
    for step in (0, 1):
        r, o = ref[f"a/adam/{step}"], ds[f"a/adam/{step}"]
        assert r.keys() == o.keys() and r
        for name in r:
            for j, tag in ((1, "exp_avg"), (2, "exp_avg_sq")):
                a, b = r[name][j].double(), o[name][j].double()
                err, scale = float((a - b).abs().max()), float(a.abs().max())
                assert err <= 1e-4 * scale, f"step {step} {name} {tag}: max |diff| {err:.3g} > 1e-4 x {scale:.3g}"
    assert torch.is_tensor(next(iter(ds["a/adam/1"].values()))[0])
