"""Tinker ids <-> ours: client sessions, training-model ids, sampling sessions and tinker:// checkpoint paths.

The only state of the Tinker API: `TinkerIds`, attached to the app by `install`.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from together_train_server.service.errors import ServiceError, invalid

if TYPE_CHECKING:
    from together_train_server.service.interfaces import ResourceApi


@dataclass
class ClientSession:
    """A tinker client session: the training models (our session ids) created in it."""

    session_id: str
    owner: str
    models: dict[str, str] = field(default_factory=dict)  # tinker model id -> our session id
    finished: bool = False
    last_heartbeat: float = field(default_factory=time.time)
    created_at: float = field(default_factory=time.time)
    user_metadata: dict[str, Any] | None = None  # as sent to create_session (RestClient.get_session)
    display_name: str | None = None


class TinkerIds:
    """Tinker client sessions and model ids <-> our session ids (the only state of this API)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sessions: dict[str, ClientSession] = {}
        self.models: dict[str, tuple[str, str]] = {}  # model id -> (client session id, our session id)
        self.samplers: dict[str, Sampler] = {}
        # Fields a tinker result needs that our operation's result lacks (by operation id).
        self.op_extra: dict[str, dict[str, Any]] = {}

    def new_session(self, owner: str) -> ClientSession:
        cs = ClientSession(f"ts-{uuid.uuid4().hex[:16]}", owner)
        with self._lock:
            self.sessions[cs.session_id] = cs
        return cs

    def session(self, session_id: str, owner: str) -> ClientSession:
        """Raises ServiceError NOT_FOUND for an unknown id (or another key's)."""
        with self._lock:
            cs = self.sessions.get(session_id)
        if cs is None or cs.owner != owner:
            raise ServiceError("NOT_FOUND", f"unknown session {session_id!r}; create one with create_session",
                               key="session_id")
        return cs

    def live_session(self, session_id: str, owner: str) -> ClientSession:
        cs = self.session(session_id, owner)
        if cs.finished:
            raise ServiceError("FAILED_PRECONDITION", f"session {session_id} has finished", key="session_id")
        return cs

    def add_model(self, cs: ClientSession, model_id: str, ours: str) -> None:
        with self._lock:
            cs.models[model_id] = ours
            self.models[model_id] = (cs.session_id, ours)

    def ours(self, model_id: str, owner: str) -> str:
        """Our session id for a tinker model id. Raises ServiceError NOT_FOUND."""
        with self._lock:
            hit = self.models.get(model_id)
            cs = self.sessions.get(hit[0]) if hit else None
        if hit is None or cs is None or cs.owner != owner:
            raise ServiceError("NOT_FOUND", f"unknown model_id {model_id!r}", key="model_id")
        return hit[1]

    def usable(self, resource: ResourceApi, model_id: str, owner: str) -> str:
        """`ours` for a model the caller may train now: ACTIVE, else FAILED_PRECONDITION (checked before
        any payload, so the answer about a model never depends on the body). Raises ServiceError."""
        ours = self.ours(model_id, owner)
        resource.session_table.active_session(ours, owner)
        return ours

    def add_sampler(self, sampler: Sampler) -> None:
        with self._lock:
            self.samplers[sampler.sampler_id] = sampler
            if sampler.source_op:
                self.op_extra[sampler.source_op] = {"type": "save_weights_for_sampler",
                                                    "sampling_session_id": sampler.sampler_id}

    def sampler(self, sampler_id: str, owner: str) -> Sampler:
        """Raises ServiceError NOT_FOUND for an unknown id (or another key's)."""
        with self._lock:
            s = self.samplers.get(sampler_id)
        if s is None or s.owner != owner:
            raise ServiceError("NOT_FOUND", f"unknown sampling_session_id {sampler_id!r}", key="sampling_session_id")
        return s


def install(app: FastAPI, resource: ResourceApi) -> None:
    """Attach this API's id tables to the app, and release client sessions whose heartbeats stop
    (service/sessions/heartbeats.py; ``resource.client_heartbeat_timeout_s``, set by ``serve``)."""
    from together_train_server.service.interfaces import HeartbeatWatch

    ids = app.state.tinker = TinkerIds()
    timeout = resource.client_heartbeat_timeout_s
    if timeout > 0:
        app.state.tinker_heartbeats = HeartbeatWatch(lambda: list(ids.sessions.values()),
                                                     lambda cs: finish(resource, ids, cs), timeout)


def finish(resource: ResourceApi, ids: TinkerIds, cs: ClientSession) -> None:
    """End a client session: its training models are stopped (their checkpoints stay), its snapshots dropped."""
    cs.finished = True
    for ours in list(cs.models.values()):
        try:
            resource.sessions.stop_session(ours, cs.owner)
        except ServiceError:
            pass
        resource.snapshots.release_session(ours)


# tinker://<our session>/weights/<name>          = together-train://<our session>/state/<name>   (save_state)
# tinker://<our session>/sampler_weights/<name>  = together-train://<our session>/weights/<name> (save_weights)
_TO_OURS = {"weights": "state", "sampler_weights": "weights"}

_TO_TINKER = {v: k for k, v in _TO_OURS.items()}


def to_tinker_path(uri: str) -> str:
    """Our checkpoint URI -> the tinker:// path naming it."""
    rest = uri.split("://", 1)[1]
    session, kind, name = rest.split("/", 2)
    return f"tinker://{session}/{_TO_TINKER[kind]}/{name}"


def to_our_uri(path: str, key: str = "path") -> str:
    """A tinker:// path (or one of our URIs) -> our checkpoint URI. INVALID_ARGUMENT naming `key` otherwise."""
    if path.startswith("together-train://"):
        return path
    parts = path[len("tinker://"):].split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in _TO_OURS or not parts[0] or not parts[2]:
        raise invalid(f"{key} {path!r} is not a checkpoint path: expected tinker://<run>/weights/<name> or "
                      "tinker://<run>/sampler_weights/<name>", key=key)
    return f"together-train://{parts[0]}/{_TO_OURS[parts[1]]}/{parts[2]}"


@dataclass
class Sampler:
    """A tinker sampling session: which weights it samples from.

    Exactly one source: `source_op` (a snapshot / inflight save of session
    `session_id`, resolved once that operation succeeds), `checkpoint_uri`
    (a saved adapter) or neither (the base model).
    """

    sampler_id: str
    owner: str
    source_op: str = ""
    session_id: str = ""
    inflight: bool = False
    checkpoint_uri: str = ""
    model_path: str | None = None
    # seq_id -> (body hash, operation id, num_samples) of recent asample requests (re-sends find them)
    seqs: dict[int, tuple[str, str, int]] = field(default_factory=dict)


def _run_id(ids: TinkerIds, run_id: str, owner: str) -> str:
    """A training run id is our session id (the first part of its tinker:// paths); a tinker model id works too."""
    return ids.ours(run_id, owner) if ":train:" in run_id else run_id
