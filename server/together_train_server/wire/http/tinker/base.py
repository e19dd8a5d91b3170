"""The Tinker API's router (``/api/v1``), its LoRA conventions and the request context."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from together_train_server.wire.http.tinker.ids import TinkerIds


router = APIRouter(prefix="/api/v1")

LORA_ALPHA = 32.0

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")

MLP_MODULES = ("gate_proj", "up_proj", "down_proj")

PROTO = "application/x-protobuf"


def _ctx(request: Request) -> tuple[Any, TinkerIds, str]:
    return request.app.state.resource, request.app.state.tinker, request.state.owner
