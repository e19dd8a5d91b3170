"""Training through a real resource process over gRPC, checked against plain torch + peft.

The reference starts from the adapter the server exports at step 0 (a PEFT
directory loaded with plain peft) and does its own forward, loss, backward
and torch.optim.AdamW step; the server's loss, per-token logprobs and
updated adapter must match it.

Tolerances (fp32, CPU): loss and logprobs rtol 1e-5 / atol 1e-5; updated
weights atol 1e-6 (both sides run the same fp32 kernels in a different
batch layout, so sums differ only in the last bits).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import together_train as tt

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_batch(seed: int, vocab: int, lengths=(12, 7, 20)) -> list[tt.Sample]:
    """Samples of different lengths with weights of several signs (cross_entropy takes any real weight)."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        tokens = rng.integers(0, vocab, size=n + 1)
        weights = rng.choice([0.0, 1.0, 0.5, -0.25], size=n).astype(np.float32)
        out.append(tt.Sample(model_input=tokens[:-1], loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights}))
    return out


def load_reference(tiny_model_dir, adapter_dir):
    """Plain transformers + peft model from the exported adapter directory."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    model.eval()
    return model


def reference_logprobs(model, samples):
    """Per-sample logprob of each target token, one unpadded forward per sample."""
    out = []
    for s in samples:
        inp = torch.as_tensor(np.asarray(s.model_input))[None]
        tgt = torch.as_tensor(np.asarray(s.loss_fn_inputs["target_tokens"]))[None]
        logits = model(input_ids=inp).logits.float()
        out.append(torch.log_softmax(logits, -1).gather(-1, tgt[..., None])[0, :, 0])
    return out


def reference_loss(model, samples):
    lps = reference_logprobs(model, samples)
    return sum(-(torch.as_tensor(np.asarray(s.loss_fn_inputs["weights"])) * lp).sum() for s, lp in zip(samples, lps)), lps


def adapter_tensors(path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "adapter_model.safetensors"))


def test_cross_entropy_logprobs_and_adamw_match_plain_torch(resource, tiny_model_dir, tmp_path):
    vocab = resource.get_capabilities().vocab_size
    session = resource.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=3))
    try:
        init = session.save_weights("init").result(timeout=120)
        ref = load_reference(tiny_model_dir, init.path)
        batch1, batch2 = make_batch(1, vocab), make_batch(2, vocab, lengths=(9, 15))
        adam = tt.AdamParams(
            learning_rate=1e-2, beta1=0.8, beta2=0.95, eps=1e-4, weight_decay=0.1, grad_clip_norm=0.05, lora_plus_ratio=4.0
        )
        # eps=1e-4 (not 1e-8): a gradient element that nearly cancels to ~1e-9 carries fp32
        # summation-order noise of the same size (padded batch vs one sample at a time);
        # Adam divides it by sqrt(v)+eps, so with a tiny eps that noise becomes a visible
        # update difference. eps well above the noise floor makes the comparison well-conditioned.

        # Server: two forward_backward calls accumulate before one optim_step; then one more step.
        fb1 = session.forward_backward(batch1, "cross_entropy", return_logprobs=True).result(timeout=120)
        fb2 = session.forward_backward(batch2, "cross_entropy").result(timeout=120)
        opt1 = session.optim_step(adam).result(timeout=120)
        fb3 = session.forward_backward(batch2, "cross_entropy").result(timeout=120)
        opt2 = session.optim_step(adam).result(timeout=120)
        after = session.save_weights("after").result(timeout=120)

        # Reference: the same in plain torch.
        params = {n: p for n, p in ref.named_parameters() if p.requires_grad}
        a_params = [p for n, p in params.items() if "lora_A" in n]
        b_params = [p for n, p in params.items() if "lora_B" in n]
        assert a_params and b_params and len(a_params) + len(b_params) == len(params)
        opt = torch.optim.AdamW(
            [{"params": a_params, "lr": 1e-2}, {"params": b_params, "lr": 4e-2}],
            betas=(0.8, 0.95),
            eps=1e-4,
            weight_decay=0.1,
        )
        loss1, lps1 = reference_loss(ref, batch1)
        np.testing.assert_allclose(fb1.loss, loss1.item(), rtol=1e-5, atol=1e-5)
        assert len(fb1.logprobs) == len(batch1)
        for got, want in zip(fb1.logprobs, lps1):
            np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-5, atol=1e-5)
        loss1.backward()
        loss2, _ = reference_loss(ref, batch2)
        np.testing.assert_allclose(fb2.loss, loss2.item(), rtol=1e-5, atol=1e-5)
        loss2.backward()
        norm = torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm=0.05)
        np.testing.assert_allclose(opt1.grad_norm, norm.item(), rtol=1e-5)
        assert opt1.step == 1 and opt1.learning_rate == pytest.approx(1e-2)
        opt.step()
        opt.zero_grad()
        loss3, _ = reference_loss(ref, batch2)
        np.testing.assert_allclose(fb3.loss, loss3.item(), rtol=1e-5, atol=1e-5)
        loss3.backward()
        norm = torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm=0.05)
        np.testing.assert_allclose(opt2.grad_norm, norm.item(), rtol=1e-5)
        opt.step()
        assert opt2.step == 2

        got = adapter_tensors(after.path)
        from peft import get_peft_model_state_dict

        want = get_peft_model_state_dict(ref)
        assert set(got) == set(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k].detach(), atol=1e-6, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
        # The update really moved the weights (the comparison is not trivially true).
        init_t = adapter_tensors(init.path)
        assert any(not torch.equal(init_t[k], got[k]) for k in got if "lora_B" in k)
    finally:
        session.stop()


def _train(session, batches, adam, pipelined: bool):
    futures = []
    for b in batches:
        fb = session.forward_backward(b, "cross_entropy")
        opt = session.optim_step(adam)
        if pipelined:
            futures += [fb, opt]
        else:
            fb.result(timeout=120)
            opt.result(timeout=120)
    return [f.result(timeout=120) for f in futures]


def test_pipelined_futures_equal_waiting_after_each(resource):
    vocab = resource.get_capabilities().vocab_size
    batches = [make_batch(10 + i, vocab) for i in range(3)]
    adam = tt.AdamParams(learning_rate=5e-3)
    a = resource.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=7))
    b = resource.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=7))
    try:
        results = _train(a, batches, adam, pipelined=True)
        assert [r.step for r in results[1::2]] == [1, 2, 3]
        _train(b, batches, adam, pipelined=False)
        wa = adapter_tensors(a.save_weights("w").result(timeout=120).path)
        wb = adapter_tensors(b.save_weights("w").result(timeout=120).path)
        for k in wa:
            assert torch.equal(wa[k], wb[k]), k
    finally:
        a.stop()
        b.stop()


def test_retried_request_with_same_idempotency_key_runs_once(resource):
    """A raw OptimStep sent twice with one idempotency key is one operation, one step."""
    from together_train._proto import common_pb2, session_pb2, session_pb2_grpc
    import grpc

    vocab = resource.get_capabilities().vocab_size
    session = resource.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=1))
    try:
        session.forward_backward(make_batch(3, vocab), "cross_entropy").result(timeout=120)
        info = session.info()
        with grpc.insecure_channel(resource.address) as channel:
            stub = session_pb2_grpc.SessionServiceStub(channel)
            header = session_pb2.OperationHeader(
                session_id=session.session_id, seq_id=info.next_seq_id, idempotency_key="retry-me"
            )
            req = session_pb2.OptimStepRequest(header=header, adam_params=common_pb2.AdamParams(learning_rate=1e-3))
            first = stub.OptimStep(req)
            second = stub.OptimStep(req)
            assert first.operation_id == second.operation_id
            done = stub.WaitOperation(session_pb2.WaitOperationRequest(operation_id=first.operation_id, timeout_seconds=60))
            assert done.status == session_pb2.SUCCEEDED
            assert done.optim_step.step == 1
        assert session.info().step == 1
    finally:
        session.stop()
