"""What the OpenAI endpoints serve: model ids -> replica adapter keys.

`ResourceCatalog` serves a running resource's base model, the caller's
inference checkpoints (``save_weights`` PEFT adapters, loaded on the replicas
under ``ckpt:<uri>`` on first use) and the caller's training sessions (by
session id: the weights the session's last ``weights_sync`` published);
`FixedCatalog` serves a fixed set (``together-train deploy``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Protocol, Sequence

from together_train_server.service.errors import ServiceError, invalid

if TYPE_CHECKING:
    from together_train_server.service.core.session_record import Serving
    from together_train_server.service.checkpoints.store import Checkpoint
    from together_train_server.service.core.runtime import TrainerRuntime

@dataclass(frozen=True)
class ModelEntry:
    """One servable model.

    Attributes:
        id: the name to pass as ``model`` (the base model's id, or a checkpoint URI).
        created: unix seconds (the checkpoint's write time; the server's start for the base).
        parent: the base model id for a checkpoint, None for the base.
    """

    id: str
    created: int
    parent: str | None = None


class ModelCatalog(Protocol):
    """What `InferenceService` serves: ids -> replica adapter keys."""

    base_id: str

    def list(self, owner: str) -> list[ModelEntry]:
        """Servable models visible to `owner`, the base model first."""
        ...

    def adapter_key(self, model: str, owner: str) -> str:
        """The replica adapter key serving `model` ("" = base), loading it on the replicas if needed.

        Raises:
            ServiceError: NOT_FOUND (key "model") for an unknown model; INVALID_ARGUMENT for one
                that cannot be served here (the message says what to do instead).
        """
        ...

    def is_session(self, model: str, owner: str) -> bool:
        """Whether `model` is a training session id (served at its last published version)."""
        ...


class CatalogCheckpoints(Protocol):
    """What `ResourceCatalog` reads of the resource's checkpoints (`checkpoints.ops.Checkpoints`)."""

    def list_checkpoints(self, session_id: str = "", owner: str = "") -> list[Checkpoint]: ...

    def get_checkpoint(self, uri: str, owner: str = "", *, verify: bool = False) -> Checkpoint: ...

    def checkpoint_scoring_key(self, uri: str, owner: str = "") -> tuple[str, int]: ...


class CatalogSessions(Protocol):
    """What `ResourceCatalog` reads of the resource's session lifecycle (`sessions.manager.SessionLifecycle`)."""

    def check_sample_session(self, session_id: str, owner: str = "") -> Serving: ...


class CatalogSessionTable(Protocol):
    """What `ResourceCatalog` reads of the resource's live sessions (`sessions.table.SessionTable`)."""

    def get_session(self, session_id: str, owner: str = "") -> object: ...


class CatalogSource(Protocol):
    """What `ResourceCatalog` reads of a `Resource` (a protocol: the resource imports this room)."""

    @property
    def runtime(self) -> TrainerRuntime: ...

    @property
    def checkpoints(self) -> CatalogCheckpoints: ...

    @property
    def sessions(self) -> CatalogSessions: ...

    @property
    def session_table(self) -> CatalogSessionTable: ...


class ResourceCatalog:
    """The models of a running resource: its base model and the caller's inference checkpoints.

    Args:
        resource: the `Resource` (its runtime's ``model_id`` / ``model_dir``, its checkpoint store).
    """

    def __init__(self, resource: CatalogSource) -> None:
        self.resource = resource
        self.base_id = str(resource.runtime.model_id)
        model_dir = resource.runtime.model_dir
        # The model directory (what tinker/together clients name) is an alias of the base id.
        self.aliases = {self.base_id, "base"} | ({str(model_dir)} if model_dir else set())
        self.started = int(time.time())

    def list(self, owner: str) -> list[ModelEntry]:
        out = [ModelEntry(self.base_id, self.started)]
        ckpts = [c for c in self.resource.checkpoints.list_checkpoints(owner=owner) if c.kind == "weights" and not c.merged]
        for c in sorted(ckpts, key=lambda c: c.created_at, reverse=True):  # newest first
            out.append(ModelEntry(c.uri, int(c.created_at), self.base_id))
        return out

    def adapter_key(self, model: str, owner: str) -> str:
        if model in self.aliases:
            return ""
        if self.is_session(model, owner):
            # What the session's last push published; the base while it has only its fresh adapter (B = 0).
            return self.resource.sessions.check_sample_session(model, owner).key
        if not model.startswith("together-train://"):
            raise ServiceError("NOT_FOUND", f"model {model!r} does not exist: this server serves {self.base_id!r}, "
                               "its inference checkpoints (together-train://<session>/weights/<name>, "
                               "see GET /v1/models) and your training sessions by id", key="model")
        try:
            ckpt = self.resource.checkpoints.get_checkpoint(model, owner)
        except ServiceError as e:
            if e.code == "INVALID_ARGUMENT":
                raise invalid(f"model {model!r}: {e.message}", key="model") from None
            raise ServiceError("NOT_FOUND", f"model {model!r} does not exist (no such checkpoint; see GET /v1/models)",
                               key="model") from None
        if ckpt.kind != "weights":
            raise invalid(f"model {model!r} is a training checkpoint (save_state); serve an inference checkpoint "
                          "from save_weights", key="model")
        if ckpt.merged:
            raise invalid(f"model {model!r} is a merged model: serve it on its own with "
                          f"`together-train deploy {model}` (or vllm serve its directory)", key="model")
        key, _step = self.resource.checkpoints.checkpoint_scoring_key(model, owner)
        return key

    def is_session(self, model: str, owner: str) -> bool:
        """Whether `model` names one of `owner`'s training sessions (their versions start at 0, not -1)."""
        if model.startswith("together-train://") or model in self.aliases:
            return False
        try:
            self.resource.session_table.get_session(model, owner)
        except ServiceError:
            return False
        return True


class FixedCatalog:
    """A fixed set of models (``together-train deploy``): the base and adapters pushed at startup.

    Args:
        base_id: the base model's id.
        adapters: served name -> replica adapter key (already on the replicas).
        aliases: more names of the base model.
        names_only: serve only `adapters` (the base is not listed or served) when True.
    """

    def __init__(self, base_id: str, adapters: Mapping[str, str], aliases: Sequence[str] = (),
                 names_only: bool = False) -> None:
        self.base_id = base_id
        self.adapters = dict(adapters)
        self.aliases = set() if names_only else {base_id, *aliases}
        self.started = int(time.time())

    def is_session(self, model: str, owner: str) -> bool:
        return False

    def list(self, owner: str) -> list[ModelEntry]:
        base = [] if not self.aliases else [ModelEntry(self.base_id, self.started)]
        return base + [ModelEntry(n, self.started, self.base_id) for n in self.adapters]

    def adapter_key(self, model: str, owner: str) -> str:
        if model in self.adapters:
            return self.adapters[model]
        if model in self.aliases:
            return ""
        served = sorted(self.adapters) + sorted(self.aliases)
        raise ServiceError("NOT_FOUND", f"model {model!r} does not exist: this server serves {served}", key="model")
