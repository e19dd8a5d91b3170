"""The wire's face of the service: the one service module the wire (gRPC servicers, HTTP routes) imports.

`ResourceApi` is what a servicer or a route package is handed (`resource.Resource` is the one
implementation, checked by mypy there): one Protocol per part, each listing what the wire calls of
it (`SessionsApi`, `SubmissionsApi`, `CheckpointsApi`, `SnapshotsApi`, `LifecycleApi`, `SamplingApi`,
`ImporterApi`, `CheckpointRowsApi`), the operations composing two parts and what the resource
reports. The plain values those calls take and return (records, rows, sampling requests and
outputs, the chat call) are re-exported here, so the wire names nothing deeper; import-linter holds
it to that (contract ``wire-face`` in pyproject.toml). A new call from the wire is a line in a
Protocol here; mypy then checks the part has it.

`service.errors` (`ServiceError`, `invalid`) is the other service module the wire may import.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Protocol, Sequence

import numpy as np

from together_train_server.engines.types import LoraConfig, SamplingParams
from together_train_server.service.checkpoints.adapter_import import UploadChunk
from together_train_server.service.checkpoints.lifecycle import checkpoint_type
from together_train_server.service.checkpoints.registry import CheckpointRow, SessionRow
from together_train_server.service.checkpoints.store import URI_SCHEME, Checkpoint, owner_tag
from together_train_server.service.core.operations import CANCELLED, FAILED, QUEUED, RUNNING, SUCCEEDED, OperationRecord
from together_train_server.service.core.session_record import Serving, SessionRecord
# The replica process's service (its gRPC servicer's one collaborator): the adapter host.
from together_train_server.service.replica_host.host import ReplicaHost, Resolved
from together_train_server.service.replicas.pool import (
    Deadlines,
    ReplicaError,
    ReplicaLacksWeights,
    ReplicaUnavailable,
)
from together_train_server.service.sampling.cancellation import CallerGone, SampleCancelled
from together_train_server.service.sampling.chat import ChatCall, ChatResult, Chats, ChatStream, ResolvedModel
from together_train_server.service.sampling.chat_tools import ParsedReply
from together_train_server.service.sampling.completions import Choice, Completion, CompletionStream, TokenLogprob
from together_train_server.service.sampling.inference import InferenceService
from together_train_server.service.sampling.inference_params import InferenceParams
from together_train_server.service.sampling.model_catalog import ModelEntry
from together_train_server.service.sampling.replica_sampler import (
    LogprobsOutput,
    SampleOutput,
    SampleRequest,
    TokenBatch,
)
from together_train_server.service.sampling.responses import ResponseStore
from together_train_server.service.sampling.rollouts import RolloutStore
from together_train_server.service.sampling.session_ops import PromptSamples
from together_train_server.service.sampling.snapshots import Snapshot
from together_train_server.service.sessions.heartbeats import HeartbeatWatch
from together_train_server.service.telemetry import log_event
from together_train_server.service.tokenizer_files import TokenizerFiles
from together_train_server.service.usage.meter import UsageTotals
from together_train_server.service.validation import MIN_TEMPERATURE, Limits, check_counts, check_sampling
from together_train_server.service.weights.publishing import WeightsSyncOutcome

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [  # grouped: the faces, then the values they carry
    "CheckpointRowsApi", "CheckpointsApi", "ImporterApi", "LifecycleApi", "ResourceApi", "SamplingApi", "SessionRowsApi",
    "SessionTableApi", "SessionsApi", "SnapshotsApi", "SubmissionsApi",
    "CANCELLED", "FAILED", "MIN_TEMPERATURE", "QUEUED", "RUNNING", "SUCCEEDED", "URI_SCHEME", "CallerGone", "ChatCall",
    "ChatResult", "Chats", "ChatStream", "Checkpoint", "CheckpointRow", "Choice", "Completion", "CompletionStream", "Deadlines",
    "HeartbeatWatch", "InferenceParams", "InferenceService", "Limits", "LogprobsOutput", "ModelEntry",
    "OperationRecord", "ParsedReply", "PromptSamples", "ReplicaError", "ReplicaLacksWeights", "ReplicaUnavailable",
    "ReplicaHost", "Resolved",
    "ResolvedModel", "ResponseStore", "RolloutStore", "SampleCancelled", "SampleOutput", "SampleRequest",
    "SessionRecord", "SessionRow", "Serving", "TokenBatch", "TokenLogprob", "UploadChunk", "WeightsSyncOutcome",
    "check_counts", "check_sampling", "checkpoint_type", "log_event", "owner_tag",
]


class SessionsApi(Protocol):
    """What the wire calls of `sessions.manager.SessionLifecycle`: create, stop, what a sample is served with (its docstrings say more)."""

    def create_session(
        self,
        lora: LoraConfig | None,
        *,
        name: str = "",
        owner: str = "",
        checkpoint_uri: str = "",
        with_optimizer: bool = False,
    ) -> SessionRecord:
        """Create a LoRA session (adapter + AdamW + step counter)."""
        ...

    def stop_session(self, session_id: str, owner: str = "", *, state: str = ...) -> SessionRecord:
        """Cancel queued operations, drop the adapter everywhere, free the slot."""
        ...

    def check_sample_session(self, session_id: str, owner: str = "") -> Serving:
        """The replica key and version a sample for this session is served with now (`SessionRecord.serving`):
        ("", -1) is the base model."""
        ...


class SessionTableApi(Protocol):
    """What the wire calls of `sessions.table.SessionTable`: the live sessions, owner checks, heartbeats (its docstrings say more)."""

    def active_session(self, session_id: str, owner: str = "") -> SessionRecord:
        """The session if ACTIVE, touching both its idle timers (a call that uses it: discard and page-out)."""
        ...

    def get_session(self, session_id: str, owner: str = "") -> SessionRecord:
        """Raises ServiceError NOT_FOUND for an unknown id (or one owned by another key)."""
        ...

    def keep_alive(self, session_id: str, owner: str = "") -> SessionRecord:
        """A heartbeat: the session is not discarded as idle (``last_active_at``), but it is still paged out
        once no operation used it for ``--page-out-idle`` (``last_op_at`` is left as it is)."""
        ...

    def list_sessions(self, owner: str = "") -> list[SessionRecord]:
        """The live sessions `owner` may see."""
        ...

    def list_sessions_all(self) -> list[SessionRecord]:
        """Every live session (every key's)."""
        ...

    def expires_at(self, s: SessionRecord) -> float:
        """When the idle session is discarded (epoch seconds); 0.0 when discarding is off (``idle_timeout_s``
        0)."""
        ...


class SessionRowsApi(Protocol):
    """What the wire calls of `sessions.rows.SessionRows`: the registry's session rows and the replica view (its docstrings say more)."""

    def count_session_rows(self, owner: str = "") -> int:
        """How many sessions of `owner` the model registry holds (every run of this storage)."""
        ...

    def page_session_rows(
        self, owner: str = "", *, status: Iterable[str] = (), limit: int = 0, after: str = "", offset: int = 0
    ) -> tuple[list[SessionRow], str]:
        """`owner`'s sessions from the model registry (earlier runs' too), newest first."""
        ...

    def replica_view(self, owner: str | None) -> list[dict[str, Any]]:
        """The replica pool's `snapshot()`, with adapter versions limited to what `owner` may see."""
        ...

    def session_row(self, session_id: str, owner: str = "") -> SessionRow:
        """The model registry's row of a session this storage ever held (live, or of an earlier run)."""
        ...

    def update_session_info(
        self,
        session_id: str,
        owner: str = "",
        *,
        display_name: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        """Set a session's display name and/or user metadata (replaced as a whole) in the model registry."""
        ...


class SubmissionsApi(Protocol):
    """What the wire calls of `training.submissions.Submissions` (its docstrings say more)."""

    def submit_forward(
        self,
        session_id: str,
        seq_id: int,
        idempotency_key: str,
        *,
        samples: Sequence[tuple[np.ndarray, Mapping[str, np.ndarray]]],
        loss_fn: str,
        loss_params: Mapping[str, Any],
        backward: bool,
        return_logprobs: bool,
        return_elementwise: bool,
        owner: str = "",
    ) -> OperationRecord:
        """Queue `forward` (backward=False) or `forward_backward`; result is a ForwardOutput."""
        ...

    def submit_custom_forward_backward(
        self,
        session_id: str,
        seq_id: int,
        idempotency_key: str,
        *,
        samples: Sequence[tuple[np.ndarray, Mapping[str, np.ndarray]]],
        gradients: Sequence[np.ndarray],
        return_logprobs: bool = True,
        return_elementwise: bool = False,
        owner: str = "",
    ) -> OperationRecord:
        """Queue custom_forward_backward: backpropagate client gradients ``g = dL/dp``."""
        ...

    def submit_optim_step(
        self, session_id: str, seq_id: int, idempotency_key: str, adam: Mapping[str, float | None], owner: str = ""
    ) -> OperationRecord:
        """Queue an AdamW step; result is an OptimOutput (step = new policy version)."""
        ...

    def get_operation(self, operation_id: str, owner: str = "") -> OperationRecord:
        """Raises ServiceError NOT_FOUND for an unknown id, or one of another API key's session."""
        ...

    def wait_operation(
        self, operation_id: str, timeout_s: float, owner: str = "", *, max_wait_s: float = 60.0
    ) -> OperationRecord:
        """The operation once terminal, or as it is after `timeout_s` (0 = 30 s; at most `max_wait_s`, 60 s:
        gRPC's WaitOperation; an in-process caller waiting on an operation it depends on passes more)."""
        ...

    def cancel_operation(self, operation_id: str, owner: str = "") -> OperationRecord:
        """Cancel a queued operation (a running one finishes). Raises as `get_operation`."""
        ...

    def run_detached(self, kind: str, fn: Callable[[], Any], *, session_id: str = "") -> OperationRecord:
        """Run `fn` as an operation outside every session queue (e.g. an HTTP API's create-model or
        sampling)."""
        ...


class CheckpointsApi(Protocol):
    """What the wire calls of `checkpoints.ops.Checkpoints` (its docstrings say more)."""

    def get_checkpoint(self, uri: str, owner: str = "", *, verify: bool = False) -> Checkpoint:
        """A checkpoint visible to `owner` (written with the same API key)."""
        ...

    def list_checkpoints(self, session_id: str = "", owner: str = "") -> list[Checkpoint]:
        """Complete checkpoints of `owner`, oldest first; of one session id when given."""
        ...

    def page_checkpoints(
        self,
        owner: str = "",
        *,
        session_id: str = "",
        kind: str = "",
        variant: str = "",
        base_model: str = "",
        limit: int = 0,
        cursor: str = "",
        after: str = "",
        offset: int = 0,
    ) -> tuple[list[Checkpoint], str]:
        """Checkpoints of `owner` from the model registry, filtered; returns (checkpoints, next cursor or
        "")."""
        ...

    def count_checkpoints(self, owner: str = "") -> int:
        """How many checkpoints of `owner` the model registry holds."""
        ...

    def checkpoint_registered(self, uri: str) -> bool:
        """True when the model registry holds checkpoint `uri` (of any API key)."""
        ...

    def checkpoint_file(self, uri: str, filename: str) -> Path:
        """The path of one file of a checkpoint's manifest (or ``manifest.json``), unverified."""
        ...

    def checkpoint_files(self, uri: str, owner: str = "") -> tuple[Checkpoint, list[tuple[str, Path, int, str]]]:
        """A verified checkpoint and its files for download: (relative path, path, size, sha256)."""
        ...

    def adapter_config(self, uri: str, owner: str = "") -> dict[str, Any]:
        """The PEFT ``adapter_config.json`` of a checkpoint (``r``, ``target_modules``, ``modules_to_save``,
        ...); {} when it has none (a merged model) or it does not read."""
        ...

    def delete_checkpoint(self, uri: str, owner: str = "") -> None:
        """Delete a checkpoint. Raises ServiceError NOT_FOUND when unknown (or another key's)."""
        ...

    def checkpoint_scoring_key(self, uri: str, owner: str = "") -> tuple[str, int]:
        """Make a saved checkpoint's adapter servable for compute_logprobs; returns (replica key, step)."""
        ...

    @staticmethod
    def cursor_key(cursor: str) -> str:
        """The id (checkpoint URI or session id) of the row a listing cursor resumes after."""
        ...


class SnapshotsApi(Protocol):
    """What the wire calls of `sampling.snapshots.SnapshotStore` (its docstrings say more)."""

    def submit_snapshot(self, session_id: str, seq_id: int, idempotency_key: str, owner: str = "") -> OperationRecord:
        """Queue a snapshot of the session's adapter at this point of its operation order."""
        ...

    def get(self, snapshot_id: str, owner: str = "") -> Snapshot:
        """The live snapshot `snapshot_id` of `owner`; NOT_FOUND naming it (and why it is gone) otherwise."""
        ...

    def release(self, snapshot_id: str, owner: str = "") -> bool:
        """Release the snapshot (its adapter leaves the replicas); False when it was already gone."""
        ...

    def check(self, snap: Snapshot) -> None:
        """Mark a snapshot used. Raises ServiceError FAILED_PRECONDITION when it was released."""
        ...

    def release_session(self, session_id: str) -> None:
        """Drop every snapshot taken from `session_id` from the replicas."""
        ...


class LifecycleApi(Protocol):
    """What the wire calls of `checkpoints.lifecycle.CheckpointLifecycle` (its docstrings say more)."""

    def update(
        self,
        uri: str,
        owner: str = "",
        *,
        user_metadata: dict[str, str] | None = None,
        ttl_seconds: int | None | bool = False,
        pinned: bool | None = None,
    ) -> CheckpointRow:
        """Replace a checkpoint's user metadata, set its TTL (from now; None/0: never; False: as is) or pin."""
        ...

    def usage(self, owner: str = "") -> dict[str, int]:
        """Checkpoint bytes per owner tag: the caller's own; every key's for an admin key."""
        ...

    def search(
        self,
        owner: str = "",
        *,
        user_metadata: dict[str, str] | None = None,
        type: str = "",
        base_model: str = "",
        session_id: str = "",
        of_owner: str = "",
        limit: int = 50,
        cursor: str = "",
    ) -> tuple[list[CheckpointRow], str]:
        """Checkpoints matching every filter, newest first: (rows, next cursor or "")."""
        ...

    def set_session_keep_last(self, session_id: str, keep_last: int) -> None:
        """A session's default keep_last (0: keep all). Raises INVALID_ARGUMENT for a negative count."""
        ...


class SamplingApi(Protocol):
    """What the wire calls of `sampling.ops.Sampling` (its docstrings say more)."""

    @property
    def inference(self) -> InferenceService:
        """The OpenAI-style inference service: the base model and the callers' inference checkpoints."""
        ...

    def request(
        self,
        key: str,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        num_samples: int = 1,
        prompt_logprobs: bool = False,
        top_k_prompt_logprobs: int = 0,
        sample_index: int | None = None,
        gone: CallerGone | None = None,
    ) -> SampleRequest:
        """A checked `SampleRequest` (step 1; see `ReplicaSampler.request`)."""
        ...

    def sample(self, request: SampleRequest, *, scope: str = "", record: str | None = None) -> SampleOutput:
        """Sample on the least-loaded replica (step 2; see `ReplicaSampler.sample`)."""
        ...

    def sample_stream(
        self, request: SampleRequest, *, scope: str = "", record: str | None = None
    ) -> Iterator[TokenBatch | SampleOutput]:
        """`sample`, yielding token batches as they are sampled, then the `SampleOutput`."""
        ...

    def score(self, key: str, sequences: Sequence[Sequence[int]], *, scope: str = "") -> LogprobsOutput:
        """Untempered logprobs of `sequences` under adapter `key` (see `ReplicaSampler.score`; `scope`: the
        session metered for it)."""
        ...


class ImporterApi(Protocol):
    """What the wire calls of `checkpoints.adapter_import.AdapterImporter` (its docstrings say more)."""

    def import_stream(
        self,
        chunks: Iterable[UploadChunk],
        *,
        name: str,
        as_type: str,
        owner: str = "",
        options: dict[str, Any] | None = None,
        upload_id: str = "",
    ) -> Checkpoint:
        """Receive the files, check them, store the checkpoint; returns it."""
        ...

    def progress(self, upload_id: str, owner: str = "") -> dict[str, int]:
        """Bytes received so far of each file of the resumable upload `upload_id` ({} when none is kept)."""
        ...


class CheckpointRowsApi(Protocol):
    """What the wire calls of `checkpoints.registry.Registry` (its docstrings say more)."""

    def checkpoint(self, uri: str) -> CheckpointRow | None:
        """The registry's row of checkpoint `uri` (None: unknown)."""
        ...


class ResourceApi(Protocol):
    """The wire's whole view of the service (`resource.Resource` is the one implementation): its parts, each
    through its own face, the operations that compose two parts, and what the resource reports."""

    @property
    def sessions(self) -> SessionsApi: ...

    @property
    def session_table(self) -> SessionTableApi: ...

    @property
    def session_rows(self) -> SessionRowsApi: ...

    @property
    def submissions(self) -> SubmissionsApi: ...

    @property
    def checkpoints(self) -> CheckpointsApi: ...

    @property
    def snapshots(self) -> SnapshotsApi: ...

    @property
    def lifecycle(self) -> LifecycleApi: ...

    @property
    def sampling(self) -> SamplingApi: ...

    @property
    def importer(self) -> ImporterApi: ...

    @property
    def registry(self) -> CheckpointRowsApi: ...

    @property
    def rollouts(self) -> RolloutStore:
        """The calls recorded under ``/v1/rollouts/{id}``."""
        ...

    @property
    def inference(self) -> InferenceService:
        """The OpenAI-style inference service (`SamplingApi.inference`)."""
        ...

    @property
    def limits(self) -> Limits: ...

    @property
    def idle_timeout_s(self) -> float: ...

    @property
    def client_heartbeat_timeout_s(self) -> float: ...

    @property
    def generator_engine(self) -> str: ...

    def submit_save_weights(
        self,
        session_id: str,
        seq_id: int,
        idempotency_key: str,
        name: str,
        merged: bool,
        owner: str = "",
        options: Mapping[str, Any] | None = None,
    ) -> OperationRecord:
        """Queue save_weights: an inference checkpoint (kind "weights"); see `Checkpoints.prepare_save`."""
        ...

    def submit_save_state(
        self,
        session_id: str,
        seq_id: int,
        idempotency_key: str,
        name: str,
        owner: str = "",
        options: Mapping[str, Any] | None = None,
    ) -> OperationRecord:
        """Queue save_state: a training checkpoint (kind "state"); see `Checkpoints.prepare_save`."""
        ...

    def submit_load_state(
        self, session_id: str, seq_id: int, idempotency_key: str, uri: str, with_optimizer: bool, owner: str = ""
    ) -> OperationRecord:
        """Queue load_state / load_state_with_optimizer; result a LoadOutcome (see
        `Checkpoints.prepare_load`)."""
        ...

    def submit_weights_sync(
        self, session_id: str, seq_id: int, idempotency_key: str, background: bool, owner: str = ""
    ) -> OperationRecord:
        """Queue a weights_sync: publish the session's current adapter to every replica; result a
        WeightsSyncOutcome (see `WeightsPublisher.prepare_sync`)."""
        ...

    def submit_sample(
        self,
        session_id: str,
        seq_id: int,
        idempotency_key: str,
        *,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        num_samples: int,
        prompt_logprobs: bool = False,
        top_k_prompt_logprobs: int = 0,
        owner: str = "",
    ) -> OperationRecord:
        """Queue a sample in the session's operation order (the Together API's ``sample``; see
        `session_ops.submit_sample`)."""
        ...

    def usage(self, owner: str = "", session_id: str = "") -> tuple[list[UsageTotals], list[UsageTotals]]:
        """(per-key, per-session) usage `owner` may see: an admin key (``--admin-key-file``) every key's, any
        other key its own (service/usage/access.py; `session_id` narrows to one session)."""
        ...

    def capabilities(self) -> dict[str, Any]:
        """Everything GetCapabilities reports, as plain values."""
        ...

    def tokenizer_files(self) -> TokenizerFiles:
        """The base model's tokenizer files (read once; see service/tokenizer_files.py)."""
        ...

    def base_model_name(self) -> str:
        """The base model as the HTTP APIs name it: its local directory when it has one, else its model id."""
        ...

    def check_base_model(self, base_model: str | None) -> None:
        """Accept a client's base model name when it is the one this resource serves ("" / None: any)."""
        ...

    def trains_lora(self) -> bool:
        """True when sessions train LoRA adapters (False: full weights, ``serve --full-weights``)."""
        ...

    def num_replicas(self) -> int:
        """Generator replicas in the pool (0: a trainer-only resource)."""
        ...

    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The base model's ``transformers`` tokenizer (the trainer engine's)."""
        ...

    def scratch_dir(self, name: str) -> Path:
        """``<storage>/.<name>``: a directory for an API's own files beside the checkpoints (not created
        here)."""
        ...

    def metrics_text(self, visible: Callable[[str], bool] | None, viewer: str | None = None) -> bytes:
        """The Prometheus text exposition; per-session series only of sessions whose owner tag `visible` accepts
        (None: none). See `Telemetry.scrape`. Usage series per key (service/usage/prometheus.py): `viewer` None
        (an anonymous scrape with API keys on) none; an admin key every key's; any other key ("" without keys)
        its own."""
        ...

    def dashboard_state(self, owner: str | None) -> dict[str, Any]:
        """What the web dashboard shows, limited to what `owner` may see (see `telemetry.dashboard_state`)."""
        ...

    def model_architecture(self) -> str | None:
        """The base model's class name (``architectures[0]`` of its config.json); None when unknown."""
        ...

    def max_request_bytes(self) -> int:
        """gRPC's receive limit for this resource: the largest request its limits allow (bytes)."""
        ...
