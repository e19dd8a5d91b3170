"""together-train SDK: typed client of a self-hostable LLM post-training resource.

A training loop in plain Python::

    import together_train as tt

    with tt.launch_local(model=None) as client:          # or tt.ResourceClient("host:port")
        session = client.create_session(lora=tt.LoraConfig(rank=16))
        for batch in batches:                              # batch: list[tt.Sample]
            fb = session.forward_backward(batch, loss_fn="cross_entropy")
            opt = session.optim_step(tt.AdamParams(learning_rate=1e-4))
            print(fb.result().loss, opt.result().step)

Every call that does work returns an `OperationFuture` at once; see
`together_train.resource_client` and `together_train.session` for the wire details and `together_train.errors` for
the exceptions. This package needs only grpcio, protobuf, numpy and tenacity
(no torch).
"""

from __future__ import annotations

__version__ = "0.1.0"

from together_train.resource_client import ResourceClient
from together_train.cluster_client import ClusterClient, ClusterResource
from together_train.session import Session
from together_train.snapshot import Snapshot
from together_train.errors import (
    AlreadyExistsError,
    ClientClosedError,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    OperationCancelledError,
    PermissionDeniedError,
    ResourceExhaustedError,
    TogetherTrainError,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
)
from together_train.futures import OperationFuture
from together_train.launcher import LocalResource, ServerStartError, launch_local
from together_train.retry import RetryPolicy
from together_train.types import (
    MIN_TEMPERATURE,
    AdamParams,
    Capabilities,
    CheckpointInfo,
    ComputeLogprobsResult,
    ForwardResult,
    InputSpec,
    LoadStateResult,
    LoraConfig,
    LossSpec,
    OptimStepResult,
    ParamSpec,
    Rollout,
    RolloutCall,
    RolloutChoice,
    Sample,
    SampledSequence,
    SampleResult,
    SamplingLimits,
    SamplingParams,
    SessionInfo,
    VersionSpan,
    WeightsSyncResult,
)

__all__ = [
    "__version__",
    # clients
    "ResourceClient",
    "ClusterClient",
    "ClusterResource",
    "Session",
    "Snapshot",
    "OperationFuture",
    "launch_local",
    "LocalResource",
    "ServerStartError",
    "RetryPolicy",
    # types
    "Sample",
    "LoraConfig",
    "AdamParams",
    "SamplingParams",
    "MIN_TEMPERATURE",
    "ForwardResult",
    "OptimStepResult",
    "WeightsSyncResult",
    "LoadStateResult",
    "VersionSpan",
    "SampledSequence",
    "SampleResult",
    "ComputeLogprobsResult",
    "CheckpointInfo",
    "SessionInfo",
    "Capabilities",
    "LossSpec",
    "InputSpec",
    "ParamSpec",
    "SamplingLimits",
    "Rollout",
    "RolloutCall",
    "RolloutChoice",
    # errors
    "TogetherTrainError",
    "InvalidArgumentError",
    "NotFoundError",
    "AlreadyExistsError",
    "FailedPreconditionError",
    "ResourceExhaustedError",
    "UnimplementedError",
    "UnavailableError",
    "DeadlineExceededError",
    "OperationCancelledError",
    "PermissionDeniedError",
    "UnauthenticatedError",
    "InternalError",
    "ClientClosedError",
]
