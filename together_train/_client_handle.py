"""What a `Session`, `CheckpointRegistry`, the keep-alive thread and the tokenizer fetch need of their `ResourceClient`.

`ResourceClient` creates those objects and they call back into it; typing them against this protocol, not
against the class, keeps the imports one-way (resource_client -> session/keepalive/tokenizer -> here).
`ResourceClient` satisfies it structurally; nothing else implements it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Protocol, Sequence, TypeVar

if TYPE_CHECKING:
    from together_train._poller import OperationPoller
    from together_train.futures import CallCanceller, OperationFuture
    from together_train.retry import RetryPolicy
    from together_train.types import (
        Capabilities,
        ComputeLogprobsResult,
        LossSpec,
        SampleResult,
        SamplingParams,
        SessionInfo,
        Usage,
        TokenArray,
    )


T = TypeVar("T")


class KeepAliveRegistry(Protocol):
    """The client's heartbeat thread as a session sees it (`together_train.keepalive.SessionKeepAlive`)."""

    def register(self, session: Any) -> None: ...

    def unregister(self, session: Any) -> None: ...


class ClientHandle(Protocol):
    """The `ResourceClient` members its sessions use: RPC stubs, the retrying unary call, the poller, keep-alive."""

    timeout: float
    retry: RetryPolicy
    storage_dir: Path | None
    _metadata: tuple[tuple[str, str], ...]
    _resource: Any  # resource_pb2_grpc.ResourceServiceStub
    _sessions: Any  # session_pb2_grpc.SessionServiceStub
    _poller: OperationPoller

    @property
    def _keepalive(self) -> KeepAliveRegistry | None: ...

    @property
    def closed(self) -> bool: ...

    def _call(self, method: Any, request: Any, *, what: str, timeout: float | None | Literal["default"] = "default",
              idempotent: bool = True, retry: RetryPolicy | None = None) -> Any: ...

    def _check_open(self) -> None: ...

    def _known_losses(self) -> dict[str, LossSpec] | None: ...

    def _keep_alive_rpc(self, session_id: str, *, timeout: float | Literal["default"] = "default",
                        retry: RetryPolicy | None = None) -> SessionInfo: ...

    def _sample(self, session_id: str, prompt_tokens: TokenArray, sampling_params: SamplingParams, num_samples: int,
                prompt_logprobs: bool, top_k_prompt_logprobs: int, wait_for: OperationFuture | None,
                validate: bool = True, *, checkpoint_uri: str = "",
                snapshot_id: str = "") -> OperationFuture[SampleResult]: ...

    def _compute_logprobs(self, session_id: str, sequences: Sequence[TokenArray], source: str,
                          checkpoint_uri: str | None, wait_for: OperationFuture | None, *, snapshot_id: str = "",
                          ) -> OperationFuture[ComputeLogprobsResult]: ...

    def _submit_call(self, kind: str, fn: Callable[[], T], wait_for: OperationFuture | None = None,
                     canceller: CallCanceller | None = None) -> OperationFuture[T]: ...

    def get_capabilities(self, *, refresh: bool = False) -> Capabilities: ...

    def get_session(self, session_id: str) -> SessionInfo: ...

    def session_usage(self, session_id: str) -> Usage: ...

    def keep_alive(self, session_id: str) -> SessionInfo: ...

    def stop_session(self, session_id: str) -> SessionInfo: ...
