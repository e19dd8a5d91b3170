from together_train._proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SyncMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SYNC_MODE_UNSPECIFIED: _ClassVar[SyncMode]
    SYNCHRONOUS: _ClassVar[SyncMode]
    BACKGROUND: _ClassVar[SyncMode]

class OperationStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OPERATION_STATUS_UNSPECIFIED: _ClassVar[OperationStatus]
    QUEUED: _ClassVar[OperationStatus]
    RUNNING: _ClassVar[OperationStatus]
    SUCCEEDED: _ClassVar[OperationStatus]
    FAILED: _ClassVar[OperationStatus]
    CANCELLED: _ClassVar[OperationStatus]
SYNC_MODE_UNSPECIFIED: SyncMode
SYNCHRONOUS: SyncMode
BACKGROUND: SyncMode
OPERATION_STATUS_UNSPECIFIED: OperationStatus
QUEUED: OperationStatus
RUNNING: OperationStatus
SUCCEEDED: OperationStatus
FAILED: OperationStatus
CANCELLED: OperationStatus

class OperationHeader(_message.Message):
    __slots__ = ("session_id", "seq_id", "idempotency_key")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    seq_id: int
    idempotency_key: str
    def __init__(self, session_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class OutputOptions(_message.Message):
    __slots__ = ("logprobs", "elementwise_loss")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ELEMENTWISE_LOSS_FIELD_NUMBER: _ClassVar[int]
    logprobs: bool
    elementwise_loss: bool
    def __init__(self, logprobs: _Optional[bool] = ..., elementwise_loss: _Optional[bool] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("header", "samples", "loss_fn", "loss_fn_config", "outputs")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_CONFIG_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    header: OperationHeader
    samples: _containers.RepeatedCompositeFieldContainer[_common_pb2.Sample]
    loss_fn: str
    loss_fn_config: _common_pb2.LossConfig
    outputs: OutputOptions
    def __init__(self, header: _Optional[_Union[OperationHeader, _Mapping]] = ..., samples: _Optional[_Iterable[_Union[_common_pb2.Sample, _Mapping]]] = ..., loss_fn: _Optional[str] = ..., loss_fn_config: _Optional[_Union[_common_pb2.LossConfig, _Mapping]] = ..., outputs: _Optional[_Union[OutputOptions, _Mapping]] = ...) -> None: ...

class CustomForwardBackwardRequest(_message.Message):
    __slots__ = ("header", "samples", "gradients", "outputs")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    header: OperationHeader
    samples: _containers.RepeatedCompositeFieldContainer[_common_pb2.Sample]
    gradients: _containers.RepeatedCompositeFieldContainer[_common_pb2.Tensor]
    outputs: OutputOptions
    def __init__(self, header: _Optional[_Union[OperationHeader, _Mapping]] = ..., samples: _Optional[_Iterable[_Union[_common_pb2.Sample, _Mapping]]] = ..., gradients: _Optional[_Iterable[_Union[_common_pb2.Tensor, _Mapping]]] = ..., outputs: _Optional[_Union[OutputOptions, _Mapping]] = ...) -> None: ...

class OptimStepRequest(_message.Message):
    __slots__ = ("header", "adam_params")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    ADAM_PARAMS_FIELD_NUMBER: _ClassVar[int]
    header: OperationHeader
    adam_params: _common_pb2.AdamParams
    def __init__(self, header: _Optional[_Union[OperationHeader, _Mapping]] = ..., adam_params: _Optional[_Union[_common_pb2.AdamParams, _Mapping]] = ...) -> None: ...

class WeightsSyncRequest(_message.Message):
    __slots__ = ("header", "mode")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    header: OperationHeader
    mode: SyncMode
    def __init__(self, header: _Optional[_Union[OperationHeader, _Mapping]] = ..., mode: _Optional[_Union[SyncMode, str]] = ...) -> None: ...

class SaveStateRequest(_message.Message):
    __slots__ = ("header", "name", "user_metadata", "ttl_seconds", "pinned", "keep_last")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    HEADER_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    KEEP_LAST_FIELD_NUMBER: _ClassVar[int]
    header: OperationHeader
    name: str
    user_metadata: _containers.ScalarMap[str, str]
    ttl_seconds: int
    pinned: bool
    keep_last: int
    def __init__(self, header: _Optional[_Union[OperationHeader, _Mapping]] = ..., name: _Optional[str] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., ttl_seconds: _Optional[int] = ..., pinned: _Optional[bool] = ..., keep_last: _Optional[int] = ...) -> None: ...

class LoadStateRequest(_message.Message):
    __slots__ = ("header", "uri", "with_optimizer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    WITH_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    header: OperationHeader
    uri: str
    with_optimizer: bool
    def __init__(self, header: _Optional[_Union[OperationHeader, _Mapping]] = ..., uri: _Optional[str] = ..., with_optimizer: _Optional[bool] = ...) -> None: ...

class SaveWeightsRequest(_message.Message):
    __slots__ = ("header", "name", "merged", "user_metadata", "ttl_seconds", "pinned", "keep_last")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    HEADER_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MERGED_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    KEEP_LAST_FIELD_NUMBER: _ClassVar[int]
    header: OperationHeader
    name: str
    merged: bool
    user_metadata: _containers.ScalarMap[str, str]
    ttl_seconds: int
    pinned: bool
    keep_last: int
    def __init__(self, header: _Optional[_Union[OperationHeader, _Mapping]] = ..., name: _Optional[str] = ..., merged: _Optional[bool] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., ttl_seconds: _Optional[int] = ..., pinned: _Optional[bool] = ..., keep_last: _Optional[int] = ...) -> None: ...

class SampleOutput(_message.Message):
    __slots__ = ("logprobs", "elementwise_loss")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ELEMENTWISE_LOSS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _common_pb2.Tensor
    elementwise_loss: _common_pb2.Tensor
    def __init__(self, logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., elementwise_loss: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class ForwardResult(_message.Message):
    __slots__ = ("loss", "outputs", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LOSS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    loss: float
    outputs: _containers.RepeatedCompositeFieldContainer[SampleOutput]
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, loss: _Optional[float] = ..., outputs: _Optional[_Iterable[_Union[SampleOutput, _Mapping]]] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class OptimStepResult(_message.Message):
    __slots__ = ("step", "grad_norm", "learning_rate")
    STEP_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    step: int
    grad_norm: float
    learning_rate: float
    def __init__(self, step: _Optional[int] = ..., grad_norm: _Optional[float] = ..., learning_rate: _Optional[float] = ...) -> None: ...

class WeightsSyncResult(_message.Message):
    __slots__ = ("policy_version", "num_replicas", "num_bytes", "seconds")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    num_replicas: int
    num_bytes: int
    seconds: float
    def __init__(self, policy_version: _Optional[int] = ..., num_replicas: _Optional[int] = ..., num_bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class LoadStateResult(_message.Message):
    __slots__ = ("step", "with_optimizer")
    STEP_FIELD_NUMBER: _ClassVar[int]
    WITH_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    step: int
    with_optimizer: bool
    def __init__(self, step: _Optional[int] = ..., with_optimizer: _Optional[bool] = ...) -> None: ...

class Operation(_message.Message):
    __slots__ = ("operation_id", "session_id", "seq_id", "kind", "status", "forward", "optim_step", "weights_sync", "checkpoint", "load_state", "snapshot", "error", "created_at", "started_at", "finished_at", "queue_position")
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_FIELD_NUMBER: _ClassVar[int]
    OPTIM_STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_SYNC_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    LOAD_STATE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    operation_id: str
    session_id: str
    seq_id: int
    kind: str
    status: OperationStatus
    forward: ForwardResult
    optim_step: OptimStepResult
    weights_sync: WeightsSyncResult
    checkpoint: _common_pb2.CheckpointInfo
    load_state: LoadStateResult
    snapshot: SnapshotResult
    error: _common_pb2.ErrorDetail
    created_at: float
    started_at: float
    finished_at: float
    queue_position: int
    def __init__(self, operation_id: _Optional[str] = ..., session_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., kind: _Optional[str] = ..., status: _Optional[_Union[OperationStatus, str]] = ..., forward: _Optional[_Union[ForwardResult, _Mapping]] = ..., optim_step: _Optional[_Union[OptimStepResult, _Mapping]] = ..., weights_sync: _Optional[_Union[WeightsSyncResult, _Mapping]] = ..., checkpoint: _Optional[_Union[_common_pb2.CheckpointInfo, _Mapping]] = ..., load_state: _Optional[_Union[LoadStateResult, _Mapping]] = ..., snapshot: _Optional[_Union[SnapshotResult, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.ErrorDetail, _Mapping]] = ..., created_at: _Optional[float] = ..., started_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., queue_position: _Optional[int] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("header",)
    HEADER_FIELD_NUMBER: _ClassVar[int]
    header: OperationHeader
    def __init__(self, header: _Optional[_Union[OperationHeader, _Mapping]] = ...) -> None: ...

class SnapshotResult(_message.Message):
    __slots__ = ("snapshot_id", "policy_version")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    policy_version: int
    def __init__(self, snapshot_id: _Optional[str] = ..., policy_version: _Optional[int] = ...) -> None: ...

class ReleaseSnapshotRequest(_message.Message):
    __slots__ = ("snapshot_id",)
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    def __init__(self, snapshot_id: _Optional[str] = ...) -> None: ...

class ReleaseSnapshotResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class GetOperationRequest(_message.Message):
    __slots__ = ("operation_id",)
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    operation_id: str
    def __init__(self, operation_id: _Optional[str] = ...) -> None: ...

class WaitOperationRequest(_message.Message):
    __slots__ = ("operation_id", "timeout_seconds")
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    operation_id: str
    timeout_seconds: float
    def __init__(self, operation_id: _Optional[str] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class CancelOperationRequest(_message.Message):
    __slots__ = ("operation_id",)
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    operation_id: str
    def __init__(self, operation_id: _Optional[str] = ...) -> None: ...
