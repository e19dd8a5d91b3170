"""numpy <-> wire `Tensor` conversion, shared by the SDK and the server's wire layer.

A wire Tensor carries raw little-endian bytes in C order plus dtype and shape
(common.proto). Only int64 and float32 travel; other numpy dtypes are cast
when the cast is exact in kind (ints to int64, floats to float32).
"""

from __future__ import annotations

import numpy as np

from together_train._proto import common_pb2

_TO_WIRE = {np.dtype(np.int64): common_pb2.INT64, np.dtype(np.float32): common_pb2.FLOAT32}
_FROM_WIRE = {common_pb2.INT64: np.dtype("<i8"), common_pb2.FLOAT32: np.dtype("<f4")}


def as_wire_array(values) -> np.ndarray:
    """Return `values` as a C-contiguous int64 or float32 numpy array.

    Integers (and bools) become int64, floating values float32.

    Raises:
        TypeError: for arrays of any other kind (strings, objects, complex).
    """
    arr = np.asarray(values)
    if arr.dtype.kind in "iub":
        arr = arr.astype(np.int64, copy=False)
    elif arr.dtype.kind == "f":
        arr = arr.astype(np.float32, copy=False)
    else:
        raise TypeError(f"tensor values must be integers or floats, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr)


def to_tensor(values) -> common_pb2.Tensor:
    """Encode an array-like as a wire Tensor (int64 or float32)."""
    arr = as_wire_array(values)
    return common_pb2.Tensor(
        dtype=_TO_WIRE[arr.dtype],
        shape=list(arr.shape),
        data=arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes(),
    )


def from_tensor(tensor: common_pb2.Tensor) -> np.ndarray:
    """Decode a wire Tensor into a writable numpy array.

    Raises:
        ValueError: unknown dtype, or a byte length that does not match the shape.
    """
    if tensor.dtype not in _FROM_WIRE:
        raise ValueError(f"unknown tensor dtype {tensor.dtype}")
    dtype = _FROM_WIRE[tensor.dtype]
    shape = tuple(int(s) for s in tensor.shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"tensor shape {list(shape)} has a negative dimension")
    expected = dtype.itemsize
    for s in shape:  # Python ints: a huge shape must not wrap around to a small byte count
        expected *= s
    if len(tensor.data) != expected:
        raise ValueError(
            f"tensor data has {len(tensor.data)} bytes, shape {list(shape)} of "
            f"{dtype.name} needs {expected}"
        )
    return np.frombuffer(tensor.data, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))

