"""How a push's bytes are laid out: tensors back to back in the wire dtype, the header's tensor list, checksums.

A push lays the adapter tensors out back to back, in the order of the
header's ``TensorMeta`` list, each in the wire dtype (the replica's
``HealthResponse.weights_dtype``: a bf16 replica gets half the bytes of
float32). `pack` lays them out on the pushing side, `unpack` cuts views of
the received bytes on the replica's; `checksum` is the trailer's xxh3-128.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import xxhash

from together_train._proto import common_pb2, generator_pb2
from together_train_server.engines.generator_base import contiguous_run
from together_train_server.engines.lora import FlatLayout, FlatTensors

# wire dtype name -> (proto DType, torch dtype)
WIRE_DTYPES: dict[str, tuple[int, torch.dtype]] = {
    "float32": (common_pb2.FLOAT32, torch.float32),
    "bfloat16": (common_pb2.BFLOAT16, torch.bfloat16),
    "float16": (common_pb2.FLOAT16, torch.float16),
}
_TORCH_OF_PROTO = {proto: td for proto, td in WIRE_DTYPES.values()}
_ITEMSIZE = {td: torch.empty((), dtype=td).element_size() for _, td in WIRE_DTYPES.values()}


def wire_dtype(name: str | None) -> str:
    """The wire dtype for a replica reporting ``weights_dtype`` `name` ("" or unknown = "float32")."""
    return name if name in WIRE_DTYPES else "float32"


def checksum(buf) -> str:
    """xxh3-128 hex digest of a bytes-like object (no copy)."""
    return xxhash.xxh3_128(buf).hexdigest()


@dataclass
class Packed:
    """One push's bytes: ``metas`` (header order) and ``data`` (uint8, contiguous, ``nbytes`` long)."""

    metas: Sequence[generator_pb2.TensorMeta]
    data: torch.Tensor
    nbytes: int


def layout(tensors: Mapping[str, torch.Tensor], dtype: str) -> tuple[Sequence[generator_pb2.TensorMeta], int]:
    """The header's tensor list for `tensors` sent as `dtype`, and the total bytes.

    For a `FlatTensors` the list is built once per (`FlatLayout`, dtype) and kept while the layout
    lives (an adapter's snapshots share one): 420 ``TensorMeta`` are ~1 ms of Python a push. It is
    shared (a tuple): copy it into a header (``header.tensors.extend``), never change its messages.
    """
    proto, td = WIRE_DTYPES[dtype]
    item = _ITEMSIZE[td]
    if isinstance(tensors, FlatTensors):
        by_dtype = _METAS.get(tensors.layout)
        if by_dtype is None:
            by_dtype = _METAS[tensors.layout] = {}
        metas = by_dtype.get(dtype)
        if metas is None:
            metas = by_dtype[dtype] = tuple(_metas(zip(tensors.layout.names, tensors.layout.shapes), proto))
        return metas, tensors.layout.numel * item
    return (_metas(((k, t.shape) for k, t in tensors.items()), proto),
            sum(int(t.numel()) * item for t in tensors.values()))


def _metas(shapes, proto: int) -> list[generator_pb2.TensorMeta]:
    return [generator_pb2.TensorMeta(name=k, dtype=proto, shape=list(shape)) for k, shape in shapes]  # type: ignore[arg-type]  # an enum value (int) the stubs type as DType


# FlatLayout -> wire dtype -> the header's tensor list (see `layout`).
_METAS: "weakref.WeakKeyDictionary[FlatLayout, dict[str, tuple[generator_pb2.TensorMeta, ...]]]" = weakref.WeakKeyDictionary()


def pack(tensors: Mapping[str, torch.Tensor], dtype: str, out: torch.Tensor | None = None) -> Packed:
    """Lay `tensors` out back to back as `dtype` (one conversion pass; none when already so laid out).

    Args:
        tensors: name -> float tensor (CPU), in header order.
        dtype: a `WIRE_DTYPES` name.
        out: uint8 buffer of at least the total bytes to write into (a shared-memory segment); None =
            allocate, or reuse `tensors`' own storage when they already lie back to back as `dtype`.
    """
    metas, nbytes = layout(tensors, dtype)
    td = WIRE_DTYPES[dtype][1]
    # A trainer snapshot (`FlatTensors`) says it is one buffer: no walk over its views to find out.
    run = tensors.flat if isinstance(tensors, FlatTensors) else contiguous_run(list(tensors.values()))
    if run is not None and run.device.type != "cpu":
        run = None
    if out is None:
        if run is not None and run.dtype == td:
            return Packed(metas, run.view(torch.uint8), nbytes)
        out = torch.empty(nbytes, dtype=torch.uint8)
    data = out[:nbytes]
    flat = data.view(td)
    if run is not None:
        flat.copy_(run)  # one converting copy (a float32 snapshot into a bf16 replica's push)
        return Packed(metas, data, nbytes)
    off = 0  # per tensor a slice of one view (420 tensors: Python overhead matters)
    for t in tensors.values():
        n = t.numel()
        flat[off: off + n].view(t.shape).copy_(t.detach())
        off += n
    return Packed(metas, data, nbytes)


def header_bytes(metas) -> int:
    """Total bytes the header's `metas` describe.

    Raises:
        ValueError: a dtype that is not a float wire dtype, or a negative dimension (naming the tensor).
    """
    total = 0
    for m in metas:
        td = _TORCH_OF_PROTO.get(m.dtype)
        if td is None:
            raise ValueError(f"tensor {m.name}: dtype {m.dtype} is not a float wire dtype")
        if any(d < 0 for d in m.shape):
            raise ValueError(f"tensor {m.name}: negative dimension in shape {list(m.shape)}")
        total += math.prod(m.shape) * _ITEMSIZE[td]
    return total


def unpack(metas, data: torch.Tensor) -> Mapping[str, torch.Tensor]:
    """Tensors (views of the uint8 `data`, no copy) described by the header's `metas`.

    A `FlatTensors` over `data` when every tensor has one dtype (a push from this
    server's trainer): the engine then checks and copies the buffer as one piece.

    Raises:
        ValueError: an unknown dtype, or `data` is not exactly the bytes the metas describe.
    """
    out: dict[str, torch.Tensor] = {}
    off, aligned = 0, True
    views: dict[torch.dtype, torch.Tensor] = {}  # data viewed as each dtype, while offsets stay aligned
    for m in metas:
        td = _TORCH_OF_PROTO.get(m.dtype)
        if td is None:
            raise ValueError(f"tensor {m.name}: dtype {m.dtype} is not a float wire dtype")
        shape = tuple(m.shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"tensor {m.name}: negative dimension in shape {list(shape)}")
        item = _ITEMSIZE[td]
        n = math.prod(shape)
        if off + n * item > data.numel():
            raise ValueError(f"the push carried {data.numel()} bytes, the header describes more (at tensor {m.name})")
        if off % item == 0 and data.numel() % item == 0:
            flat = views.get(td)
            if flat is None:
                flat = views[td] = data.view(td)
            out[m.name] = flat[off // item: off // item + n].view(shape)
        else:
            out[m.name] = data[off: off + n * item].clone().view(td).view(shape)  # unaligned: a copy can be viewed
            aligned = False
        off += n * item
    if off != data.numel():
        raise ValueError(f"the push carried {data.numel()} bytes, the header describes {off}")
    if aligned and len(views) == 1 and len(out) == len(metas):
        (flat,) = views.values()
        return FlatTensors(flat, FlatLayout([m.name for m in metas], [tuple(m.shape) for m in metas]), out)
    return out
