"""Sessions: creation (optionally from a checkpoint), lookup, stop, keep-alive and expiry.

A session is one LoRA adapter with its AdamW state, step counter and operation
queue (`SessionRecord`, service/core/session_record.py). `Sessions` is the part of `Resource` that
creates, finds, stops and expires them. An idle session is paged out (sessions/pager.py); with
``idle_timeout_s`` > 0 (off by default) one idle that long is discarded after a training
checkpoint is written (its sweeper thread).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from typing import Any, Iterable

from together_train_server.engines.interfaces import TrainerEngine
from together_train_server.engines.types import LoraConfig
from together_train_server.service import validation
from together_train_server.service.checkpoints.ops import Checkpoints
from together_train_server.service.checkpoints.registry import Registry, SessionRow
from together_train_server.service.checkpoints.store import CheckpointStore, owner_tag
from together_train_server.service.core.operations import OperationBook, SessionQueue, TrainerWorker
from together_train_server.service.core.session_record import ACTIVE, EXPIRED, STOPPED, Serving, SessionRecord
from together_train_server.service.errors import ServiceError, invalid
from together_train_server.service.replicas.pool import ReplicaPool
from together_train_server.service.sessions.pager import PagingConfig, SessionPager
from together_train_server.service.telemetry import Telemetry
from together_train_server.service.tenancy.quotas import Quotas
from together_train_server.service.weights.publishing import WeightsPublisher

log = logging.getLogger(__name__)


class Sessions:
    """Session lifecycle: create, get, list, stop, keep alive, expire (its sweeper thread).

    Args:
        engine: the trainer engine (adapters are created and dropped under `engine_lock`).
        engine_lock: held while the engine runs anything (the engine is not thread-safe).
        pool: the generator replicas (a stopped session's adapter is dropped there).
        registry: the model registry (a row per session, of this run and earlier ones).
        book, worker: the operation book and the trainer worker each session queue submits to.
        telemetry: session events.
        checkpoints: reads and loads the checkpoint a session starts from.
        publisher: pushes a session's loaded weights to the replicas.
        limits: LoRA configs are checked against them.
        max_sessions: concurrent ACTIVE sessions allowed (RESOURCE_EXHAUSTED past it).
        idle_timeout_s: a session with no call for this long expires (docs/design.md §6).
        lora_target_modules: the LoRA targets a session may name (the engine's).
        quotas: per-API-key limits (max_sessions_per_key).
        store: where a session idle past ``idle_timeout_s`` is checkpointed before it is discarded.
        paging, pager: the resident-session budget and its pager (None: every session stays resident);
            the sweeper pages out sessions idle past ``paging.page_idle_s``.
    """

    def __init__(self, engine: TrainerEngine, engine_lock: threading.RLock, pool: ReplicaPool[Any],
                 registry: Registry, book: OperationBook, worker: TrainerWorker, telemetry: Telemetry,
                 checkpoints: Checkpoints, publisher: WeightsPublisher, *, limits: validation.Limits,
                 store: CheckpointStore, max_sessions: int, idle_timeout_s: float,
                 lora_target_modules: tuple[str, ...], quotas: Quotas, paging: PagingConfig,
                 pager: SessionPager | None) -> None:
        self.engine = engine
        self.engine_lock = engine_lock
        self.pool = pool
        self.registry = registry
        self.book = book
        self.worker = worker
        self.telemetry = telemetry
        self.checkpoints = checkpoints
        self.publisher = publisher
        self.limits = limits
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.lora_target_modules = lora_target_modules
        self.quotas = quotas
        self.store = store
        self.paging = paging
        self.pager = pager
        self._sessions: dict[str, SessionRecord] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="session-expiry", daemon=True)
        self._sweeper.start()

    def close(self) -> None:
        """Stop the expiry sweeper."""
        self._closed.set()

    def create_session(
        self,
        lora: LoraConfig | None,
        *,
        name: str = "",
        owner: str = "",
        checkpoint_uri: str = "",
        with_optimizer: bool = False,
    ) -> SessionRecord:
        """Create a LoRA session (adapter + AdamW + step counter).

        With `checkpoint_uri` (a training checkpoint from `save_state`, of this
        or an earlier session, also from before a restart of the resource) the
        session starts from its weights, and with `with_optimizer` also from
        its AdamW moments and RNG stream (see `submit_load_state`). `lora`
        None takes the checkpoint's LoRA config (or the defaults without a
        checkpoint); a given `lora` must have the checkpoint's shape. The step
        (= policy version) starts at the checkpoint's step, and the loaded
        adapter is pushed to the replicas before the session is returned, so
        its samples are served by the loaded weights whatever the step (an
        imported adapter's is 0; only a fresh adapter is served as the base).

        Raises:
            ServiceError: INVALID_ARGUMENT for a bad LoRA config, `with_optimizer`
                without a checkpoint, or a URI that is malformed or names an
                inference checkpoint; NOT_FOUND for an
                unknown checkpoint; DATA_LOSS for a corrupted one;
                FAILED_PRECONDITION when its base model or LoRA shape differs
                (the message names what); RESOURCE_EXHAUSTED past max_sessions or
                the key's max_sessions_per_key.
        """
        ckpt = meta = None
        if with_optimizer and not checkpoint_uri:
            raise invalid(
                "with_optimizer restores a checkpoint's optimizer: it needs checkpoint_uri", key="with_optimizer"
            )
        if checkpoint_uri:
            ckpt, meta = self.checkpoints.state_checkpoint(checkpoint_uri, owner)
            self.checkpoints.check_fits(meta, None, checkpoint_uri)
            if lora is None:
                lora = self.engine.spec_from_meta(meta)
            else:
                self.checkpoints.check_fits(meta, lora, checkpoint_uri)
        lora = lora or LoraConfig()
        validation.validate_lora(
            lora.rank, lora.alpha, lora.dropout, lora.target_modules, self.lora_target_modules, self.limits
        )
        with self._lock:
            active = sum(1 for s in self._sessions.values() if s.state == ACTIVE)
            if active >= self.max_sessions:
                raise ServiceError(
                    "RESOURCE_EXHAUSTED",
                    f"this resource already has {active} active sessions (max_sessions={self.max_sessions}); "
                    "stop one first",
                    retryable=True,
                )
            self.quotas.check_session(sum(1 for s in self._sessions.values() if s.state == ACTIVE and s.owner == owner))
            session_id = f"s-{uuid.uuid4().hex[:12]}"
            queue = SessionQueue(session_id, self.book, self.worker, owner)
            # Reserve the slot before the slow adapter creation.
            placeholder = SessionRecord(session_id, name, lora, queue, 0, owner=owner)
            self._sessions[session_id] = placeholder
        created = False
        try:
            with self.engine_lock:
                n_params = self.engine.create_adapter(session_id, lora)
                created = True
                if ckpt is not None:
                    placeholder.step = self.checkpoints.load_into(session_id, ckpt, with_optimizer)
                    tensors = self.publisher.loaded_snapshot(placeholder)
            placeholder.num_trainable_params = int(n_params)
            if ckpt is not None:
                self.publisher.publish_loaded(placeholder, placeholder.step, tensors)
        except Exception as err:
            with self._lock:
                del self._sessions[session_id]
            if created:
                with self.engine_lock:
                    self.engine.drop_adapter(session_id)
                self.pool.drop_all(session_id)
            if not isinstance(err, ServiceError) and hasattr(err, "grpc_code"):
                # An engine refusal that names its status (e.g. full mode: one session at a time).
                raise ServiceError(err.grpc_code, str(err)) from err
            raise
        self._register_session(placeholder)
        self.telemetry.session_event("created", placeholder)
        return placeholder

    def _register_session(self, s: SessionRecord) -> None:
        """The session's registry row (a registry failure is logged, never fails the session)."""
        try:
            self.registry.record_session(s.session_id, owner=owner_tag(s.owner),
                                         base_model=str(self.engine.model_id),
                                         lora=dataclasses.asdict(s.lora), status=s.state, step=s.step,
                                         created_at=s.created_at, display_name=s.name)
        except Exception:
            log.exception("could not register session %s in the model registry", s.session_id)

    def find(self, session_id: str) -> SessionRecord | None:
        """The record of `session_id` (any owner, any state); None when unknown."""
        with self._lock:
            return self._sessions.get(session_id)

    def get_session(self, session_id: str, owner: str = "") -> SessionRecord:
        """Raises ServiceError NOT_FOUND for an unknown id (or one owned by another key)."""
        with self._lock:
            s = self._sessions.get(session_id)
        if s is None or (s.owner and s.owner != owner):
            raise ServiceError("NOT_FOUND", f"unknown session {session_id!r}", key="session_id")
        return s

    def active_session(self, session_id: str, owner: str = "") -> SessionRecord:
        """The session if ACTIVE, touching both its idle timers (a call that uses it: discard and page-out).

        Raises:
            ServiceError: NOT_FOUND for an unknown id; FAILED_PRECONDITION for
                a stopped or expired session.
        """
        s = self._live(session_id, owner)
        s.last_op_at = s.last_active_at = time.time()
        return s

    def _live(self, session_id: str, owner: str) -> SessionRecord:
        """The session if ACTIVE, touching no timer (raises as `active_session`)."""
        s = self.get_session(session_id, owner)
        if s.state != ACTIVE:
            raise ServiceError(
                "FAILED_PRECONDITION",
                f"session {session_id} is {s.state.lower()}; create a new session"
                + (" (it expired after an idle timeout; call keep_alive to prevent that)" if s.state == EXPIRED else ""),
                key="session_id",
            )
        return s

    def list_sessions(self, owner: str = "") -> list[SessionRecord]:
        with self._lock:
            return [s for s in self._sessions.values() if not s.owner or s.owner == owner]

    def stop_session(self, session_id: str, owner: str = "", *, state: str = STOPPED) -> SessionRecord:
        """Cancel queued operations, drop the adapter everywhere, free the slot."""
        s = self.get_session(session_id, owner)
        if s.state != ACTIVE:
            return s
        s.state = state
        s.queue.cancel_all(f"session {session_id} was {state.lower()}")
        with self.engine_lock:  # waits for a running operation to finish
            self.engine.drop_adapter(session_id)
        self.pool.drop_all(session_id)
        try:
            self.registry.update_session(session_id, status=state, step=s.step, stopped=True)
        except Exception:
            log.exception("could not record the stop of session %s in the model registry", session_id)
        self.telemetry.session_event(state.lower(), s)
        return s

    def keep_alive(self, session_id: str, owner: str = "") -> SessionRecord:
        """A heartbeat: the session is not discarded as idle (``last_active_at``), but it is still paged out
        once no operation used it for ``--page-out-idle`` (``last_op_at`` is left as it is).

        Raises:
            ServiceError: as `active_session`.
        """
        s = self._live(session_id, owner)
        s.last_active_at = time.time()
        return s

    def expires_at(self, s: SessionRecord) -> float:
        """When the idle session is discarded (epoch seconds); 0.0 when discarding is off (``idle_timeout_s`` 0)."""
        return s.last_active_at + self.idle_timeout_s if self.idle_timeout_s > 0 else 0.0

    def is_idle(self, session_id: str) -> bool:
        """Nothing of the session is queued or running (the pager pages out only such sessions)."""
        with self._lock:
            s = self._sessions.get(session_id)
        return s is None or not s.queue.pending()

    def _sweep_loop(self) -> None:
        period = min([10.0] + [t / 4 for t in (self.idle_timeout_s, self.paging.page_idle_s) if t > 0])
        while not self._closed.wait(period):
            now = time.time()
            if self.pager is not None and self.paging.page_idle_s > 0:
                with self.engine_lock:
                    self.pager.page_out_idle(self._idle_for, self.paging.page_idle_s)
            if self.idle_timeout_s <= 0:
                continue
            for s in self.list_sessions_all():
                if s.state == ACTIVE and now > self.expires_at(s) and not s.queue.pending():
                    self._discard_idle(s)

    def _idle_for(self, session_id: str) -> float:
        with self._lock:
            s = self._sessions.get(session_id)
        return 0.0 if s is None else time.time() - s.last_op_at   # heartbeats do not count (keep_alive)

    def _discard_idle(self, s: SessionRecord) -> None:
        """Expire a session idle past ``idle_timeout_s``: first a training checkpoint its owner can resume from.

        The checkpoint is named ``idle-<step>-<epoch seconds>``; when it cannot be written the session is
        kept (and the error logged), never discarded without one.
        """
        name = f"idle-{s.step}-{int(time.time())}"
        try:
            with self.engine_lock:
                if s.queue.pending() or s.state != ACTIVE:
                    return
                step = self.engine.step(s.session_id)
                with self.store.writer(s.session_id, "state", name, step=step, owner=s.owner) as tmp:
                    self.engine.save_state(s.session_id, tmp)
        except Exception:
            log.exception("session %s is idle past --idle-timeout but its checkpoint %r could not be written; "
                          "it is kept", s.session_id, name)
            return
        log.info("session %s idle for %.0f s: checkpoint %s written, session expired", s.session_id,
                 time.time() - s.last_active_at, self.store.uri(s.session_id, "state", name))
        self.stop_session(s.session_id, s.owner, state=EXPIRED)

    def list_sessions_all(self) -> list[SessionRecord]:
        with self._lock:
            return list(self._sessions.values())

    def replica_view(self, owner: str | None) -> list[dict[str, Any]]:
        """The replica pool's `snapshot()`, with adapter versions limited to what `owner` may see.

        A replica's ``versions`` keys are adapter keys (session ids, ``ckpt:<uri>``,
        ``snap:<id>``); a key is kept when it names one of `owner`'s sessions (every
        session without API keys); `owner` None (an anonymous scrape with keys on)
        sees none. ``hidden`` counts the keys left out.
        """
        visible = {s.session_id for s in self.list_sessions(owner)} if owner is not None else set()
        out = []
        for r in self.pool.snapshot():
            shown = {k: v for k, v in r["versions"].items() if any(sid in k for sid in visible)}
            out.append({**r, "versions": shown, "hidden": len(r["versions"]) - len(shown)})
        return out

    # ----- the model registry's rows (sessions of this run and of earlier ones) ------------------
    def session_row(self, session_id: str, owner: str = "") -> SessionRow:
        """The model registry's row of a session this storage ever held (live, or of an earlier run).

        Raises:
            ServiceError: NOT_FOUND for an unknown session or one of another API key.
        """
        row = self.registry.session(session_id)
        if row is None or row.owner != owner_tag(owner):
            raise ServiceError("NOT_FOUND", f"unknown session {session_id!r}", key="session_id")
        return row

    def page_session_rows(self, owner: str = "", *, status: Iterable[str] = (), limit: int = 0,
                          after: str = "", offset: int = 0) -> tuple[list[SessionRow], str]:
        """`owner`'s sessions from the model registry (earlier runs' too), newest first.

        Args:
            status: registry statuses to keep (ACTIVE, STOPPED, ...; empty = any).
            limit: rows per page (0 = all).
            after: the session id the page resumes after ("" = from the newest).
            offset: rows skipped first (APIs that page by offset, as Tinker's).

        Returns:
            (rows, the next page's cursor or "" when this is the last page).

        Raises:
            ServiceError: INVALID_ARGUMENT (key "after") for an unknown `after`.
        """
        cursor = self.registry.cursor_after("sessions", after) if after else ""
        return self.registry.list_sessions(owner_tag(owner), status=list(status), limit=limit, cursor=cursor,
                                           offset=offset)

    def update_session_info(self, session_id: str, owner: str = "", *, display_name: str | None = None,
                            metadata: dict[str, Any] | None = None) -> None:
        """Set a session's display name and/or user metadata (replaced as a whole) in the model registry.

        Sessions of earlier runs can be updated too; None leaves a field as it is.

        Raises:
            ServiceError: NOT_FOUND for an unknown session or one of another API key.
        """
        self.session_row(session_id, owner)
        self.registry.update_session(session_id, display_name=display_name, metadata=metadata)

    def count_session_rows(self, owner: str = "") -> int:
        """How many sessions of `owner` the model registry holds (every run of this storage)."""
        return self.registry.count("sessions", owner_tag(owner))

    def check_sample_session(self, session_id: str, owner: str = "") -> Serving:
        """The replica key and version a sample for this session is served with now (`SessionRecord.serving`);
        no session: ("", -1), the base model. Raises as `active_session`."""
        if not session_id:
            return Serving("", -1)
        return self.active_session(session_id, owner).serving()
