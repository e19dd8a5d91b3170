"""The bytes of a PushWeights call, from the pushing resource to a replica (design.md §3, PushWeights).

- `layout`: tensors laid out back to back in the replica's dtype (`pack`, `unpack`, the header's
  tensor list), the xxh3-128 `checksum`.
- `framing`: data chunks framed by hand (`chunk_frames`) and read without a copy (`parse_chunk`).
- `shared_memory`: memfd segments for a replica on this host (`Segment`, `SegmentPool` on the
  pushing side, `SegmentReader` on the replica's).
- `receive`: the replica's one `Receiver`: messages in, verified tensors out (`ReceiveBuffers`
  keeps streamed pushes' buffers for the next push of the same layout).

Integrity: xxh3-128 of all the bytes (``trailer_xxh3_128``) is checked before
anything is loaded (xxhash hashes ~10 GB/s per core, sha256 ~0.5 GB/s; the
replica secret authenticates the call, the hash only catches corruption or
truncation).
"""

from together_train_server.wire.weights.framing import DataChunk, chunk_frames, parse_chunk
from together_train_server.wire.weights.layout import (
    WIRE_DTYPES, Packed, checksum, header_bytes, layout, pack, unpack, wire_dtype)
from together_train_server.wire.weights.receive import ReceiveBuffers, ReceivedPush, Receiver
from together_train_server.wire.weights.shared_memory import (
    MEMFD_NAME, Segment, SegmentError, SegmentPool, SegmentReader, shared_memory_available)

__all__ = [
    "DataChunk", "chunk_frames", "parse_chunk",
    "WIRE_DTYPES", "Packed", "checksum", "header_bytes", "layout", "pack", "unpack", "wire_dtype",
    "ReceiveBuffers", "ReceivedPush", "Receiver",
    "MEMFD_NAME", "Segment", "SegmentError", "SegmentPool", "SegmentReader", "shared_memory_available",
]
