"""Anthropic's Messages API (``POST /v1/messages``) over the same `InferenceService` as the OpenAI routes.

The request becomes chat messages rendered with the model's chat template (tools included), is
sampled with the same constraints (a forced ``tool_choice``: `structured.chat_constraint`) and
parsed by the same tool-call parser; only the shapes are Anthropic's (`messages`). The
``anthropic`` client's ``base_url`` is the server's root (it adds ``/v1/messages``), or
``http://HOST:PORT/v1/rollouts/{rollout_id}``: then each call is recorded exactly as a chat call. Errors take
Anthropic's shape ``{"type": "error", "error": {"type", "message"}}``. The ``anthropic`` client's
``x-api-key`` header is one of the app's accepted key headers. Needs the OpenAI package mounted
first (it hands the routes their `InferenceService`: `deps.Services`).
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from together_train_server.service.errors import ServiceError
from together_train_server.wire.http.anthropic import messages
from together_train_server.wire.http.anthropic.routing import router

__all__ = ["ERROR_PREFIXES", "error_response", "router"]

_ROUTE_MODULES = (messages,)
ERROR_PREFIXES = ("/v1/messages",)


def error_response(err: ServiceError) -> JSONResponse:
    """Anthropic's error shape for a ServiceError (`routing.error_json`)."""
    from together_train_server.wire.http.anthropic.routing import error_json

    return error_json(err)
