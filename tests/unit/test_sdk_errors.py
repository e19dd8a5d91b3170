"""Error mapping from real gRPC statuses (with and without ErrorDetail) and the retry policy."""

from __future__ import annotations

import concurrent.futures as cf
import pickle

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import status_pb2

import together_train as tt
from together_train._proto import common_pb2
from together_train.errors import from_error_detail, from_rpc_error, make_error
from together_train.retry import RetryPolicy, is_retryable

_METHOD = "/test.Errors/Fail"


class _Behaviour:
    def __init__(self):
        self.next = None  # callable(context)


def _status(code, message, detail=None, status_message=None):
    st = status_pb2.Status(code=code.value[0], message=status_message if status_message is not None else message)
    if detail is not None:
        a = any_pb2.Any()
        a.Pack(detail)
        st.details.append(a)
    return st


@pytest.fixture(scope="module")
def server():
    behaviour = _Behaviour()

    def fail(request, context):
        behaviour.next(context)
        return b""

    handler = grpc.method_handlers_generic_handler(
        "test.Errors", {"Fail": grpc.unary_unary_rpc_method_handler(fail, lambda b: b, lambda b: b)}
    )
    srv = grpc.server(cf.ThreadPoolExecutor(max_workers=4))
    srv.add_generic_rpc_handlers((handler,))
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    call = channel.unary_unary(_METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b)

    def rpc_error(fn):
        behaviour.next = fn
        with pytest.raises(grpc.RpcError) as ei:
            call(b"", timeout=5)
        return ei.value

    yield rpc_error
    channel.close()
    srv.stop(None)


def _abort_with(st):
    from grpc_status import rpc_status

    def fn(context):
        context.abort_with_status(rpc_status.to_status(st))

    return fn


def test_detail_is_read_from_status(server):
    detail = common_pb2.ErrorDetail(code=3, message="weights has length 3, model_input 4", retryable=False, sample_index=2, key="weights")
    err = from_rpc_error(server(_abort_with(_status(grpc.StatusCode.INVALID_ARGUMENT, detail.message, detail))))
    assert type(err) is tt.InvalidArgumentError
    assert (err.code, err.retryable, err.sample_index, err.key) == ("INVALID_ARGUMENT", False, 2, "weights")
    assert err.message == "weights has length 3, model_input 4"
    assert str(err) == "[INVALID_ARGUMENT] weights has length 3, model_input 4 (sample 2, key 'weights')"
    assert isinstance(err, ValueError)  # also a ValueError


def test_sample_index_zero_is_kept(server):
    detail = common_pb2.ErrorDetail(code=3, message="bad", sample_index=0, key="target_tokens")
    err = from_rpc_error(server(_abort_with(_status(grpc.StatusCode.INVALID_ARGUMENT, "bad", detail))))
    assert err.sample_index == 0
    detail2 = common_pb2.ErrorDetail(code=3, message="bad")
    err2 = from_rpc_error(server(_abort_with(_status(grpc.StatusCode.INVALID_ARGUMENT, "bad", detail2))))
    assert err2.sample_index is None and err2.key is None


@pytest.mark.parametrize(
    "code, cls, retryable",
    [
        (grpc.StatusCode.UNAVAILABLE, tt.UnavailableError, True),
        (grpc.StatusCode.DEADLINE_EXCEEDED, tt.DeadlineExceededError, True),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, tt.ResourceExhaustedError, False),
        (grpc.StatusCode.NOT_FOUND, tt.NotFoundError, False),
        (grpc.StatusCode.FAILED_PRECONDITION, tt.FailedPreconditionError, False),
        (grpc.StatusCode.UNIMPLEMENTED, tt.UnimplementedError, False),
        (grpc.StatusCode.PERMISSION_DENIED, tt.PermissionDeniedError, False),
        (grpc.StatusCode.UNAUTHENTICATED, tt.UnauthenticatedError, False),
        (grpc.StatusCode.INTERNAL, tt.InternalError, False),
        (grpc.StatusCode.CANCELLED, tt.OperationCancelledError, False),
        (grpc.StatusCode.ALREADY_EXISTS, tt.AlreadyExistsError, False),
    ],
)
def test_fallback_without_detail(server, code, cls, retryable):
    err = from_rpc_error(server(lambda ctx: ctx.abort(code, f"plain {code.name}")))
    assert type(err) is cls
    assert err.code == code.name and err.retryable is retryable
    assert err.message == f"plain {code.name}" and err.sample_index is None and err.key is None


def test_detail_retryable_flag_overrides_code_default(server):
    d = common_pb2.ErrorDetail(code=14, message="replica gone for good", retryable=False)
    err = from_rpc_error(server(_abort_with(_status(grpc.StatusCode.UNAVAILABLE, d.message, d))))
    assert isinstance(err, tt.UnavailableError) and not err.retryable
    d = common_pb2.ErrorDetail(code=8, message="queue full", retryable=True, key="seq_id")
    err = from_rpc_error(server(_abort_with(_status(grpc.StatusCode.RESOURCE_EXHAUSTED, d.message, d))))
    assert isinstance(err, tt.ResourceExhaustedError) and err.retryable and err.key == "seq_id"


def test_detail_with_unset_code_uses_call_code(server):
    d = common_pb2.ErrorDetail(message="", key="session_id")
    err = from_rpc_error(server(_abort_with(_status(grpc.StatusCode.NOT_FOUND, "unknown session", d))))
    assert isinstance(err, tt.NotFoundError) and err.key == "session_id" and err.message == "unknown session"


def test_inconsistent_status_message_still_parsed(server):
    d = common_pb2.ErrorDetail(code=3, message="detail text", key="loss_fn")
    st = _status(grpc.StatusCode.INVALID_ARGUMENT, "x", d, status_message="something else")

    def fn(context):
        context.set_trailing_metadata((("grpc-status-details-bin", st.SerializeToString()),))
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "call details")

    err = from_rpc_error(server(fn))
    assert isinstance(err, tt.InvalidArgumentError) and err.key == "loss_fn" and err.message == "detail text"


def test_from_error_detail_for_operations():
    d = common_pb2.ErrorDetail(code=13, message="CUDA OOM", retryable=True)
    err = from_error_detail(d, operation_id="op-1")
    assert isinstance(err, tt.InternalError) and err.retryable and err.operation_id == "op-1"
    assert "operation op-1" in str(err)
    err = from_error_detail(common_pb2.ErrorDetail(code=1, message="cancelled"), operation_id="op-2")
    assert isinstance(err, tt.OperationCancelledError) and isinstance(err, cf.CancelledError)
    err = from_error_detail(common_pb2.ErrorDetail(), default_code="INTERNAL")
    assert isinstance(err, tt.InternalError)


def test_errors_pickle_and_hierarchy():
    e = make_error("INVALID_ARGUMENT", "bad", sample_index=1, key="weights", operation_id="op")
    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is tt.InvalidArgumentError and (e2.sample_index, e2.key, e2.operation_id) == (1, "weights", "op")
    assert isinstance(make_error("DEADLINE_EXCEEDED", "x"), TimeoutError)
    assert isinstance(make_error("UNAVAILABLE", "x"), ConnectionError)
    assert isinstance(make_error(5, "x"), tt.NotFoundError)  # by number
    assert all(isinstance(make_error(c, "x"), tt.TogetherTrainError) for c in ("OUT_OF_RANGE", "ABORTED", "DATA_LOSS", "BOGUS"))


class _Flaky:
    def __init__(self, errors):
        self.errors = list(errors)
        self.calls = 0

    def __call__(self):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


FAST = RetryPolicy(max_attempts=4, initial_backoff_s=0.001, max_backoff_s=0.002, jitter_s=0.001)


def test_retry_policy_retries_only_retryable():
    f = _Flaky([make_error("UNAVAILABLE", "a"), make_error("DEADLINE_EXCEEDED", "b")])
    assert FAST.call(f) == "ok" and f.calls == 3
    f = _Flaky([make_error("INVALID_ARGUMENT", "a")])
    with pytest.raises(tt.InvalidArgumentError):
        FAST.call(f)
    assert f.calls == 1
    f = _Flaky([make_error("UNAVAILABLE", "a")] * 10)
    with pytest.raises(tt.UnavailableError):
        FAST.call(f)
    assert f.calls == 4
    f = _Flaky([ValueError("not ours")])
    with pytest.raises(ValueError):
        FAST.call(f)
    assert f.calls == 1


def test_retry_policy_non_idempotent_only_unavailable():
    f = _Flaky([make_error("DEADLINE_EXCEEDED", "a")])
    with pytest.raises(tt.DeadlineExceededError):
        FAST.call(f, idempotent=False)
    f = _Flaky([make_error("UNAVAILABLE", "a")])
    assert FAST.call(f, idempotent=False) == "ok"
    assert is_retryable(make_error("UNAVAILABLE", "x"), idempotent=False)
    assert not is_retryable(make_error("RESOURCE_EXHAUSTED", "x"))


def test_retry_policy_is_bounded_in_time():
    import time

    policy = RetryPolicy(max_attempts=1000, max_elapsed_s=0.2, initial_backoff_s=0.05, max_backoff_s=0.05, jitter_s=0.0)
    f = _Flaky([make_error("UNAVAILABLE", "a")] * 1000)
    t0 = time.monotonic()
    with pytest.raises(tt.UnavailableError):
        policy.call(f)
    assert time.monotonic() - t0 < 2.0 and f.calls < 20


def test_retry_policy_converts_rpc_errors(server):
    rpc_err = server(lambda ctx: ctx.abort(grpc.StatusCode.NOT_FOUND, "gone"))

    def raise_it():
        raise rpc_err

    with pytest.raises(tt.NotFoundError) as ei:
        FAST.call(raise_it)
    assert ei.value.message == "gone"
