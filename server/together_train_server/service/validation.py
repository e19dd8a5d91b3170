"""Request validation: every check runs before any state is touched (docs/design.md §4).

Pure numpy; each failure is a ServiceError naming the sample index and the key,
so the client can point at the exact array that is wrong.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from together_train.types.adam_params import ADAM_DEFAULTS, adam_range_error
from together_train_server.engines.loss_specs import InputSpec, LossSpec, ParamError, complete_params
from together_train_server.engines.types import MIN_TEMPERATURE, SamplingParams, ranged_fields
from together_train_server.service.errors import ServiceError, invalid

_DTYPES = {"int64": np.int64, "float32": np.float32}
_F32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class Limits:
    """Per-request limits the resource enforces (listed in GetCapabilities).

    vocab_size: token ids must lie in [0, vocab_size).
    max_seq_len: longest model_input (tokens) of one sample / prompt + completion.
    max_tokens_per_batch: sum of model_input lengths of one forward request.
    max_samples_per_batch: samples in one forward request.
    max_new_tokens: largest SamplingParams.max_tokens.
    max_num_samples: largest num_samples of one sample request.
    max_stop_sequences: stop strings + stop token ids of one request.
    max_top_k_prompt_logprobs: largest top_k_prompt_logprobs, and largest SamplingParams.top_logprobs.
    max_lora_rank: largest LoRA rank of a session.
    """

    vocab_size: int
    max_seq_len: int
    max_tokens_per_batch: int = 65_536
    max_samples_per_batch: int = 1024
    max_new_tokens: int = 4096
    max_num_samples: int = 64
    max_stop_sequences: int = 16
    max_top_k_prompt_logprobs: int = 20
    max_lora_rank: int = 256

    def max_request_bytes(self, max_inputs: int) -> int:
        """The largest request message (bytes) these limits can let through: gRPC's receive limit.

        A forward request at the limits holds ``max_tokens_per_batch`` tokens, each a
        model_input varint (<= 10 bytes) plus up to ``max_inputs`` loss_fn_inputs values
        of <= 8 bytes (int64; float32 is 4), and ``max_samples_per_batch`` samples of
        framing (<= 64 bytes per tensor and per sample); 1 MiB covers the rest (header,
        loss config, stop strings). A larger message cannot be a valid request, so gRPC
        refuses it (RESOURCE_EXHAUSTED) before parsing it: a 200 MB request never gets
        into memory as protobuf objects or numpy arrays.

        Args:
            max_inputs: most tensors one sample may carry (loss_fn_inputs + gradients).
        """
        per_token = 10 + 8 * max_inputs
        per_sample = 64 + 64 * max_inputs
        return self.max_tokens_per_batch * per_token + self.max_samples_per_batch * per_sample + (1 << 20)


def check_counts(lengths: Sequence[int], limits: Limits, *, key: str = "model_input") -> None:
    """Check the number of samples and their token counts, before any array is built.

    Called on the lengths read from the wire message (``len`` of a repeated field is
    free), so an oversized request is refused before numpy copies it.

    Args:
        lengths: tokens of each sample (or sequence) of one request.
        key: the field holding the tokens, named in the error.

    Raises:
        ServiceError: INVALID_ARGUMENT for an empty batch, more samples than
            max_samples_per_batch, more tokens in all than max_tokens_per_batch,
            or a sequence longer than max_seq_len (naming the sample index).
    """
    if len(lengths) == 0:
        raise invalid("the batch is empty: send at least one sample", key="samples")
    if len(lengths) > limits.max_samples_per_batch:
        raise invalid(
            f"{len(lengths)} samples exceed the limit of {limits.max_samples_per_batch} per request",
            key="samples",
        )
    total = sum(lengths)
    if total > limits.max_tokens_per_batch:
        raise invalid(
            f"the batch has {total} tokens, more than the limit of {limits.max_tokens_per_batch} per request",
            key="samples",
        )
    for i, n in enumerate(lengths):
        if n > limits.max_seq_len:
            raise invalid(
                f"sequence of {n} tokens is longer than the model's context length {limits.max_seq_len}",
                sample_index=i,
                key=key,
            )


def _check_token_ids(tokens: np.ndarray, vocab_size: int, *, sample_index: int | None, key: str) -> None:
    if tokens.size == 0:
        return
    bad = np.flatnonzero((tokens < 0) | (tokens >= vocab_size))
    if bad.size:
        pos = int(bad[0])
        raise invalid(
            f"token id {int(tokens[pos])} at position {pos} is outside the vocabulary [0, {vocab_size})",
            sample_index=sample_index,
            key=key,
        )


def validate_loss_params(loss_fn: str, params: Mapping[str, Any], specs: Mapping[str, LossSpec]) -> dict[str, Any]:
    """Check the loss name and its parameters; return params with defaults filled.

    Raises:
        ServiceError: INVALID_ARGUMENT for an unknown loss, unknown parameter,
            wrong type, missing required parameter or a value outside `choices`;
            UNIMPLEMENTED for a loss declared but not yet served.
    """
    if not loss_fn:
        raise invalid(f"loss_fn is required; one of {sorted(specs)}", key="loss_fn")
    spec = specs.get(loss_fn)
    if spec is None:
        raise invalid(f"unknown loss {loss_fn!r}; known losses: {sorted(specs)}", key="loss_fn")
    if not spec.available:
        why = f": {spec.description}" if getattr(spec, "description", "") else ""
        raise ServiceError(
            "UNIMPLEMENTED", f"loss {loss_fn!r} is not implemented by this resource{why}", key="loss_fn"
        )
    known = {p.name: p for p in spec.params}
    out: dict[str, Any] = {}
    for name, value in params.items():
        p = known.get(name)
        if p is None:
            hint = f"; {loss_fn} takes {sorted(known)}" if known else f"; {loss_fn} takes no parameters"
            owners = sorted(n for n, o in specs.items() if n != loss_fn and any(q.name == name for q in o.params))
            if owners:
                hint = f" (it is a parameter of {', '.join(owners)})" + hint
            raise invalid(f"unknown parameter {name!r} for loss {loss_fn!r}{hint}", key=name)
        if p.type in ("float", "int"):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise invalid(f"parameter {name!r} must be a finite number, got {value!r}", key=name)
            if p.type == "int" and float(value) != int(value):
                raise invalid(f"parameter {name!r} must be an integer, got {value!r}", key=name)
            value = int(value) if p.type == "int" else float(value)
        elif p.type == "string":
            if not isinstance(value, str):
                raise invalid(f"parameter {name!r} must be a string, got {value!r}", key=name)
        if p.choices and str(value) not in p.choices:
            raise invalid(f"parameter {name!r} must be one of {list(p.choices)}, got {value!r}", key=name)
        out[name] = value
    try:  # defaults, required parameters and the loss's own rules: the same as the engines apply
        return complete_params(spec, out)
    except ParamError as err:
        raise invalid(str(err), key=err.key) from None


def effective_inputs(spec: LossSpec, params: Mapping[str, Any]) -> tuple[list[InputSpec], dict[str, str]]:
    """The loss's input specs with the inputs its parameters make required marked required.

    Returns:
        (input specs, {name: reason} for the inputs made required), e.g. grpo
        with beta > 0 requires ``reference_logprobs``.
    """
    import dataclasses

    cond = getattr(spec, "conditional_inputs", None)
    why = dict(cond(params)) if cond is not None else {}
    inputs = [dataclasses.replace(i, required=True) if i.name in why else i for i in spec.inputs]
    return inputs, why


def validate_loss_inputs(spec: LossSpec, params: Mapping[str, Any],
                         samples: Sequence[tuple[np.ndarray, Mapping[str, np.ndarray]]]) -> None:
    """Run the loss's value checks (``spec.check_inputs``) on each validated sample.

    Raises:
        ServiceError: INVALID_ARGUMENT naming the sample index and key (e.g. a per-token
            ``clip_low_threshold`` outside (0, 1], an all-zero ``sequence_ratio_mask``).
    """
    check = getattr(spec, "check_inputs", None)
    if check is None:
        return
    for i, (_, inputs) in enumerate(samples):
        try:
            check(params, inputs)
        except ValueError as err:  # loss_specs.ParamError carries the input's name
            raise invalid(str(err), sample_index=i, key=getattr(err, "key", None)) from None


def validate_samples(
    samples: Sequence[tuple[np.ndarray, Mapping[str, np.ndarray]]],
    input_specs: Sequence[Any],
    limits: Limits,
    *,
    extra_per_sample: Sequence[np.ndarray] | None = None,
    extra_key: str = "gradients",
    required_because: Mapping[str, str] | None = None,
) -> list[tuple[np.ndarray, dict[str, np.ndarray]]]:
    """Validate a batch of (model_input, loss_fn_inputs) pairs against a loss's inputs.

    Args:
        samples: per sample, model_input (int64 [n]) and its loss_fn_inputs
            (each 1-D, [n]).
        input_specs: objects with `name`, `dtype` ("int64"|"float32") and
            `required` (the loss table's inputs).
        limits: resource limits.
        extra_per_sample: optional per-sample arrays that must also be [n],
            floating point and finite (e.g. client gradients of
            custom_forward_backward); their count must equal the samples'.
        required_because: reasons appended to the "missing required" message
            of inputs made required by the loss parameters.

    Returns:
        The samples with each input cast to its declared dtype (int64 token
        ids, float32 values); integer arrays given for float inputs are cast.

    Raises:
        ServiceError: INVALID_ARGUMENT naming the sample index and key for an
            empty batch, too many samples or tokens, an empty or too long
            sequence, a missing/unknown key, a wrong dtype or shape, a length
            mismatch, a NaN/inf value or a token id outside the vocabulary.
    """
    _check_batch(samples, limits, extra_per_sample, extra_key)
    specs = {s.name: s for s in input_specs}
    why = required_because or {}
    out = []
    for i, (model_input, inputs) in enumerate(samples):
        mi = _checked_model_input(model_input, limits, i)
        cast = _cast_inputs(inputs, specs, why, mi.size, limits.vocab_size, i)
        if extra_per_sample is not None:
            _check_extra(extra_per_sample[i], mi.size, extra_key, i)
        out.append((mi.astype(np.int64, copy=False), cast))
    return out


def _check_batch(samples: Sequence[Any], limits: Limits, extra_per_sample: Sequence[np.ndarray] | None,
                 extra_key: str) -> None:
    """The request-wide limits: at least one sample, at most the limits' samples and tokens, one extra array
    per sample."""
    if len(samples) == 0:
        raise invalid("the batch is empty: send at least one sample", key="samples")
    if len(samples) > limits.max_samples_per_batch:
        raise invalid(
            f"{len(samples)} samples exceed the limit of {limits.max_samples_per_batch} per request",
            key="samples",
        )
    total = sum(int(np.asarray(mi).size) for mi, _ in samples)
    if total > limits.max_tokens_per_batch:
        raise invalid(
            f"the batch has {total} tokens, more than the limit of {limits.max_tokens_per_batch} per request",
            key="samples",
        )
    if extra_per_sample is not None and len(extra_per_sample) != len(samples):
        raise invalid(
            f"{len(extra_per_sample)} {extra_key} arrays for {len(samples)} samples: send one per sample",
            key=extra_key,
        )


def _checked_model_input(model_input: Any, limits: Limits, i: int) -> np.ndarray:
    """Sample ``i``'s model_input as an array: 1-D, not empty, within the context length and the vocabulary."""
    mi = np.asarray(model_input)
    if mi.ndim != 1:
        raise invalid(f"model_input must be 1-D, got shape {list(mi.shape)}", sample_index=i, key="model_input")
    n = mi.size
    if n == 0:
        raise invalid("model_input is empty", sample_index=i, key="model_input")
    if n > limits.max_seq_len:
        raise invalid(
            f"sequence of {n} tokens is longer than the model's context length {limits.max_seq_len}",
            sample_index=i,
            key="model_input",
        )
    _check_token_ids(mi, limits.vocab_size, sample_index=i, key="model_input")
    return mi


def _cast_inputs(inputs: Mapping[str, Any], specs: Mapping[str, Any], why: Mapping[str, str], n: int,
                 vocab_size: int, i: int) -> dict[str, np.ndarray]:
    """Sample ``i``'s loss_fn_inputs checked against the loss's ``specs`` (no unknown key, every required one)
    and each cast to its declared dtype (`_cast_input`)."""
    for name in inputs:
        if name not in specs:
            raise invalid(
                f"unknown loss_fn_inputs key {name!r}; this loss takes {sorted(specs)}",
                sample_index=i,
                key=name,
            )
    cast: dict[str, np.ndarray] = {}
    for name, spec in specs.items():
        if name not in inputs:
            if spec.required:
                reason = f" ({why[name]})" if name in why else ""
                raise invalid(
                    f"missing required loss_fn_inputs key {name!r}{reason}", sample_index=i, key=name
                )
            continue
        cast[name] = _cast_input(name, spec.dtype, inputs[name], n, vocab_size, i)
    return cast


def _cast_input(name: str, dtype: str, value: Any, n: int, vocab_size: int, i: int) -> np.ndarray:
    """One loss_fn_inputs array: 1-D of ``n`` values, of ``dtype`` ("int64": integers, target_tokens inside
    the vocabulary; "float32": numbers, all finite), cast to it."""
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise invalid(f"{name} must be 1-D, got shape {list(arr.shape)}", sample_index=i, key=name)
    if arr.size != n:
        raise invalid(
            f"{name} has {arr.size} values but model_input has {n} tokens; every "
            "loss_fn_inputs array must be exactly as long as model_input",
            sample_index=i,
            key=name,
        )
    if _DTYPES[dtype] is np.int64:
        if arr.dtype.kind not in "iu":
            raise invalid(f"{name} must be int64, got {arr.dtype}", sample_index=i, key=name)
        arr = arr.astype(np.int64, copy=False)
        if name == "target_tokens":
            _check_token_ids(arr, vocab_size, sample_index=i, key=name)
        return arr
    if arr.dtype.kind not in "iuf":
        raise invalid(f"{name} must be float32, got {arr.dtype}", sample_index=i, key=name)
    arr = arr.astype(np.float32, copy=False)
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:
        raise invalid(
            f"{name} has a non-finite value ({arr[bad[0]]}) at position {int(bad[0])}",
            sample_index=i,
            key=name,
        )
    return arr


def _check_extra(extra_value: Any, n: int, extra_key: str, i: int) -> None:
    """Sample ``i``'s extra array (e.g. custom gradients): 1-D of ``n`` finite floating-point values."""
    extra = np.asarray(extra_value)
    if extra.ndim != 1 or extra.size != n:
        raise invalid(
            f"{extra_key} has shape {list(extra.shape)} but model_input has {n} tokens",
            sample_index=i,
            key=extra_key,
        )
    if extra.dtype.kind != "f":
        raise invalid(f"{extra_key} must be float32, got {extra.dtype}", sample_index=i, key=extra_key)
    if not np.all(np.isfinite(extra)):
        raise invalid(f"{extra_key} has a non-finite value", sample_index=i, key=extra_key)


def check_sampling(
    prompt: Sequence[int],
    params: SamplingParams,
    *,
    num_samples: int,
    top_k_prompt_logprobs: int,
    limits: Limits,
) -> SamplingParams:
    """Check one sample request against the resource's limits (docs/design.md §7).

    Every API's parser builds the `SamplingParams` (wire/); this is the one place its values are
    checked on the resource. Returns `params` with plain Python scalars (ints, floats, tuples).

    Raises:
        ServiceError: INVALID_ARGUMENT naming the field: empty prompt, prompt
            token out of vocabulary or at/over the context length, max_tokens
            zero/over the limit, temperature < 0, non-finite or in
            (0, MIN_TEMPERATURE) (too small to divide by; 0 is greedy), top_k < 0,
            top_p outside (0, 1], a `ranged` field (e.g. min_p) outside its range,
            num_samples outside [1, max], too many stop sequences, stop token id
            out of vocabulary, top_k_prompt_logprobs or top_logprobs over the limit.
    """
    _check_prompt(prompt, limits)
    max_tokens, t, tp = _check_decoding(params, limits)
    ranged: dict[str, Any] = check_ranged(params)
    if not 1 <= num_samples <= limits.max_num_samples:
        raise invalid(f"num_samples must be in [1, {limits.max_num_samples}], got {num_samples}", key="num_samples")
    stop, stop_ids = _check_stops(params, limits)
    if not 0 <= top_k_prompt_logprobs <= limits.max_top_k_prompt_logprobs:
        raise invalid(
            f"top_k_prompt_logprobs must be in [0, {limits.max_top_k_prompt_logprobs}], got {top_k_prompt_logprobs}",
            key="top_k_prompt_logprobs",
        )
    top = params.top_logprobs
    if top is not None and not 0 <= top <= limits.max_top_k_prompt_logprobs:
        raise invalid(f"top_logprobs must be in [0, {limits.max_top_k_prompt_logprobs}], got {top}", key="top_logprobs")
    return dataclasses.replace(
        params, max_tokens=max_tokens, temperature=t, top_k=int(params.top_k), top_p=tp,
        seed=None if params.seed is None else int(params.seed), stop=stop, stop_token_ids=stop_ids,
        ignore_eos=bool(params.ignore_eos), top_logprobs=None if top is None else int(top), **ranged)


def _check_prompt(prompt: Sequence[int], limits: Limits) -> None:
    """A prompt to sample from: not empty, shorter than the context, every token in the vocabulary."""
    n = len(prompt)  # before any copy: a huge prompt is refused without building an array
    if n == 0:
        raise invalid("prompt is empty", key="prompt")
    if n >= limits.max_seq_len:
        raise invalid(
            f"prompt of {n} tokens leaves no room to generate within the context length {limits.max_seq_len}",
            key="prompt",
        )
    p = np.asarray(list(prompt), dtype=np.int64)
    _check_token_ids(p, limits.vocab_size, sample_index=None, key="prompt")


def _check_decoding(params: SamplingParams, limits: Limits) -> tuple[int, float, float]:
    """``(max_tokens, temperature, top_p)`` as plain scalars, after checking them and top_k."""
    max_tokens = params.max_tokens
    if max_tokens <= 0:
        raise invalid(f"sampling_params.max_tokens must be > 0, got {max_tokens}", key="max_tokens")
    if max_tokens > limits.max_new_tokens:
        raise invalid(
            f"sampling_params.max_tokens {max_tokens} exceeds the limit {limits.max_new_tokens}", key="max_tokens"
        )
    t = float(params.temperature)
    if not math.isfinite(t) or t < 0:
        raise invalid(f"temperature must be a finite number >= 0, got {params.temperature}", key="temperature")
    if 0 < t < MIN_TEMPERATURE:
        # Refused, not turned greedy: logits / t overflow to inf and every logprob would be NaN.
        raise invalid(
            f"temperature {params.temperature} is too small to divide the logits by: use 0 for greedy or "
            f">= {MIN_TEMPERATURE}",
            key="temperature",
        )
    if params.top_k < 0:
        raise invalid(f"top_k must be >= 0 (0 = off), got {params.top_k}", key="top_k")
    tp = float(params.top_p)
    if not math.isfinite(tp) or not 0.0 < tp <= 1.0:
        raise invalid(f"top_p must be in (0, 1], got {params.top_p}", key="top_p")
    return int(max_tokens), t, tp


def _check_stops(params: SamplingParams, limits: Limits) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(stop strings, stop token ids) of `params`, checked: their count, no empty string, ids in the vocabulary."""
    stop, stop_ids = tuple(params.stop), tuple(int(x) for x in params.stop_token_ids)
    if len(stop) + len(stop_ids) > limits.max_stop_sequences:
        raise invalid(f"at most {limits.max_stop_sequences} stop strings and token ids", key="stop")
    if any(not s for s in stop):
        raise invalid("stop strings must not be empty", key="stop")
    _check_token_ids(np.asarray(stop_ids, dtype=np.int64), limits.vocab_size, sample_index=None, key="stop_token_ids")
    return stop, stop_ids


def check_ranged(params: SamplingParams) -> dict[str, float | int]:
    """The `ranged` fields of `params` (e.g. min_p), each checked against its declared range.

    Returns {name: value as the field's type}. Raises ServiceError INVALID_ARGUMENT naming the field.
    """
    out: dict[str, float | int] = {}
    for f in ranged_fields():
        lo, hi = f.metadata["range"]
        v = getattr(params, f.name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
            raise invalid(f"{f.name} must be a number in [{lo}, {hi}], got {v!r}", key=f.name)
        out[f.name] = int(v) if f.type == "int" else float(v)
    return out


# Ranges checked in this order (the first offender is named).
_ADAM_CHECK_ORDER = ("learning_rate", "weight_decay", "grad_clip_norm", "beta1", "beta2", "eps", "lora_plus_ratio")


def validate_adam(values: Mapping[str, float | None]) -> dict[str, float]:
    """Check AdamParams fields; unset optional ones take ADAM_DEFAULTS (the SDK's, with its ADAM_RANGES).

    Raises:
        ServiceError: INVALID_ARGUMENT naming the field: learning_rate missing,
            any value non-finite or beyond float32 (also learning_rate x
            lora_plus_ratio and learning_rate x weight_decay: the trainer's
            float32 update would overflow), learning_rate/weight_decay/grad_clip_norm < 0,
            beta outside [0, 1), eps <= 0, lora_plus_ratio <= 0.
    """
    out: dict[str, float] = {}
    lr = values.get("learning_rate")
    if lr is None:
        raise invalid("adam_params.learning_rate is required", key="learning_rate")
    out["learning_rate"] = float(lr)
    for k, d in ADAM_DEFAULTS.items():
        v = values.get(k)
        out[k] = float(d if v is None else v)
    for k, v in out.items():
        if not math.isfinite(v):
            raise invalid(f"adam_params.{k} must be finite, got {v}", key=k)
        if abs(v) > _F32_MAX:
            raise invalid(f"adam_params.{k} {v} exceeds the float32 range (max {_F32_MAX:.4g}) the trainer computes in",
                          key=k)
    # The optimizer scales float32 tensors by lr x ratio (B matrices) and lr x weight_decay.
    for k in ("lora_plus_ratio", "weight_decay"):
        if abs(out["learning_rate"] * out[k]) > _F32_MAX:
            raise invalid(
                f"adam_params.learning_rate x {k} = {out['learning_rate'] * out[k]:.4g} exceeds the float32 range "
                f"(max {_F32_MAX:.4g}) the trainer computes in",
                key=k,
            )
    bad = adam_range_error(out, _ADAM_CHECK_ORDER)
    if bad is not None:
        k, text = bad
        raise invalid(f"adam_params.{k} must be {text}, got {out[k]}", key=k)
    return out


def validate_lora(
    rank: int, alpha: float, dropout: float, target_modules: Sequence[str], allowed_modules: Sequence[str], limits: Limits
) -> None:
    """Check a LoRA config.

    Raises:
        ServiceError: INVALID_ARGUMENT naming the field: rank outside
            [1, max_lora_rank], alpha <= 0, dropout outside [0, 1), or a
            target module the model does not have.
    """
    if not 1 <= rank <= limits.max_lora_rank:
        raise invalid(f"lora.rank must be in [1, {limits.max_lora_rank}], got {rank}", key="rank")
    if not math.isfinite(alpha) or alpha <= 0:
        raise invalid(f"lora.alpha must be > 0, got {alpha}", key="alpha")
    if not math.isfinite(dropout) or not 0.0 <= dropout < 1.0:
        raise invalid(f"lora.dropout must be in [0, 1), got {dropout}", key="dropout")
    unknown = [m for m in target_modules if m not in allowed_modules]
    if unknown:
        raise invalid(
            f"unknown lora.target_modules {unknown}; this model has {list(allowed_modules)}", key="target_modules"
        )
