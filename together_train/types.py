"""Typed values of the SDK and their conversion to and from the wire messages.

Conventions used throughout:

- Token ids are non-negative integers, sent as int64.
- A `Sample` is one training example (DESIGN §4): `model_input` is the full
  sequence minus its last token; every `loss_fn_inputs` array is 1-D and
  exactly as long as `model_input`; position ``i`` is scored on predicting
  ``target_tokens[i] = full[i + 1]``. Nothing is ever shifted by the server.
- Losses are **sums** over samples and positions, never means. Divide by
  ``metrics["num_tokens:sum"]`` (or the weight sum) yourself for a mean.
- Logprobs are natural-log probabilities (float32). Training logprobs are
  never temperature-scaled; sampler logprobs are of the temperature-scaled
  distribution.
- Times are Unix seconds (float); durations are seconds.

Client-side validation (`Sample.to_proto`, `validate_samples`) rejects what is
certainly wrong before anything is sent, raising `InvalidArgumentError` that
names the sample index and the key. The server validates again, including the
limits only it knows (vocabulary size, context length, tokens per batch).
"""

from __future__ import annotations

import math
import pathlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Mapping, Sequence, Union

import numpy as np

from together_train._proto import common_pb2, generator_pb2, resource_pb2, session_pb2
from together_train.errors import InvalidArgumentError
from together_train.tensors import as_wire_array, from_tensor, to_tensor

__all__ = [
    "TokenArray",
    "Sample",
    "LoraConfig",
    "AdamParams",
    "SamplingParams",
    "ForwardResult",
    "OptimStepResult",
    "WeightsSyncResult",
    "LoadStateResult",
    "VersionSpan",
    "SampledSequence",
    "SampleResult",
    "ComputeLogprobsResult",
    "CheckpointInfo",
    "SessionInfo",
    "InputSpec",
    "ParamSpec",
    "LossSpec",
    "SamplingLimits",
    "Capabilities",
    "validate_samples",
    "loss_config_to_proto",
]

#: Anything accepted as a 1-D sequence of token ids.
TokenArray = Union[Sequence[int], np.ndarray]

#: loss_fn_inputs keys that hold token ids (int64, >= 0) when the server's
#: capabilities do not say otherwise; every other key defaults to float32.
_TOKEN_KEYS = frozenset({"target_tokens"})


#: Smallest non-zero sampling temperature (the server refuses smaller ones too): the float32
#: logits are divided by it, and below this they overflow to inf and every logprob is NaN.
MIN_TEMPERATURE = 1e-5


def _invalid(message: str, *, sample_index: int | None = None, key: str | None = None) -> InvalidArgumentError:
    return InvalidArgumentError(message, "INVALID_ARGUMENT", False, sample_index, key)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_types(owner: str, fields: Sequence[tuple[str, Any, str]]) -> None:
    """Refuse a value of the wrong type before any comparison or wire encoding would raise a bare
    TypeError/ValueError (e.g. ``learning_rate="0.1"`` or ``None``).

    Args:
        owner: class name used in the message, e.g. ``"AdamParams"``.
        fields: (name, value, kind) with kind ``"number"`` (int or float, not bool),
            ``"int"``, ``"ints"`` (a sequence of ints) or ``"strs"`` (a sequence of strings).

    Raises:
        InvalidArgumentError: naming the field, its value and the type wanted.
    """
    for name, value, kind in fields:
        if kind == "number":
            ok, want = _is_number(value), "a number"
        elif kind == "int":
            ok, want = _is_int(value), "an integer"
        elif kind == "ints":
            ok, want = all(_is_int(v) for v in value), "integers"
        else:
            ok, want = all(isinstance(v, str) for v in value), "strings"
        if not ok:
            raise _invalid(f"{owner}.{name} must be {want}, got {value!r} ({type(value).__name__})", key=name)


def _as_token_array(values: Any, *, what: str, sample_index: int | None, key: str, allow_empty: bool = False) -> np.ndarray:
    """Validate and convert token ids to a 1-D int64 array (>= 0)."""
    try:
        arr = np.asarray(values)
    except Exception as exc:  # ragged lists and the like
        raise _invalid(f"{what} is not an array of integers: {exc}", sample_index=sample_index, key=key) from None
    if arr.ndim != 1:
        raise _invalid(f"{what} must be 1-D, got shape {list(arr.shape)}", sample_index=sample_index, key=key)
    if arr.size == 0:
        if not allow_empty:
            raise _invalid(f"{what} is empty", sample_index=sample_index, key=key)
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind in "iu":
        out = arr.astype(np.int64, copy=False)
    elif arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)) or not np.all(arr == np.floor(arr)):
            raise _invalid(f"{what} must hold integer token ids, got non-integer values", sample_index=sample_index, key=key)
        out = arr.astype(np.int64)
    else:
        raise _invalid(f"{what} must hold integer token ids, got dtype {arr.dtype}", sample_index=sample_index, key=key)
    if out.min() < 0:
        pos = int(np.argmax(out < 0))
        raise _invalid(
            f"{what} holds a negative token id {int(out[pos])} at position {pos}", sample_index=sample_index, key=key
        )
    return np.ascontiguousarray(out)


def _as_input_array(values: Any, dtype: str, *, n: int, sample_index: int | None, key: str) -> np.ndarray:
    """Validate and convert one loss_fn_inputs array to int64 / float32 of length n."""
    try:
        arr = np.asarray(values)
    except Exception as exc:
        raise _invalid(f"loss_fn_inputs[{key!r}] is not a numeric array: {exc}", sample_index=sample_index, key=key) from None
    if arr.dtype.kind not in "biuf":
        raise _invalid(
            f"loss_fn_inputs[{key!r}] must be numeric, got dtype {arr.dtype}", sample_index=sample_index, key=key
        )
    if arr.ndim != 1:
        raise _invalid(
            f"loss_fn_inputs[{key!r}] must be 1-D, got shape {list(arr.shape)}", sample_index=sample_index, key=key
        )
    if arr.shape[0] != n:
        raise _invalid(
            f"loss_fn_inputs[{key!r}] has length {arr.shape[0]} but model_input has length {n}; "
            "every array must be exactly as long as model_input",
            sample_index=sample_index,
            key=key,
        )
    if arr.dtype.kind == "f" and arr.size and not np.all(np.isfinite(arr)):
        pos = int(np.argmax(~np.isfinite(arr)))
        raise _invalid(
            f"loss_fn_inputs[{key!r}] holds a non-finite value ({arr[pos]}) at position {pos}",
            sample_index=sample_index,
            key=key,
        )
    if dtype == "int64":
        if key in _TOKEN_KEYS:
            return _as_token_array(arr, what=f"loss_fn_inputs[{key!r}]", sample_index=sample_index, key=key, allow_empty=True)
        if arr.dtype.kind == "f" and arr.size and not np.all(arr == np.floor(arr)):
            raise _invalid(
                f"loss_fn_inputs[{key!r}] must hold integers (int64), got non-integer values",
                sample_index=sample_index,
                key=key,
            )
        return np.ascontiguousarray(arr.astype(np.int64, copy=False))
    out = arr.astype(np.float32, copy=False)
    if out.size and not np.all(np.isfinite(out)):  # float64 values beyond float32 range
        raise _invalid(
            f"loss_fn_inputs[{key!r}] holds a value that overflows float32", sample_index=sample_index, key=key
        )
    return np.ascontiguousarray(out)


@dataclass
class Sample:
    """One training example (DESIGN §4).

    Args:
        model_input: token ids, int [n]: the full sequence minus its last token.
        loss_fn_inputs: named 1-D arrays, each of length n. Which keys a loss
            needs is listed in `Capabilities.losses`; e.g. ``cross_entropy``
            takes ``target_tokens`` (int64 [n], ``= full[1:]``) and ``weights``
            (float32 [n]); the policy losses take ``target_tokens``,
            ``logprobs`` (sampler logprobs, float32) and ``advantages``
            (float32). Integer keys are sent as int64, the others as float32.

    Arrays are validated and converted when the sample is sent, not when it
    is built (see `validate`).
    """

    model_input: TokenArray
    loss_fn_inputs: dict[str, Any] = field(default_factory=dict)

    @property
    def length(self) -> int:
        """Number of positions n (= len(model_input))."""
        return int(np.shape(np.asarray(self.model_input))[0]) if np.ndim(self.model_input) else 0

    @classmethod
    def for_cross_entropy(cls, tokens: TokenArray, weights: Sequence[float] | np.ndarray | None = None) -> "Sample":
        """Build a ``cross_entropy`` sample from a full token sequence.

        Args:
            tokens: the full sequence, int [m] with m >= 2.
            weights: one weight per token of `tokens` (float [m]); the weight of
                token j scales the loss of predicting it. None = all ones (every
                token but the first is trained). The first weight is dropped
                (nothing predicts the first token).

        Returns:
            Sample with model_input = tokens[:-1], target_tokens = tokens[1:],
            weights = weights[1:] (float32), all of length m - 1.

        Raises:
            InvalidArgumentError: fewer than 2 tokens or mismatched lengths.
        """
        toks = _as_token_array(tokens, what="tokens", sample_index=None, key="tokens")
        if toks.shape[0] < 2:
            raise _invalid("a cross_entropy sample needs at least 2 tokens", key="tokens")
        if weights is None:
            w = np.ones(toks.shape[0] - 1, dtype=np.float32)
        else:
            w = np.asarray(weights, dtype=np.float32)
            if w.ndim != 1 or w.shape[0] != toks.shape[0]:
                raise _invalid(
                    f"weights has shape {list(w.shape)} but tokens has length {toks.shape[0]}", key="weights"
                )
            w = w[1:]
        return cls(model_input=toks[:-1], loss_fn_inputs={"target_tokens": toks[1:], "weights": w})

    def validate(
        self, index: int | None = None, input_dtypes: Mapping[str, str] | None = None
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Check and convert the arrays; returns ``(model_input, loss_fn_inputs)`` as numpy.

        Args:
            index: position of this sample in its batch (named in errors).
            input_dtypes: key -> "int64" | "float32" from the loss's spec; keys
                not listed default to int64 for ``target_tokens``, float32 otherwise.

        Raises:
            InvalidArgumentError: naming `index` and the key, when model_input is
                empty or not 1-D integer ids >= 0, or any loss_fn_inputs array is
                not 1-D numeric, differs in length from model_input, holds
                NaN/inf, or (``target_tokens``) holds a negative id.
        """
        tokens = _as_token_array(self.model_input, what="model_input", sample_index=index, key="model_input")
        n = tokens.shape[0]
        if not isinstance(self.loss_fn_inputs, Mapping):
            raise _invalid("loss_fn_inputs must be a dict of arrays", sample_index=index, key="loss_fn_inputs")
        inputs: dict[str, np.ndarray] = {}
        for key, values in self.loss_fn_inputs.items():
            if not isinstance(key, str) or not key:
                raise _invalid(f"loss_fn_inputs keys must be non-empty strings, got {key!r}", sample_index=index, key=str(key))
            dtype = (input_dtypes or {}).get(key) or ("int64" if key in _TOKEN_KEYS else "float32")
            inputs[key] = _as_input_array(values, dtype, n=n, sample_index=index, key=key)
        return tokens, inputs

    def to_proto(
        self, index: int | None = None, input_dtypes: Mapping[str, str] | None = None, *, validate: bool = True
    ) -> common_pb2.Sample:
        """Validate (see `validate`) and encode as a wire ``Sample``.

        With ``validate=False`` the arrays are only converted (to test the
        server's own validation): lengths, NaN, negative ids pass through.
        """
        if validate:
            tokens, inputs = self.validate(index, input_dtypes)
        else:
            tokens, inputs = self._encode_unchecked(input_dtypes)
        msg = common_pb2.Sample(model_input=tokens.tolist())
        for key, arr in inputs.items():
            msg.loss_fn_inputs[key].CopyFrom(to_tensor(arr))
        return msg

    def _encode_unchecked(self, input_dtypes: Mapping[str, str] | None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        tokens = np.asarray(self.model_input).reshape(-1)
        tokens = tokens.astype(np.int64) if tokens.size else np.zeros(0, dtype=np.int64)
        inputs = {}
        for key, values in dict(self.loss_fn_inputs).items():
            arr = np.asarray(values)
            dtype = (input_dtypes or {}).get(key) or ("int64" if key in _TOKEN_KEYS else "float32")
            if dtype == "int64" and arr.dtype.kind in "biu":
                arr = arr.astype(np.int64)
            elif arr.dtype.kind in "biuf":
                arr = arr.astype(np.float32)
            inputs[str(key)] = as_wire_array(arr)
        return tokens, inputs

    @classmethod
    def from_proto(cls, msg: common_pb2.Sample) -> "Sample":
        """Decode a wire ``Sample`` (arrays as int64 / float32 numpy)."""
        return cls(
            model_input=np.asarray(list(msg.model_input), dtype=np.int64),
            loss_fn_inputs={k: from_tensor(v) for k, v in msg.loss_fn_inputs.items()},
        )


def validate_samples(
    samples: Iterable[Sample | Mapping[str, Any]],
    input_dtypes: Mapping[str, str] | None = None,
    *,
    spec: "LossSpec | None" = None,
    validate: bool = True,
) -> list[common_pb2.Sample]:
    """Validate a batch client-side and encode it; see `Sample.validate`.

    Samples may also be given as mappings with keys ``model_input`` and
    ``loss_fn_inputs``. With the loss's `spec` (from `Capabilities.losses`)
    the dtypes come from it, and a missing required key or a key the loss
    does not take is refused too. ``validate=False`` only encodes (to test
    the server's validation).

    Raises:
        InvalidArgumentError: empty batch (key ``samples``) or a bad sample
            (naming its index and key).
    """
    if spec is not None:
        input_dtypes = {**spec.input_dtypes, **(input_dtypes or {})}
    if not validate:
        out = []
        for s in samples:
            if isinstance(s, Mapping):
                s = Sample(model_input=s.get("model_input", []), loss_fn_inputs=dict(s.get("loss_fn_inputs", {})))
            out.append(s.to_proto(input_dtypes=input_dtypes, validate=False))
        return out
    out = []
    for i, s in enumerate(samples):
        if isinstance(s, Mapping):
            try:
                s = Sample(model_input=s["model_input"], loss_fn_inputs=dict(s.get("loss_fn_inputs", {})))
            except KeyError:
                raise _invalid("a sample given as a dict needs 'model_input'", sample_index=i, key="model_input") from None
        elif not isinstance(s, Sample):
            raise _invalid(f"expected a Sample, got {type(s).__name__}", sample_index=i, key="samples")
        if spec is not None and isinstance(s.loss_fn_inputs, Mapping):
            _check_keys(s.loss_fn_inputs, spec, i)
        out.append(s.to_proto(i, input_dtypes))
    if not out:
        raise _invalid("the batch is empty: pass at least one sample", key="samples")
    return out


def _check_keys(inputs: Mapping[str, Any], spec: "LossSpec", index: int) -> None:
    known = {i.name for i in spec.inputs}
    for key in inputs:
        if key not in known:
            raise _invalid(
                f"unknown loss_fn_inputs key {key!r} for loss {spec.name!r}; it takes {sorted(known)}",
                sample_index=index,
                key=str(key),
            )
    for i in spec.inputs:
        if i.required and i.name not in inputs:
            raise _invalid(
                f"missing required loss_fn_inputs key {i.name!r} for loss {spec.name!r}", sample_index=index, key=i.name
            )


def _check_params(config: Mapping[str, Any], spec: "LossSpec") -> None:
    known = {p.name: p for p in spec.params}
    for name, value in config.items():
        p = known.get(name)
        if p is None:
            hint = f"; it takes {sorted(known)}" if known else "; it takes no parameters"
            raise _invalid(f"unknown parameter {name!r} for loss {spec.name!r}{hint}", key=str(name))
        if p.type in ("float", "int") and (isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating))):
            raise _invalid(f"parameter {name!r} must be a number, got {value!r}", key=name)
        if p.type == "string" and not isinstance(value, str):
            raise _invalid(f"parameter {name!r} must be a string, got {value!r}", key=name)
        if p.choices and str(value) not in p.choices:
            raise _invalid(f"parameter {name!r} must be one of {list(p.choices)}, got {value!r}", key=name)
    for p in spec.params:
        if p.required and p.name not in config:
            raise _invalid(f"loss {spec.name!r} requires parameter {p.name!r}", key=p.name)


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
        raise _invalid(
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
            raise _invalid(f"loss_fn_config keys must be strings, got {k!r}", key=str(k))
        if isinstance(v, (np.generic,)):
            v = v.item()
        if isinstance(v, bool) or isinstance(v, str):
            clean[k] = v
        elif isinstance(v, (int, float)):
            if not math.isfinite(float(v)):
                raise _invalid(f"loss_fn_config[{k!r}] must be finite, got {v}", key=k)
            clean[k] = float(v)
        else:
            raise _invalid(f"loss_fn_config[{k!r}] must be a number or a string, got {type(v).__name__}", key=k)
    msg.params.update(clean)
    return msg


# --------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class LoraConfig:
    """Shape and initialisation of a session's LoRA adapter.

    Args:
        rank: LoRA rank r (>= 1; the server's limit is `Capabilities.max_lora_rank`).
        alpha: scaling numerator; the adapter output is scaled by alpha / rank.
        dropout: dropout probability on the adapter input during training, in [0, 1).
        target_modules: module names to adapt; empty = every linear layer of the
            transformer blocks (`Capabilities.lora_target_modules` lists them).
        train_unembed: also train the output embedding (lm_head) as a full parameter.
        seed: seed of the adapter initialisation (A random, B zero).
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ()
    train_unembed: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, str):
            object.__setattr__(self, "target_modules", (self.target_modules,))
        else:
            object.__setattr__(self, "target_modules", tuple(self.target_modules))

    def validate(self) -> "LoraConfig":
        """Check the ranges the client knows (the server checks its own limits).

        Raises:
            InvalidArgumentError: naming the field (also for a value of the wrong type).
        """
        self._check_types()
        if not isinstance(self.rank, (int, np.integer)) or self.rank < 1:
            raise _invalid(f"LoRA rank must be an integer >= 1, got {self.rank!r}", key="rank")
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise _invalid(f"LoRA alpha must be > 0, got {self.alpha!r}", key="alpha")
        if not 0.0 <= self.dropout < 1.0:
            raise _invalid(f"LoRA dropout must be in [0, 1), got {self.dropout!r}", key="dropout")
        return self

    def _check_types(self) -> None:
        _check_types("LoraConfig", [
            ("rank", self.rank, "int"), ("alpha", self.alpha, "number"), ("dropout", self.dropout, "number"),
            ("target_modules", self.target_modules, "strs"), ("seed", self.seed, "int"),
        ])
        if not isinstance(self.train_unembed, (bool, np.bool_)):
            raise _invalid(f"LoraConfig.train_unembed must be a bool, got {self.train_unembed!r}", key="train_unembed")

    def to_proto(self) -> common_pb2.LoraConfig:
        """The wire message.

        Raises:
            InvalidArgumentError: a field of the wrong type (ranges are left to `validate`).
        """
        self._check_types()
        return common_pb2.LoraConfig(
            rank=int(self.rank),
            alpha=float(self.alpha),
            dropout=float(self.dropout),
            target_modules=list(self.target_modules),
            train_unembed=bool(self.train_unembed),
            seed=int(self.seed),
        )

    @classmethod
    def from_proto(cls, msg: common_pb2.LoraConfig) -> "LoraConfig":
        return cls(
            rank=msg.rank or 16,
            alpha=msg.alpha or 32.0,
            dropout=msg.dropout,
            target_modules=tuple(msg.target_modules),
            train_unembed=msg.train_unembed,
            seed=msg.seed,
        )


@dataclass(frozen=True)
class AdamParams:
    """AdamW hyperparameters for one `optim_step`; sent in full on every step
    (there is no hidden schedule: vary `learning_rate` yourself).

    Args:
        learning_rate: step size (> = 0) of the A matrices (and of every other
            trained parameter).
        beta1, beta2: moment decay rates, in [0, 1).
        eps: denominator epsilon (> 0).
        weight_decay: decoupled (AdamW) weight decay, >= 0.
        grad_clip_norm: clip the global L2 gradient norm to this value; 0 = off.
        lora_plus_ratio: LoRA+: learning rate of B matrices / that of A matrices (> 0).
    """

    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0
    lora_plus_ratio: float = 1.0

    def validate(self) -> "AdamParams":
        """Check every field's range (`optim_step` calls this unless validate=False).

        Raises:
            InvalidArgumentError: naming the field (also for a value of the wrong type).
        """
        self._check_types()
        checks = [
            ("learning_rate", self.learning_rate >= 0),
            ("beta1", 0.0 <= self.beta1 < 1.0),
            ("beta2", 0.0 <= self.beta2 < 1.0),
            ("eps", self.eps > 0),
            ("weight_decay", self.weight_decay >= 0),
            ("grad_clip_norm", self.grad_clip_norm >= 0),
            ("lora_plus_ratio", self.lora_plus_ratio > 0),
        ]
        for name, ok in checks:
            value = getattr(self, name)
            if not isinstance(value, (int, float, np.integer, np.floating)) or not math.isfinite(value) or not ok:
                raise _invalid(f"AdamParams.{name} is out of range: {value!r}", key=name)
        return self

    def _check_types(self) -> None:
        if self.learning_rate is None:
            raise _invalid("AdamParams.learning_rate is required (a number >= 0), got None", key="learning_rate")
        _check_types("AdamParams", [(f, getattr(self, f), "number") for f in _ADAM_FIELDS])

    def to_proto(self) -> common_pb2.AdamParams:
        """The wire message (every field set).

        Raises:
            InvalidArgumentError: a field of the wrong type (ranges are left to `validate`).
        """
        self._check_types()
        return common_pb2.AdamParams(
            learning_rate=float(self.learning_rate),
            beta1=float(self.beta1),
            beta2=float(self.beta2),
            eps=float(self.eps),
            weight_decay=float(self.weight_decay),
            grad_clip_norm=float(self.grad_clip_norm),
            lora_plus_ratio=float(self.lora_plus_ratio),
        )

    @classmethod
    def from_proto(cls, msg: common_pb2.AdamParams) -> "AdamParams":
        """Fields left unset take this class's defaults (learning_rate: 0)."""
        kw = {f: getattr(msg, f) for f in _ADAM_FIELDS if msg.HasField(f)}
        kw.setdefault("learning_rate", 0.0)
        return cls(**kw)


_ADAM_FIELDS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm", "lora_plus_ratio")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample completions (DESIGN §7).

    Args:
        max_tokens: most new tokens per completion (required, > 0).
        temperature: 0 = greedy; otherwise at least `MIN_TEMPERATURE` (1e-5): a smaller
            one would overflow the logits it divides, so it is refused (InvalidArgumentError,
            here and on the server), never silently made greedy. Logprobs are of the
            temperature-scaled distribution.
        top_k: keep the k most likely tokens; 0 = off.
        top_p: nucleus sampling mass in (0, 1]; 1 = off.
        seed: same seed, same tokens; the i-th of `num_samples` uses its own
            stream. None = a random seed.
        stop: stop strings (a single string is accepted); the stop text is
            included in the returned tokens.
        stop_token_ids: token ids that end generation (included in the output).
        ignore_eos: keep generating past the model's end-of-sequence tokens.
    """

    max_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        # Integers (numpy ones too) become ints; anything else is kept for validate() to name.
        ids = tuple(int(t) if _is_int(t) else t for t in (self.stop_token_ids or ()))
        object.__setattr__(self, "stop_token_ids", ids)

    def validate(self) -> "SamplingParams":
        """Check the ranges (`sample` calls this unless validate=False); the
        server checks its limits (`Capabilities.sampling`).

        Raises:
            InvalidArgumentError: naming the field (also for a value of the wrong type).
        """
        self._check_types()
        stop = self.stop
        # wire types: max_tokens / top_k int32, seed int64 (protobuf would raise a bare ValueError)
        for key, value, bits in (("max_tokens", self.max_tokens, 32), ("top_k", self.top_k, 32), ("seed", self.seed, 64)):
            if value is None and key == "seed":
                continue
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise _invalid(f"SamplingParams.{key} must be an integer, got {value!r}", key=key)
            if not -(2 ** (bits - 1)) <= int(value) < 2 ** (bits - 1):
                raise _invalid(f"SamplingParams.{key} must fit in int{bits}, got {value!r}", key=key)
        if not isinstance(self.max_tokens, (int, np.integer)) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise _invalid(f"SamplingParams.max_tokens must be an integer > 0, got {self.max_tokens!r}", key="max_tokens")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise _invalid(f"SamplingParams.temperature must be >= 0, got {self.temperature!r}", key="temperature")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise _invalid(
                f"SamplingParams.temperature {self.temperature!r} is too small to divide the logits by: "
                f"use 0 for greedy or >= {MIN_TEMPERATURE}",
                key="temperature",
            )
        if self.top_k < 0:
            raise _invalid(f"SamplingParams.top_k must be >= 0, got {self.top_k!r}", key="top_k")
        if not 0.0 < self.top_p <= 1.0:
            raise _invalid(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}", key="top_p")
        if any(not isinstance(s, str) or not s for s in stop):
            raise _invalid("SamplingParams.stop must hold non-empty strings", key="stop")
        if any(t < 0 for t in self.stop_token_ids):
            raise _invalid("SamplingParams.stop_token_ids must be >= 0", key="stop_token_ids")
        return self

    def _check_types(self) -> None:
        _check_types("SamplingParams", [
            ("temperature", self.temperature, "number"), ("top_p", self.top_p, "number"),
            ("stop_token_ids", self.stop_token_ids, "ints"),
        ])

    def to_proto(self) -> common_pb2.SamplingParams:
        """The wire message.

        Raises:
            InvalidArgumentError: temperature, top_p or stop_token_ids of the wrong type.
        """
        self._check_types()
        msg = common_pb2.SamplingParams(
            max_tokens=int(self.max_tokens),
            temperature=float(self.temperature),
            top_k=int(self.top_k),
            top_p=float(self.top_p),
            stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=bool(self.ignore_eos),
        )
        if self.seed is not None:
            msg.seed = int(self.seed)
        return msg

    @classmethod
    def from_proto(cls, msg: common_pb2.SamplingParams) -> "SamplingParams":
        return cls(
            max_tokens=msg.max_tokens,
            temperature=msg.temperature if msg.HasField("temperature") else 1.0,
            top_k=msg.top_k,
            top_p=msg.top_p if msg.HasField("top_p") else 1.0,
            seed=msg.seed if msg.HasField("seed") else None,
            stop=tuple(msg.stop),
            stop_token_ids=tuple(msg.stop_token_ids),
            ignore_eos=msg.ignore_eos,
        )


# --------------------------------------------------------------------------- results


@dataclass
class ForwardResult:
    """Result of `forward`, `forward_backward` and `custom_forward_backward`.

    Attributes:
        loss: the loss **summed** over all samples and positions (never a mean).
        logprobs: when requested, one float32 [n_i] array per sample: the
            untempered logprob of ``target_tokens[j]`` at every position j
            (whatever its weight); else None.
        elementwise_loss: when requested, one float32 [n_i] array per sample
            with each position's loss contribution (sums to the sample's loss); else None.
        metrics: e.g. ``"loss:sum"``, ``"num_tokens:sum"``, ``"weight:sum"``, clip
            fractions, ratio means, KL (suffix names the reduction).
    """

    loss: float
    logprobs: list[np.ndarray] | None = None
    elementwise_loss: list[np.ndarray] | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_proto(cls, msg: session_pb2.ForwardResult) -> "ForwardResult":
        outs = list(msg.outputs)
        logprobs = [from_tensor(o.logprobs) for o in outs] if outs and any(o.HasField("logprobs") for o in outs) else None
        elem = (
            [from_tensor(o.elementwise_loss) for o in outs]
            if outs and any(o.HasField("elementwise_loss") for o in outs)
            else None
        )
        return cls(loss=float(msg.loss), logprobs=logprobs, elementwise_loss=elem, metrics=dict(msg.metrics))

    def to_proto(self) -> session_pb2.ForwardResult:
        msg = session_pb2.ForwardResult(loss=self.loss, metrics=self.metrics)
        n = max(len(self.logprobs or ()), len(self.elementwise_loss or ()))
        for i in range(n):
            out = msg.outputs.add()
            if self.logprobs is not None:
                out.logprobs.CopyFrom(to_tensor(np.asarray(self.logprobs[i], dtype=np.float32)))
            if self.elementwise_loss is not None:
                out.elementwise_loss.CopyFrom(to_tensor(np.asarray(self.elementwise_loss[i], dtype=np.float32)))
        return msg


@dataclass(frozen=True)
class OptimStepResult:
    """Result of `optim_step`.

    Attributes:
        step: optimizer steps taken so far including this one (= the new policy version).
        grad_norm: global L2 norm of the accumulated gradient *before* clipping.
        learning_rate: the learning rate used (of the A matrices).
    """

    step: int
    grad_norm: float
    learning_rate: float

    @classmethod
    def from_proto(cls, msg: session_pb2.OptimStepResult) -> "OptimStepResult":
        return cls(step=int(msg.step), grad_norm=float(msg.grad_norm), learning_rate=float(msg.learning_rate))

    def to_proto(self) -> session_pb2.OptimStepResult:
        return session_pb2.OptimStepResult(step=self.step, grad_norm=self.grad_norm, learning_rate=self.learning_rate)


@dataclass(frozen=True)
class WeightsSyncResult:
    """Result of `weights_sync`.

    Attributes:
        policy_version: the version pushed (= optimizer steps taken).
        num_replicas: generator replicas that received it.
        num_bytes: adapter bytes pushed per replica.
        seconds: wall time of the push.
    """

    policy_version: int
    num_replicas: int
    num_bytes: int
    seconds: float

    @classmethod
    def from_proto(cls, msg: session_pb2.WeightsSyncResult) -> "WeightsSyncResult":
        return cls(int(msg.policy_version), int(msg.num_replicas), int(msg.num_bytes), float(msg.seconds))

    def to_proto(self) -> session_pb2.WeightsSyncResult:
        return session_pb2.WeightsSyncResult(
            policy_version=self.policy_version, num_replicas=self.num_replicas, num_bytes=self.num_bytes, seconds=self.seconds
        )


@dataclass(frozen=True)
class LoadStateResult:
    """Result of `load_state` / `load_state_with_optimizer`.

    Attributes:
        step: the session's optimizer step count after loading.
        with_optimizer: whether optimizer moments were restored too.
    """

    step: int
    with_optimizer: bool

    @classmethod
    def from_proto(cls, msg: session_pb2.LoadStateResult) -> "LoadStateResult":
        return cls(step=int(msg.step), with_optimizer=bool(msg.with_optimizer))


@dataclass(frozen=True)
class VersionSpan:
    """Tokens ``[start, end)`` of a sampled sequence came from `policy_version` (-1 = base model)."""

    start: int
    end: int
    policy_version: int


_STOP_REASONS = {generator_pb2.STOP: "stop", generator_pb2.LENGTH: "length"}


@dataclass
class SampledSequence:
    """One completion.

    Attributes:
        tokens: the new token ids (the prompt is not repeated).
        logprobs: one float per token: its logprob under the temperature-scaled
            distribution it was sampled from.
        stop_reason: ``"stop"`` (stop string, stop token or EOS) or ``"length"``
            (max_tokens or the context length).
        version_spans: which policy version produced which tokens.
    """

    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]
    version_spans: list[VersionSpan] = field(default_factory=list)

    @classmethod
    def from_proto(cls, msg: generator_pb2.SampledSequence) -> "SampledSequence":
        return cls(
            tokens=list(msg.tokens),
            logprobs=list(msg.logprobs),
            stop_reason=_STOP_REASONS.get(msg.stop_reason, "stop"),  # type: ignore[arg-type]
            version_spans=[VersionSpan(int(v.start), int(v.end), int(v.policy_version)) for v in msg.version_spans],
        )


@dataclass
class SampleResult:
    """Result of `sample`.

    Attributes:
        sequences: `num_samples` completions, in order.
        prompt_logprobs: when requested, len(prompt) - 1 floats: logprob of
            ``prompt[i+1]`` given ``prompt[:i+1]``; else None.
        top_k_prompt_logprobs: when requested, len(prompt) - 1 entries
            ``(token_ids, logprobs)`` of the k most likely tokens; else None.
        policy_version: the version that served the request (-1 = base model).
        replica_id: which generator replica served it.
    """

    sequences: list[SampledSequence]
    prompt_logprobs: list[float] | None = None
    top_k_prompt_logprobs: list[tuple[list[int], list[float]]] | None = None
    policy_version: int = -1
    replica_id: str = ""

    @classmethod
    def from_proto(
        cls, msg: generator_pb2.SampleResponse, *, prompt_logprobs: bool = True, top_k: bool = True
    ) -> "SampleResult":
        return cls(
            sequences=[SampledSequence.from_proto(s) for s in msg.sequences],
            prompt_logprobs=list(msg.prompt_logprobs) if prompt_logprobs and len(msg.prompt_logprobs) else None,
            top_k_prompt_logprobs=(
                [(list(t.token_ids), list(t.logprobs)) for t in msg.top_k_prompt_logprobs]
                if top_k and len(msg.top_k_prompt_logprobs)
                else None
            ),
            policy_version=int(msg.policy_version),
            replica_id=msg.replica_id,
        )


@dataclass
class ComputeLogprobsResult:
    """Result of `compute_logprobs`.

    Attributes:
        logprobs: one float32 [len(tokens) - 1] array per sequence: logprob of
            ``tokens[i+1]`` given ``tokens[:i+1]`` (untempered).
        policy_version: the version scored with (-1 = base model).
        replica_id: which generator replica served it.
    """

    logprobs: list[np.ndarray]
    policy_version: int = -1
    replica_id: str = ""

    @classmethod
    def from_proto(cls, msg: generator_pb2.ComputeLogprobsResponse) -> "ComputeLogprobsResult":
        return cls(
            logprobs=[np.asarray(list(s.logprobs), dtype=np.float32) for s in msg.sequences],
            policy_version=int(msg.policy_version),
            replica_id=msg.replica_id,
        )


@dataclass(frozen=True)
class CheckpointInfo:
    """A saved checkpoint (DESIGN §8).

    Attributes:
        uri: ``together-train://<session_id>/<kind>/<name>``; pass it to
            `load_state`, `create_session(checkpoint_uri=...)`, `compute_logprobs`.
        session_id, name: who saved it and under what name.
        kind: ``"weights"`` (inference checkpoint) or ``"state"`` (training checkpoint).
        path: the checkpoint directory on the resource host (a `pathlib.Path`;
            directly readable when the resource runs on this machine, e.g. from
            `launch_local`; else use `ResourceClient.download_checkpoint`), or None.
        size_bytes: total size of its files.
        step: optimizer steps of the session when saved.
        merged: for weights: a merged full model rather than a PEFT adapter.
        created_at: Unix seconds.
    """

    uri: str
    session_id: str
    kind: str
    name: str
    path: pathlib.Path | None = None
    size_bytes: int = 0
    step: int = 0
    merged: bool = False
    created_at: float = 0.0

    @classmethod
    def from_proto(cls, msg: common_pb2.CheckpointInfo) -> "CheckpointInfo":
        return cls(
            uri=msg.uri,
            session_id=msg.session_id,
            kind=msg.kind,
            name=msg.name,
            path=pathlib.Path(msg.path) if msg.path else None,
            size_bytes=int(msg.size_bytes),
            step=int(msg.step),
            merged=bool(msg.merged),
            created_at=float(msg.created_at),
        )

    def to_proto(self) -> common_pb2.CheckpointInfo:
        return common_pb2.CheckpointInfo(
            uri=self.uri,
            session_id=self.session_id,
            kind=self.kind,
            name=self.name,
            path=str(self.path) if self.path is not None else "",
            size_bytes=self.size_bytes,
            step=self.step,
            merged=self.merged,
            created_at=self.created_at,
        )


_SESSION_STATES = {
    resource_pb2.ACTIVE: "active",
    resource_pb2.STOPPED: "stopped",
    resource_pb2.EXPIRED: "expired",
}


@dataclass(frozen=True)
class SessionInfo:
    """State of a session as the resource sees it.

    Attributes:
        session_id, name: identity and free-form label.
        lora: the adapter's configuration.
        state: ``"active"``, ``"stopped"``, ``"expired"`` (or ``"unspecified"``).
        step: optimizer steps taken (= current policy version).
        synced_version: policy version last published to the replicas (-1 = none).
        created_at, last_active_at, expires_at: Unix seconds.
        next_seq_id: the seq_id the next operation must carry.
        num_trainable_params: parameters the optimizer updates.
    """

    session_id: str
    name: str
    lora: LoraConfig
    state: str
    step: int
    synced_version: int
    created_at: float
    last_active_at: float
    expires_at: float
    next_seq_id: int
    num_trainable_params: int

    @classmethod
    def from_proto(cls, msg: resource_pb2.SessionInfo) -> "SessionInfo":
        return cls(
            session_id=msg.session_id,
            name=msg.name,
            lora=LoraConfig.from_proto(msg.lora),
            state=_SESSION_STATES.get(msg.state, "unspecified"),
            step=int(msg.step),
            synced_version=int(msg.synced_version),
            created_at=float(msg.created_at),
            last_active_at=float(msg.last_active_at),
            expires_at=float(msg.expires_at),
            next_seq_id=int(msg.next_seq_id),
            num_trainable_params=int(msg.num_trainable_params),
        )


@dataclass(frozen=True)
class InputSpec:
    """One ``loss_fn_inputs`` key a loss takes: name, dtype ("int64"/"float32"), required."""

    name: str
    dtype: str
    required: bool
    description: str = ""


@dataclass(frozen=True)
class ParamSpec:
    """One loss parameter: name, type ("float"/"int"/"string"), required, default (text), choices."""

    name: str
    type: str
    required: bool
    default: str = ""
    choices: tuple[str, ...] = ()
    description: str = ""


@dataclass(frozen=True)
class LossSpec:
    """A loss the resource knows: its inputs, parameters, formula and whether it is served."""

    name: str
    inputs: tuple[InputSpec, ...]
    params: tuple[ParamSpec, ...]
    formula: str = ""
    available: bool = True

    @property
    def input_dtypes(self) -> dict[str, str]:
        """key -> "int64" | "float32"."""
        return {i.name: i.dtype for i in self.inputs}

    @classmethod
    def from_proto(cls, msg: resource_pb2.LossSpec) -> "LossSpec":
        return cls(
            name=msg.name,
            inputs=tuple(InputSpec(i.name, i.dtype, i.required, i.description) for i in msg.inputs),
            params=tuple(
                ParamSpec(p.name, p.type, p.required, p.default, tuple(p.choices), p.description) for p in msg.params
            ),
            formula=msg.formula,
            available=msg.available,
        )


@dataclass(frozen=True)
class SamplingLimits:
    """Per-request sampling limits of the resource."""

    max_tokens: int = 0
    max_num_samples: int = 0
    max_stop_sequences: int = 0
    max_top_k_prompt_logprobs: int = 0


@dataclass(frozen=True)
class Capabilities:
    """What a resource offers (``GetCapabilities``).

    Attributes:
        protocol_version, model_id, dtype: identity of the resource and its model.
        vocab_size: token ids must be < vocab_size.
        max_seq_len: longest sample / prompt + completion, in tokens.
        mode: ``"lora"`` or ``"full"``.
        operations: operation names served.
        max_lora_rank, lora_target_modules, max_sessions: LoRA limits.
        losses: name -> `LossSpec` (inputs with dtypes, parameters, availability).
        sampling: `SamplingLimits`.
        num_replicas: generator replicas behind the resource.
        max_tokens_per_batch, max_samples_per_batch: batch limits (0 = none).
        adam_defaults: defaults the server applies to unset AdamParams fields.
        generator_engine, trainer_backend: engine names.
    """

    protocol_version: str
    model_id: str
    vocab_size: int
    max_seq_len: int
    mode: str
    operations: tuple[str, ...]
    max_lora_rank: int
    lora_target_modules: tuple[str, ...]
    max_sessions: int
    losses: dict[str, LossSpec]
    sampling: SamplingLimits
    num_replicas: int
    max_tokens_per_batch: int
    max_samples_per_batch: int
    adam_defaults: dict[str, float]
    generator_engine: str
    trainer_backend: str
    dtype: str

    @classmethod
    def from_proto(cls, msg: resource_pb2.Capabilities) -> "Capabilities":
        s = msg.sampling
        return cls(
            protocol_version=msg.protocol_version,
            model_id=msg.model_id,
            vocab_size=int(msg.vocab_size),
            max_seq_len=int(msg.max_seq_len),
            mode=msg.mode,
            operations=tuple(msg.operations),
            max_lora_rank=int(msg.max_lora_rank),
            lora_target_modules=tuple(msg.lora_target_modules),
            max_sessions=int(msg.max_sessions),
            losses={l.name: LossSpec.from_proto(l) for l in msg.losses},
            sampling=SamplingLimits(s.max_tokens, s.max_num_samples, s.max_stop_sequences, s.max_top_k_prompt_logprobs),
            num_replicas=int(msg.num_replicas),
            max_tokens_per_batch=int(msg.max_tokens_per_batch),
            max_samples_per_batch=int(msg.max_samples_per_batch),
            adam_defaults={f: getattr(msg.adam_defaults, f) for f in _ADAM_FIELDS if msg.adam_defaults.HasField(f)},
            generator_engine=msg.generator_engine,
            trainer_backend=msg.trainer_backend,
            dtype=msg.dtype,
        )


