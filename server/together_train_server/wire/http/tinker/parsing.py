"""Reading Tinker requests: JSON fields, seq ids, idempotency keys, protobuf datums and tensors, LoRA configs.

Every error is INVALID_ARGUMENT naming the field (and the sample index for a datum).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
from fastapi import Request

from together_train_server.engines.types import LoraConfig
from together_train_server.service.errors import invalid
from together_train_server.wire.http import tinker_wire as tw
from together_train_server.wire.http.tinker.base import ATTN_MODULES, LORA_ALPHA, MLP_MODULES


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as e:
        raise invalid(f"the request body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body


def _get(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = ..., where: str = "") -> Any:
    """body[name] checked against `kind`; INVALID_ARGUMENT naming the field when missing or mistyped."""
    value = body.get(name, default)
    if value is ...:
        raise invalid(f"{where}{name} is required", key=name)
    if value is not None and value is not default and not isinstance(value, kind):
        raise invalid(f"{where}{name} must be {getattr(kind, '__name__', kind)}, got {value!r}", key=name)
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise invalid(f"{where}{name} must be a number, got {value!r}", key=name)
    return value


def _seq(seq_id: Any) -> int:
    """Our 0-based queue position for the SDK's 1-based seq_id."""
    if not isinstance(seq_id, int) or isinstance(seq_id, bool) or seq_id < 1:
        raise invalid(f"seq_id must be an integer >= 1 (the SDK sends request_id + 1), got {seq_id!r}", key="seq_id")
    return seq_id - 1


def _dedupe_key(seq_id: int, payload: bytes) -> str:
    """Idempotency key of a submission: re-sent with the same seq_id and body, it finds the first operation."""
    return f"tinker:{seq_id}:{hashlib.sha256(payload).hexdigest()[:32]}"


def _lora_from_tinker(cfg: dict[str, Any]) -> LoraConfig:
    """Tinker's LoraConfig -> ours (alpha LORA_ALPHA; train_attn/train_mlp -> target modules)."""
    rank = _get(cfg, "rank", int, where="lora_config.")
    seed = _get(cfg, "seed", int, None, where="lora_config.")
    train_mlp = _get(cfg, "train_mlp", bool, True, where="lora_config.")
    train_attn = _get(cfg, "train_attn", bool, True, where="lora_config.")
    train_unembed = _get(cfg, "train_unembed", bool, True, where="lora_config.")
    modules = (ATTN_MODULES if train_attn else ()) + (MLP_MODULES if train_mlp else ())
    if not modules:
        # Ours reads an empty list as "all linear layers"; Tinker's unembed-only has no equivalent here.
        raise invalid("train_mlp and train_attn are both false: this resource trains LoRA on attention and/or "
                      "MLP layers (an lm_head-only adapter is not supported)", key="train_mlp")
    if seed is None:  # the SDK documents None as a random seed; the session records the one drawn
        import secrets

        seed = secrets.randbelow(2**31)
    return LoraConfig(rank=int(rank), alpha=LORA_ALPHA, target_modules=modules, train_unembed=bool(train_unembed),
                      seed=int(seed))


_NP_DTYPES = {tw.DTYPE_FLOAT32: np.float32, tw.DTYPE_INT64: np.int64, tw.DTYPE_INT32: np.int32}


def _tensor(t: Any, sample: int, key: str) -> np.ndarray:
    """A tinker proto Tensor as a 1-D numpy array (int64 or float32)."""
    if t.WhichOneof("encoding") == "sparse_csr":
        raise invalid("sparse loss_fn_inputs are not supported; send dense arrays", sample_index=sample, key=key)
    if t.dtype == tw.DTYPE_BFLOAT16:
        raw = np.frombuffer(t.dense, dtype=np.uint16)
        arr = (raw.astype(np.uint32) << 16).view(np.float32)
    elif t.dtype in _NP_DTYPES:
        dtype = np.dtype(_NP_DTYPES[t.dtype])
        if len(t.dense) % dtype.itemsize:
            raise invalid(f"{len(t.dense)} bytes are not a whole number of {dtype} values", sample_index=sample,
                          key=key)
        arr = np.frombuffer(t.dense, dtype=dtype)
    else:
        raise invalid(f"unsupported tensor dtype {t.dtype}", sample_index=sample, key=key)
    if len(t.shape) > 1:
        raise invalid(f"loss_fn_inputs must be 1-D (one value per position), got shape {list(t.shape)}",
                      sample_index=sample, key=key)
    if t.shape and int(t.shape[0]) != arr.size:
        raise invalid(f"shape {list(t.shape)} does not match its {arr.size} values", sample_index=sample, key=key)
    return arr.astype(np.int64) if arr.dtype.kind in "iu" else arr.astype(np.float32)


def _samples(msg: Any) -> list[tuple[np.ndarray, dict[str, np.ndarray]]]:
    """Datums -> (model_input int64 [n], loss_fn_inputs) pairs; the service validates lengths and ids."""
    out = []
    for i, datum in enumerate(msg.data):
        parts = []
        for chunk in datum.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise invalid(f"model_input chunk of type {kind!r} is not supported (text tokens only)",
                              sample_index=i, key="model_input")
            if len(chunk.encoded_text.tokens) % 4:
                raise invalid("encoded_text tokens are not int32 values", sample_index=i, key="model_input")
            parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
        tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        inputs = {name: _tensor(t, i, name) for name, t in datum.loss_fn_inputs.items()}
        out.append((tokens, inputs))
    return out


def _loss_params(msg: Any) -> dict[str, Any]:
    """loss_fn_config: the v2 map (numbers and strings) when sent, else the legacy float map."""
    if msg.loss_fn_config_v2:
        return {k: (v.text if v.WhichOneof("value") == "text" else v.number) for k, v in msg.loss_fn_config_v2.items()}
    return dict(msg.loss_fn_config)


async def _body_bytes(request: Request) -> bytes:
    raw = await request.body()
    if request.headers.get("content-encoding", "").lower() == "zstd":
        import zstandard

        try:
            raw = zstandard.ZstdDecompressor().decompressobj().decompress(raw)
        except zstandard.ZstdError as e:
            raise invalid(f"the zstd body does not decompress: {e}") from None
    return raw


def _prompt_tokens(prompt: Any) -> list[int]:
    if not isinstance(prompt, dict) or not isinstance(prompt.get("chunks"), list):
        raise invalid("prompt must be a ModelInput {chunks: [...]}", key="prompt")
    tokens: list[int] = []
    for chunk in prompt["chunks"]:
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            kind = chunk.get("type") if isinstance(chunk, dict) else type(chunk).__name__
            raise invalid(f"prompt chunk of type {kind!r} is not supported (text tokens only)", key="prompt")
        toks = chunk.get("tokens")
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
            raise invalid("prompt chunk tokens must be a list of integers", key="prompt")
        tokens.extend(toks)
    return tokens
