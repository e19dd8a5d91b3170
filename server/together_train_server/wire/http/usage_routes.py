"""``GET /v1/usage``: usage per API key and per session (`Resource.usage`), as JSON.

The caller's key reads its own key's sums and sessions; an admin key (``serve --admin-key-file``) every
key's. ``?session_id=`` narrows the sessions to one (404 for an unknown one or another key's). Each entry
has the fields of `UsageTotals` (service/usage/meter.py): ``key`` (owner tag), ``session_id`` ("" for a
key), the token counts, ``optimizer_steps``, ``trainer_seconds``, ``sampler_seconds``, ``checkpoint_bytes``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter

from together_train_server.wire.http.deps import OwnerDep, ResourceDep

router = APIRouter()


@router.get("/v1/usage")
async def usage(resource: ResourceDep, owner: OwnerDep, session_id: str = "") -> Any:
    """``{"object": "usage", "keys": [...], "sessions": [...]}``."""
    keys, sessions = await asyncio.to_thread(resource.usage, owner, session_id)
    return {"object": "usage", "keys": [u.as_dict() for u in keys], "sessions": [s.as_dict() for s in sessions]}
