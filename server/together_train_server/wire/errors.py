"""Map service errors to gRPC statuses with a structured ErrorDetail (google.rpc.Status details)."""

from __future__ import annotations

import functools
from typing import Any, Callable

import grpc
from google.protobuf import any_pb2
from google.rpc import status_pb2
from grpc_status import rpc_status

from together_train._proto import common_pb2
from together_train_server.service.errors import ServiceError, internal_error

_CODES = {c.name: c for c in grpc.StatusCode}


def error_detail(err: ServiceError) -> common_pb2.ErrorDetail:
    """ErrorDetail message for a ServiceError."""
    code = _CODES.get(err.code, grpc.StatusCode.INTERNAL)
    detail = common_pb2.ErrorDetail(
        code=code.value[0], message=err.message, retryable=err.retryable, key=err.key or ""
    )
    if err.sample_index is not None:
        detail.sample_index = err.sample_index
    return detail


def abort(context: grpc.ServicerContext, err: ServiceError) -> None:
    """End the RPC with err's status code, message and packed ErrorDetail."""
    code = _CODES.get(err.code, grpc.StatusCode.INTERNAL)
    packed = any_pb2.Any()
    packed.Pack(error_detail(err))
    context.abort_with_status(
        rpc_status.to_status(status_pb2.Status(code=code.value[0], message=str(err), details=[packed]))
    )


def _session_of(request: Any) -> str:
    """The session id a request names (header.session_id or session_id), '' when none."""
    try:
        if request.HasField("header"):
            return request.header.session_id
    except (ValueError, AttributeError):  # no such field / not a message (a stream)
        pass
    return str(getattr(request, "session_id", "") or "")


def handle_errors(method: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for servicer methods: ServiceError -> its status; ValueError -> INVALID_ARGUMENT;
    any other exception -> INTERNAL, logged with its traceback under an error id the message carries."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except ServiceError as err:
            abort(context, err)
        except NotImplementedError as err:
            abort(context, ServiceError("UNIMPLEMENTED", str(err)))
        except ValueError as err:  # engines raise ValueError for inputs they cannot serve
            abort(context, ServiceError("INVALID_ARGUMENT", str(err)))
        except Exception as err:
            if context.code() is not None:  # the method already ended the RPC (context.abort raises)
                raise
            abort(context, internal_error(err, what=method.__name__, session_id=_session_of(request)))

    return wrapper


def owner_of(context: grpc.ServicerContext) -> str:
    """The API key a call authenticated with ('' without authentication)."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):]
    return ""
