"""Service routes of the Tinker API: health, client feature flags, telemetry, server capabilities."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from together_train_server.wire.http.tinker.base import _ctx, router


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.post("/client/config")
def client_config() -> dict[str, Any]:
    """Feature flags: what this server implements of the SDK's optional protocol features."""
    return {
        "pjwt_auth_enabled": False,  # API keys only, no JWT exchange
        "credential_default_source": "api_key",
        "parallel_fwdbwd_chunks": True,  # chunks may arrive out of order: the session queue holds them back
        "proto_compress_fwdbwd": False,  # loopback/LAN: compressing costs more CPU than it saves
        "use_pyqwest_transport": False,
        "sample_use_retrieve_futures": False,
        "custom_loss_server_side": False,  # forward_backward_custom runs the loss in the client
        "sample_join_sampling_session": False,
    }


@router.post("/client/dynamic_config")
def client_dynamic_config() -> dict[str, Any]:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@router.post("/telemetry")
def telemetry() -> dict[str, str]:
    """The SDK reports client telemetry here; accepted and dropped."""
    return {"status": "accepted"}


@router.get("/get_server_capabilities")
def get_server_capabilities(request: Request) -> dict[str, Any]:
    resource, _, _ = _ctx(request)
    caps = resource.capabilities()
    return {
        "supported_models": [
            {
                # The name to pass as base_model (the model directory; its basename is accepted too).
                "model_name": resource.base_model_name(),
                "max_context_length": int(caps["max_seq_len"]),
                "trainable": True,
                "sampleable": int(caps["num_replicas"]) > 0,
            }
        ]
    }
