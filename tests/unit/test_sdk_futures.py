"""SDK futures, retries and idempotency against an in-process fake resource.

Only what a real server cannot be made to do on demand stays here: injected
transport faults and lost replies (retries, idempotency keys), operations held
QUEUED or RUNNING by hand (cancel, timeouts, close, ordering of syncs and
samples), WaitOperation unimplemented, the exact bytes a request carries, and
corrupt or hostile download streams. The fake's numbers (loss = token count)
only show that a result came through; the SDK's behaviour against real
numbers is tested in test_sdk_real_server.py.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import grpc
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_sdk_fakes import FakeResource

import together_train as tt
from together_train.retry import RetryPolicy

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


def test_capabilities_failure_is_not_fatal_and_not_repeated(fake):
    fake.inject("GetCapabilities", grpc.StatusCode.UNIMPLEMENTED)
    with tt.ResourceClient(f"127.0.0.1:{fake.port}", retry=FAST_RETRY) as c:
        s = c.create_session()
        assert s.forward(batch()).result(timeout=10).loss == 10.0
        assert s.forward(batch()).result(timeout=10).loss == 10.0
    assert fake.count("GetCapabilities") == 1


def test_download_refuses_bad_checksums_and_escaping_paths(client, fake, tmp_path):
    """Corrupt or hostile streams a real server does not send (listing, download and delete: test_sdk_real_server)."""
    session = client.create_session()
    info = session.save_weights("w1").result(timeout=10)
    fake.corrupt = True
    with pytest.raises(tt.InternalError, match="sha256"):
        client.download_checkpoint(info.uri, tmp_path / "dl2")
    fake.corrupt = False
    fake.files = {"../escape.txt": b"nope"}
    with pytest.raises(tt.InternalError, match="escapes"):
        client.download_checkpoint(info.uri, tmp_path / "dl3")
    assert not (tmp_path / "escape.txt").exists()


def test_cancel_twice_and_after_completion():
    # A running client-side call cancelled by its canceller ends with OperationCancelledError: a second
    # cancel() must say True (it is cancelled) without calling the canceller again; a call that
    # succeeded stays False however often it is asked. Before: the second cancel() of a cancelled
    # running sample returned False while cancelled() was True.
    import concurrent.futures as cf

    from together_train.errors import OperationCancelledError
    from together_train.futures import OperationFuture

    calls = []

    def canceller(fut):
        calls.append(fut)
        fut._inner.set_exception(OperationCancelledError("Sample was cancelled"))
        return True

    inner = cf.Future()
    inner.set_running_or_notify_cancel()  # running: cf's own cancel() cannot cancel it
    fut = OperationFuture(inner, kind="sample", canceller=canceller)
    assert fut.cancel() is True and fut.cancelled()
    assert fut.cancel() is True and fut.cancel() is True
    assert len(calls) == 1, f"canceller called {len(calls)} times"
    with pytest.raises(OperationCancelledError, match="Sample was cancelled"):
        fut.result(0)

    done = cf.Future()
    done.set_running_or_notify_cancel()
    done.set_result("ok")
    finished = OperationFuture(done, kind="sample", canceller=canceller)
    assert finished.cancel() is False and finished.cancel() is False and not finished.cancelled()
    assert finished.result(0) == "ok" and len(calls) == 1
