"""The `Resource` attributes `SamplingOpsMixin` (service/sampling/ops.py) reads, declared for it.

`Resource` (service/resource.py) is composed of objects built with their dependencies; the sampling
entry points are still a mixin on it until they become an object of their own. They read only these
public attributes, which `Resource.__init__` sets. This module goes with the mixin.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from together_train_server.engines.interfaces import TrainerEngine
    from together_train_server.service import validation
    from together_train_server.service.replicas.pool import ReplicaPool
    from together_train_server.service.telemetry import Telemetry
    from together_train_server.service.training.memory_admission import MemoryAdmission
    from together_train_server.service.training.submissions import Submissions
    from together_train_server.service.weights.publishing import WeightsPublisher


class ResourceState:
    """The public `Resource` attributes the sampling mixin reads (declarations only; see `Resource`)."""

    engine: TrainerEngine
    pool: ReplicaPool[Any]
    limits: validation.Limits
    admission: MemoryAdmission   # per-operation memory budget (memory_admission.py)
    telemetry: Telemetry
    submissions: Submissions     # session-ordered operations (submit_sample)
    publisher: WeightsPublisher  # the per-session publish chain (submit_sample)
