"""SDK futures, ordering, retries and idempotency against an in-process fake resource."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time

import grpc
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_sdk_fakes import FakeResource  # noqa: E402

import together_train as tt  # noqa: E402
from together_train.retry import RetryPolicy  # noqa: E402

FAST_RETRY = RetryPolicy(max_attempts=4, max_elapsed_s=10, initial_backoff_s=0.01, max_backoff_s=0.05, jitter_s=0.01)


@pytest.fixture
def fake():
    f = FakeResource()
    f.start()
    yield f
    f.stop()


@pytest.fixture
def client(fake):
    c = tt.ResourceClient(f"127.0.0.1:{fake.port}", retry=FAST_RETRY, timeout=10, long_poll_s=1.0)
    yield c
    c.close()


def batch(n=2, length=5, weight=1.0):
    return [
        tt.Sample.for_cross_entropy(np.arange(1, length + 2) + i, np.full(length + 1, weight, dtype=np.float32))
        for i in range(n)
    ]


def test_training_loop_reads_naturally(client, fake):
    session = client.create_session(lora=tt.LoraConfig(rank=8), name="demo")
    for step in range(3):
        fb = session.forward_backward(batch(), loss_fn="cross_entropy")
        opt = session.optim_step(tt.AdamParams(learning_rate=1e-4))
        assert fb.result(timeout=10).loss == 10.0
        res = opt.result(timeout=10)
        assert res.step == step + 1 and res.learning_rate == pytest.approx(1e-4)
        assert res.grad_norm == 1.5
    assert fake.executed == ["forward_backward", "optim_step"] * 3
    assert [r.header.seq_id for r in fake.requests("ForwardBackward")] == [0, 2, 4]


def test_pipelined_submissions_keep_order_and_resolve(client, fake):
    fake.manual = True
    session = client.create_session()
    futs = []
    for _ in range(5):
        futs.append(session.forward_backward(batch()))
        futs.append(session.optim_step(tt.AdamParams(learning_rate=1e-3)))
    assert [f.seq_id for f in futs] == list(range(10))
    assert not any(f.done() for f in futs)
    fake.release(10)
    assert [f.result(timeout=10).step for f in futs[1::2]] == [1, 2, 3, 4, 5]
    assert fake.executed == ["forward_backward", "optim_step"] * 5
    # the poller long-polls one operation per session at a time, not one per future
    assert fake.max_waits_in_flight <= 2


def test_seq_ids_thread_safe_across_threads(client, fake):
    session = client.create_session()
    futs: list = []
    lock = threading.Lock()

    def worker():
        for _ in range(10):
            f = session.forward(batch(1))
            with lock:
                futs.append(f)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(f.seq_id for f in futs) == list(range(80))
    for f in futs:
        assert f.result(timeout=20).loss == 5.0
    assert session.next_seq_id == 80


def test_forward_returns_logprobs_and_elementwise(client):
    session = client.create_session()
    res = session.forward(batch(2, 4), return_logprobs=True, return_elementwise_loss=True).result(timeout=10)
    assert res.loss == 8.0 and res.metrics["num_tokens:sum"] == 8.0
    assert [a.dtype for a in res.logprobs] == [np.float32, np.float32]
    assert [len(a) for a in res.elementwise_loss] == [4, 4]
    res2 = session.forward(batch(1)).result(timeout=10)
    assert res2.logprobs is None and res2.elementwise_loss is None


def test_retry_after_lost_reply_reuses_key_and_runs_once(client, fake):
    session = client.create_session()
    fake.inject("OptimStep", grpc.StatusCode.UNAVAILABLE, after=True, retryable=True)
    fut = session.optim_step(tt.AdamParams(learning_rate=0.1))
    assert fut.result(timeout=10).step == 1
    reqs = fake.requests("OptimStep")
    assert len(reqs) == 2
    assert reqs[0].header.idempotency_key == reqs[1].header.idempotency_key
    assert reqs[0].header.seq_id == reqs[1].header.seq_id == 0
    assert fake.executed == ["optim_step"]  # ran once
    # the next operation continues the sequence
    assert session.optim_step(tt.AdamParams(learning_rate=0.1)).result(timeout=10).step == 2


def test_retryable_transport_error_without_detail_is_retried(client, fake):
    fake.inject("GetCapabilities", grpc.StatusCode.UNAVAILABLE, times=2, with_detail=False)
    assert client.get_capabilities().model_id == "fake"
    assert fake.count("GetCapabilities") == 3


def test_non_retryable_submission_error_raises_at_once_and_session_stays_usable(client, fake):
    session = client.create_session()
    fake.inject("ForwardBackward", grpc.StatusCode.INVALID_ARGUMENT, sample_index=1, key="target_tokens")
    with pytest.raises(tt.InvalidArgumentError) as ei:
        session.forward_backward(batch())
    assert ei.value.sample_index == 1 and ei.value.key == "target_tokens" and not ei.value.retryable
    assert fake.count("ForwardBackward") == 1  # not retried
    # seq was re-read from the server; the next submission is accepted
    assert session.forward_backward(batch()).result(timeout=10).loss == 10.0


def test_detail_retryable_flag_wins(client, fake):
    session = client.create_session()
    fake.inject("Forward", grpc.StatusCode.RESOURCE_EXHAUSTED, retryable=True)
    assert session.forward(batch()).result(timeout=10).loss == 10.0
    assert fake.count("Forward") == 2
    fake.inject("Forward", grpc.StatusCode.UNAVAILABLE, retryable=False, times=3)
    with pytest.raises(tt.UnavailableError):
        session.forward(batch())
    assert fake.count("Forward") == 3


def test_retries_are_bounded(fake):
    c = tt.ResourceClient(
        f"127.0.0.1:{fake.port}",
        retry=RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.01, jitter_s=0.0),
    )
    try:
        fake.inject("ListSessions", grpc.StatusCode.UNAVAILABLE, times=5, with_detail=False)
        with pytest.raises(tt.UnavailableError) as ei:
            c.list_sessions()
        assert ei.value.retryable
        assert fake.count("ListSessions") == 3
    finally:
        c.close()


def test_create_session_not_retried_on_deadline(client, fake):
    fake.inject("CreateSession", grpc.StatusCode.DEADLINE_EXCEEDED, with_detail=False)
    with pytest.raises(tt.DeadlineExceededError):
        client.create_session()
    assert fake.count("CreateSession") == 1
    fake.inject("CreateSession", grpc.StatusCode.UNAVAILABLE, with_detail=False)
    client.create_session()
    assert fake.count("CreateSession") == 3


def test_failed_operation_raises_typed_error_from_result(client, fake):
    session = client.create_session()
    bad = batch(3)
    bad[2] = tt.Sample.for_cross_entropy([1, 2, 3], [1.0, 999.0, 1.0])
    fut = session.forward_backward(bad)
    with pytest.raises(tt.InvalidArgumentError) as ei:
        fut.result(timeout=10)
    err = ei.value
    assert err.sample_index == 2 and err.key == "weights" and err.operation_id == fut.operation_id
    assert isinstance(fut.exception(), tt.InvalidArgumentError)
    assert session.optim_step(tt.AdamParams(learning_rate=1.0)).result(timeout=10).step == 1


def test_client_side_validation_sends_nothing(client, fake):
    session = client.create_session()
    bad = batch(3)
    bad[1].loss_fn_inputs["weights"] = np.array([1.0, np.nan, 1.0, 1.0, 1.0], dtype=np.float32)
    with pytest.raises(tt.InvalidArgumentError) as ei:
        session.forward_backward(bad)
    assert ei.value.sample_index == 1 and ei.value.key == "weights"
    with pytest.raises(tt.InvalidArgumentError) as ei:
        session.forward_backward([])
    assert ei.value.key == "samples"
    assert fake.count("ForwardBackward") == 0
    assert session.next_seq_id == 0


def test_cancel_queued_but_not_running(client, fake):
    fake.manual = True
    session = client.create_session()
    first = session.forward_backward(batch())
    second = session.optim_step(tt.AdamParams(learning_rate=1.0))
    fake.delays["forward_backward"] = 0.5
    fake.release(1)  # first starts running (for 0.5 s); second stays QUEUED
    deadline = time.time() + 5
    while fake.ops[first.operation_id].status != 2 and time.time() < deadline:  # 2 = RUNNING
        time.sleep(0.01)
    assert second.cancel() is True
    assert second.cancelled() and second.done()
    with pytest.raises(tt.OperationCancelledError):
        second.result(timeout=1)
    assert first.cancel() is False
    assert first.result(timeout=10).loss == 10.0
    assert fake.executed == ["forward_backward"]
    # cancelled futures are also concurrent.futures.CancelledError
    import concurrent.futures as cf

    with pytest.raises(cf.CancelledError):
        second.result()


def test_result_timeout_and_done_callback(client, fake):
    fake.manual = True
    session = client.create_session()
    fut = session.forward(batch())
    with pytest.raises(TimeoutError):
        fut.result(timeout=0.2)
    assert not fut.done()
    seen = []
    done = threading.Event()
    fut.add_done_callback(lambda f: (seen.append(f), done.set()))
    fake.release(1)
    assert done.wait(10)
    assert seen == [fut] and fut.done() and fut.exception() is None
    late = []
    fut.add_done_callback(late.append)  # already done: called at once
    assert late == [fut]


def test_await_and_async_variants(client, fake):
    session = client.create_session()

    async def main():
        fb = await session.forward_backward_async(batch(), loss_fn="cross_entropy")
        opt = await session.optim_step_async(tt.AdamParams(learning_rate=1e-3))
        fut = session.forward(batch(1))
        res = await fut
        again = await fut.result_async()
        sync = await session.weights_sync_async()
        sample = await session.sample_async([1, 2, 3], tt.SamplingParams(max_tokens=4))
        return fb, opt, res, again, sync, sample

    fb, opt, res, again, sync, sample = asyncio.run(main())
    assert fb.loss == 10.0 and opt.step == 1 and res.loss == 5.0 and again is res
    assert sync.policy_version == 1 and sample.policy_version == 1


def test_await_failed_operation_raises(client, fake):
    session = client.create_session()
    bad = [tt.Sample.for_cross_entropy([1, 2, 3], [1.0, 999.0, 1.0])]

    async def main():
        return await session.forward_backward_async(bad)

    with pytest.raises(tt.InvalidArgumentError):
        asyncio.run(main())


def test_gather_submits_in_order(client, fake):
    session = client.create_session()

    async def main():
        return await asyncio.gather(
            session.forward_backward_async(batch()),
            session.optim_step_async(tt.AdamParams(learning_rate=1.0)),
            session.forward_backward_async(batch()),
        )

    asyncio.run(main())
    assert fake.executed == ["forward_backward", "optim_step", "forward_backward"]


def test_sample_waits_for_synchronous_weights_sync(client, fake):
    session = client.create_session()
    fake.delays["weights_sync"] = 0.3
    session.forward_backward(batch())
    session.optim_step(tt.AdamParams(learning_rate=1.0))
    sync = session.weights_sync()
    s = session.sample([1, 2, 3], tt.SamplingParams(max_tokens=3, seed=1), num_samples=2, prompt_logprobs=True)
    res = s.result(timeout=10)
    assert sync.done()
    assert res.policy_version == 1 and fake.sample_versions_seen == [1]
    assert len(res.sequences) == 2 and res.sequences[0].stop_reason == "length"
    assert res.sequences[0].version_spans == [tt.VersionSpan(0, 3, 1)]
    assert res.prompt_logprobs == [-1.0, -1.0] and res.top_k_prompt_logprobs is None
    lp = session.compute_logprobs([[1, 2, 3], [4, 5]]).result(timeout=10)
    assert [len(a) for a in lp.logprobs] == [2, 1] and lp.policy_version == 1
    assert client.compute_logprobs([[1, 2]]).result(timeout=10).policy_version == -1


def test_sample_does_not_wait_for_background_sync(client, fake):
    session = client.create_session()
    fake.manual = True
    session.optim_step(tt.AdamParams(learning_rate=1.0))
    sync = session.weights_sync(mode="background")
    res = session.sample([1, 2], tt.SamplingParams(max_tokens=2)).result(timeout=10)
    assert res.policy_version == -1 and not sync.done()
    fake.release(2)
    assert sync.result(timeout=10).policy_version == 1


def test_sample_fails_when_awaited_sync_fails(client, fake):
    session = client.create_session()
    fake.manual = True
    sync = session.weights_sync()
    s = session.sample([1, 2], tt.SamplingParams(max_tokens=2))
    assert sync.cancel()
    with pytest.raises(tt.FailedPreconditionError):
        s.result(timeout=10)
    assert fake.count("Sample") == 0


def test_api_key_sent_as_bearer_metadata():
    fake = FakeResource(api_key="sekret")
    fake.start()
    try:
        with tt.ResourceClient(f"127.0.0.1:{fake.port}", api_key="sekret", retry=FAST_RETRY) as c:
            s = c.create_session()
            assert s.forward(batch()).result(timeout=10).loss == 10.0
        assert all(md.get("authorization") == "Bearer sekret" for _, _, md in fake.calls)
        with tt.ResourceClient(f"127.0.0.1:{fake.port}", api_key="wrong", retry=FAST_RETRY) as c:
            with pytest.raises(tt.UnauthenticatedError) as ei:
                c.create_session()
            assert isinstance(ei.value, tt.PermissionDeniedError)
    finally:
        fake.stop()


def test_close_fails_pending_futures(fake):
    c = tt.ResourceClient(f"127.0.0.1:{fake.port}", retry=FAST_RETRY, long_poll_s=0.5)
    fake.manual = True
    session = c.create_session()
    fut = session.forward(batch())
    c.close()
    with pytest.raises(tt.ClientClosedError) as ei:
        fut.result(timeout=5)
    assert ei.value.operation_id == fut.operation_id
    with pytest.raises(tt.FailedPreconditionError):
        session.forward(batch())


def test_session_context_manager_cancels_queued_and_stops(client, fake):
    fake.manual = True
    with client.create_session() as session:
        a = session.forward(batch())
        b = session.forward(batch())
        sid = session.session_id
    assert b.cancelled()
    assert client.get_session(sid).state == "stopped"
    fake.release(5)
    assert a.done() or a.result(timeout=5)


def test_wait_operation_unimplemented_falls_back_to_get(client, fake):
    fake.wait_unimplemented = True
    session = client.create_session()
    assert session.optim_step(tt.AdamParams(learning_rate=1.0)).result(timeout=10).step == 1
    assert fake.count("GetOperation") >= 1


def test_attach_continues_sequence_and_reattaches_operation(client, fake):
    session = client.create_session()
    fut = session.optim_step(tt.AdamParams(learning_rate=1.0))
    session.optim_step(tt.AdamParams(learning_rate=1.0)).result(timeout=10)
    with tt.ResourceClient(f"127.0.0.1:{fake.port}", retry=FAST_RETRY) as other:
        attached = other.session(session.session_id)
        assert attached.next_seq_id == 2
        assert attached.optim_step(tt.AdamParams(learning_rate=1.0)).result(timeout=10).step == 3
        again = attached.operation(fut.operation_id)
        assert again.kind == "optim_step" and again.result(timeout=10).step == 1
        with pytest.raises(tt.NotFoundError):
            attached.operation("op-nope")
    assert session.info().step == 3


def test_checkpoint_operations_and_custom_unimplemented(client, fake):
    session = client.create_session()
    info = session.save_weights("final").result(timeout=10)
    assert info.uri.endswith("/weights/final") and info.kind == "weights"
    st = session.save_state("ckpt").result(timeout=10)
    assert st.kind == "state"
    assert session.load_state_with_optimizer(st.uri).result(timeout=10).with_optimizer is True
    assert session.load_state(st.uri).result(timeout=10).with_optimizer is False
    with pytest.raises(tt.UnimplementedError):
        session.custom_forward_backward(batch(1), [np.zeros(5, dtype=np.float32)])
    with pytest.raises(tt.InvalidArgumentError) as ei:
        session.custom_forward_backward(batch(2), [np.zeros(5), np.zeros(4)])
    assert ei.value.sample_index == 1 and ei.value.key == "gradients"


def test_stopped_session_errors_clearly(client, fake):
    session = client.create_session()
    session.stop()
    with pytest.raises(tt.FailedPreconditionError):
        session.forward(batch())
    with pytest.raises(tt.NotFoundError):
        client.session("s-unknown")


def test_capabilities_typed_and_used_for_dtypes(client, fake):
    caps = client.get_capabilities()
    assert caps.losses["cross_entropy"].input_dtypes == {"target_tokens": "int64", "weights": "float32"}
    assert caps.sampling.max_tokens == 32 and caps.adam_defaults == {"beta1": 0.9, "beta2": 0.999}
    session = client.create_session()
    # integer weights are sent as float32 per the loss spec
    s = tt.Sample(model_input=[1, 2, 3], loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1, 0, 1]})
    session.forward([s]).result(timeout=10)
    sent = fake.requests("Forward")[0].samples[0].loss_fn_inputs
    from together_train._proto import common_pb2

    assert sent["weights"].dtype == common_pb2.FLOAT32 and sent["target_tokens"].dtype == common_pb2.INT64


def test_spec_based_client_checks(client, fake):
    session = client.create_session()
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
    assert fake.count("ForwardBackward") == 0


def test_validate_false_sends_bad_requests_to_the_server(client, fake):
    session = client.create_session()
    bad = tt.Sample(model_input=[1, -2, 3], loss_fn_inputs={"target_tokens": [1, 2], "weights": [1.0, np.nan, 1.0, 1.0]})
    session.forward_backward([bad], loss_fn="nope", loss_fn_config={"beta": 0.1}, validate=False)
    session.forward_backward([], validate=False)
    session.optim_step(tt.AdamParams(learning_rate=1e-3, beta1=1.5), validate=False)
    session.sample([1, 2], tt.SamplingParams(max_tokens=1, top_p=0.0), validate=False).result(timeout=10)
    req = fake.requests("ForwardBackward")[0]
    assert req.loss_fn == "nope" and list(req.samples[0].model_input) == [1, -2, 3]
    assert list(req.samples[0].loss_fn_inputs["weights"].shape) == [4]
    assert dict(req.loss_fn_config.params) == {"beta": 0.1}
    assert len(fake.requests("ForwardBackward")[1].samples) == 0
    assert fake.requests("OptimStep")[0].adam_params.beta1 == 1.5
    assert fake.requests("Sample")[0].params.top_p == 0.0
    with pytest.raises(tt.InvalidArgumentError):
        session.optim_step(tt.AdamParams(learning_rate=1e-3, beta1=1.5))


def test_context_manager_after_explicit_stop_is_quiet(client, fake):
    with client.create_session() as session:
        session.stop()
    assert fake.count("StopSession") == 1


def test_capabilities_failure_is_not_fatal_and_not_repeated(fake):
    fake.inject("GetCapabilities", grpc.StatusCode.UNIMPLEMENTED)
    with tt.ResourceClient(f"127.0.0.1:{fake.port}", retry=FAST_RETRY) as c:
        s = c.create_session()
        assert s.forward(batch()).result(timeout=10).loss == 10.0
        assert s.forward(batch()).result(timeout=10).loss == 10.0
    assert fake.count("GetCapabilities") == 1


def test_checkpoint_listing_download_and_delete(client, fake, tmp_path):
    session = client.create_session()
    info = session.save_weights("w1").result(timeout=10)
    assert str(info.path) == f"/store/{session.session_id}/weights/w1"
    assert [c.uri for c in client.list_checkpoints(session.session_id)] == [info.uri]
    assert client.list_checkpoints("other") == []
    out = client.download_checkpoint(info.uri, tmp_path / "dl")
    assert (out / "adapter_config.json").read_bytes() == b'{"r": 4}'
    assert (out / "sub" / "adapter_model.safetensors").read_bytes() == b"0123456789"
    fake.corrupt = True
    with pytest.raises(tt.InternalError, match="sha256"):
        client.download_checkpoint(info.uri, tmp_path / "dl2")
    fake.corrupt = False
    fake.files = {"../escape.txt": b"nope"}
    with pytest.raises(tt.InternalError, match="escapes"):
        client.download_checkpoint(info.uri, tmp_path / "dl3")
    assert not (tmp_path / "escape.txt").exists()
    client.delete_checkpoint(info.uri)
    with pytest.raises(tt.NotFoundError):
        client.delete_checkpoint(info.uri)
    with pytest.raises(tt.NotFoundError):
        client.download_checkpoint(info.uri, tmp_path / "dl4")
