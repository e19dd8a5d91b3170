"""The Together API's router, error shape and request context (the resource, this API's ids, the caller)."""

from __future__ import annotations

import functools
from typing import Any, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from together_train_server.service.errors import ServiceError
from together_train_server.service.interfaces import ResourceApi
from together_train_server.wire.http.deps import owner_of, resource_of
from together_train_server.wire.http.app import HTTP_STATUS, error_body
from together_train_server.wire.http.together.ids import TogetherIds

router = APIRouter(prefix="/v1/rl")
# Signed download/upload URLs: the SDK fetches them without the Authorization header.
OPEN_PREFIXES = ("/v1/rl/files/",)
# The app answers errors under these paths (auth failures, unknown bodies) with `error_response`.
ERROR_PREFIXES = ("/v1/rl",)


def error_response(err: ServiceError) -> JSONResponse:
    """The HTTP error of a refused request: 4xx that the SDK does not retry (429 included), 5xx that it does.

    Also the app's handler for this API's paths (see app.create_app's ERROR_PREFIXES).
    """
    status = HTTP_STATUS.get(err.code, 500)
    body = error_body(err)  # detail (the message naming sample and key), code, sample_index, key
    body["message"] = body.pop("detail")
    if err.code == "FAILED_PRECONDITION" and err.key == "session_id":
        body["code"] = "SESSION_NOT_ACTIVE"
    retry = status >= 500 and err.retryable
    return JSONResponse({"error": body}, status_code=status, headers={"x-should-retry": "true" if retry else "false"})


def routes(fn: Callable) -> Callable:
    """Service errors raised by a route become `error_response`s (not the app's generic mapping)."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except ServiceError as err:
            return error_response(err)

    return wrapper


def ctx(request: Request) -> tuple[ResourceApi, TogetherIds, str]:
    """The request's resource, this API's tables and the caller's owner tag."""
    return resource_of(request), request.app.state.together, owner_of(request)


def base_url(request: Request) -> str:
    """This server's address as the client reached it (for the signed URLs it hands out)."""
    return str(request.base_url).rstrip("/")
