"""Tinker's ``SamplingParams`` (JSON) -> the service's `SamplingParams`."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from together_train_server.engines.types import SamplingParams
from together_train_server.service.errors import invalid
from together_train_server.service.interfaces import Limits
from together_train_server.wire.sampling_params import default_max_tokens, ranged_from_body


def tinker_sampling_params(params: Mapping[str, Any], prompt_len: int, limits: Limits) -> SamplingParams:
    """Tinker's ``sampling_params`` object as the service's `SamplingParams` (ranges checked later, by the service).

    Tinker's conventions: ``max_tokens`` None = `DEFAULT_MAX_TOKENS` bounded
    by the context left after the prompt and by ``limits.max_new_tokens``;
    ``stop`` absent/None = stop at EOS, ``[]`` = no stop at all (EOS
    ignored), a string or list of strings = stop strings, a list of ints =
    stop token ids (EOS still stops); ``top_k`` -1 = off (ours: 0);
    ``seed`` None = unseeded. Fields tinker's type lacks (``min_p``) are read
    as extras by name (`ranged_from_body`).

    Raises:
        ServiceError: INVALID_ARGUMENT naming the field for a wrong type.
    """
    def num(name: str, kind: type, default: Any) -> Any:
        v = params.get(name, default)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
            raise invalid(f"sampling_params.{name} must be {kind.__name__}, got {v!r}", key=name)
        return kind(v)

    max_tokens = num("max_tokens", int, None)
    if max_tokens is None:
        max_tokens = default_max_tokens(limits, prompt_len)
    top_k = num("top_k", int, -1)
    stop_strs, stop_ids, ignore_eos = _stops(params.get("stop"))
    temperature, top_p, seed = num("temperature", float, 1.0), num("top_p", float, 1.0), num("seed", int, None)
    return SamplingParams(max_tokens=max_tokens, temperature=1.0 if temperature is None else temperature,
                          top_k=0 if top_k in (-1, None) else top_k, top_p=1.0 if top_p is None else top_p, seed=seed,
                          stop=stop_strs, stop_token_ids=stop_ids, ignore_eos=ignore_eos,
                          **ranged_from_body(params, "sampling_params."))


def _stops(stop: Any) -> tuple[tuple[str, ...], tuple[int, ...], bool]:
    """Tinker's ``stop``: (stop strings, stop token ids, ignore_eos); see `tinker_sampling_params`."""
    if stop is None:
        return (), (), False
    if isinstance(stop, str):
        return (stop,), (), False
    if isinstance(stop, Sequence) and all(isinstance(x, str) for x in stop):
        return tuple(stop), (), not stop
    if isinstance(stop, Sequence) and all(isinstance(x, int) and not isinstance(x, bool) for x in stop):
        return (), tuple(int(x) for x in stop), False
    raise invalid(f"sampling_params.stop must be a string, a list of strings or a list of token ids, got {stop!r}",
                  key="stop")
