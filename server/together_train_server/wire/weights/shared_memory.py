"""Shared-memory segments for pushes to a replica on this host: the pusher's (`Segment`, `SegmentPool`) and
the replica's maps of them (`SegmentReader`).

Segments are memfds (`Segment`): never a file in ``/dev/shm``, freed by the
kernel when their creator and every reader closed them or died. Their handle
(``/proc/<pid>/fd/<fd>``) and size go in the push's header. One snapshot pushed
to several replicas of this host is packed once, into one segment they all map
(`SegmentPool`). A segment whose push failed is never written again (the
replica may still be reading it); one whose pushes were all answered is reused.
"""

from __future__ import annotations

import mmap
import os
import re
import threading
from typing import Mapping, Sequence

import numpy as np
import torch

from together_train._proto import generator_pb2
from together_train_server.engines.lora import one_thread
from together_train_server.wire.weights.layout import checksum, layout, pack

MEMFD_NAME = "tt-weights"
_HANDLE_RE = re.compile(r"/proc/\d+/fd/\d+")


def shared_memory_available() -> bool:
    """True when this system has memfd segments and ``/proc/<pid>/fd`` to open them (Linux)."""
    return hasattr(os, "memfd_create") and os.path.isdir(f"/proc/{os.getpid()}/fd")


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
