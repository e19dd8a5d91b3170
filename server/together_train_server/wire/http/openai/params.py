"""OpenAI's sampling fields of a /v1/completions or /v1/chat/completions body: the OpenAI API's parser.

`openai_params` reads them into the service's `InferenceParams` (holding the one `SamplingParams`)
with errors naming the field; `InferenceService` samples with them. Extra body fields that are
`ranged` sampling fields (``min_p``, as vLLM's OpenAI server takes it) are read by name.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from together_train_server.engines.types import SamplingParams
from together_train_server.service.interfaces import InferenceParams, Limits, MIN_TEMPERATURE
from together_train_server.service.errors import invalid
from together_train_server.wire.sampling_params import ranged_from_body

# OpenAI's bounds: chat top_logprobs <= 20, completions logprobs <= 5.
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
# /v1/completions' max_tokens default (OpenAI's); chat defaults to what the context leaves.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Request fields we do not implement: refused when set to anything but their neutral value.
UNSUPPORTED = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "suffix": None,
               "best_of": 1, "functions": None, "function_call": None}
# Fields of one endpoint only (chat: tools through the chat template; completions: echo).
CHAT_ONLY = {"tools": None, "tool_choice": None, "response_format": None}
COMPLETIONS_ONLY = {"echo": False}


def _field(body: Mapping[str, Any], name: str, kind: type, default: Any) -> Any:
    """A typed field of an OpenAI request body (None = absent); INVALID_ARGUMENT naming it otherwise."""
    v = body.get(name, None)
    if v is None:
        return default
    if kind is bool:
        if not isinstance(v, bool):
            raise invalid(f"{name} must be a boolean, got {v!r}", key=name)
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise invalid(f"{name} must be a number, got {v!r}", key=name)
    if kind is int:
        if not float(v).is_integer():
            raise invalid(f"{name} must be an integer, got {v!r}", key=name)
        return int(v)
    if not math.isfinite(float(v)):
        raise invalid(f"{name} must be a finite number, got {v!r}", key=name)
    return float(v)


def openai_params(body: Mapping[str, Any], *, chat: bool, limits: Limits) -> InferenceParams:
    """Read OpenAI's sampling fields of a request body.

    Chat: ``max_completion_tokens`` (or ``max_tokens``), ``logprobs`` (bool)
    with ``top_logprobs`` (0-20). Completions: ``max_tokens`` (default 16),
    ``logprobs`` (int 0-5 = alternatives per position), ``echo`` (max_tokens may
    then be 0). Chat's ``tools`` / ``tool_choice`` are read by `chat_tools`. Both: temperature
    (0-2), top_p, n, seed, stop (a string or a list of up to the resource's
    max_stop_sequences strings), stream, stream_options.include_usage.

    Raises:
        ServiceError: INVALID_ARGUMENT naming the field (key) for a wrong type or
            value, or a set field this server does not implement.
    """
    refused = {**UNSUPPORTED, **(COMPLETIONS_ONLY if chat else CHAT_ONLY)}
    for name, neutral in refused.items():
        v = body.get(name)
        if v is not None and v != neutral and not (isinstance(v, (list, dict)) and not v):
            raise invalid(f"{name} is not supported by this server", key=name)
    max_tokens = _field(body, "max_completion_tokens", int, None) if chat else None
    if max_tokens is None:
        max_tokens = _field(body, "max_tokens", int, None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS)
    echo = not chat and bool(_field(body, "echo", bool, False))
    if max_tokens is not None and max_tokens < (0 if echo else 1):
        key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        raise invalid(f"{key} must be at least {0 if echo else 1}, got {max_tokens}", key=key)
    if max_tokens is not None and max_tokens > limits.max_new_tokens:
        raise invalid(f"max_tokens {max_tokens} exceeds this server's limit {limits.max_new_tokens}", key="max_tokens")
    temperature = _field(body, "temperature", float, 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise invalid(f"temperature must be in [0, 2], got {temperature}", key="temperature")
    if 0 < temperature < MIN_TEMPERATURE:
        temperature = 0.0  # OpenAI accepts any value in [0, 2]; ours this small would divide by ~0: greedy
    top_p = _field(body, "top_p", float, 1.0)  # its range: the service's check (check_sampling)
    n = _field(body, "n", int, 1)
    if not 1 <= n <= limits.max_num_samples:
        raise invalid(f"n must be in [1, {limits.max_num_samples}], got {n}", key="n")
    seed = _field(body, "seed", int, None)
    stop_v = body.get("stop")
    if stop_v is None:
        stop: tuple[str, ...] = ()
    elif isinstance(stop_v, str):
        stop = (stop_v,)
    elif isinstance(stop_v, list) and all(isinstance(s, str) for s in stop_v):
        stop = tuple(stop_v)
    else:
        raise invalid(f"stop must be a string or a list of strings, got {stop_v!r}", key="stop")
    if any(not s for s in stop):
        raise invalid("stop strings must not be empty", key="stop")
    if len(stop) > limits.max_stop_sequences:
        raise invalid(f"at most {limits.max_stop_sequences} stop strings, got {len(stop)}", key="stop")
    if chat:
        logprobs = bool(_field(body, "logprobs", bool, False))
        top = _field(body, "top_logprobs", int, 0)
        if not 0 <= top <= MAX_CHAT_TOP_LOGPROBS:
            raise invalid(f"top_logprobs must be in [0, {MAX_CHAT_TOP_LOGPROBS}], got {top}", key="top_logprobs")
        if top and not logprobs:
            raise invalid("top_logprobs needs logprobs: true", key="top_logprobs")
    else:
        lp = _field(body, "logprobs", int, None)
        if lp is not None and not 0 <= lp <= MAX_COMPLETION_LOGPROBS:
            raise invalid(f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {lp}", key="logprobs")
        logprobs, top = lp is not None, lp or 0
    top = min(top, limits.max_top_k_prompt_logprobs)
    stream = bool(_field(body, "stream", bool, False))
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise invalid(f"stream_options must be an object, got {opts!r}", key="stream_options")
    # Unset max_tokens (chat): what the context leaves, capped per prompt by `InferenceService`.
    sampling = SamplingParams(max_tokens=limits.max_new_tokens if max_tokens is None else max_tokens,
                              temperature=temperature, top_p=top_p, seed=seed, stop=stop, **ranged_from_body(body))
    return InferenceParams(sampling, n=n, logprobs=logprobs, top_logprobs=top, stream=stream,
                           include_usage=bool(opts.get("include_usage", False)), echo=echo)
