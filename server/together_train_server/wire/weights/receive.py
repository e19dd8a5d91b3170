"""The replica's receiving end of PushWeights: one `Receiver` turns a push's messages into verified tensors.

A push is a header, then either ``data`` chunks or nothing (the header names a
shared-memory segment of the pusher), then a checksum trailer (design.md §3).
The bytes go straight into one buffer sized from the header (`ReceiveBuffers`,
reused by the next push of the same layout) or are mapped from the segment
(`SegmentReader`); the checksum (xxh3-128, or sha256 from older clients) is
checked over all of them before any tensor is handed out, so a push that fails
anywhere leaves the replica's previous version serving.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping

import numpy as np
import torch
import xxhash

from together_train._proto import generator_pb2
from together_train_server.service.errors import ServiceError, invalid
from together_train_server.wire.weights.layout import checksum, header_bytes, unpack
from together_train_server.wire.weights.shared_memory import SegmentError, SegmentReader

__all__ = ["ReceiveBuffers", "ReceivedPush", "Receiver"]


@dataclass
class ReceivedPush:
    """One push, read and verified.

    ``header``: its ``PushWeightsHeader``; ``tensors``: name -> tensor (views of the
    received bytes, in the header's dtypes and shapes; valid until the `Receiver.receive`
    block ends: the engine copies them); ``num_bytes``: the bytes it carried.
    """

    header: generator_pb2.PushWeightsHeader
    tensors: Mapping[str, torch.Tensor]
    num_bytes: int


class Receiver:
    """A replica's one receiver of pushes: its segment maps and receive buffers, kept across pushes. Thread-safe.

    Args:
        segments: the maps of pushers' shared-memory segments (default a new `SegmentReader`).
        buffers: the streamed pushes' buffers (default a new `ReceiveBuffers`).
    """

    def __init__(self, segments: SegmentReader | None = None, buffers: "ReceiveBuffers | None" = None) -> None:
        self.segments = segments if segments is not None else SegmentReader()
        self.buffers = buffers if buffers is not None else ReceiveBuffers()

    @contextlib.contextmanager
    def receive(self, messages: Iterable[Any]) -> Iterator[ReceivedPush]:
        """Read `messages` (``PushWeightsChunk``s or `framing.DataChunk`s) into a verified `ReceivedPush`.

        Use the tensors inside the block. On leaving it a streamed push's buffer goes back to
        `buffers` for the next push; a segment is forgotten when the block raised (its pusher
        will not write it again).

        Raises:
            ServiceError: INVALID_ARGUMENT (messages out of order, more or fewer bytes than the
                header describes, a bad tensor list or segment handle; ``key`` names the field),
                FAILED_PRECONDITION "cannot open shared-memory segment" (retryable: stream instead),
                DATA_LOSS (checksum mismatch, retryable).
        """
        incoming = _Incoming(self)
        try:
            for msg in messages:
                incoming.read(msg)
            push = incoming.verified()
            yield push
        except BaseException:
            incoming.failed = True
            raise
        finally:
            incoming.end()

    def close(self) -> None:
        """Close the segment maps (buffers are freed with their last reference)."""
        self.segments.close()


class _Incoming:
    """One push being read: its header, its bytes so far, its trailer."""

    def __init__(self, receiver: Receiver) -> None:
        self._receiver = receiver
        self.header: generator_pb2.PushWeightsHeader | None = None
        self.segment: str | None = None
        self.data: torch.Tensor | None = None   # uint8, the bytes the header describes
        self._arr: np.ndarray | None = None     # `data` as numpy, for the chunk copies
        self._views: Mapping[str, torch.Tensor] | None = None   # kept views of a reused buffer
        self.received = 0
        self._hasher = xxhash.xxh3_128()         # over the streamed chunks as they arrive
        self.digest: str | None = None
        self.algo: str | None = None
        self._kept: tuple | None = None          # (metas, buffer, views) for `ReceiveBuffers.give`
        self.failed = False

    def read(self, msg: Any) -> None:
        part = msg.WhichOneof("part")
        if part == "header":
            self._on_header(msg.header)
        elif part == "data":
            self._on_data(msg.data)
        elif part == "trailer_sha256":
            self.digest, self.algo = msg.trailer_sha256, "sha256"
        elif part == "trailer_xxh3_128":
            self.digest, self.algo = msg.trailer_xxh3_128, "xxh3_128"

    def _on_header(self, header: generator_pb2.PushWeightsHeader) -> None:
        self.header = header
        if header.HasField("segment") and header.segment.name:
            self.segment = header.segment.name
            try:
                self.data = self._receiver.segments.open(self.segment, header.segment.size)
            except ValueError as e:
                raise invalid(str(e), key="segment") from None
            except SegmentError as e:
                raise ServiceError("FAILED_PRECONDITION", str(e), key="segment", retryable=True) from None
            self.received = self.data.numel()
        else:
            try:
                self.data, self._views = self._receiver.buffers.take(header.tensors)
            except (ValueError, RuntimeError) as e:
                raise invalid(f"PushWeights header: {e}", key="tensors") from None
            self._arr = self.data.numpy()

    def _on_data(self, chunk) -> None:
        if self.data is None or self._arr is None or self.segment is not None:
            raise invalid("PushWeights data chunks need a header without a segment first", key="data")
        n = len(chunk)
        if self.received + n > self.data.numel():
            raise invalid(f"PushWeights carried more than the {self.data.numel()} bytes its header describes",
                          key="data")
        self._arr[self.received: self.received + n] = np.frombuffer(chunk, dtype=np.uint8)
        self._hasher.update(chunk)   # while the next chunk is on its way
        self.received += n

    def verified(self) -> ReceivedPush:
        """The push once complete and its checksum matches (raises what `Receiver.receive` names)."""
        header, data = self.header, self.data
        if header is None or data is None or self.digest is None:
            raise invalid("PushWeights needs a header first and a trailer last", key="part")
        if self.received != data.numel():
            raise invalid(f"PushWeights carried {self.received} bytes, the header describes {data.numel()}",
                          key="data")
        if self._digest_of(data) != self.digest:
            raise ServiceError("DATA_LOSS", "PushWeights checksum mismatch", retryable=True)
        try:
            tensors = self._views if self._views is not None else unpack(header.tensors, data)
        except ValueError as e:
            raise invalid(f"PushWeights: {e}", key="tensors") from None
        if self.segment is None:  # the engine copies the tensors (GeneratorEngine.load_adapter): reusable
            self._kept = (header.tensors, data, tensors)
        self.data = self._arr = None
        return ReceivedPush(header, tensors, self.received)

    def _digest_of(self, data: torch.Tensor) -> str:
        if self.algo == "xxh3_128" and self.segment is None:
            return self._hasher.hexdigest()   # hashed as the chunks arrived
        buf = data.numpy()
        return hashlib.sha256(buf).hexdigest() if self.algo == "sha256" else checksum(buf)  # type: ignore[arg-type]  # numpy arrays are buffers; the stubs lack __buffer__

    def end(self) -> None:
        if self._kept is not None:
            self._receiver.buffers.give(*self._kept)
        self._kept = self.data = self._arr = self._views = None
        if self.segment is not None and self.failed:
            self._receiver.segments.forget(self.segment)  # the pusher drops a segment whose push failed


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
