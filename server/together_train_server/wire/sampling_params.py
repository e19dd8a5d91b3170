"""The wire's side of the one `SamplingParams`: the proto conversion and what every API's parser shares.

- `params_from_proto` / `params_to_proto`: the one translation between the ``SamplingParams``
  message and the service's `SamplingParams` (the resource's gRPC ``Sample``, the replica client,
  the replica's own servicer).
- `ranged_from_body`: the `ranged` fields (plain numbers such as ``min_p``) of a JSON object, read
  by name, so a new one needs no line in the Tinker, Together or OpenAI parser.
- `default_max_tokens`: the HTTP APIs' max_tokens when a request leaves it unset.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from together_train._proto import common_pb2
from together_train_server.engines.types import Constraint, SamplingParams, ranged_fields
from together_train_server.service.errors import invalid
from together_train_server.service.interfaces import Limits

# max_tokens when a Tinker or Together request leaves it unset: this many, bounded by what
# the context and the resource's max_new_tokens leave.
DEFAULT_MAX_TOKENS = 256


def default_max_tokens(limits: Limits, prompt_len: int) -> int:
    """`DEFAULT_MAX_TOKENS` bounded by ``limits.max_new_tokens`` and the context a prompt of
    `prompt_len` tokens leaves (at least 1: the limit check then names the prompt)."""
    return max(1, min(DEFAULT_MAX_TOKENS, limits.max_new_tokens, limits.max_seq_len - prompt_len))


def params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """The ``SamplingParams`` message as the service's `SamplingParams` (unset optionals: the defaults).

    Raises:
        ServiceError: INVALID_ARGUMENT when max_tokens is unset (it is required).
    """
    if not msg.HasField("max_tokens"):
        raise invalid("sampling_params.max_tokens is required", key="max_tokens")
    ranged = {f.name: getattr(msg, f.name) for f in ranged_fields() if msg.HasField(f.name)}
    return SamplingParams(
        max_tokens=msg.max_tokens,
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        constraint=Constraint(msg.constraint.kind, msg.constraint.spec) if msg.HasField("constraint") else None,
        top_logprobs=msg.top_logprobs if msg.HasField("top_logprobs") else None,
        **ranged,
    )


def params_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    """The service's `SamplingParams` as the ``SamplingParams`` message (every field set but an unset seed
    and an unset top_logprobs)."""
    msg = common_pb2.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                                    stop=list(p.stop), stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
                                    **{f.name: getattr(p, f.name) for f in ranged_fields()})
    if p.seed is not None:
        msg.seed = p.seed
    if p.constraint is not None:
        msg.constraint.kind, msg.constraint.spec = p.constraint.kind, p.constraint.spec
    if p.top_logprobs is not None:
        msg.top_logprobs = p.top_logprobs
    return msg


def ranged_from_body(body: Mapping[str, Any], where: str = "") -> dict[str, float | int]:
    """The `ranged` fields (e.g. ``min_p``) present in a JSON object, typed; absent or null ones are left out.

    Args:
        body: a request's sampling object (Tinker / Together ``sampling_params``, an OpenAI body).
        where: prefix of the field in errors (``"sampling_params."``).

    Raises:
        ServiceError: INVALID_ARGUMENT naming the field for a value that is not a finite number (an
            integer for an int field). Ranges are checked by the service (`validation.check_sampling`).
    """
    out: dict[str, float | int] = {}
    for f in ranged_fields():
        v = body.get(f.name)
        if v is None:
            continue
        kind = "integer" if f.type == "int" else "number"
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (
                kind == "integer" and not float(v).is_integer()):
            raise invalid(f"{where}{f.name} must be a finite {kind}, got {v!r}", key=f.name)
        out[f.name] = int(v) if kind == "integer" else float(v)
    return out
