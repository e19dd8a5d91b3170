"""The OpenAI API's router, error shape and request context (the `InferenceService`, the caller)."""

from __future__ import annotations

import functools
import json
from typing import Any, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from together_train_server.service.errors import ServiceError, invalid
from together_train_server.service.interfaces import InferenceService
from together_train_server.wire.http.deps import inference_of, owner_of

router = APIRouter()

# Paths whose errors (auth included) take OpenAI's shape; /v1/rl/... is the Together API's.
ERROR_PREFIXES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/rollouts")

_STATUS = {"INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "OUT_OF_RANGE": 400, "UNIMPLEMENTED": 400,
           "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429,
           "ABORTED": 409, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504}
_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "invalid_request_error", 409: "conflict_error", 429: "rate_limit_error"}


def error_response(err: ServiceError) -> JSONResponse:
    """OpenAI's error shape for a ServiceError: ``{"error": {"message", "type", "param", "code"}}``.

    ``param`` is the request field at fault (our error's key); ``code`` is
    ``model_not_found`` for an unknown model, else our status code's name
    (lower case); 5xx are ``server_error``.
    """
    status = _STATUS.get(err.code, 500)
    code = "model_not_found" if err.code == "NOT_FOUND" and err.key == "model" else err.code.lower()
    if err.code == "UNAUTHENTICATED":
        code = "invalid_api_key"
    body = {"error": {"message": err.message, "type": _TYPE.get(status, "server_error"), "param": err.key,
                      "code": code}}
    return JSONResponse(body, status_code=status)


def handled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Answer ServiceErrors in OpenAI's shape (the app's handler answers in the Tinker shape)."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except ServiceError as err:
            return error_response(err)

    return wrapper


def service(request: Request) -> tuple[InferenceService, str]:
    """The app's `InferenceService` and the caller's owner tag."""
    return inference_of(request), owner_of(request)


def rollout_id(request: Request, svc: InferenceService, owner: str) -> str | None:
    """The rollout of a ``/v1/rollouts/{rollout_id}/...`` call, checked before anything is sampled
    (a bad id 400, another key's 404); None under ``/v1``."""
    rid = request.path_params.get("rollout_id")
    if rid is not None:
        svc.check_rollout(rid, owner)
    return rid


async def json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object ({} for an empty body); INVALID_ARGUMENT for anything else."""
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError as e:
        raise invalid(f"the request body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body
