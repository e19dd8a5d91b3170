"""The Anthropic API's router and error shape."""

from __future__ import annotations

import functools
from typing import Any, Callable

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from together_train_server.service.errors import ServiceError

router = APIRouter()

_STATUS = {"INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "OUT_OF_RANGE": 400, "UNIMPLEMENTED": 400,
           "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429,
           "UNAVAILABLE": 529, "DEADLINE_EXCEEDED": 504}
_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
         429: "rate_limit_error", 529: "overloaded_error"}


def error_json(err: ServiceError) -> JSONResponse:
    """``{"type": "error", "error": {"type", "message"}}`` (the field at fault named in the message)."""
    status = _STATUS.get(err.code, 500)
    msg = f"{err.key}: {err.message}" if err.key and not err.message.startswith(str(err.key)) else err.message
    return JSONResponse({"type": "error", "error": {"type": _TYPE.get(status, "api_error"), "message": msg}},
                        status_code=status)


def handled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Answer ServiceErrors in Anthropic's shape."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except ServiceError as err:
            return error_json(err)

    return wrapper
