"""Checkpoints of a `Resource`: lookup, listing, deletion, downloads, and saving/loading them as operations.

`CheckpointOpsMixin` reads the checkpoint store and the model registry with
the caller's API key as the owner, and queues ``save_weights``,
``save_state`` and ``load_state`` in a session's operation order.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from together_train_server.engines.types import LoraConfig
from together_train_server.service.checkpoints.lifecycle import SaveOptions
from together_train_server.service.checkpoints.store import Checkpoint, owner_tag, validate_name
from together_train_server.service.errors import ServiceError, invalid
from together_train_server.service.training.operations import OperationRecord
from together_train_server.service.resource_state import ResourceState

log = logging.getLogger(__name__)


@dataclass
class LoadOutcome:
    """Result of load_state: the session's step (= policy version) after loading."""

    step: int
    with_optimizer: bool



class CheckpointOpsMixin(ResourceState):
    """Checkpoint reads (get, list, page, delete, files) and the save/load operations of a `Resource`."""

    def get_checkpoint(self, uri: str, owner: str = "", *, verify: bool = False) -> Checkpoint:
        """A checkpoint visible to `owner` (written with the same API key).

        Raises:
            ServiceError: INVALID_ARGUMENT for a malformed URI, NOT_FOUND for an
                unknown one (or another key's), DATA_LOSS with `verify` when a
                file's size or sha256 differs from the manifest.
        """
        ckpt = self.store.get(uri, verify=False)
        if ckpt.owner != owner_tag(owner):
            raise ServiceError("NOT_FOUND", f"no checkpoint {uri}", key="uri")
        return self.store.get(uri, verify=True) if verify else ckpt

    def list_checkpoints(self, session_id: str = "", owner: str = "") -> list[Checkpoint]:
        """Complete checkpoints of `owner`, oldest first; of one session id when given.

        Checkpoints outlive their session (and a restart of the resource), so
        a session id that is no longer (or never was) live is not an error.

        Raises:
            ServiceError: INVALID_ARGUMENT for a malformed session id.
        """
        tag = owner_tag(owner)
        return [c for c in self.store.list(session_id or None) if c.owner == tag]

    def page_checkpoints(self, owner: str = "", *, session_id: str = "", kind: str = "", variant: str = "",
                         base_model: str = "", limit: int = 0, cursor: str = "",
                         after: str = "", offset: int = 0) -> tuple[list[Checkpoint], str]:
        """Checkpoints of `owner` from the model registry, filtered; returns (checkpoints, next cursor or "").

        Filters ("" = any): session id, kind ("weights" | "state"), variant ("adapter" |
        "merged"), base model id. `limit` 0: every match, oldest first (as `list_checkpoints`);
        `limit` > 0: one page, newest first, with the cursor of the next page (`cursor_key`
        names its last row); `after` (a checkpoint URI, for APIs whose cursor is the last id of
        the previous page) resumes after that checkpoint instead of at `cursor`; `offset` skips that many
        checkpoints first (APIs that page by offset, as Tinker's). A registered
        checkpoint whose files are gone is skipped (and logged).

        Raises:
            ServiceError: INVALID_ARGUMENT naming a malformed kind, variant, cursor, an unknown
                `after` or a negative limit.
        """
        from together_train_server.service.checkpoints.store import _NAME_RE

        if limit < 0:
            raise invalid(f"limit must be >= 0 (0 = all), got {limit}", key="limit")
        if session_id and not _NAME_RE.match(session_id):
            raise invalid(f"invalid session id {session_id!r}", key="session_id")
        if after:
            cursor = self.registry.cursor_after("checkpoints", after)
        rows, nxt = self.registry.list_checkpoints(owner_tag(owner), session_id=session_id, kind=kind,
                                                   variant=variant, base_model=base_model, limit=limit, cursor=cursor,
                                                   offset=offset)
        out = []
        for r in rows:
            try:
                out.append(self.store.get(r.uri, verify=False))
            except ServiceError:
                log.warning("checkpoint %s is registered but its files are gone; not listed", r.uri)
        return (out if limit else out[::-1]), nxt

    @staticmethod
    def cursor_key(cursor: str) -> str:
        """The id (checkpoint URI or session id) of the row a listing cursor resumes after."""
        from together_train_server.service.checkpoints.registry import Registry

        return Registry.cursor_key(cursor)

    def checkpoint_registered(self, uri: str) -> bool:
        """True when the model registry holds checkpoint `uri` (of any API key)."""
        return self.registry.checkpoint(uri) is not None

    def checkpoint_file(self, uri: str, filename: str) -> Path:
        """The path of one file of a checkpoint's manifest (or ``manifest.json``), unverified.

        For a holder of a signed URL (the route checked its signature, so there is no owner
        check here); nothing outside the checkpoint's manifest can be named.

        Raises:
            ServiceError: NOT_FOUND for an unknown checkpoint or a file not in its manifest.
        """
        ckpt = self.store.get(uri, verify=False)
        if filename not in set(ckpt.files or {}) | {"manifest.json"}:
            raise ServiceError("NOT_FOUND", f"checkpoint {uri} has no file {filename!r}", key="filename")
        return ckpt.path / filename

    def count_checkpoints(self, owner: str = "") -> int:
        """How many checkpoints of `owner` the model registry holds."""
        return self.registry.count("checkpoints", owner_tag(owner))

    def adapter_config(self, uri: str, owner: str = "") -> dict[str, Any]:
        """The PEFT ``adapter_config.json`` of a checkpoint (``r``, ``target_modules``, ``modules_to_save``, ...);
        {} when it has none (a merged model) or it does not read.

        Raises:
            ServiceError: INVALID_ARGUMENT (malformed URI), NOT_FOUND (unknown or another key's).
        """
        import json

        ckpt = self.get_checkpoint(uri, owner)
        try:
            return json.loads((Path(ckpt.path) / "adapter_config.json").read_text())
        except (OSError, ValueError):
            return {}

    def delete_checkpoint(self, uri: str, owner: str = "") -> None:
        """Delete a checkpoint. Raises ServiceError NOT_FOUND when unknown (or another key's)."""
        self.get_checkpoint(uri, owner)
        self.store.delete(uri)
        self.telemetry.checkpoint_deleted(uri)

    def checkpoint_files(self, uri: str, owner: str = "") -> tuple[Checkpoint, list[tuple[str, Path, int, str]]]:
        """A verified checkpoint and its files for download: (relative path, path, size, sha256).

        Includes `manifest.json` (last), so a download is a complete copy.

        Raises:
            ServiceError: NOT_FOUND, DATA_LOSS (corrupted: nothing is sent).
        """
        from together_train_server.service.checkpoints.store import _sha256

        ckpt = self.get_checkpoint(uri, owner, verify=True)
        files = [(rel, ckpt.path / rel, int(m["size"]), str(m["sha256"])) for rel, m in sorted((ckpt.files or {}).items())]
        manifest = ckpt.path / "manifest.json"
        files.append(("manifest.json", manifest, manifest.stat().st_size, _sha256(manifest)))
        return ckpt, files

    def _state_checkpoint(self, uri: str, owner: str) -> tuple[Checkpoint, dict[str, Any]]:
        """A verified training checkpoint and its metadata (see engine `read_state_meta`)."""
        ckpt = self.get_checkpoint(uri, owner, verify=True)
        if ckpt.kind != "state":
            raise invalid(
                f"{uri} is an inference checkpoint (save_weights); loading needs a training checkpoint "
                "from save_state (together-train://<session>/state/<name>)",
                key="uri",
            )
        try:
            meta = self.engine.read_state_meta(ckpt.path)
        except (OSError, ValueError) as e:
            raise ServiceError("DATA_LOSS", f"checkpoint {uri} is not a readable training checkpoint: {e}", key="uri") from e
        return ckpt, meta

    def _check_fits(self, meta: Mapping[str, Any], lora: LoraConfig | None, uri: str) -> None:
        """FAILED_PRECONDITION naming every base-model or LoRA-shape difference."""
        diffs = self.engine.state_differences(meta, lora)
        if diffs:
            raise ServiceError(
                "FAILED_PRECONDITION", f"checkpoint {uri} does not fit: " + "; ".join(diffs), key="uri"
            )

    def _engine_load(self, session_id: str, ckpt: Checkpoint, with_optimizer: bool) -> int:
        """engine.load_state (caller holds engine_lock); engine refusals become FAILED_PRECONDITION."""
        try:
            return int(self.engine.load_state(session_id, ckpt.path, with_optimizer))
        except (ValueError, OSError) as e:
            raise ServiceError("FAILED_PRECONDITION", f"cannot load checkpoint {ckpt.uri}: {e}", key="uri") from e

    def submit_save_weights(
        self, session_id: str, seq_id: int, idempotency_key: str, name: str, merged: bool, owner: str = "",
        options: Mapping[str, Any] | None = None,
    ) -> OperationRecord:
        """Queue save_weights: an inference checkpoint in the store (kind "weights").

        Unmerged: a PEFT adapter directory (`adapter_config.json`,
        `adapter_model.safetensors`) for peft / vLLM. Merged: a standard Hugging
        Face model directory (engine `save_merged`: base + scaling * B @ A on a
        fresh copy of the base, config, generation config, tokenizer, chat
        template). Result: the Checkpoint. ALREADY_EXISTS when the name is taken. `options`: user
        metadata, TTL, pin, keep_last (`SaveOptions.checked` arguments, checked at preparation: a bad one
        fails the operation naming it; keep-last-K runs after the write).
        """

        def prepare() -> Callable[[], Any]:
            validate_name(name)
            opts = SaveOptions.checked(**(options or {}))

            def run() -> Any:
                step = self.engine.step(session_id)
                with self.store.writer(session_id, "weights", name, step=step, merged=merged, owner=owner,
                                       record=opts.record(time.time())) as tmp:
                    if merged:
                        self.engine.save_merged(session_id, tmp)
                    else:
                        self.engine.save_adapter(session_id, tmp)
                ckpt = self.store.get(self.store.uri(session_id, "weights", name), verify=False)
                self.telemetry.checkpoint_written(ckpt)
                self.lifecycle.after_save(session_id, "weights", opts)
                return ckpt

            return run

        return self._submit(session_id, owner, seq_id, idempotency_key, "save_weights", prepare)

    def submit_save_state(
        self, session_id: str, seq_id: int, idempotency_key: str, name: str, owner: str = "",
        options: Mapping[str, Any] | None = None,
    ) -> OperationRecord:
        """Queue save_state: a training checkpoint (kind "state") of the session.

        Holds the adapter tensors, AdamW moments and per-parameter steps, the
        step counter, the session's dropout RNG state, the LoRA config and the
        base model's fingerprint (engine `save_state`). Gradients accumulated
        since the last optim_step are not saved. Result: the Checkpoint. `options`: as save_weights.

        Errors: INVALID_ARGUMENT for a bad name (at submission, as a FAILED
        operation); ALREADY_EXISTS when the name is taken.
        """

        def prepare() -> Callable[[], Any]:
            validate_name(name)
            opts = SaveOptions.checked(**(options or {}))

            def run() -> Any:
                step = self.engine.step(session_id)
                with self.store.writer(session_id, "state", name, step=step, owner=owner,
                                       record=opts.record(time.time())) as tmp:
                    self.engine.save_state(session_id, tmp)
                ckpt = self.store.get(self.store.uri(session_id, "state", name), verify=False)
                self.telemetry.checkpoint_written(ckpt)
                self.lifecycle.after_save(session_id, "state", opts)
                return ckpt

            return run

        return self._submit(session_id, owner, seq_id, idempotency_key, "save_state", prepare)

    def submit_load_state(
        self, session_id: str, seq_id: int, idempotency_key: str, uri: str, with_optimizer: bool, owner: str = ""
    ) -> OperationRecord:
        """Queue load_state / load_state_with_optimizer; result is a LoadOutcome.

        The checkpoint is verified against its manifest first (a corrupted
        file is DATA_LOSS and nothing is loaded). Weights always; with
        `with_optimizer` also the AdamW moments and the dropout RNG stream, so
        training continues bit-for-bit; without, a fresh AdamW. The step
        counter (= policy version) becomes the checkpoint's step either way,
        accumulated gradients are dropped, and the replicas are updated to
        serve the loaded weights (`_publish_loaded`) before it succeeds.

        Errors: INVALID_ARGUMENT (malformed URI, an inference checkpoint),
        NOT_FOUND, DATA_LOSS, FAILED_PRECONDITION (different base model or
        LoRA shape, naming what differs).
        """
        s = self.get_session(session_id, owner)

        def prepare() -> Callable[[], Any]:
            self.store.parse_uri(uri)

            def run() -> concurrent.futures.Future:
                ckpt, meta = self._state_checkpoint(uri, owner)
                self._check_fits(meta, s.lora, uri)
                step = s.step = self._engine_load(session_id, ckpt, with_optimizer)
                tensors = self._loaded_snapshot(s)

                def publish() -> LoadOutcome:  # off the trainer worker
                    self._publish_loaded(s, step, tensors)
                    return LoadOutcome(step, with_optimizer)

                return self._publish_async(s, publish)

            return run

        return self._submit(session_id, owner, seq_id, idempotency_key, "load_state", prepare)
