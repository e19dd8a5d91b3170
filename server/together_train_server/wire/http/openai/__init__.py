"""OpenAI-compatible inference: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

JSON <-> `service.inference` only: the models, prompts, limits, sampling and
text live in `InferenceService`; this package reads OpenAI's request shapes,
writes OpenAI's response shapes (also as server-sent events for
``stream: true``) and errors in OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``; sampling goes through the
resource's `ReplicaSampler` (`Resource.inference`). ``model`` is the base
model's id (``GET /v1/models``), an inference checkpoint's URI
(``together-train://<session>/weights/<name>``) or a training session's id. Under
``/v1/rollouts/{rollout_id}`` every call is also recorded token for token (`service.rollouts`). API keys: ``Authorization:
Bearer <key>`` (the official ``openai`` client's ``api_key``), checked by the
app (`app.create_app`), which answers a refused key in this package's error
shape (`ERROR_PREFIXES`, `error_response`).

Modules: `routing` (router, errors, request context), `rendering` (response
objects), `streaming` (server-sent events), `models`, `completions`, `chat`
(one endpoint family each), `rollouts` (the recorded rollouts). A new endpoint is a new module
imported here.
"""

from __future__ import annotations

from typing import Any, Protocol

from together_train_server.service.interfaces import Chats, InferenceService, ResourceApi, ResponseStore
from together_train_server.wire.http.deps import services_of
from together_train_server.wire.http.openai import chat, completions, models, responses, rollouts
from together_train_server.wire.http.openai.routing import ERROR_PREFIXES, error_response, router

# The endpoint modules register their routes on `router` when imported.
_ROUTE_MODULES = (models, completions, chat, responses, rollouts)

__all__ = ["ERROR_PREFIXES", "error_response", "install", "router"]


class InferenceHost(Protocol):
    """What ``together-train deploy`` serves instead of a `Resource`: its own `InferenceService`."""

    inference: InferenceService


def install(app: Any, resource: ResourceApi | InferenceHost) -> None:
    """Hand the routes their `InferenceService` (`deps.Services.inference`): one built for a `Resource`, or a
    deployment's own (``together-train deploy``)."""
    services = services_of(app)
    svc = services.inference = resource.inference
    services.chats = Chats(svc)  # OpenAI chat, Responses and Anthropic Messages: one use case
    if getattr(svc, "responses", None) is None:  # POST /v1/responses with store: previous_response_id
        svc.responses = ResponseStore()
