"""The web dashboard: ``GET /`` (a static page) polling ``GET /api/dashboard/state`` (JSON).

The page (``static/index.html``, ``dashboard.js``, ``dashboard.css``; plain
HTML/CSS/JS, charts drawn as SVG by the page itself, nothing fetched from
the network) is served to anyone. The state is built in the service layer
(`telemetry.dashboard_state`) and limited to what the caller may see
(`metrics_routes.viewer`): with API keys, the page asks for the key once,
keeps it in the browser's sessionStorage and sends it as ``X-API-Key``;
without a key it shows the resource and replica states only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from together_train_server.service.interfaces import ResourceApi
from together_train_server.wire.http.deps import ResourceDep
from together_train_server.wire.http.metrics_routes import viewer

STATIC = Path(__file__).with_name("static")
router = APIRouter()
OPEN_PATHS = ("/", "/api/dashboard/state")
OPEN_PREFIXES = ("/dashboard/static/",)


def install(app: FastAPI, resource: ResourceApi) -> None:
    """Serve the page's files under ``/dashboard/static/``."""
    app.mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static")


@router.get("/", include_in_schema=False)
def index() -> Any:
    """The dashboard page (revalidated on every load, so an upgraded server's page is picked up)."""
    return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


@router.get("/api/dashboard/state")
def state(request: Request, resource: ResourceDep) -> Any:
    """The dashboard's JSON: what the caller's key may see, and whether the resource asks for a key."""
    owner = viewer(request)
    body = resource.dashboard_state(owner)
    store = resource.rollouts  # the caller's recorded rollouts (/v1/rollouts/{id}), newest first
    body["rollouts"] = store.list(owner)[:50] if owner is not None else []
    body["rollout_store"] = store.stats()
    # Usage per API key (service/usage/): the caller's own key, every key for an admin key.
    body["usage"] = [u.as_dict() for u in resource.usage(owner)[0]] if owner is not None else []
    body["auth_required"] = getattr(request.app.state, "api_keys", None) is not None
    return body
