"""Writing a ``DownloadCheckpoint`` stream to a folder, each file's size and sha256 checked."""

from __future__ import annotations

import hashlib
import pathlib
from typing import Any, Iterable

from together_train.errors import InternalError

__all__ = ["write_checkpoint_stream"]


def write_checkpoint_stream(chunks: Iterable[Any], dest: pathlib.Path) -> pathlib.Path:
    """Write ``CheckpointChunk`` messages into `dest` (created; files overwritten).

    A chunk carries ``relative_path``, ``offset`` and ``data``; the first chunk of
    a file also carries its ``file_size`` and ``sha256``, checked once the stream ends.

    Returns:
        `dest`.

    Raises:
        InternalError: a file's size or checksum does not match, or a path in the
            stream escapes `dest`.
    """
    dest = pathlib.Path(dest).resolve()
    dest.mkdir(parents=True, exist_ok=True)
    handles: dict[str, Any] = {}
    expect: dict[str, tuple[int, str]] = {}
    try:
        for chunk in chunks:
            rel = chunk.relative_path
            path = (dest / rel).resolve()
            if dest != path and dest not in path.parents:
                raise InternalError(f"checkpoint file {rel!r} escapes {dest}")
            if rel not in handles:
                path.parent.mkdir(parents=True, exist_ok=True)
                handles[rel] = open(path, "wb")
            f = handles[rel]
            f.seek(chunk.offset)
            f.write(chunk.data)
            if chunk.file_size or chunk.sha256:
                expect[rel] = (int(chunk.file_size), chunk.sha256 or expect.get(rel, (0, ""))[1])
    finally:
        for f in handles.values():
            f.close()
    for rel, (size, sha) in expect.items():
        path = dest / rel
        if size and path.stat().st_size != size:
            raise InternalError(f"{rel}: downloaded {path.stat().st_size} bytes, expected {size}")
        if sha:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            if h.hexdigest() != sha:
                raise InternalError(f"{rel}: sha256 mismatch after download")
    return dest
