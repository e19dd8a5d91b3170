"""Prometheus ``GET /metrics`` on the HTTP port (text exposition of `Resource.telemetry`).

Metric names and labels are listed in ``service/telemetry.py`` and the README
("Operating a resource"). Only ``together_train_queue_depth{session}`` carries
session ids. Without API keys every series is served. With API keys:

- a scrape without a key is answered (Prometheus often scrapes without one)
  with every resource-wide series and no per-session series;
- a scrape with a key (``Authorization: Bearer <key>`` or ``X-API-Key``, as for
  the rest of the HTTP API; Prometheus' ``authorization`` scrape option) also
  gets the queue depth of that key's own sessions, never another key's;
- an unknown key is refused (401), so a typo does not silently hide series.
"""

from __future__ import annotations

from typing import Any, Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from together_train_server.service.errors import ServiceError
from together_train_server.wire.http.deps import ResourceDep

router = APIRouter()
OPEN_PATHS = ("/metrics",)


def viewer(request: Request) -> str | None:
    """Who is looking: the owner tag (API key) whose sessions may be shown.

    Returns "" without API keys (everything is visible), the key when a valid one
    is presented, None for an anonymous request on a keyed resource (nothing private).

    Raises:
        ServiceError: UNAUTHENTICATED for a presented key the resource does not know.
    """
    from together_train_server.wire.http.app import owner_for

    keys = getattr(request.app.state, "api_keys", None)
    if keys is None:
        return ""
    presented = request.headers.get("x-api-key")
    auth = request.headers.get("authorization", "")
    if not presented and auth.startswith("Bearer "):
        presented = auth[7:]
    if not presented:
        return None
    owner = owner_for(presented, keys)
    if owner is None:
        raise ServiceError("UNAUTHENTICATED", "unknown API key (header X-API-Key or Authorization: Bearer <key>)")
    return owner


def visible_to(owner: str | None) -> Callable[[str], bool] | None:
    """A filter on a session's owner tag: True for sessions `owner` may see; None = none."""
    if owner is None:
        return None
    return lambda session_owner: not session_owner or session_owner == owner


@router.get("/metrics")
def metrics(request: Request, resource: ResourceDep) -> Any:
    """The Prometheus text exposition (per-session series only of the caller's sessions)."""
    owner = viewer(request)
    body = resource.metrics_text(visible_to(owner), owner)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
