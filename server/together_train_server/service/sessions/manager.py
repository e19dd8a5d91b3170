"""`SessionLifecycle`: creating a session (optionally from a checkpoint) and stopping one.

A session is one LoRA adapter with its AdamW state, step counter and operation
queue (`SessionRecord`, service/core/session_record.py). The sessions part of `Resource` is
three pieces: the table of live sessions (sessions/table.py: lookup, owner checks, idle
timers), this lifecycle (create, stop: the adapter is made and dropped on the trainer runtime's
thread, in the scheduler's order) and the sweeper (sessions/sweeper.py: page-out and expiry);
sessions/rows.py answers the registry's listings.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from typing import Any

from together_train_server.engines.types import LoraConfig
from together_train_server.service import validation
from together_train_server.service.checkpoints.ops import Checkpoints
from together_train_server.service.checkpoints.registry import Registry
from together_train_server.service.checkpoints.store import owner_tag
from together_train_server.service.core.runtime import TrainerRuntime
from together_train_server.service.core.session_record import ACTIVE, STOPPED, Serving, SessionRecord
from together_train_server.service.errors import ServiceError, invalid
from together_train_server.service.replicas.pool import ReplicaPool
from together_train_server.service.sessions.table import SessionTable
from together_train_server.service.telemetry import Telemetry
from together_train_server.service.weights.publishing import WeightsPublisher

log = logging.getLogger(__name__)


class SessionLifecycle:
    """Session create (optionally from a checkpoint) and stop.

    Args:
        table: the live sessions (a slot is reserved there first, removed when creation fails).
        runtime: the trainer runtime (adapters are made, loaded and dropped on its thread).
        pool: the generator replicas (a stopped session's adapter is dropped there).
        registry: the model registry (a row per session, of this run and earlier ones).
        telemetry: session events.
        checkpoints: reads and loads the checkpoint a session starts from.
        publisher: pushes a session's loaded weights to the replicas.
        limits: LoRA configs are checked against them (the targets: the engine's ``lora_target_modules``).
    """

    def __init__(self, table: SessionTable, runtime: TrainerRuntime, pool: ReplicaPool[Any], registry: Registry,
                 telemetry: Telemetry, checkpoints: Checkpoints, publisher: WeightsPublisher, *,
                 limits: validation.Limits) -> None:
        self.table = table
        self.runtime = runtime
        self.pool = pool
        self.registry = registry
        self.telemetry = telemetry
        self.checkpoints = checkpoints
        self.publisher = publisher
        self.limits = limits
        self.lora_target_modules: tuple[str, ...] = tuple(runtime.lora_target_modules)

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
                lora = self.runtime.spec_from_meta(meta)
            else:
                self.checkpoints.check_fits(meta, lora, checkpoint_uri)
        lora = lora or LoraConfig()
        validation.validate_lora(
            lora.rank, lora.alpha, lora.dropout, lora.target_modules, self.lora_target_modules, self.limits
        )
        session_id = f"s-{uuid.uuid4().hex[:12]}"
        # Reserve the slot before the slow adapter creation.
        placeholder = SessionRecord(session_id, name, lora, self.runtime.new_queue(session_id, owner), 0, owner=owner)
        self.table.reserve(placeholder)
        created = False

        def create() -> tuple[int, Any]:   # on the runtime's thread, in the scheduler's order
            nonlocal created
            n = self.runtime.create_adapter(session_id, lora)
            created = True
            tensors = None
            if ckpt is not None:
                placeholder.step = self.checkpoints.load_into(session_id, ckpt, with_optimizer)
                tensors = self.publisher.loaded_snapshot(placeholder)
            return n, tensors

        try:
            n_params, tensors = self.runtime.call(create, session_id=session_id, tenant=owner, kind="create_session")
            placeholder.num_trainable_params = int(n_params)
            if ckpt is not None:
                self.publisher.publish_loaded(placeholder, placeholder.step, tensors)
        except Exception as err:
            self.table.remove(session_id)
            if created:
                self.runtime.drop_adapter(session_id)
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
                                         base_model=str(self.runtime.model_id),
                                         lora=dataclasses.asdict(s.lora), status=s.state, step=s.step,
                                         created_at=s.created_at, display_name=s.name)
        except Exception:
            log.exception("could not register session %s in the model registry", s.session_id)

    def stop_session(self, session_id: str, owner: str = "", *, state: str = STOPPED) -> SessionRecord:
        """Cancel queued operations, drop the adapter everywhere, free the slot."""
        s = self.table.get_session(session_id, owner)
        if s.state != ACTIVE:
            return s
        s.state = state
        s.queue.cancel_all(f"session {session_id} was {state.lower()}")
        self.runtime.drop_adapter(session_id)   # on the runtime's thread: after a running operation
        self.pool.drop_all(session_id)
        try:
            self.registry.update_session(session_id, status=state, step=s.step, stopped=True)
        except Exception:
            log.exception("could not record the stop of session %s in the model registry", session_id)
        self.telemetry.session_event(state.lower(), s)
        return s

    def check_sample_session(self, session_id: str, owner: str = "") -> Serving:
        """The replica key and version a sample for this session is served with now (`SessionRecord.serving`);
        no session: ("", -1), the base model. Raises as `active_session`."""
        if not session_id:
            return Serving("", -1)
        return self.table.active_session(session_id, owner).serving()
