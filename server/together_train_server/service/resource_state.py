"""What the parts of `Resource` share: the attributes `Resource.__init__` sets.

`Resource` (service/resource.py) is composed of mixins, one concept each:
sessions (service/sessions/manager.py), checkpoints (service/checkpoints/ops.py),
training submissions (service/training/submissions.py) and weight publishing
(service/weights/publishing.py). Each mixin reads the state declared here;
only `Resource.__init__` assigns it.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from together_train_server.engines.interfaces import TrainerEngine
    from together_train_server.service import validation
    from together_train_server.service.checkpoints.lifecycle import CheckpointLifecycle
    from together_train_server.service.checkpoints.store import CheckpointStore
    from together_train_server.service.training.operations import OperationBook, TrainerWorker
    from together_train_server.service.training.memory_admission import MemoryAdmission
    from together_train_server.service.checkpoints.registry import Registry
    from together_train_server.service.replicas.pool import ReplicaPool
    from together_train_server.service.sampling.snapshots import SnapshotStore
    from together_train_server.service.sessions.pager import PagingConfig, SessionPager
    from together_train_server.service.sessions.record import SessionRecord
    from together_train_server.service.telemetry import Telemetry
    from together_train_server.service.tenancy.config import TenancyConfig
    from together_train_server.service.tenancy.quotas import Quotas
    from together_train_server.service.usage.meter import UsageMeter


class ResourceState:
    """The attributes the `Resource` mixins share (declarations only; see `Resource`)."""

    engine: TrainerEngine
    pool: ReplicaPool
    registry: Registry
    store: CheckpointStore
    lifecycle: CheckpointLifecycle  # metadata, search, TTL, keep-last-K (checkpoints/lifecycle.py)
    limits: validation.Limits
    admission: MemoryAdmission   # per-operation memory budget (memory_admission.py)
    max_sessions: int
    idle_timeout_s: float
    paging: PagingConfig
    pager: SessionPager | None   # None: every session resident (paging off, or an engine that cannot page)
    lora_target_modules: tuple[str, ...]
    book: OperationBook
    telemetry: Telemetry
    worker: TrainerWorker
    tenancy: TenancyConfig
    quotas: Quotas  # per-API-key limits (service/tenancy/quotas.py)
    usage_meter: UsageMeter  # usage per session and key (service/usage/meter.py)
    admin_keys: frozenset[str]  # keys that see every key's checkpoints and usage
    # The engine is not thread-safe: the worker holds this lock while an operation runs.
    engine_lock: threading.RLock
    _sessions: dict[str, SessionRecord]
    _lock: threading.Lock
    _closed: threading.Event
    _scoring_ckpts: dict[str, tuple[str, int]]
    _scoring_lock: threading.Lock
    _snapshots: SnapshotStore
