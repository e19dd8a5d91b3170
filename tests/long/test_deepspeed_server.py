"""`together-train serve --trainer deepspeed` under torchrun (2 CPU ranks, gloo), driven over gRPC.

The served loss and AdamW step equal TorchTrainerEngine's on the same batch
(loss 1e-4 absolute, grad norm 1e-5 relative). Needs deepspeed (dev extra).
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("deepspeed")
import together_train as tt

from _models import tiny_model
from together_train_server.engines.types import AdamParams, LoraConfig, Sample

sys.path.insert(0, os.path.dirname(__file__))
import _deepspeed_helpers as H


def test_served_deepspeed_two_ranks_matches_single_process(tmp_path):
    model = tiny_model(tmp_path / "tiny")
    with H.served_two_ranks(tmp_path, model, "--zero-stage", "2") as client:
        session = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=3))
        samples = H.batches(0)[0]
        batch = [tt.Sample(model_input=s.model_input, loss_fn_inputs=dict(s.inputs)) for s in samples]
        adam = tt.AdamParams(learning_rate=1e-2, weight_decay=0.01, lora_plus_ratio=4.0)
        fb = session.forward_backward(batch, "cross_entropy", return_logprobs=True).result(timeout=180)
        opt = session.optim_step(adam).result(timeout=180)
        fb2 = session.forward_backward(batch, "cross_entropy").result(timeout=180)

    from together_train_server.engines.torch_trainer import TorchTrainerEngine

    eng = TorchTrainerEngine(model)
    eng.create_adapter("x", LoraConfig(rank=4, alpha=8.0, seed=3))
    ref = eng.forward("x", [Sample(s.model_input, s.inputs) for s in samples], "cross_entropy", backward=True)
    ro = eng.optim_step("x", AdamParams(learning_rate=1e-2, weight_decay=0.01, lora_plus_ratio=4.0))
    ref2 = eng.forward("x", [Sample(s.model_input, s.inputs) for s in samples], "cross_entropy")
    assert fb.loss == pytest.approx(ref.loss, abs=1e-4)
    assert opt.grad_norm == pytest.approx(ro.grad_norm, rel=1e-5)
    assert fb2.loss == pytest.approx(ref2.loss, abs=1e-4)
