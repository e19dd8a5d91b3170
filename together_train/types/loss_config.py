"""`loss_config_to_proto`: loss parameters (``loss_fn_config``) checked and encoded."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from together_train._proto import common_pb2
from together_train.types._checks import invalid

if TYPE_CHECKING:
    from together_train.types.loss_spec import LossSpec

__all__ = ["loss_config_to_proto"]


def _check_params(config: Mapping[str, Any], spec: "LossSpec") -> None:
    known = {p.name: p for p in spec.params}
    for name, value in config.items():
        p = known.get(name)
        if p is None:
            hint = f"; it takes {sorted(known)}" if known else "; it takes no parameters"
            raise invalid(f"unknown parameter {name!r} for loss {spec.name!r}{hint}", key=str(name))
        if p.type in ("float", "int") and (isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating))):
            raise invalid(f"parameter {name!r} must be a number, got {value!r}", key=name)
        if p.type == "string" and not isinstance(value, str):
            raise invalid(f"parameter {name!r} must be a string, got {value!r}", key=name)
        if p.choices and str(value) not in p.choices:
            raise invalid(f"parameter {name!r} must be one of {list(p.choices)}, got {value!r}", key=name)
    for p in spec.params:
        if p.required and p.name not in config:
            raise invalid(f"loss {spec.name!r} requires parameter {p.name!r}", key=p.name)


def loss_config_to_proto(
    config: Mapping[str, Any] | None, spec: "LossSpec | None" = None, *, validate: bool = True
) -> common_pb2.LossConfig:
    """Encode loss parameters (numbers, strings, bools) as a ``LossConfig``.

    With the loss's `spec`, unknown or missing-required parameters, wrong
    types and values outside ``choices`` are refused too.

    Raises:
        InvalidArgumentError: not a mapping (key ``loss_fn_config``), a
            non-string key, a value of another type, or a non-finite number
            (naming the key).
    """
    msg = common_pb2.LossConfig()
    if config is not None and not isinstance(config, Mapping):
        # e.g. [("clip_low_threshold", 0.2)]: refused even with validate=False (it cannot be encoded).
        raise invalid(
            f"loss_fn_config must be a mapping of parameter name to value (a dict), got {type(config).__name__}",
            key="loss_fn_config",
        )
    if validate and spec is not None:
        _check_params(config or {}, spec)
    if not config:
        return msg
    if not validate:
        msg.params.update({str(k): (v.item() if isinstance(v, np.generic) else v) for k, v in config.items()})
        return msg
    clean: dict[str, Any] = {}
    for k, v in config.items():
        if not isinstance(k, str):
            raise invalid(f"loss_fn_config keys must be strings, got {k!r}", key=str(k))
        if isinstance(v, (np.generic,)):
            v = v.item()
        if isinstance(v, bool) or isinstance(v, str):
            clean[k] = v
        elif isinstance(v, (int, float)):
            if not math.isfinite(float(v)):
                raise invalid(f"loss_fn_config[{k!r}] must be finite, got {v}", key=k)
            clean[k] = float(v)
        else:
            raise invalid(f"loss_fn_config[{k!r}] must be a number or a string, got {type(v).__name__}", key=k)
    msg.params.update(clean)
    return msg
