from together_train._proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StopReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STOP_REASON_UNSPECIFIED: _ClassVar[StopReason]
    STOP: _ClassVar[StopReason]
    LENGTH: _ClassVar[StopReason]

class LogprobSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOGPROB_SOURCE_UNSPECIFIED: _ClassVar[LogprobSource]
    BASE: _ClassVar[LogprobSource]
    SESSION: _ClassVar[LogprobSource]
    CHECKPOINT: _ClassVar[LogprobSource]
    SNAPSHOT: _ClassVar[LogprobSource]
STOP_REASON_UNSPECIFIED: StopReason
STOP: StopReason
LENGTH: StopReason
LOGPROB_SOURCE_UNSPECIFIED: LogprobSource
BASE: LogprobSource
SESSION: LogprobSource
CHECKPOINT: LogprobSource
SNAPSHOT: LogprobSource

class SampleRequest(_message.Message):
    __slots__ = ("session_id", "prompt", "params", "num_samples", "prompt_logprobs", "top_k_prompt_logprobs", "checkpoint_uri", "snapshot_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_URI_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    num_samples: int
    prompt_logprobs: bool
    top_k_prompt_logprobs: int
    checkpoint_uri: str
    snapshot_id: str
    def __init__(self, session_id: _Optional[str] = ..., prompt: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., num_samples: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., top_k_prompt_logprobs: _Optional[int] = ..., checkpoint_uri: _Optional[str] = ..., snapshot_id: _Optional[str] = ...) -> None: ...

class VersionSpan(_message.Message):
    __slots__ = ("start", "end", "policy_version")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    policy_version: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ..., policy_version: _Optional[int] = ...) -> None: ...

class SampledSequence(_message.Message):
    __slots__ = ("tokens", "logprobs", "stop_reason", "version_spans", "untempered_logprobs", "top_logprobs")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    VERSION_SPANS_FIELD_NUMBER: _ClassVar[int]
    UNTEMPERED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    stop_reason: StopReason
    version_spans: _containers.RepeatedCompositeFieldContainer[VersionSpan]
    untempered_logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopKLogprobs]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., stop_reason: _Optional[_Union[StopReason, str]] = ..., version_spans: _Optional[_Iterable[_Union[VersionSpan, _Mapping]]] = ..., untempered_logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopKLogprobs, _Mapping]]] = ...) -> None: ...

class TopKLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SampleResponse(_message.Message):
    __slots__ = ("sequences", "prompt_logprobs", "top_k_prompt_logprobs", "policy_version", "replica_id", "prompt_cache_hit_tokens")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SampledSequence]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_k_prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TopKLogprobs]
    policy_version: int
    replica_id: str
    prompt_cache_hit_tokens: int
    def __init__(self, sequences: _Optional[_Iterable[_Union[SampledSequence, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., top_k_prompt_logprobs: _Optional[_Iterable[_Union[TopKLogprobs, _Mapping]]] = ..., policy_version: _Optional[int] = ..., replica_id: _Optional[str] = ..., prompt_cache_hit_tokens: _Optional[int] = ...) -> None: ...

class SampleTokens(_message.Message):
    __slots__ = ("sequence", "token_ids", "sampled_at")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_AT_FIELD_NUMBER: _ClassVar[int]
    sequence: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampled_at: float
    def __init__(self, sequence: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampled_at: _Optional[float] = ...) -> None: ...

class SampleStreamChunk(_message.Message):
    __slots__ = ("tokens", "done")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    tokens: SampleTokens
    done: SampleResponse
    def __init__(self, tokens: _Optional[_Union[SampleTokens, _Mapping]] = ..., done: _Optional[_Union[SampleResponse, _Mapping]] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class ComputeLogprobsRequest(_message.Message):
    __slots__ = ("session_id", "sequences", "source", "checkpoint_uri", "snapshot_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_URI_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    sequences: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    source: LogprobSource
    checkpoint_uri: str
    snapshot_id: str
    def __init__(self, session_id: _Optional[str] = ..., sequences: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ..., source: _Optional[_Union[LogprobSource, str]] = ..., checkpoint_uri: _Optional[str] = ..., snapshot_id: _Optional[str] = ...) -> None: ...

class LogprobSequence(_message.Message):
    __slots__ = ("logprobs",)
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ComputeLogprobsResponse(_message.Message):
    __slots__ = ("sequences", "policy_version", "replica_id")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[LogprobSequence]
    policy_version: int
    replica_id: str
    def __init__(self, sequences: _Optional[_Iterable[_Union[LogprobSequence, _Mapping]]] = ..., policy_version: _Optional[int] = ..., replica_id: _Optional[str] = ...) -> None: ...

class TensorMeta(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: _common_pb2.DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class PushWeightsHeader(_message.Message):
    __slots__ = ("session_id", "policy_version", "lora", "tensors", "segment")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    policy_version: int
    lora: _common_pb2.LoraConfig
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    segment: SharedSegment
    def __init__(self, session_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., lora: _Optional[_Union[_common_pb2.LoraConfig, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., segment: _Optional[_Union[SharedSegment, _Mapping]] = ...) -> None: ...

class SharedSegment(_message.Message):
    __slots__ = ("name", "size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class PushWeightsChunk(_message.Message):
    __slots__ = ("header", "data", "trailer_sha256", "trailer_xxh3_128")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TRAILER_SHA256_FIELD_NUMBER: _ClassVar[int]
    TRAILER_XXH3_128_FIELD_NUMBER: _ClassVar[int]
    header: PushWeightsHeader
    data: bytes
    trailer_sha256: str
    trailer_xxh3_128: str
    def __init__(self, header: _Optional[_Union[PushWeightsHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., trailer_sha256: _Optional[str] = ..., trailer_xxh3_128: _Optional[str] = ...) -> None: ...

class PushWeightsResponse(_message.Message):
    __slots__ = ("session_id", "policy_version", "num_bytes", "replica_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    policy_version: int
    num_bytes: int
    replica_id: str
    def __init__(self, session_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., num_bytes: _Optional[int] = ..., replica_id: _Optional[str] = ...) -> None: ...

class DropWeightsRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DropWeightsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("replica_id", "ready", "outstanding_requests", "loaded_versions", "engine", "replicas", "weights_dtype", "shared_memory", "sampled_tokens")
    class LoadedVersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    LOADED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    ready: bool
    outstanding_requests: int
    loaded_versions: _containers.ScalarMap[str, int]
    engine: str
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    weights_dtype: str
    shared_memory: bool
    sampled_tokens: int
    def __init__(self, replica_id: _Optional[str] = ..., ready: _Optional[bool] = ..., outstanding_requests: _Optional[int] = ..., loaded_versions: _Optional[_Mapping[str, int]] = ..., engine: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., weights_dtype: _Optional[str] = ..., shared_memory: _Optional[bool] = ..., sampled_tokens: _Optional[int] = ...) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("replica_id", "address", "state", "loaded_versions", "outstanding_requests", "restarts")
    class LoadedVersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LOADED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    state: str
    loaded_versions: _containers.ScalarMap[str, int]
    outstanding_requests: int
    restarts: int
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., state: _Optional[str] = ..., loaded_versions: _Optional[_Mapping[str, int]] = ..., outstanding_requests: _Optional[int] = ..., restarts: _Optional[int] = ...) -> None: ...
