"""`Sample`: one training example, and `validate_samples`: a batch checked and encoded."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import numpy as np

from together_train._proto import common_pb2
from together_train.tensors import as_wire_array, from_tensor, to_tensor
from together_train.types._checks import TOKEN_KEYS, TokenArray, as_input_array, as_token_array, invalid

if TYPE_CHECKING:
    from together_train.types.loss_spec import LossSpec

__all__ = ["Sample", "validate_samples"]


@dataclass
class Sample:
    """One training example (docs/design.md §4).

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
        toks = as_token_array(tokens, what="tokens", sample_index=None, key="tokens")
        if toks.shape[0] < 2:
            raise invalid("a cross_entropy sample needs at least 2 tokens", key="tokens")
        if weights is None:
            w = np.ones(toks.shape[0] - 1, dtype=np.float32)
        else:
            w = np.asarray(weights, dtype=np.float32)
            if w.ndim != 1 or w.shape[0] != toks.shape[0]:
                raise invalid(
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
        tokens = as_token_array(self.model_input, what="model_input", sample_index=index, key="model_input")
        n = tokens.shape[0]
        if not isinstance(self.loss_fn_inputs, Mapping):
            raise invalid("loss_fn_inputs must be a dict of arrays", sample_index=index, key="loss_fn_inputs")
        inputs: dict[str, np.ndarray] = {}
        for key, values in self.loss_fn_inputs.items():
            if not isinstance(key, str) or not key:
                raise invalid(f"loss_fn_inputs keys must be non-empty strings, got {key!r}", sample_index=index, key=str(key))
            dtype = (input_dtypes or {}).get(key) or ("int64" if key in TOKEN_KEYS else "float32")
            inputs[key] = as_input_array(values, dtype, n=n, sample_index=index, key=key)
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
            dtype = (input_dtypes or {}).get(key) or ("int64" if key in TOKEN_KEYS else "float32")
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
                raise invalid("a sample given as a dict needs 'model_input'", sample_index=i, key="model_input") from None
        elif not isinstance(s, Sample):
            raise invalid(f"expected a Sample, got {type(s).__name__}", sample_index=i, key="samples")
        if spec is not None and isinstance(s.loss_fn_inputs, Mapping):
            _check_keys(s.loss_fn_inputs, spec, i)
        out.append(s.to_proto(i, input_dtypes))
    if not out:
        raise invalid("the batch is empty: pass at least one sample", key="samples")
    return out


def _check_keys(inputs: Mapping[str, Any], spec: "LossSpec", index: int) -> None:
    known = {i.name for i in spec.inputs}
    for key in inputs:
        if key not in known:
            raise invalid(
                f"unknown loss_fn_inputs key {key!r} for loss {spec.name!r}; it takes {sorted(known)}",
                sample_index=index,
                key=str(key),
            )
    for i in spec.inputs:
        if i.required and i.name not in inputs:
            raise invalid(
                f"missing required loss_fn_inputs key {i.name!r} for loss {spec.name!r}", sample_index=index, key=i.name
            )
