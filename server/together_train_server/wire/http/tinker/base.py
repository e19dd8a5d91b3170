"""The Tinker API's router (``/api/v1``), its LoRA conventions and the request context."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter, Request

from together_train_server.wire.http.deps import owner_of, resource_of
from together_train_server.wire.http.tinker.ids import TinkerIds

if TYPE_CHECKING:
    from together_train_server.service.interfaces import ResourceApi


router = APIRouter(prefix="/api/v1")

LORA_ALPHA = 32.0

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")

MLP_MODULES = ("gate_proj", "up_proj", "down_proj")

PROTO = "application/x-protobuf"


def _ctx(request: Request) -> tuple[ResourceApi, TinkerIds, str]:
    """The app's `Resource`, this API's id tables and the caller's owner tag (its API key, "" without keys)."""
    return resource_of(request), request.app.state.tinker, owner_of(request)
