"""Import a PEFT LoRA adapter trained elsewhere as a training or sampler checkpoint (docs/design.md §8).

`AdapterImporter.import_stream` takes the files as chunks (the gRPC ``ImportAdapter`` stream, translated by
the wire layer), writes them into a private upload directory ``<storage>/.uploads/<pid>-<random>/``, checks
them (engines/peft_import.py: base model, target modules, key layout, dtypes, shapes against the rank and
the base layers, NaN/inf; each refusal INVALID_ARGUMENT naming the file and tensor) and only then writes
the checkpoint through `CheckpointStore.writer` (temporary directory, renamed into place, then
registered). A process killed at any point leaves nothing listed: an upload directory (removed by the next
start once its pid is gone) or the writer's temporary directory (likewise).

Checkpoint URIs: ``together-train://import-<12 hex>/<state|weights>/<name>``. A training checkpoint is at
step 0 with no optimizer state (`create_session(checkpoint_uri=...)` starts a fresh AdamW); a sampler
checkpoint is a PEFT adapter directory as `save_weights` writes one.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from together_train_server.engines.peft_import import (
    ADAPTER_FILES, AdapterProblem, check_adapter, write_adapter, write_training_state)
from together_train_server.service.checkpoints.lifecycle import CheckpointLifecycle, SaveOptions
from together_train_server.service.checkpoints.store import (
    Checkpoint, CheckpointStore, _pid_alive, _sha256, owner_tag, validate_name)
from together_train_server.service.errors import ServiceError, invalid

if TYPE_CHECKING:
    from together_train_server.service.core.runtime import TrainerRuntime

UPLOADS = ".uploads"
MAX_UPLOAD_BYTES = 8 << 30  # both files together
STALE_UPLOAD_S = 24 * 3600  # a resumable upload not continued for this long is removed at startup
IMPORT_TYPES = {"training": "state", "sampler": "weights"}


@dataclass(frozen=True)
class UploadChunk:
    """One piece of one adapter file.

    Attributes:
        relative_path: ``adapter_config.json`` or ``adapter_model.safetensors``.
        offset: byte offset of `data` in the file (chunks of a file arrive in order).
        data: the bytes.
        file_size, sha256: on a file's first chunk, its total size and sha256 hex (0 / "": not checked).
    """

    relative_path: str
    offset: int
    data: bytes
    file_size: int = 0
    sha256: str = ""


class AdapterImporter:
    """Checks uploaded PEFT adapters and stores them as checkpoints.

    Args:
        store, lifecycle: the resource's checkpoint store and lifecycle (save options, keep-last).
        runtime: the trainer runtime (``model_id``, ``model_dir``, ``lora_target_modules``, ``base_fingerprint()``,
            ``read_state_meta``, ``state_differences``).
        max_rank: the largest LoRA rank accepted (the resource's limit).
        on_written: called with each stored checkpoint (telemetry: its bytes and a log line).
    """

    def __init__(self, store: CheckpointStore, lifecycle: CheckpointLifecycle, runtime: TrainerRuntime, max_rank: int,
                 on_written: Callable[[Checkpoint], None] | None = None) -> None:
        self.store, self.lifecycle, self.runtime, self.max_rank = store, lifecycle, runtime, int(max_rank)
        self.on_written = on_written or (lambda ckpt: None)
        self.uploads = store.root / UPLOADS
        self.uploads.mkdir(parents=True, exist_ok=True)
        for d in self.uploads.iterdir():  # uploads of a process that is gone; resumable ones left too long
            m = re.match(r"^(\d+)-", d.name)
            if (m and not _pid_alive(int(m.group(1)))) or (
                    d.name.startswith("r-") and time.time() - d.stat().st_mtime > STALE_UPLOAD_S):
                shutil.rmtree(d, ignore_errors=True)

    def _upload_dir(self, owner: str, upload_id: str) -> Path:
        """``<pid>-<random>`` for a one-shot upload; ``r-<owner tag>-<upload_id>`` for a resumable one (only the
        same API key reaches it again)."""
        if not upload_id:
            return self.uploads / f"{os.getpid()}-{uuid.uuid4().hex}"
        if not re.fullmatch(r"[A-Za-z0-9_-]{8,64}", upload_id):
            raise invalid(f"upload_id must be 8-64 of [A-Za-z0-9_-], got {upload_id!r}", key="upload_id")
        return self.uploads / f"r-{owner_tag(owner)[:16] or 'anon'}-{upload_id}"

    def progress(self, upload_id: str, owner: str = "") -> dict[str, int]:
        """Bytes received so far of each file of the resumable upload `upload_id` ({} when none is kept)."""
        d = self._upload_dir(owner, upload_id)
        return {rel: (d / rel).stat().st_size for rel in ADAPTER_FILES if (d / rel).is_file()}

    def import_stream(self, chunks: Iterable[UploadChunk], *, name: str, as_type: str, owner: str = "",
                      options: dict[str, Any] | None = None, upload_id: str = "") -> Checkpoint:
        """Receive the files, check them, store the checkpoint; returns it.

        Args:
            as_type: "training" (a step-0 training checkpoint) or "sampler" (a PEFT adapter for sampling).
            options: `SaveOptions.checked` arguments (user_metadata, ttl_seconds, pinned).
            upload_id: "" = one shot; else resumable: bytes of a stream that broke are kept under this id
                (`progress` tells how many), and the next call with it continues each file where it stopped.
                Kept uploads older than `STALE_UPLOAD_S` are removed at startup.

        Raises:
            ServiceError: INVALID_ARGUMENT naming the bad field, file or tensor (nothing is stored, nothing
                kept); ABORTED (retryable) when the stream ended before a file was whole (a resumable upload's
                bytes are kept); RESOURCE_EXHAUSTED when the files pass `MAX_UPLOAD_BYTES` or the disk is full.
        """
        validate_name(name)
        if as_type not in IMPORT_TYPES:
            raise invalid(f"type must be 'training' or 'sampler', got {as_type!r}", key="type")
        opts = SaveOptions.checked(**(options or {}))
        tmp = self._upload_dir(owner, upload_id)
        session_id = ""
        if upload_id:  # a retry of an import that succeeded gets the same checkpoint back
            session_id = "import-" + hashlib.sha256(f"{owner_tag(owner)}/{upload_id}".encode()).hexdigest()[:12]
            uri = self.store.uri(session_id, IMPORT_TYPES[as_type], name)
            if self.store.registry is None or self.store.registry.checkpoint(uri) is not None:
                if self.store.registry is not None:  # this call's metadata, TTL and pin, as a fresh import's
                    rec = opts.record(time.time())
                    self.store.registry.update_checkpoint(uri, metadata=rec["metadata"],
                                                          expires_at=rec["expires_at"], pinned=rec["pinned"])
                try:
                    return self.store.get(uri, verify=False)
                except ServiceError:
                    pass
        tmp.mkdir(exist_ok=bool(upload_id))
        done = not upload_id  # a one-shot upload is always removed; a resumable one once it was all received
        try:
            self._receive(chunks, tmp)
            done = True
            return self.import_dir(tmp, name=name, as_type=as_type, owner=owner, options=opts, session_id=session_id)
        except ServiceError as err:
            done = err.code != "ABORTED"  # refused (order, size, checksum, content): start over; cut short: keep
            raise
        finally:
            if done:
                shutil.rmtree(tmp, ignore_errors=True)

    def _receive(self, chunks: Iterable[UploadChunk], into: Path) -> None:
        """Append the chunks to the files in `into` (a file's first chunk of this call continues where the
        file stops), checking names, order, the total size, and at the end each declared size and sha256."""
        seen: dict[str, list[Any]] = {}  # name -> [next offset, declared size, declared sha256]
        total = sum(f.stat().st_size for f in into.iterdir() if f.is_file())
        for c in chunks:
            if c.relative_path not in ADAPTER_FILES:
                raise invalid(f"file {c.relative_path!r} is not part of a PEFT adapter (send {list(ADAPTER_FILES)})",
                              key=c.relative_path or "relative_path")
            f = into / c.relative_path
            st = seen.setdefault(c.relative_path, [f.stat().st_size if f.is_file() else 0, int(c.file_size),
                                                   c.sha256])
            if c.offset != st[0]:
                raise invalid(f"{c.relative_path}: chunk at offset {c.offset}, expected {st[0]} (chunks in order)",
                              key=c.relative_path)
            total += len(c.data)
            if total > MAX_UPLOAD_BYTES:
                raise ServiceError("RESOURCE_EXHAUSTED", f"adapter upload passes {MAX_UPLOAD_BYTES} bytes",
                                   key=c.relative_path)
            with open(f, "ab") as out:
                out.write(c.data)
            st[0] += len(c.data)
        for rel in ADAPTER_FILES:
            size, want, sha = seen.get(rel) or [(into / rel).stat().st_size if (into / rel).is_file() else 0, 0, ""]
            if (want and size < want) or not (into / rel).is_file():
                raise ServiceError("ABORTED", f"{rel}: the upload ended after {size} of {want or '?'} bytes (the stream "
                                   "broke?); an ImportAdapter with the same upload_id continues it", key=rel,
                                   retryable=True)
            if want and size != want:
                raise invalid(f"{rel}: received {size} bytes, the upload declared {want}", key=rel)
            if sha and _sha256(into / rel) != sha:
                raise invalid(f"{rel}: sha256 of the received bytes differs from the declared one", key=rel)

    def import_dir(self, src: Path, *, name: str, as_type: str, owner: str = "",
                   options: SaveOptions | None = None, session_id: str = "") -> Checkpoint:
        """Check the adapter directory `src` and store it (see `import_stream`; `src` is not changed) under
        ``together-train://<session_id or import-<random>>/<kind>/<name>``."""
        e = self.runtime
        try:
            adapter = check_adapter(src, model_id=str(e.model_id), model_dir=e.model_dir, max_rank=self.max_rank)
        except AdapterProblem as err:
            key = f"{err.file}:{err.tensor}" if err.tensor else err.file
            raise invalid(f"adapter not imported, nothing stored: {err}", key=key) from None
        kind, session_id = IMPORT_TYPES[as_type], session_id or f"import-{uuid.uuid4().hex[:12]}"
        opts = options or SaveOptions()
        targets = list(e.lora_target_modules)
        with self.store.writer(session_id, kind, name, step=0, owner=owner, record=opts.record(time.time())) as tmp:
            if kind == "state":
                write_training_state(tmp, adapter, targets, e.model_dir, e.base_fingerprint())
                diffs = e.state_differences(e.read_state_meta(tmp))
                if diffs:  # our own writing disagrees with the engine: a bug, never stored
                    raise ServiceError("INTERNAL", "imported training checkpoint does not fit this engine: "
                                       + "; ".join(diffs))
            else:
                write_adapter(tmp, adapter, targets, e.model_dir)
        ckpt = self.store.get(self.store.uri(session_id, kind, name), verify=False)
        self.on_written(ckpt)
        return ckpt
