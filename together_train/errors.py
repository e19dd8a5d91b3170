"""Typed exceptions of the SDK.

Every error the SDK raises for a refused request or a failed operation is a
`TogetherTrainError` carrying:

- `code`: the gRPC status code name (``"INVALID_ARGUMENT"``, ``"NOT_FOUND"``, ...),
- `retryable`: True when the *same* request may succeed if sent again unchanged,
- `sample_index`: which sample of a batch is at fault (``None`` if not sample-specific),
- `key`: which ``loss_fn_inputs`` key, loss parameter or request field is at fault,
- `operation_id`: the server operation that failed, when there is one.

There is one subclass per status code (see `error_class_for_code`), so callers
can ``except InvalidArgumentError`` or ``except TogetherTrainError`` and read
``err.code`` / ``err.retryable``.

Where the flag comes from: the server packs a ``together_train.v1.ErrorDetail``
into the ``google.rpc.Status`` details of every error it returns (and into
``Operation.error`` of failed operations); its ``retryable`` flag is used as is.
Without a detail (transport errors, a proxy, a client-side deadline), the
SDK decides by code:

- ``UNAVAILABLE``: retryable (server not reachable / restarting / connection dropped),
- ``DEADLINE_EXCEEDED``: retryable (every SessionService request carries an
  idempotency key, so a resend never runs an operation twice; CreateSession is
  the exception and is not retried on it, see `retry.py`),
- ``RESOURCE_EXHAUSTED``: *not* retryable (limits such as message size, tokens
  per batch or max sessions do not change by resending; a server that is
  transiently full marks its detail retryable),
- everything else: not retryable.
"""

from __future__ import annotations

import concurrent.futures

import grpc

from together_train._proto import common_pb2

__all__ = [
    "TogetherTrainError",
    "InvalidArgumentError",
    "NotFoundError",
    "AlreadyExistsError",
    "FailedPreconditionError",
    "ResourceExhaustedError",
    "UnimplementedError",
    "UnavailableError",
    "DeadlineExceededError",
    "OperationCancelledError",
    "PermissionDeniedError",
    "UnauthenticatedError",
    "InternalError",
    "ClientClosedError",
    "error_class_for_code",
    "make_error",
    "from_rpc_error",
    "from_error_detail",
    "DEFAULT_RETRYABLE_CODES",
]

#: Codes retried when the server sent no ErrorDetail (see module docstring).
DEFAULT_RETRYABLE_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED"})

_CODE_BY_NUMBER = {sc.value[0]: sc.name for sc in grpc.StatusCode}


class TogetherTrainError(Exception):
    """Base class of every error raised by the SDK for a refused or failed request.

    Attributes:
        message: human-readable description (from the server or the client).
        code: gRPC status code name, e.g. ``"INVALID_ARGUMENT"``.
        retryable: True when the same request may succeed if sent again unchanged.
        sample_index: index of the offending sample in the batch, or None.
        key: offending ``loss_fn_inputs`` key / loss parameter / request field, or None.
        operation_id: id of the failed server operation, or None.
    """

    default_code = "UNKNOWN"

    def __init__(
        self,
        message: str,
        code: str | None = None,
        retryable: bool = False,
        sample_index: int | None = None,
        key: str | None = None,
        *,
        operation_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.retryable = bool(retryable)
        self.sample_index = sample_index
        self.key = key or None
        self.operation_id = operation_id or None

    def __str__(self) -> str:
        where = []
        if self.sample_index is not None:
            where.append(f"sample {self.sample_index}")
        if self.key:
            where.append(f"key {self.key!r}")
        if self.operation_id:
            where.append(f"operation {self.operation_id}")
        suffix = f" ({', '.join(where)})" if where else ""
        return f"[{self.code}] {self.message}{suffix}"

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(message={self.message!r}, code={self.code!r}, "
            f"retryable={self.retryable}, sample_index={self.sample_index!r}, key={self.key!r})"
        )

    def __reduce__(self):  # picklable despite the keyword-only argument
        return (
            _rebuild_error,
            (type(self), self.message, self.code, self.retryable, self.sample_index, self.key, self.operation_id),
        )


def _rebuild_error(cls, message, code, retryable, sample_index, key, operation_id):
    return cls(message, code, retryable, sample_index, key, operation_id=operation_id)


class InvalidArgumentError(TogetherTrainError, ValueError):
    """The request is malformed (INVALID_ARGUMENT, OUT_OF_RANGE): fix it, do not retry.

    Raised client-side too, before anything is sent, for samples whose arrays
    differ in length, are not 1-D, contain NaN/inf or negative token ids.
    """

    default_code = "INVALID_ARGUMENT"


class NotFoundError(TogetherTrainError, LookupError):
    """Unknown session, operation or checkpoint (NOT_FOUND)."""

    default_code = "NOT_FOUND"


class AlreadyExistsError(TogetherTrainError):
    """E.g. a checkpoint name that is already taken (ALREADY_EXISTS)."""

    default_code = "ALREADY_EXISTS"


class FailedPreconditionError(TogetherTrainError):
    """The request is valid but the state does not allow it (FAILED_PRECONDITION, ABORTED):
    a stopped or expired session, an out-of-order seq_id, a cancel of a started operation."""

    default_code = "FAILED_PRECONDITION"


class ResourceExhaustedError(TogetherTrainError):
    """A limit was hit: max sessions, tokens per batch, message size (RESOURCE_EXHAUSTED)."""

    default_code = "RESOURCE_EXHAUSTED"


class UnimplementedError(TogetherTrainError, NotImplementedError):
    """The resource does not offer this operation or loss (yet) (UNIMPLEMENTED)."""

    default_code = "UNIMPLEMENTED"


class UnavailableError(TogetherTrainError, ConnectionError):
    """The resource cannot be reached or is not ready (UNAVAILABLE); retryable by default."""

    default_code = "UNAVAILABLE"


class DeadlineExceededError(TogetherTrainError, TimeoutError):
    """An RPC ran past its deadline (DEADLINE_EXCEEDED); retryable by default.

    Not raised by `OperationFuture.result(timeout)` running out: that raises the
    builtin `TimeoutError` (of which this class is also a subclass).
    """

    default_code = "DEADLINE_EXCEEDED"


class OperationCancelledError(TogetherTrainError, concurrent.futures.CancelledError):
    """The operation was cancelled (CANCELLED), by `OperationFuture.cancel()`, by
    stopping the session, or by the server.

    Also a `concurrent.futures.CancelledError`, so code written against standard
    futures catches it. (Named to avoid clashing with `asyncio.CancelledError`.)
    """

    default_code = "CANCELLED"


class PermissionDeniedError(TogetherTrainError, PermissionError):
    """The API key may not access this session or checkpoint (PERMISSION_DENIED)."""

    default_code = "PERMISSION_DENIED"


class UnauthenticatedError(PermissionDeniedError):
    """Missing or wrong API key (UNAUTHENTICATED)."""

    default_code = "UNAUTHENTICATED"


class InternalError(TogetherTrainError):
    """A server-side bug or crash (INTERNAL, UNKNOWN, DATA_LOSS)."""

    default_code = "INTERNAL"


class ClientClosedError(TogetherTrainError):
    """The client was closed while an operation was pending.

    The operation may still run on the server; attach again with
    `ResourceClient.session(session_id).operation(operation_id)` to get its result.
    """

    default_code = "CANCELLED"


_CLASS_BY_CODE: dict[str, type[TogetherTrainError]] = {
    "INVALID_ARGUMENT": InvalidArgumentError,
    "OUT_OF_RANGE": InvalidArgumentError,
    "NOT_FOUND": NotFoundError,
    "ALREADY_EXISTS": AlreadyExistsError,
    "FAILED_PRECONDITION": FailedPreconditionError,
    "ABORTED": FailedPreconditionError,
    "RESOURCE_EXHAUSTED": ResourceExhaustedError,
    "UNIMPLEMENTED": UnimplementedError,
    "UNAVAILABLE": UnavailableError,
    "DEADLINE_EXCEEDED": DeadlineExceededError,
    "CANCELLED": OperationCancelledError,
    "PERMISSION_DENIED": PermissionDeniedError,
    "UNAUTHENTICATED": UnauthenticatedError,
    "INTERNAL": InternalError,
    "UNKNOWN": InternalError,
    "DATA_LOSS": InternalError,
}


def error_class_for_code(code: str) -> type[TogetherTrainError]:
    """The exception class for a gRPC status code name (TogetherTrainError if unknown)."""
    return _CLASS_BY_CODE.get(code, TogetherTrainError)


def _code_name(code: int | str | grpc.StatusCode | None) -> str:
    if code is None:
        return "UNKNOWN"
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):
        return _CODE_BY_NUMBER.get(code, "UNKNOWN")
    return str(code).upper()


def make_error(
    code: int | str | grpc.StatusCode,
    message: str,
    *,
    retryable: bool | None = None,
    sample_index: int | None = None,
    key: str | None = None,
    operation_id: str | None = None,
) -> TogetherTrainError:
    """Build the typed exception for `code` (name, number or grpc.StatusCode).

    `retryable=None` applies the default for the code (`DEFAULT_RETRYABLE_CODES`).
    """
    name = _code_name(code)
    if retryable is None:
        retryable = name in DEFAULT_RETRYABLE_CODES
    cls = error_class_for_code(name)
    return cls(message, name, retryable, sample_index, key, operation_id=operation_id)


def from_error_detail(
    detail: common_pb2.ErrorDetail, *, operation_id: str | None = None, default_code: str = "UNKNOWN"
) -> TogetherTrainError:
    """Typed exception from a ``together_train.v1.ErrorDetail`` (e.g. ``Operation.error``).

    The detail's own ``retryable`` flag is used as is. A detail with code 0
    (OK / unset) becomes `default_code`.
    """
    name = _code_name(detail.code) if detail.code else default_code
    sample_index = detail.sample_index if detail.HasField("sample_index") else None
    return make_error(
        name,
        detail.message or name.lower().replace("_", " "),
        retryable=detail.retryable,
        sample_index=sample_index,
        key=detail.key or None,
        operation_id=operation_id,
    )


def _status_from_trailers(err: grpc.RpcError):
    """google.rpc.Status from the error's trailing metadata, or None."""
    try:
        from grpc_status import rpc_status

        return rpc_status.from_call(err)
    except ValueError:
        pass  # code/message inconsistent with the packed status: parse it anyway
    except Exception:  # not a grpc.Call, no trailing metadata
        return None
    try:
        from google.rpc import status_pb2

        for k, v in err.trailing_metadata() or ():
            if k == "grpc-status-details-bin":
                return status_pb2.Status.FromString(v)
    except Exception:
        return None
    return None


def from_rpc_error(err: grpc.RpcError) -> TogetherTrainError:
    """Convert a `grpc.RpcError` into the typed exception.

    Reads the ``together_train.v1.ErrorDetail`` packed into the
    ``google.rpc.Status`` details (trailer ``grpc-status-details-bin``); falls
    back to the call's code and details string when there is none, with the
    default retryable flag for the code.
    """
    if isinstance(err, TogetherTrainError):
        return err
    try:
        code = err.code()
    except Exception:
        code = None
    try:
        details = err.details()
    except Exception:
        details = None
    code_name = _code_name(code)
    status = _status_from_trailers(err)
    if status is not None:
        for any_msg in status.details:
            if any_msg.Is(common_pb2.ErrorDetail.DESCRIPTOR):
                detail = common_pb2.ErrorDetail()
                any_msg.Unpack(detail)
                out = from_error_detail(detail, default_code=code_name)
                if not detail.message and (status.message or details):
                    out.message = status.message or details
                    out.args = (out.message,)
                return out
    message = details or (status.message if status is not None else "") or f"RPC failed with {code_name}"
    return make_error(code_name, message)
