"""JSON -> service values for the Together RL API: request bodies, tensors, prompts, losses, LoRA configs.

The wire shapes are those of the ``together`` SDK (3.1.1,
``together/types/post_training``): tensors are ``{"data": [...], "dtype":
"int64" | "float32", "shape"?}``, prompts are ``{"chunks": [{"encoded_text":
{"tokens": [...]}}]}``, int64 values may arrive as JSON strings (proto3 JSON),
enums are the long proto names (``LOSS_TYPE_CROSS_ENTROPY``). Every parse error is
INVALID_ARGUMENT naming the sample index and key, so the SDK's exception text (the
JSON error body) says where.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import numpy as np
from fastapi import Request

from together_train_server.engines.types import LoraConfig
from together_train_server.service.errors import ServiceError, invalid

# Together loss type -> (our loss name, the LossConfig member holding its parameters).
LOSSES = {
    "LOSS_TYPE_CROSS_ENTROPY": ("cross_entropy", "cross_entropy_params"),
    "LOSS_TYPE_IMPORTANCE_SAMPLING": ("importance_sampling", None),
    "LOSS_TYPE_PPO": ("ppo", "ppo_params"),
    "LOSS_TYPE_CISPO": ("cispo", "cispo_params"),
    "LOSS_TYPE_DRO": ("dro", "dro_params"),
    "LOSS_TYPE_GRPO": ("grpo", "grpo_params"),
}
_GRPO_AGG = {
    "GRPO_LOSS_AGGREGATION_TYPE_UNSPECIFIED": None,
    "GRPO_LOSS_AGGREGATION_TYPE_TOKEN_MEAN": "token_mean",
    "GRPO_LOSS_AGGREGATION_TYPE_SEQUENCE_MEAN": "sequence_mean",
    "GRPO_LOSS_AGGREGATION_TYPE_FIXED_HORIZON": "fixed_horizon",
}
_GRPO_RATIO = {"GRPO_LOSS_RATIO_TYPE_TOKEN": "token", "GRPO_LOSS_RATIO_TYPE_SEQUENCE": "sequence"}


def int64(value: Any, key: str, *, sample: int | None = None, where: str = "") -> int:
    """An int64 field sent as a JSON number or (proto3 JSON) a decimal string.

    Raises:
        ServiceError: INVALID_ARGUMENT naming `key` (and the sample) for anything else.
    """
    if isinstance(value, bool):
        raise invalid(f"{where}{key} must be an integer, got {value!r}", sample_index=sample, key=key)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise invalid(f"{where}{key} must be an integer, got {value!r}", sample_index=sample, key=key)


def number(value: Any, key: str, where: str = "") -> float:
    """A JSON number (finite or not; the service checks ranges). INVALID_ARGUMENT naming `key` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"{where}{key} must be a number, got {value!r}", key=key)
    return float(value)


def tokens(model_input: Any, sample: int | None, key: str = "model_input") -> list[int]:
    """The token ids of a ModelInput ``{"chunks": [{"encoded_text": {"tokens": [...]}}]}``, chunks concatenated."""
    if not isinstance(model_input, Mapping) or not isinstance(model_input.get("chunks"), list):
        raise invalid(f"{key} must be an object with a 'chunks' list", sample_index=sample, key=key)
    out: list[int] = []
    for j, chunk in enumerate(model_input["chunks"]):
        enc = chunk.get("encoded_text") if isinstance(chunk, Mapping) else None
        toks = enc.get("tokens") if isinstance(enc, Mapping) else None
        if not isinstance(toks, list):
            raise invalid(f"{key}.chunks[{j}] must be an encoded_text chunk with a tokens list (the only chunk type "
                          "this resource accepts)", sample_index=sample, key=key)
        for t in toks:
            if isinstance(t, int) and not isinstance(t, bool):
                out.append(t)
            else:
                out.append(int64(t, key, sample=sample, where=f"{key}.chunks[{j}].tokens: "))
    return out


def tensor(td: Any, sample: int, key: str) -> np.ndarray:
    """A TensorData as a 1-D numpy array: int64 for ``target_tokens``, float32 otherwise.

    ``weights`` / ``mask`` may be sent as int64 (Together accepts both); they are
    float32 here. Raises INVALID_ARGUMENT naming the sample and key for a
    missing or mistyped ``data``, an unknown dtype, sparse data, or a shape
    that is not ``[len(data)]``.
    """
    if not isinstance(td, Mapping) or not isinstance(td.get("data"), list):
        raise invalid("must be a TensorData object {data: [...], dtype}", sample_index=sample, key=key)
    if td.get("sparse_crow_indices") or td.get("sparse_col_indices"):
        raise invalid("sparse tensors are not supported; send dense data", sample_index=sample, key=key)
    dtype = td.get("dtype", "float32")
    if dtype not in ("int64", "float32"):
        raise invalid(f"dtype must be 'int64' or 'float32', got {dtype!r}", sample_index=sample, key=key)
    data = td["data"]
    try:
        if dtype == "int64":
            arr = np.array([int64(v, key, sample=sample) for v in data], dtype=np.int64)
        else:
            arr = np.array([number(v, key) if not isinstance(v, str) else float(v) for v in data], dtype=np.float64)
    except (ValueError, OverflowError) as e:
        if isinstance(e, ServiceError):
            raise
        raise invalid(f"data holds a value that is not a {dtype}: {e}", sample_index=sample, key=key) from None
    except ServiceError as e:
        raise ServiceError(e.code, e.message, sample_index=sample, key=key) from None
    shape = td.get("shape")
    if shape is not None and (not isinstance(shape, list) or [int64(d, "shape", sample=sample) for d in shape]
                              != [arr.size]):
        raise invalid(f"shape {shape} does not match its {arr.size} values (tensors are 1-D)", sample_index=sample,
                      key=key)
    if key == "target_tokens":
        if dtype != "int64":
            raise invalid("target_tokens must be int64 token ids, got dtype float32", sample_index=sample, key=key)
        return arr
    if dtype == "float32" and np.any(np.abs(arr[np.isfinite(arr)]) > np.finfo(np.float32).max):
        raise invalid("a value is beyond the float32 range", sample_index=sample, key=key)
    return arr.astype(np.float32)


def samples(items: Any, key: str = "samples") -> list[tuple[np.ndarray, dict[str, np.ndarray]]]:
    """Together ``samples`` -> the service's ``[(model_input int64 [n], {key: array})]``."""
    if not isinstance(items, list):
        raise invalid(f"{key} must be a list", key=key)
    out = []
    for i, s in enumerate(items):
        if not isinstance(s, Mapping):
            raise invalid("must be an object {model_input, loss_fn_inputs}", sample_index=i, key=key)
        mi = np.asarray(tokens(s.get("model_input"), i), dtype=np.int64)
        inputs = s.get("loss_fn_inputs")
        if not isinstance(inputs, Mapping):
            raise invalid("loss_fn_inputs must be an object of TensorData", sample_index=i, key="loss_fn_inputs")
        if "weights" in inputs and "mask" in inputs:
            raise invalid("give weights or mask, not both", sample_index=i, key="mask")
        out.append((mi, {str(k): tensor(v, i, str(k)) for k, v in inputs.items()}))
    return out


def loss(cfg: Any) -> tuple[str, dict[str, Any]]:
    """A Together LossConfig -> (our loss name, our loss parameters).

    Raises:
        ServiceError: INVALID_ARGUMENT naming ``loss.type`` for an unknown or
            unsupported type (LOSS_TYPE_DPPO), or the parameter for a bad enum value.
    """
    if not isinstance(cfg, Mapping):
        raise invalid("loss must be an object {type, <type>_params}", key="loss")
    kind = cfg.get("type")
    if kind not in LOSSES:
        raise invalid(f"loss.type {kind!r} is not supported here; supported: {sorted(LOSSES)}", key="loss.type")
    name, params_key = LOSSES[kind]
    params = dict(cfg.get(params_key) or {}) if params_key else {}
    if name == "grpo":
        if "agg_type" in params:
            agg = params.pop("agg_type")
            if agg not in _GRPO_AGG:
                raise invalid(f"grpo_params.agg_type {agg!r} is not one of {sorted(_GRPO_AGG)}", key="agg_type")
            if _GRPO_AGG[agg]:
                params["aggregation"] = _GRPO_AGG[agg]
        if "ratio_type" in params:
            rt = params.pop("ratio_type")
            if rt not in _GRPO_RATIO:
                raise invalid(f"grpo_params.ratio_type {rt!r} is not one of {sorted(_GRPO_RATIO)}", key="ratio_type")
            params["ratio_type"] = _GRPO_RATIO[rt]
    return name, params


async def json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object ({} for an empty body); INVALID_ARGUMENT for anything else."""
    raw = await request.body()
    if not raw.strip():  # empty-body POSTs arrive with Content-Length: 0
        return {}
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise invalid(f"the request body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body


def page_limit(q: Any) -> int:
    """A listing's ``limit`` query parameter (default 100), in [1, 100]."""
    value = int64(q.get("limit", 100), "limit")
    if not 1 <= value <= 100:
        raise invalid(f"limit must be in [1, 100], got {value}", key="limit")
    return value


def lora_config(cfg: Any) -> LoraConfig | None:
    """A Together LoraConfig object -> ours (unset fields: our defaults); None stays None."""
    if cfg is None:
        return None
    if not isinstance(cfg, dict):
        raise invalid("lora_config must be an object", key="lora_config")
    d = LoraConfig()
    return LoraConfig(
        rank=int64(cfg.get("rank", d.rank), "rank", where="lora_config."),
        alpha=number(cfg.get("alpha", d.alpha), "alpha", "lora_config."),
        dropout=number(cfg.get("dropout", d.dropout), "dropout", "lora_config."),
        seed=int64(cfg.get("seed", d.seed), "seed", where="lora_config."),
        train_unembed=bool(cfg.get("train_unembed", False)),
    )
