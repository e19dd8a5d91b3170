"""The message stream of `ResourceClient.import_adapter`: a header, then each PEFT adapter file in chunks."""

from __future__ import annotations

import hashlib
import pathlib
from typing import Iterator

from together_train._proto import resource_pb2

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def adapter_files(path: str | pathlib.Path) -> list[tuple[str, pathlib.Path, str]]:
    """(relative path, path, sha256 hex) of the two files of a PEFT adapter directory.

    Raises:
        FileNotFoundError: a file is missing.
    """
    out = []
    for rel in ADAPTER_FILES:
        f = pathlib.Path(path) / rel
        if not f.is_file():
            raise FileNotFoundError(f"{f} not found (a PEFT adapter directory holds {', '.join(ADAPTER_FILES)})")
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        out.append((rel, f, h.hexdigest()))
    return out


def upload_id_for(name: str, kind: str, files: list[tuple[str, pathlib.Path, str]]) -> str:
    """A resumable upload's id: the same files under the same name and type resume each other."""
    h = hashlib.sha256(f"{name}\0{kind}".encode())
    for rel, _, sha in files:
        h.update(f"\0{rel}\0{sha}".encode())
    return h.hexdigest()[:32]


def upload_messages(header: resource_pb2.ImportAdapterHeader, files: list[tuple[str, pathlib.Path, str]],
                    chunk_bytes: int, start: dict[str, int] | None = None) -> Iterator[resource_pb2.ImportAdapterChunk]:
    """The header message, then each file in order in pieces of at most `chunk_bytes` from `start[rel]`
    (bytes the resource already holds; 0 when absent). The first piece of each file carries the whole
    file's size and sha256; a file sent whole before is one empty piece at its end."""
    yield resource_pb2.ImportAdapterChunk(header=header)
    for rel, f, sha in files:
        size = f.stat().st_size
        offset = min(int((start or {}).get(rel, 0)), size)
        first_offset = offset
        with open(f, "rb") as fh:
            fh.seek(offset)
            while True:
                data = fh.read(chunk_bytes)
                first = offset == first_offset
                yield resource_pb2.ImportAdapterChunk(relative_path=rel, offset=offset, data=data,
                                                      file_size=size if first else 0, sha256=sha if first else "")
                offset += len(data)
                if offset >= size:
                    break
