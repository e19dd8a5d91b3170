from together_train._proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SessionState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_STATE_UNSPECIFIED: _ClassVar[SessionState]
    ACTIVE: _ClassVar[SessionState]
    STOPPED: _ClassVar[SessionState]
    EXPIRED: _ClassVar[SessionState]
SESSION_STATE_UNSPECIFIED: SessionState
ACTIVE: SessionState
STOPPED: SessionState
EXPIRED: SessionState

class GetCapabilitiesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InputSpec(_message.Message):
    __slots__ = ("name", "dtype", "required", "description")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    required: bool
    description: str
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., required: _Optional[bool] = ..., description: _Optional[str] = ...) -> None: ...

class ParamSpec(_message.Message):
    __slots__ = ("name", "type", "required", "default", "choices", "description")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    name: str
    type: str
    required: bool
    default: str
    choices: _containers.RepeatedScalarFieldContainer[str]
    description: str
    def __init__(self, name: _Optional[str] = ..., type: _Optional[str] = ..., required: _Optional[bool] = ..., default: _Optional[str] = ..., choices: _Optional[_Iterable[str]] = ..., description: _Optional[str] = ...) -> None: ...

class LossSpec(_message.Message):
    __slots__ = ("name", "inputs", "params", "formula", "available")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    FORMULA_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    inputs: _containers.RepeatedCompositeFieldContainer[InputSpec]
    params: _containers.RepeatedCompositeFieldContainer[ParamSpec]
    formula: str
    available: bool
    def __init__(self, name: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[InputSpec, _Mapping]]] = ..., params: _Optional[_Iterable[_Union[ParamSpec, _Mapping]]] = ..., formula: _Optional[str] = ..., available: _Optional[bool] = ...) -> None: ...

class SamplingLimits(_message.Message):
    __slots__ = ("max_tokens", "max_num_samples", "max_stop_sequences", "max_top_k_prompt_logprobs")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MAX_STOP_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOP_K_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    max_num_samples: int
    max_stop_sequences: int
    max_top_k_prompt_logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., max_num_samples: _Optional[int] = ..., max_stop_sequences: _Optional[int] = ..., max_top_k_prompt_logprobs: _Optional[int] = ...) -> None: ...

class Capabilities(_message.Message):
    __slots__ = ("protocol_version", "model_id", "vocab_size", "max_seq_len", "mode", "operations", "max_lora_rank", "lora_target_modules", "max_sessions", "losses", "sampling", "num_replicas", "max_tokens_per_batch", "max_samples_per_batch", "adam_defaults", "generator_engine", "trainer_backend", "dtype", "tokenizer_sha256", "trainer_capabilities")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    OPERATIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    LORA_TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    LOSSES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_SAMPLES_PER_BATCH_FIELD_NUMBER: _ClassVar[int]
    ADAM_DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_ENGINE_FIELD_NUMBER: _ClassVar[int]
    TRAINER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_SHA256_FIELD_NUMBER: _ClassVar[int]
    TRAINER_CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    protocol_version: str
    model_id: str
    vocab_size: int
    max_seq_len: int
    mode: str
    operations: _containers.RepeatedScalarFieldContainer[str]
    max_lora_rank: int
    lora_target_modules: _containers.RepeatedScalarFieldContainer[str]
    max_sessions: int
    losses: _containers.RepeatedCompositeFieldContainer[LossSpec]
    sampling: SamplingLimits
    num_replicas: int
    max_tokens_per_batch: int
    max_samples_per_batch: int
    adam_defaults: _common_pb2.AdamParams
    generator_engine: str
    trainer_backend: str
    dtype: str
    tokenizer_sha256: str
    trainer_capabilities: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, protocol_version: _Optional[str] = ..., model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_seq_len: _Optional[int] = ..., mode: _Optional[str] = ..., operations: _Optional[_Iterable[str]] = ..., max_lora_rank: _Optional[int] = ..., lora_target_modules: _Optional[_Iterable[str]] = ..., max_sessions: _Optional[int] = ..., losses: _Optional[_Iterable[_Union[LossSpec, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingLimits, _Mapping]] = ..., num_replicas: _Optional[int] = ..., max_tokens_per_batch: _Optional[int] = ..., max_samples_per_batch: _Optional[int] = ..., adam_defaults: _Optional[_Union[_common_pb2.AdamParams, _Mapping]] = ..., generator_engine: _Optional[str] = ..., trainer_backend: _Optional[str] = ..., dtype: _Optional[str] = ..., tokenizer_sha256: _Optional[str] = ..., trainer_capabilities: _Optional[_Iterable[str]] = ...) -> None: ...

class CreateSessionRequest(_message.Message):
    __slots__ = ("lora", "checkpoint_uri", "with_optimizer", "name", "keep_last")
    LORA_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_URI_FIELD_NUMBER: _ClassVar[int]
    WITH_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    KEEP_LAST_FIELD_NUMBER: _ClassVar[int]
    lora: _common_pb2.LoraConfig
    checkpoint_uri: str
    with_optimizer: bool
    name: str
    keep_last: int
    def __init__(self, lora: _Optional[_Union[_common_pb2.LoraConfig, _Mapping]] = ..., checkpoint_uri: _Optional[str] = ..., with_optimizer: _Optional[bool] = ..., name: _Optional[str] = ..., keep_last: _Optional[int] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "name", "lora", "state", "step", "synced_version", "created_at", "last_active_at", "expires_at", "next_seq_id", "num_trainable_params")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SYNCED_VERSION_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_ACTIVE_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TRAINABLE_PARAMS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    name: str
    lora: _common_pb2.LoraConfig
    state: SessionState
    step: int
    synced_version: int
    created_at: float
    last_active_at: float
    expires_at: float
    next_seq_id: int
    num_trainable_params: int
    def __init__(self, session_id: _Optional[str] = ..., name: _Optional[str] = ..., lora: _Optional[_Union[_common_pb2.LoraConfig, _Mapping]] = ..., state: _Optional[_Union[SessionState, str]] = ..., step: _Optional[int] = ..., synced_version: _Optional[int] = ..., created_at: _Optional[float] = ..., last_active_at: _Optional[float] = ..., expires_at: _Optional[float] = ..., next_seq_id: _Optional[int] = ..., num_trainable_params: _Optional[int] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ...) -> None: ...

class StopSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ListCheckpointsRequest(_message.Message):
    __slots__ = ("session_id", "kind", "variant", "base_model", "limit", "cursor")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    VARIANT_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    kind: str
    variant: str
    base_model: str
    limit: int
    cursor: str
    def __init__(self, session_id: _Optional[str] = ..., kind: _Optional[str] = ..., variant: _Optional[str] = ..., base_model: _Optional[str] = ..., limit: _Optional[int] = ..., cursor: _Optional[str] = ...) -> None: ...

class ListCheckpointsResponse(_message.Message):
    __slots__ = ("checkpoints", "next_cursor")
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_CURSOR_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[_common_pb2.CheckpointInfo]
    next_cursor: str
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[_common_pb2.CheckpointInfo, _Mapping]]] = ..., next_cursor: _Optional[str] = ...) -> None: ...

class DeleteCheckpointRequest(_message.Message):
    __slots__ = ("uri",)
    URI_FIELD_NUMBER: _ClassVar[int]
    uri: str
    def __init__(self, uri: _Optional[str] = ...) -> None: ...

class SearchCheckpointsRequest(_message.Message):
    __slots__ = ("user_metadata", "type", "base_model", "session_id", "owner", "limit", "cursor")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    user_metadata: _containers.ScalarMap[str, str]
    type: str
    base_model: str
    session_id: str
    owner: str
    limit: int
    cursor: str
    def __init__(self, user_metadata: _Optional[_Mapping[str, str]] = ..., type: _Optional[str] = ..., base_model: _Optional[str] = ..., session_id: _Optional[str] = ..., owner: _Optional[str] = ..., limit: _Optional[int] = ..., cursor: _Optional[str] = ...) -> None: ...

class SearchCheckpointsResponse(_message.Message):
    __slots__ = ("checkpoints", "next_cursor")
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_CURSOR_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[_common_pb2.CheckpointInfo]
    next_cursor: str
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[_common_pb2.CheckpointInfo, _Mapping]]] = ..., next_cursor: _Optional[str] = ...) -> None: ...

class UpdateCheckpointRequest(_message.Message):
    __slots__ = ("uri", "set_user_metadata", "user_metadata", "set_ttl", "ttl_seconds", "set_pinned", "pinned")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    URI_FIELD_NUMBER: _ClassVar[int]
    SET_USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    SET_TTL_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SET_PINNED_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    uri: str
    set_user_metadata: bool
    user_metadata: _containers.ScalarMap[str, str]
    set_ttl: bool
    ttl_seconds: int
    set_pinned: bool
    pinned: bool
    def __init__(self, uri: _Optional[str] = ..., set_user_metadata: _Optional[bool] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., set_ttl: _Optional[bool] = ..., ttl_seconds: _Optional[int] = ..., set_pinned: _Optional[bool] = ..., pinned: _Optional[bool] = ...) -> None: ...

class ImportAdapterHeader(_message.Message):
    __slots__ = ("name", "type", "user_metadata", "ttl_seconds", "pinned", "upload_id")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    type: str
    user_metadata: _containers.ScalarMap[str, str]
    ttl_seconds: int
    pinned: bool
    upload_id: str
    def __init__(self, name: _Optional[str] = ..., type: _Optional[str] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., ttl_seconds: _Optional[int] = ..., pinned: _Optional[bool] = ..., upload_id: _Optional[str] = ...) -> None: ...

class GetImportProgressRequest(_message.Message):
    __slots__ = ("upload_id",)
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    upload_id: str
    def __init__(self, upload_id: _Optional[str] = ...) -> None: ...

class ImportProgress(_message.Message):
    __slots__ = ("received",)
    class ReceivedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    received: _containers.ScalarMap[str, int]
    def __init__(self, received: _Optional[_Mapping[str, int]] = ...) -> None: ...

class ImportAdapterChunk(_message.Message):
    __slots__ = ("header", "relative_path", "offset", "data", "file_size", "sha256")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    RELATIVE_PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    FILE_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    header: ImportAdapterHeader
    relative_path: str
    offset: int
    data: bytes
    file_size: int
    sha256: str
    def __init__(self, header: _Optional[_Union[ImportAdapterHeader, _Mapping]] = ..., relative_path: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., file_size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class GetStorageUsageRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StorageUsage(_message.Message):
    __slots__ = ("owner", "bytes")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    owner: str
    bytes: int
    def __init__(self, owner: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class GetStorageUsageResponse(_message.Message):
    __slots__ = ("usage",)
    USAGE_FIELD_NUMBER: _ClassVar[int]
    usage: _containers.RepeatedCompositeFieldContainer[StorageUsage]
    def __init__(self, usage: _Optional[_Iterable[_Union[StorageUsage, _Mapping]]] = ...) -> None: ...

class DeleteCheckpointResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DownloadCheckpointRequest(_message.Message):
    __slots__ = ("uri",)
    URI_FIELD_NUMBER: _ClassVar[int]
    uri: str
    def __init__(self, uri: _Optional[str] = ...) -> None: ...

class CheckpointChunk(_message.Message):
    __slots__ = ("relative_path", "offset", "data", "file_size", "sha256")
    RELATIVE_PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    FILE_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    relative_path: str
    offset: int
    data: bytes
    file_size: int
    sha256: str
    def __init__(self, relative_path: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., file_size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class GetTokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerFile(_message.Message):
    __slots__ = ("name", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    data: bytes
    def __init__(self, name: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class GetTokenizerResponse(_message.Message):
    __slots__ = ("model_id", "sha256", "files")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    sha256: str
    files: _containers.RepeatedCompositeFieldContainer[TokenizerFile]
    def __init__(self, model_id: _Optional[str] = ..., sha256: _Optional[str] = ..., files: _Optional[_Iterable[_Union[TokenizerFile, _Mapping]]] = ...) -> None: ...

class GetRolloutRequest(_message.Message):
    __slots__ = ("rollout_id",)
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    def __init__(self, rollout_id: _Optional[str] = ...) -> None: ...

class DeleteRolloutRequest(_message.Message):
    __slots__ = ("rollout_id",)
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    def __init__(self, rollout_id: _Optional[str] = ...) -> None: ...

class DeleteRolloutResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RolloutChoice(_message.Message):
    __slots__ = ("tokens", "logprobs", "policy_versions", "finish_reason", "text")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    policy_versions: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    text: str
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., policy_versions: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class RolloutCall(_message.Message):
    __slots__ = ("model", "prompt_tokens", "choices", "messages_json", "created")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_JSON_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    choices: _containers.RepeatedCompositeFieldContainer[RolloutChoice]
    messages_json: str
    created: float
    def __init__(self, model: _Optional[str] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., choices: _Optional[_Iterable[_Union[RolloutChoice, _Mapping]]] = ..., messages_json: _Optional[str] = ..., created: _Optional[float] = ...) -> None: ...

class Rollout(_message.Message):
    __slots__ = ("rollout_id", "calls", "created")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    calls: _containers.RepeatedCompositeFieldContainer[RolloutCall]
    created: float
    def __init__(self, rollout_id: _Optional[str] = ..., calls: _Optional[_Iterable[_Union[RolloutCall, _Mapping]]] = ..., created: _Optional[float] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("key", "session_id", "prefill_tokens", "prefix_cache_tokens", "sampled_tokens", "trained_tokens", "forward_tokens", "optimizer_steps", "trainer_seconds", "sampler_seconds", "checkpoint_bytes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRAINED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEPS_FIELD_NUMBER: _ClassVar[int]
    TRAINER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_BYTES_FIELD_NUMBER: _ClassVar[int]
    key: str
    session_id: str
    prefill_tokens: int
    prefix_cache_tokens: int
    sampled_tokens: int
    trained_tokens: int
    forward_tokens: int
    optimizer_steps: int
    trainer_seconds: float
    sampler_seconds: float
    checkpoint_bytes: int
    def __init__(self, key: _Optional[str] = ..., session_id: _Optional[str] = ..., prefill_tokens: _Optional[int] = ..., prefix_cache_tokens: _Optional[int] = ..., sampled_tokens: _Optional[int] = ..., trained_tokens: _Optional[int] = ..., forward_tokens: _Optional[int] = ..., optimizer_steps: _Optional[int] = ..., trainer_seconds: _Optional[float] = ..., sampler_seconds: _Optional[float] = ..., checkpoint_bytes: _Optional[int] = ...) -> None: ...

class GetUsageRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class GetUsageResponse(_message.Message):
    __slots__ = ("keys", "sessions")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[Usage]
    sessions: _containers.RepeatedCompositeFieldContainer[Usage]
    def __init__(self, keys: _Optional[_Iterable[_Union[Usage, _Mapping]]] = ..., sessions: _Optional[_Iterable[_Union[Usage, _Mapping]]] = ...) -> None: ...
