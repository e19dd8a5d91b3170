"""`together-train serve --trainer deepspeed --mode full --zero-stage 3` under torchrun (2 CPU ranks), over gRPC.

A full-weight session's served loss and AdamW step equal a plain-torch
reference (transformers model + ``torch.optim.AdamW`` over every parameter,
cross-entropy sum) on the same batch: losses 1e-4 absolute, grad norm 1e-5
relative. Capabilities report ``mode = "full"``; a second session and
weights_sync are refused with clear errors; ``save_weights(merged=True)`` is a
Hugging Face directory that transformers loads and that scores the batch as
the session does; a save_state checkpoint (files from both ranks) creates a new
session with bit-exact weights. Needs deepspeed (dev extra).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("deepspeed")
import together_train as tt

from _models import tiny_model

sys.path.insert(0, os.path.dirname(__file__))
import _deepspeed_helpers as H


def _plain_loss(model, samples) -> float:
    total = 0.0
    for s in samples:
        logits = model(input_ids=torch.as_tensor(s.model_input)[None]).logits[0].float()
        lp = torch.log_softmax(logits, -1).gather(-1, torch.as_tensor(s.inputs["target_tokens"])[:, None])[:, 0]
        loss = -(torch.as_tensor(s.inputs["weights"]) * lp).sum()
        if torch.is_grad_enabled():
            loss.backward()
        total += float(loss.detach())
    return total


def test_served_full_mode_zero3_two_ranks(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model(tmp_path / "tiny")
    samples = H.batches(0)[0]
    batch = [tt.Sample(model_input=s.model_input, loss_fn_inputs=dict(s.inputs)) for s in samples]
    adam = tt.AdamParams(learning_rate=1e-3, weight_decay=0.01)
    with H.served_two_ranks(tmp_path, model, "--mode", "full", "--zero-stage", "3") as client:
        assert client.get_capabilities().mode == "full"
        session = client.create_session()
        with pytest.raises(tt.errors.FailedPreconditionError, match="one session at a time"):
            client.create_session()
        fb = session.forward_backward(batch, "cross_entropy").result(timeout=180)
        opt = session.optim_step(adam).result(timeout=180)
        fb2 = session.forward(batch, "cross_entropy").result(timeout=180)
        with pytest.raises(tt.errors.FailedPreconditionError, match="merged=True"):
            session.save_weights("adapter").result(timeout=180)
        ck = session.save_weights("merged", merged=True).result(timeout=180)
        st = session.save_state("st").result(timeout=180)
        session.stop()
        # The checkpoint's files come from both ranks; the store verifies them on load.
        resumed = client.create_session(checkpoint_uri=st.uri, with_optimizer=True)
        fb3 = resumed.forward(batch, "cross_entropy").result(timeout=180)

    ref = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    params = list(ref.parameters())
    loss0 = _plain_loss(ref, samples)
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in params]))
    torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=False).step()
    with torch.no_grad():
        loss1 = _plain_loss(ref, samples)
    assert fb.loss == pytest.approx(loss0, abs=1e-4)
    assert opt.grad_norm == pytest.approx(norm, rel=1e-5)
    assert fb2.loss == pytest.approx(loss1, abs=1e-4)
    assert fb3.loss == fb2.loss   # resumed from save_state on 2 ranks: bit-exact

    merged_dir = tmp_path / "storage"
    found = [p.parent for p in merged_dir.rglob("config.json") if (p.parent / "model.safetensors").exists()]
    assert len(found) == 1, (ck, found)
    exported = AutoModelForCausalLM.from_pretrained(str(found[0]), dtype=torch.float32).eval()
    with torch.no_grad():
        assert _plain_loss(exported, samples) == pytest.approx(fb2.loss, abs=1e-4)
