"""SDK behaviour against a real resource (moved off the hand-written fake).

The fake resource in test_sdk_fakes.py returns fixed numbers (loss = token
count, grad_norm 1.5), which can drift from what a real server does; it is
kept only for what a real server cannot be made to do on demand (injected
transport faults, lost replies, operations held in QUEUED). Everything else
runs here, on the `resource` fixture (a real ``together-train serve`` process
with one generator replica on a tiny random Llama), with numbers checked
against independent math:

- losses and per-token logprobs against the same model run directly with
  transformers (the fresh LoRA adapter has B = 0, so it is the base model),
- loss and grad_norm scale exactly with the weights (the loss is linear in them),
- ordering (seq ids, pipelining, asyncio.gather, 8 threads) shows in the values
  each operation sees, not in a fake's log,
- sampling after a synchronous weights_sync reads the synced version, its
  prompt logprobs equal compute_logprobs of the same version,
- attach / re-attach, checkpoints (the downloaded bytes equal the files on the
  resource's disk), stopped sessions, capabilities, client-side spec checks,
  and server-side refusals reported by ``future.result()``.
"""

from __future__ import annotations

import asyncio
import threading
import uuid

import numpy as np
import pytest

import together_train as tt

LORA = tt.LoraConfig(rank=4, alpha=8.0, seed=0)


def batch(n: int = 2, length: int = 5, weight: float = 1.0) -> list[tt.Sample]:
    """n cross_entropy samples of `length` positions (tokens 1.. shifted by the sample index)."""
    return [
        tt.Sample.for_cross_entropy(np.arange(1, length + 2) + i, np.full(length + 1, weight, dtype=np.float32))
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Per-token logprobs of the base model with transformers: f(samples) -> list of float64 [n_i]."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()

    def logprobs(samples: list[tt.Sample]) -> list[np.ndarray]:
        out = []
        with torch.no_grad():
            for s in samples:
                ids = torch.as_tensor(np.asarray(s.model_input, dtype=np.int64))[None]
                logits = model(input_ids=ids).logits[0].double()
                lp = torch.log_softmax(logits, -1)
                tgt = torch.as_tensor(np.asarray(s.loss_fn_inputs["target_tokens"], dtype=np.int64))
                out.append(lp.gather(-1, tgt[:, None])[:, 0].numpy())
        return out

    return logprobs


def ce_loss(samples: list[tt.Sample], logprobs: list[np.ndarray]) -> float:
    """-sum(w * p) over every sample and position (docs/design.md §4 cross_entropy)."""
    return float(-sum((np.asarray(s.loss_fn_inputs["weights"], np.float64) * lp).sum() for s, lp in zip(samples, logprobs)))


def test_training_loop_matches_reference_math(session, reference):
    b = batch()
    futs = []
    for _ in range(3):  # all submitted before any result: pipelined
        futs.append(session.forward_backward(b, loss_fn="cross_entropy"))
        futs.append(session.optim_step(tt.AdamParams(learning_rate=1e-2)))
    assert [f.seq_id for f in futs] == list(range(6))
    fbs = [f.result(timeout=120) for f in futs[0::2]]
    opts = [f.result(timeout=120) for f in futs[1::2]]
    assert fbs[0].loss == pytest.approx(ce_loss(b, reference(b)), rel=1e-5)
    assert fbs[0].metrics["num_tokens:sum"] == 10
    # each forward_backward ran after the previous optim_step: the loss on the batch falls
    assert fbs[0].loss > fbs[1].loss > fbs[2].loss
    assert [o.step for o in opts] == [1, 2, 3]
    assert all(o.learning_rate == pytest.approx(1e-2) and np.isfinite(o.grad_norm) and o.grad_norm > 0 for o in opts)
    assert session.info().step == 3 and session.next_seq_id == 6


def test_loss_and_grad_norm_scale_with_the_weights(resource):
    """The loss is linear in the weights, so both the loss and the gradient scale by the same factor."""
    with resource.create_session(lora=LORA) as one, resource.create_session(lora=LORA) as scaled:
        a = one.forward_backward(batch(weight=1.0))
        b = scaled.forward_backward(batch(weight=2.5))
        ga = one.optim_step(tt.AdamParams(learning_rate=1e-3)).result(timeout=120).grad_norm
        gb = scaled.optim_step(tt.AdamParams(learning_rate=1e-3)).result(timeout=120).grad_norm
        assert b.result(timeout=120).loss == pytest.approx(2.5 * a.result(timeout=120).loss, rel=1e-5)
        assert gb == pytest.approx(2.5 * ga, rel=1e-4) and ga > 0


def test_forward_returns_reference_logprobs_and_elementwise(session, reference):
    b = batch(2, 4)
    b[1] = tt.Sample.for_cross_entropy(np.arange(3, 8), [1.0, 0.5, 0.0, 2.0, -1.0])  # any real weight, zero too
    res = session.forward(b, return_logprobs=True, return_elementwise_loss=True).result(timeout=120)
    ref = reference(b)
    assert [a.dtype for a in res.logprobs] == [np.float32, np.float32]
    for got, want in zip(res.logprobs, ref):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    for s, el, lp in zip(b, res.elementwise_loss, res.logprobs):
        np.testing.assert_allclose(el, -s.loss_fn_inputs["weights"] * lp, atol=1e-6, rtol=1e-6)
    assert res.loss == pytest.approx(ce_loss(b, ref), rel=1e-5)
    assert res.metrics["num_tokens:sum"] == 4 + 3  # positions with a nonzero weight
    plain = session.forward(batch(1)).result(timeout=120)
    assert plain.logprobs is None and plain.elementwise_loss is None


def test_seq_ids_thread_safe_across_threads(session, reference):
    one = batch(1)
    futs: list = []
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(10):
            f = session.forward(one)
            with lock:
                futs.append(f)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(f.seq_id for f in futs) == list(range(80))
    want = ce_loss(one, reference(one))
    assert all(f.result(timeout=120).loss == pytest.approx(want, rel=1e-5) for f in futs)
    assert session.next_seq_id == 80 and session.info().next_seq_id == 80


def test_await_and_async_variants(session, reference):
    b = batch()

    async def main():
        fb = await session.forward_backward_async(b, loss_fn="cross_entropy")
        opt = await session.optim_step_async(tt.AdamParams(learning_rate=1e-2))
        fut = session.forward(b)
        res = await fut
        again = await fut.result_async()
        sync = await session.weights_sync_async()
        sample = await session.sample_async([1, 2, 3], tt.SamplingParams(max_tokens=4, ignore_eos=True))
        return fb, opt, res, again, sync, sample

    fb, opt, res, again, sync, sample = asyncio.run(main())
    assert fb.loss == pytest.approx(ce_loss(b, reference(b)), rel=1e-5)
    assert opt.step == 1 and res.loss < fb.loss and again is res
    assert sync.policy_version == 1 and sample.policy_version == 1 and len(sample.sequences[0].tokens) == 4


def test_gather_submits_in_order(session, reference):
    b = batch()

    async def main():
        return await asyncio.gather(
            session.forward_backward_async(b),
            session.optim_step_async(tt.AdamParams(learning_rate=1e-2)),
            session.forward_backward_async(b),
        )

    first, opt, second = asyncio.run(main())
    assert first.loss == pytest.approx(ce_loss(b, reference(b)), rel=1e-5)  # before the step
    assert opt.step == 1
    after = session.forward(b).result(timeout=120).loss  # same weights as the second forward_backward
    assert second.loss == pytest.approx(after, rel=1e-6) and second.loss < first.loss


def test_sample_after_synchronous_sync_reads_that_version(session):
    prompt = [1, 2, 3, 4]
    session.forward_backward(batch())
    session.optim_step(tt.AdamParams(learning_rate=1e-2))
    sync = session.weights_sync()  # not awaited: sample waits for it client-side
    params = tt.SamplingParams(max_tokens=3, seed=1, ignore_eos=True)
    res = session.sample(prompt, params, num_samples=2, prompt_logprobs=True).result(timeout=120)
    assert sync.done() and sync.result().policy_version == 1
    assert res.policy_version == 1 and len(res.sequences) == 2
    assert all(s.stop_reason == "length" and len(s.tokens) == 3 for s in res.sequences)
    assert res.sequences[0].version_spans == [tt.VersionSpan(0, 3, 1)]
    assert res.top_k_prompt_logprobs is None
    scored = session.compute_logprobs([prompt, [4, 5]]).result(timeout=120)
    assert [len(a) for a in scored.logprobs] == [3, 1] and scored.policy_version == 1
    np.testing.assert_allclose(res.prompt_logprobs, scored.logprobs[0], atol=1e-5)
    base = session.client.compute_logprobs([prompt]).result(timeout=120)
    assert base.policy_version == -1
    assert np.abs(base.logprobs[0] - scored.logprobs[0]).max() > 1e-6  # the synced adapter is not the base model


def test_attach_continues_sequence_and_reattaches_operation(resource, session):
    fut = session.optim_step(tt.AdamParams(learning_rate=1e-2))
    session.optim_step(tt.AdamParams(learning_rate=1e-2)).result(timeout=120)
    with tt.ResourceClient(resource.address) as other:
        attached = other.session(session.session_id)
        assert attached.next_seq_id == 2
        assert attached.optim_step(tt.AdamParams(learning_rate=1e-2)).result(timeout=120).step == 3
        again = attached.operation(fut.operation_id)
        assert again.kind == "optim_step" and again.result(timeout=120).step == 1
        with pytest.raises(tt.NotFoundError):
            attached.operation("op-" + uuid.uuid4().hex)
    assert session.info().step == 3
    # The first client's counter is behind (seq 2 was used by the other): refused, then re-read from the server.
    with pytest.raises(tt.FailedPreconditionError, match="seq_id 2 was already used"):
        session.optim_step(tt.AdamParams(learning_rate=1e-2))
    assert session.next_seq_id == 3
    assert session.optim_step(tt.AdamParams(learning_rate=1e-2)).result(timeout=120).step == 4


def test_checkpoints_save_load_list_download_delete(resource, session, tmp_path):
    session.forward_backward(batch())
    session.optim_step(tt.AdamParams(learning_rate=1e-2))
    info = session.save_weights("final").result(timeout=120)
    assert info.uri.endswith("/weights/final") and info.kind == "weights" and info.step == 1
    st = session.save_state("ckpt").result(timeout=120)
    assert st.kind == "state" and st.step == 1
    assert session.load_state_with_optimizer(st.uri).result(timeout=120).with_optimizer is True
    assert session.load_state(st.uri).result(timeout=120).with_optimizer is False
    assert {c.uri for c in resource.list_checkpoints(session.session_id)} == {info.uri, st.uri}

    out = resource.download_checkpoint(info.uri, tmp_path / "dl")
    on_disk = {p.relative_to(info.path): p.read_bytes() for p in info.path.rglob("*") if p.is_file()}
    got = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert on_disk and got == on_disk
    resource.delete_checkpoint(info.uri)
    with pytest.raises(tt.NotFoundError):
        resource.delete_checkpoint(info.uri)
    with pytest.raises(tt.NotFoundError):
        resource.download_checkpoint(info.uri, tmp_path / "dl2")
    assert {c.uri for c in resource.list_checkpoints(session.session_id)} == {st.uri}


def test_stopped_session_errors_clearly(resource):
    s = resource.create_session(lora=LORA)
    s.stop()
    with pytest.raises(tt.FailedPreconditionError, match="stopped"):
        s.forward(batch())
    with pytest.raises(tt.NotFoundError):
        resource.session("s-" + uuid.uuid4().hex[:12])
    with resource.create_session(lora=LORA) as quiet:  # an explicit stop inside the block: exit stays quiet
        quiet.stop()
    assert resource.get_session(quiet.session_id).state == "stopped"


def test_capabilities_typed_and_int_weights_sent_as_float(resource, session, tiny_model_dir):
    from transformers import AutoConfig

    caps = resource.get_capabilities()
    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    assert caps.vocab_size == cfg.vocab_size and caps.max_seq_len == cfg.max_position_embeddings
    assert caps.losses["cross_entropy"].input_dtypes == {"target_tokens": "int64", "weights": "float32"}
    # integer weights are converted to float32 per the loss spec: same loss as float weights
    ints = tt.Sample(model_input=[1, 2, 3], loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1, 0, 1]})
    floats = tt.Sample(model_input=[1, 2, 3], loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 0.0, 1.0]})
    a, b = session.forward([ints]).result(timeout=120), session.forward([floats]).result(timeout=120)
    assert a.loss == b.loss and a.metrics["num_tokens:sum"] == 2


def test_spec_based_client_checks_send_nothing(session):
    extra = batch(2)
    extra[1].loss_fn_inputs["advantages"] = np.ones(5, np.float32)
    with pytest.raises(tt.InvalidArgumentError) as ei:
        session.forward_backward(extra)
    assert (ei.value.sample_index, ei.value.key) == (1, "advantages") and "unknown loss_fn_inputs key" in str(ei.value)
    missing = batch(1)
    del missing[0].loss_fn_inputs["weights"]
    with pytest.raises(tt.InvalidArgumentError) as ei:
        session.forward_backward(missing)
    assert (ei.value.sample_index, ei.value.key) == (0, "weights") and "missing required" in str(ei.value)
    with pytest.raises(tt.InvalidArgumentError) as ei:
        session.forward_backward(batch(), loss_fn="cross_entropyy")
    assert ei.value.key == "loss_fn" and "unknown loss" in str(ei.value)
    with pytest.raises(tt.InvalidArgumentError) as ei:
        session.forward_backward(batch(), loss_fn_config={"beta": 0.1})
    assert ei.value.key == "beta" and "unknown parameter" in str(ei.value)
    with pytest.raises(tt.InvalidArgumentError) as ei:
        session.custom_forward_backward(batch(2), [np.zeros(5), np.zeros(4)])
    assert (ei.value.sample_index, ei.value.key) == (1, "gradients")
    assert session.next_seq_id == 0 and session.info().next_seq_id == 0  # nothing reached the server


def test_server_refusal_raises_typed_error_from_result(session, resource):
    vocab = resource.get_capabilities().vocab_size
    bad = batch(3)
    bad[2] = tt.Sample(model_input=[1, 2, 3], loss_fn_inputs={"target_tokens": [2, vocab + 7, 4], "weights": [1.0] * 3})
    fut = session.forward_backward(bad, validate=False)  # the server checks it
    with pytest.raises(tt.InvalidArgumentError) as ei:
        fut.result(timeout=120)
    err = ei.value
    assert err.sample_index == 2 and err.key == "target_tokens" and err.operation_id == fut.operation_id
    assert isinstance(fut.exception(), tt.InvalidArgumentError)

    async def main():
        return await session.forward_backward_async(bad, validate=False)

    with pytest.raises(tt.InvalidArgumentError):
        asyncio.run(main())
    # the refused batches changed nothing: no gradient to apply, the step counter still moves on
    opt = session.optim_step(tt.AdamParams(learning_rate=1.0)).result(timeout=120)
    assert opt.step == 1 and opt.grad_norm == 0.0
