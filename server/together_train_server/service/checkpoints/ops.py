"""Checkpoints: lookup, listing, deletion, downloads, saving and loading, adapters served for scoring.

`Checkpoints` is one of the parts `Resource` is composed of (service/resource.py). It reads the
checkpoint store and the model registry with the caller's API key as the owner, and builds the
``prepare`` functions of the ``save_weights``, ``save_state`` and ``load_state`` operations that
`Submissions.submit` queues in a session's operation order.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from together_train_server.engines.types import LoraConfig
from together_train_server.service.checkpoints.lifecycle import CheckpointLifecycle, SaveOptions
from together_train_server.service.checkpoints.registry import Registry
from together_train_server.service.checkpoints.store import Checkpoint, CheckpointStore, owner_tag, validate_name
from together_train_server.service.errors import ServiceError, invalid
from together_train_server.service.core.runtime import TrainerRuntime
from together_train_server.service.core.session_record import SessionRecord
from together_train_server.service.telemetry import Telemetry
from together_train_server.service.weights.publishing import WeightsPublisher

log = logging.getLogger(__name__)


@dataclass
class LoadOutcome:
    """Result of load_state: the session's step (= policy version) after loading."""

    step: int
    with_optimizer: bool



class Checkpoints:
    """Checkpoint reads (get, list, page, delete, files), the save/load operations, scoring adapters.

    Args:
        store: the checkpoint files.
        registry: the model registry indexing them.
        runtime: the trainer runtime (writes and loads checkpoints on its thread; reads their metadata).
        telemetry: records checkpoints written and deleted.
        publisher: pushes a loaded session's weights and scoring adapters to the replicas.
        lifecycle: checkpoint metadata, TTL, pins and keep-last-K (applied after each save).
    """

    MAX_SCORING_CHECKPOINTS = 4

    def __init__(self, store: CheckpointStore, registry: Registry, runtime: TrainerRuntime, telemetry: Telemetry,
                 publisher: WeightsPublisher, lifecycle: CheckpointLifecycle) -> None:
        self.store = store
        self.registry = registry
        self.runtime = runtime
        self.telemetry = telemetry
        self.publisher = publisher
        self.lifecycle = lifecycle
        # checkpoint uri -> (replica adapter key, step) loaded for compute_logprobs(source=CHECKPOINT)
        self._scoring_ckpts: dict[str, tuple[str, int]] = {}
        self._scoring_lock = threading.Lock()

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

    def state_checkpoint(self, uri: str, owner: str) -> tuple[Checkpoint, dict[str, Any]]:
        """A verified training checkpoint and its metadata (see engine `read_state_meta`)."""
        ckpt = self.get_checkpoint(uri, owner, verify=True)
        if ckpt.kind != "state":
            raise invalid(
                f"{uri} is an inference checkpoint (save_weights); loading needs a training checkpoint "
                "from save_state (together-train://<session>/state/<name>)",
                key="uri",
            )
        try:
            meta = self.runtime.read_state_meta(ckpt.path)
        except (OSError, ValueError) as e:
            raise ServiceError("DATA_LOSS", f"checkpoint {uri} is not a readable training checkpoint: {e}", key="uri") from e
        return ckpt, meta

    def check_fits(self, meta: Mapping[str, Any], lora: LoraConfig | None, uri: str) -> None:
        """FAILED_PRECONDITION naming every base-model or LoRA-shape difference."""
        diffs = self.runtime.state_differences(meta, lora)
        if diffs:
            raise ServiceError(
                "FAILED_PRECONDITION", f"checkpoint {uri} does not fit: " + "; ".join(diffs), key="uri"
            )

    def load_into(self, session_id: str, ckpt: Checkpoint, with_optimizer: bool) -> int:
        """The runtime's ``load_state`` (on its thread); engine refusals become FAILED_PRECONDITION."""
        try:
            return int(self.runtime.load_state(session_id, ckpt.path, with_optimizer))
        except (ValueError, OSError) as e:
            raise ServiceError("FAILED_PRECONDITION", f"cannot load checkpoint {ckpt.uri}: {e}", key="uri") from e

    def prepare_save(self, session_id: str, kind: str, name: str, *, merged: bool = False, owner: str = "",
                     options: Mapping[str, Any] | None = None) -> Callable[[], Callable[[], Checkpoint]]:
        """The `prepare` of a save_weights (`kind` "weights") or save_state ("state") operation.

        save_weights, unmerged: a PEFT adapter directory (`adapter_config.json`,
        `adapter_model.safetensors`) for peft / vLLM; merged: a standard Hugging
        Face model directory (engine `save_merged`: base + scaling * B @ A on a
        fresh copy of the base, config, generation config, tokenizer, chat
        template). save_state: the adapter tensors, AdamW moments and per-parameter steps, the
        step counter, the session's dropout RNG state, the LoRA config and the
        base model's fingerprint (engine `save_state`); gradients accumulated
        since the last optim_step are not saved. Result: the Checkpoint. `options`: user
        metadata, TTL, pin, keep_last (`SaveOptions.checked` arguments, checked at preparation: a bad one
        fails the operation naming it; keep-last-K runs after the write).

        Errors: INVALID_ARGUMENT for a bad name or option (at submission, as a FAILED
        operation); ALREADY_EXISTS when the name is taken.
        """

        def write(opts: SaveOptions) -> Checkpoint:
            step = self.runtime.step(session_id)
            with self.store.writer(session_id, kind, name, step=step, merged=merged, owner=owner,
                                   record=opts.record(time.time())) as tmp:
                if kind == "state":
                    self.runtime.save_state(session_id, tmp)
                elif merged:
                    self.runtime.save_merged(session_id, tmp)
                else:
                    self.runtime.save_adapter(session_id, tmp)
            ckpt = self.store.get(self.store.uri(session_id, kind, name), verify=False)
            self.telemetry.checkpoint_written(ckpt)
            self.lifecycle.after_save(session_id, kind, opts)
            return ckpt

        def prepare() -> Callable[[], Checkpoint]:
            validate_name(name)
            opts = SaveOptions.checked(**(options or {}))
            return lambda: write(opts)

        return prepare

    def prepare_load(self, s: SessionRecord, uri: str, with_optimizer: bool,
                     owner: str = "") -> Callable[[], Callable[[], concurrent.futures.Future[LoadOutcome]]]:
        """The `prepare` of a load_state / load_state_with_optimizer operation of session `s`;
        result is a LoadOutcome.

        The checkpoint is verified against its manifest first (a corrupted
        file is DATA_LOSS and nothing is loaded). Weights always; with
        `with_optimizer` also the AdamW moments and the dropout RNG stream, so
        training continues bit-for-bit; without, a fresh AdamW. The step
        counter (= policy version) becomes the checkpoint's step either way,
        accumulated gradients are dropped, and the replicas are updated to
        serve the loaded weights (`WeightsPublisher.publish_loaded`) before it succeeds.

        Errors: INVALID_ARGUMENT (malformed URI, an inference checkpoint),
        NOT_FOUND, DATA_LOSS, FAILED_PRECONDITION (different base model or
        LoRA shape, naming what differs).
        """

        def load() -> concurrent.futures.Future[LoadOutcome]:
            ckpt, meta = self.state_checkpoint(uri, owner)
            self.check_fits(meta, s.lora, uri)
            step = s.step = self.load_into(s.session_id, ckpt, with_optimizer)
            tensors = self.publisher.loaded_snapshot(s)

            def publish() -> LoadOutcome:  # off the trainer worker
                self.publisher.publish_loaded(s, step, tensors)
                return LoadOutcome(step, with_optimizer)

            return self.publisher.publish_async(s, publish)

        def prepare() -> Callable[[], concurrent.futures.Future[LoadOutcome]]:
            self.store.parse_uri(uri)
            return load

        return prepare

    def checkpoint_scoring_key(self, uri: str, owner: str = "") -> tuple[str, int]:
        """Make a saved checkpoint's adapter servable for compute_logprobs; returns (replica key, step).

        The PEFT adapter directory of a `save_weights` (unmerged) or
        `save_state` checkpoint is read and pushed to every replica under the
        synthetic key ``"ckpt:<uri>"`` with the checkpoint's step as its
        version (re-pushed to restarted replicas like a session's adapter).
        The `MAX_SCORING_CHECKPOINTS` most recently used stay loaded; older
        ones are dropped from the replicas.

        Raises:
            ServiceError: INVALID_ARGUMENT (malformed URI, merged checkpoint),
                NOT_FOUND (unknown or another key's), DATA_LOSS (corrupted or
                unreadable), FAILED_PRECONDITION (no replicas, or the adapter
                does not fit this model).
        """
        from together_train_server.engines.lora import read_peft_adapter

        ckpt = self.get_checkpoint(uri, owner)
        if ckpt.merged:
            raise invalid(f"{uri} is a merged model; sampling and compute_logprobs serve unmerged adapter "
                          "checkpoints (serve a merged model with `together-train deploy`)", key="uri")
        if len(self.publisher.pool) == 0:
            raise ServiceError("FAILED_PRECONDITION", "this resource has no generator replicas to sample or score with (--generators N)")
        with self._scoring_lock:
            hit = self._scoring_ckpts.pop(uri, None)
            if hit is not None:
                self._scoring_ckpts[uri] = hit  # most recently used last
                return hit
            ckpt = self.get_checkpoint(uri, owner, verify=True)
            try:
                spec, tensors = read_peft_adapter(ckpt.path)
            except (OSError, ValueError, KeyError) as e:
                raise ServiceError("DATA_LOSS", f"checkpoint {uri} has no readable adapter: {e}", key="uri") from e
            key = f"ckpt:{uri}"
            try:
                self.publisher.pool.push_all(key, ckpt.step, spec, tensors)
            except ServiceError as e:
                if e.code == "INTERNAL":  # the replica refused the tensors
                    raise ServiceError("FAILED_PRECONDITION", f"checkpoint {uri} does not fit this model: {e.message}",
                                       key="uri") from e
                raise
            self._scoring_ckpts[uri] = (key, ckpt.step)
            while len(self._scoring_ckpts) > self.MAX_SCORING_CHECKPOINTS:
                old = next(iter(self._scoring_ckpts))
                old_key, _ = self._scoring_ckpts.pop(old)
                self.publisher.pool.drop_all(old_key)
            return key, ckpt.step
