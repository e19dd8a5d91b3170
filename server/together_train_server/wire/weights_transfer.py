"""The bytes of a PushWeights call: packing in the replica's dtype, checksums, shared-memory segments.

A push lays the adapter tensors out back to back, in the order of the
header's ``TensorMeta`` list, each in the wire dtype (the replica's
``HealthResponse.weights_dtype``: a bf16 replica gets half the bytes of
float32). The bytes either stream as ``data`` chunks, or, for a replica on
this host, sit in a shared-memory segment whose handle (``/proc/<pid>/fd/<fd>``)
and size go in the header: the replica maps it and copies the tensors into
its adapter without a socket in between.

Integrity: xxh3-128 of all the bytes (``trailer_xxh3_128``) is checked before
anything is loaded (xxhash hashes ~10 GB/s per core, sha256 ~0.5 GB/s; the
replica secret authenticates the call, the hash only catches corruption or
truncation). Segments are memfds (`Segment`): never a file in ``/dev/shm``,
freed by the kernel when their creator and every reader closed them or died.
One snapshot pushed to several replicas of this host is packed once, into one
segment they all map (`SegmentPool`). A segment whose push failed is never
written again (the replica may still be reading it); one whose pushes were all
answered is reused.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import threading
import weakref
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import numpy as np
import torch
import xxhash

from together_train._proto import common_pb2, generator_pb2
from together_train_server.engines.generator_base import contiguous_run
from together_train_server.engines.lora import FlatLayout, FlatTensors, one_thread

MEMFD_NAME = "tt-weights"
_HANDLE_RE = re.compile(r"/proc/\d+/fd/\d+")

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


def shared_memory_available() -> bool:
    """True when this system has memfd segments and ``/proc/<pid>/fd`` to open them (Linux)."""
    return hasattr(os, "memfd_create") and os.path.isdir(f"/proc/{os.getpid()}/fd")


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


def chunk_frames(data: torch.Tensor, chunk_bytes: int, hasher: "xxhash.xxh3_128 | None" = None) -> Iterator[bytes]:
    """Serialized ``PushWeightsChunk(data=...)`` messages over `data`, each built with one copy.

    Hand-encoded (field 2, length-delimited) so the payload is copied once,
    from the buffer into the message bytes, instead of slice + message + serialize.
    With `hasher`, each piece is hashed as it is framed (the checksum of a push is
    computed while the previous chunk is on the wire, not in a pass before the first).
    """
    view = memoryview(data.numpy()).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers; the stubs lack __buffer__
    for i in range(0, len(view), chunk_bytes):
        piece = view[i: i + chunk_bytes]
        if hasher is not None:
            hasher.update(piece)
        yield b"".join((b"\x12", _varint(len(piece)), piece))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


class DataChunk:
    """A ``PushWeightsChunk`` that carries only ``data``, as `parse_chunk` gives it.

    ``data`` is a memoryview of the received message (no copy); `WhichOneof`
    answers ``"data"`` like the protobuf message does.
    """

    __slots__ = ("data",)

    def __init__(self, data: memoryview) -> None:
        self.data = data

    def WhichOneof(self, name: str) -> str:  # protobuf's spelling
        return "data"


def parse_chunk(raw: bytes) -> "generator_pb2.PushWeightsChunk | DataChunk":
    """A replica's deserializer of PushWeights messages: data chunks without a copy.

    A message that is exactly field 2 (``data``, length-delimited, as
    `chunk_frames` frames it) becomes a `DataChunk` over `raw`'s bytes:
    protobuf's parser would copy the payload once more on ``.data`` (~9 ms per
    8 MiB chunk with its fresh pages, measured). Anything else (header,
    trailer, a data chunk with other fields) is parsed by protobuf.

    Raises:
        google.protobuf.message.DecodeError: what protobuf raises for bytes that are not a message.
    """
    if raw[:1] == b"\x12":
        n, off, shift = 0, 1, 0
        while off < len(raw) and off <= 5:  # protobuf (upb) reads a length in at most 5 bytes
            b = raw[off]
            n |= (b & 0x7F) << shift
            off, shift = off + 1, shift + 7
            if not b & 0x80:
                if off + n == len(raw):
                    return DataChunk(memoryview(raw)[off:])
                break
    return generator_pb2.PushWeightsChunk.FromString(raw)


class Segment:
    """A shared-memory segment of this process for pushes: an anonymous ``memfd`` named ``tt-weights``.

    Its handle is ``/proc/<pid>/fd/<fd>``: a process of the same user on this
    host opens it there, another host cannot. A memfd has no name in
    ``/dev/shm``, so nothing can leak there: the kernel frees it when the last
    holder closes it or dies (SIGKILL included). It is reused across pushes:
    fresh tmpfs pages cost ~4x the copy into them (page allocation and zeroing),
    so a segment that is written once per push would spend most of the push
    faulting pages in. ``data`` is a writable uint8 tensor over it.

    Raises:
        OSError: no memfd on this system, or no memory.
    """

    def __init__(self, size: int) -> None:
        self.size = int(size)
        self._fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, max(1, self.size))
            self._mm: mmap.mmap | None = mmap.mmap(self._fd, max(1, self.size))
        except BaseException:
            os.close(self._fd)
            raise
        self.name = f"/proc/{os.getpid()}/fd/{self._fd}"
        # numpy holds a buffer export, so the map cannot be closed under a live tensor.
        self.data: torch.Tensor | None = torch.from_numpy(np.frombuffer(self._mm, dtype=np.uint8))

    def close(self) -> None:
        """Unmap and close (idempotent); a reader that still maps it keeps its pages until it unmaps."""
        self.data = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # a view is still alive: the map goes with it
            self._mm = None
            os.close(self._fd)

    def __enter__(self) -> "Segment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SegmentPool:
    """The push segments of one pushing process, shared by its clients of same-host replicas.

    A snapshot pushed to N replicas on this host is packed (converted, checksummed)
    into one segment that every replica maps, not N: `acquire` by the first push
    of a ``tensors`` dict packs it, later pushes of the same dict (same object,
    same wire dtype) while it is out get the same segment. A segment goes back to
    the free list (at most `keep_free`, reused: no page faults) once every push
    that used it was answered; if any failed, a replica may still be reading it,
    so it is never written again (closed once its last push ended).
    """

    def __init__(self, keep_free: int = 2) -> None:
        self.keep_free = keep_free
        self._free: list[Segment] = []
        self._out: dict[tuple[int, str], "_Lease"] = {}
        self._lock = threading.Lock()
        self._closed = False

    def acquire(self, tensors: Mapping[str, torch.Tensor], dtype: str) -> "_Lease":
        """The segment holding `tensors` as `dtype` (packed here, or by a push of the same dict in flight).

        Release it with `release` whatever the push's outcome. Raises OSError (no memfd, no memory), or
        what packing raised.
        """
        key = (id(tensors), dtype)
        with self._lock:
            lease = self._out.get(key)
            if lease is not None and lease.tensors is tensors:
                lease.refs += 1
                owner = False
            else:
                _, nbytes = layout(tensors, dtype)
                # The smallest free segment that fits: a rank-8 push does not take the rank-128 one.
                seg = min((g for g in self._free if g.size >= nbytes), key=lambda g: g.size, default=None)
                if seg is not None:
                    self._free.remove(seg)
                lease = self._out[key] = _Lease(tensors, key, seg, nbytes)
                owner = True
        if not owner:
            lease.ready.wait()
            if lease.error is not None:
                self.release(lease, answered=False)
                raise lease.error
            return lease
        try:
            lease.segment = lease.segment or Segment(lease.nbytes)
            with one_thread():  # one copy (or conversion) of bytes: no OpenMP region to wait on
                packed = pack(tensors, dtype, out=lease.segment.data)
            lease.metas = packed.metas
            lease.digest = checksum(packed.data.numpy())
        except BaseException as e:
            lease.error = e
            lease.ready.set()
            self.release(lease, answered=False)
            raise
        lease.ready.set()
        return lease

    def release(self, lease: "_Lease", answered: bool) -> None:
        """One push of `lease` ended (`answered`: the replica replied); the last one frees or keeps the segment."""
        with self._lock:
            lease.refs -= 1
            lease.failed = lease.failed or not answered
            if lease.refs > 0:
                return
            if self._out.get(lease.key) is lease:
                del self._out[lease.key]
            seg, lease.segment, lease.tensors = lease.segment, None, None
            drop = [seg] if seg is not None and (lease.failed or self._closed) else []
            if seg is not None and not drop:
                # Most recently used last; the least recently used goes when over `keep_free`. (Closing the
                # segment just used instead made every push of a third adapter size allocate a fresh one:
                # page faults on both sides, rank 128 at ~2.5x the per-byte cost of rank 32.)
                self._free.append(seg)
                while len(self._free) > self.keep_free:
                    drop.append(self._free.pop(0))
        for g in drop:
            g.close()

    def held(self) -> int:
        """Segments this pool holds (free and in use)."""
        with self._lock:
            return len(self._free) + sum(1 for x in self._out.values() if x.segment is not None)

    def close(self) -> None:
        """Free the idle segments; those in use are closed when their last push ends."""
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
        for seg in free:
            seg.close()


class _Lease:
    """One snapshot in a `SegmentPool` segment: what its pushes put in the header and trailer."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], key: tuple[int, str], segment: Segment | None,
                 nbytes: int) -> None:
        self.tensors: Mapping[str, torch.Tensor] | None = tensors  # held: its id() is the key while out
        self.key, self.segment, self.nbytes = key, segment, nbytes
        self.metas: Sequence[generator_pb2.TensorMeta] = ()
        self.digest = ""
        self.refs, self.failed = 1, False
        self.error: BaseException | None = None
        self.ready = threading.Event()


class ReceiveBuffers:
    """A replica's buffers for streamed pushes, kept with their tensor views for the next push of the same layout.

    A fresh buffer per push faults its pages in (several times the cost of the copy
    into them, see `Segment`), and cutting the tensor views out of it is ~2.5 ms of
    Python (420 views, rank 32 on SmolLM2-135M): the next push whose header lists
    the same tensors (names, dtypes, shapes, in order) takes the buffer and its views
    as they are. A buffer taken is the taker's alone until given back (two pushes at
    once get two buffers). At most `keep` buffers and `max_bytes` in all are kept,
    the least recently given back dropped first. Thread-safe.
    """

    def __init__(self, keep: int = 2, max_bytes: int = 128 << 20) -> None:
        self.keep, self.max_bytes = keep, max_bytes
        self._kept: list[tuple[object, torch.Tensor, Mapping[str, torch.Tensor]]] = []  # (metas, buffer, views)
        self._lock = threading.Lock()

    def take(self, metas) -> tuple[torch.Tensor, Mapping[str, torch.Tensor] | None]:
        """A uint8 buffer of the bytes `metas` (a header's ``TensorMeta`` list) describe, and its views if kept.

        Raises:
            ValueError: `metas` describe an unknown dtype or a negative dimension. RuntimeError: no memory.
        """
        with self._lock:
            for i, (m, data, views) in enumerate(self._kept):
                if len(m) == len(metas) and m == metas:  # type: ignore[arg-type]  # a repeated TensorMeta field
                    del self._kept[i]
                    return data, views
        return torch.empty(header_bytes(metas), dtype=torch.uint8), None

    def give(self, metas, data: torch.Tensor, views: Mapping[str, torch.Tensor]) -> None:
        """Keep `data` (filled by a push of `metas`) and `views` (`unpack` of it) for a later push.

        The caller keeps no reference it will use again: the next push overwrites every byte.
        """
        if data.numel() > self.max_bytes:
            return
        with self._lock:
            self._kept.append((metas, data, views))
            while len(self._kept) > self.keep or sum(d.numel() for _, d, _ in self._kept) > self.max_bytes:
                del self._kept[0]


class SegmentError(Exception):
    """The replica cannot read the named segment (another host, or it is gone): push by stream instead."""


class SegmentReader:
    """The replica's maps of pushing processes' segments, kept across pushes (no page faults per push).

    A map is reused while the handle names the same file (device, inode) of at
    least the size pushed; at most `keep` are kept (least recently used closed).
    Maps are private (copy-on-write), so the tensors are writable and nothing
    is ever written back to the creator's memory.
    """

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._maps: dict[str, tuple[tuple[int, int, int], mmap.mmap, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def open(self, name: str, size: int) -> torch.Tensor:
        """A uint8 tensor over the first `size` bytes of the segment `name`.

        Raises:
            ValueError: `name` is not a push segment handle (``/proc/<pid>/fd/<fd>`` of a ``tt-weights`` memfd).
            SegmentError: it cannot be opened here, or holds fewer than `size` bytes.
        """
        if not _HANDLE_RE.fullmatch(name or ""):
            raise ValueError(f"segment handle {name!r} is not /proc/<pid>/fd/<fd>")
        try:
            fd = os.open(name, os.O_RDONLY)
        except OSError as e:
            raise SegmentError(f"cannot open shared-memory segment {name}: {e.strerror}") from None
        try:
            target = os.readlink(name)
            if not target.startswith(f"/memfd:{MEMFD_NAME}"):
                raise ValueError(f"segment handle {name} is not a weights segment ({target})")
            st = os.fstat(fd)
            if size < 0 or st.st_size < size:
                raise SegmentError(f"shared-memory segment {name} holds {st.st_size} bytes, the push names {size}")
            ident = (st.st_dev, st.st_ino, st.st_size)
            with self._lock:
                hit = self._maps.pop(name, None)
                if hit is not None and hit[0] != ident:
                    self._close(hit)
                    hit = None
                if hit is None:
                    mm = mmap.mmap(fd, max(1, st.st_size), access=mmap.ACCESS_COPY)
                    hit = (ident, mm, torch.from_numpy(np.frombuffer(mm, dtype=np.uint8)))
                self._maps[name] = hit  # most recent last
                while len(self._maps) > self.keep:
                    self._close(self._maps.pop(next(iter(self._maps))))
                return hit[2][:size]
        except OSError as e:
            raise SegmentError(f"cannot map shared-memory segment {name}: {e.strerror}") from None
        finally:
            os.close(fd)

    def forget(self, name: str) -> None:
        """Close the map of `name` (its push failed: the creator will not write it again)."""
        with self._lock:
            hit = self._maps.pop(name, None)
        if hit is not None:
            self._close(hit)

    def close(self) -> None:
        with self._lock:
            maps, self._maps = list(self._maps.values()), {}
        for hit in maps:
            self._close(hit)

    @staticmethod
    def _close(hit) -> None:
        try:
            hit[1].close()
        except BufferError:
            pass  # an engine still holds a view: the map is freed with it
