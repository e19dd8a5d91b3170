"""Client-side checks shared by the types: token arrays, loss input arrays, field types.

Each raises `InvalidArgumentError` naming the sample index and the key.
"""

from __future__ import annotations

from typing import Any, Sequence, Union

import numpy as np

from together_train.errors import InvalidArgumentError

__all__ = ["TokenArray", "TOKEN_KEYS"]

#: Anything accepted as a 1-D sequence of token ids.
TokenArray = Union[Sequence[int], np.ndarray]

#: loss_fn_inputs keys that hold token ids (int64, >= 0) when the server's
#: capabilities do not say otherwise; every other key defaults to float32.
TOKEN_KEYS = frozenset({"target_tokens"})


def invalid(message: str, *, sample_index: int | None = None, key: str | None = None) -> InvalidArgumentError:
    """An INVALID_ARGUMENT error naming `sample_index` and `key` (not retryable)."""
    return InvalidArgumentError(message, "INVALID_ARGUMENT", False, sample_index, key)


def is_number(value: Any) -> bool:
    """An int or float (numpy ones too), not a bool."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def is_int(value: Any) -> bool:
    """An int (numpy ones too), not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_types(owner: str, fields: Sequence[tuple[str, Any, str]]) -> None:
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
            ok, want = is_number(value), "a number"
        elif kind == "int":
            ok, want = is_int(value), "an integer"
        elif kind == "ints":
            ok, want = all(is_int(v) for v in value), "integers"
        else:
            ok, want = all(isinstance(v, str) for v in value), "strings"
        if not ok:
            raise invalid(f"{owner}.{name} must be {want}, got {value!r} ({type(value).__name__})", key=name)


def as_token_array(values: Any, *, what: str, sample_index: int | None, key: str, allow_empty: bool = False) -> np.ndarray:
    """Validate and convert token ids to a 1-D int64 array (>= 0)."""
    try:
        arr = np.asarray(values)
    except Exception as exc:  # ragged lists and the like
        raise invalid(f"{what} is not an array of integers: {exc}", sample_index=sample_index, key=key) from None
    if arr.ndim != 1:
        raise invalid(f"{what} must be 1-D, got shape {list(arr.shape)}", sample_index=sample_index, key=key)
    if arr.size == 0:
        if not allow_empty:
            raise invalid(f"{what} is empty", sample_index=sample_index, key=key)
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind in "iu":
        out = arr.astype(np.int64, copy=False)
    elif arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)) or not np.all(arr == np.floor(arr)):
            raise invalid(f"{what} must hold integer token ids, got non-integer values", sample_index=sample_index, key=key)
        out = arr.astype(np.int64)
    else:
        raise invalid(f"{what} must hold integer token ids, got dtype {arr.dtype}", sample_index=sample_index, key=key)
    if out.min() < 0:
        pos = int(np.argmax(out < 0))
        raise invalid(
            f"{what} holds a negative token id {int(out[pos])} at position {pos}", sample_index=sample_index, key=key
        )
    return np.ascontiguousarray(out)


def as_input_array(values: Any, dtype: str, *, n: int, sample_index: int | None, key: str) -> np.ndarray:
    """Validate and convert one loss_fn_inputs array to int64 / float32 of length n."""
    try:
        arr = np.asarray(values)
    except Exception as exc:
        raise invalid(f"loss_fn_inputs[{key!r}] is not a numeric array: {exc}", sample_index=sample_index, key=key) from None
    if arr.dtype.kind not in "biuf":
        raise invalid(
            f"loss_fn_inputs[{key!r}] must be numeric, got dtype {arr.dtype}", sample_index=sample_index, key=key
        )
    if arr.ndim != 1:
        raise invalid(
            f"loss_fn_inputs[{key!r}] must be 1-D, got shape {list(arr.shape)}", sample_index=sample_index, key=key
        )
    if arr.shape[0] != n:
        raise invalid(
            f"loss_fn_inputs[{key!r}] has length {arr.shape[0]} but model_input has length {n}; "
            "every array must be exactly as long as model_input",
            sample_index=sample_index,
            key=key,
        )
    if arr.dtype.kind == "f" and arr.size and not np.all(np.isfinite(arr)):
        pos = int(np.argmax(~np.isfinite(arr)))
        raise invalid(
            f"loss_fn_inputs[{key!r}] holds a non-finite value ({arr[pos]}) at position {pos}",
            sample_index=sample_index,
            key=key,
        )
    if dtype == "int64":
        if key in TOKEN_KEYS:
            return as_token_array(arr, what=f"loss_fn_inputs[{key!r}]", sample_index=sample_index, key=key, allow_empty=True)
        if arr.dtype.kind == "f" and arr.size and not np.all(arr == np.floor(arr)):
            raise invalid(
                f"loss_fn_inputs[{key!r}] must hold integers (int64), got non-integer values",
                sample_index=sample_index,
                key=key,
            )
        return np.ascontiguousarray(arr.astype(np.int64, copy=False))
    out = arr.astype(np.float32, copy=False)
    if out.size and not np.all(np.isfinite(out)):  # float64 values beyond float32 range
        raise invalid(
            f"loss_fn_inputs[{key!r}] holds a value that overflows float32", sample_index=sample_index, key=key
        )
    return np.ascontiguousarray(out)
