"""`ResourceClient` (one model resource) and `Session` (one LoRA adapter on it).

::

    import together_train as tt

    client = tt.ResourceClient("127.0.0.1:50051", api_key=None)
    session = client.create_session(lora=tt.LoraConfig(rank=16))
    fb = session.forward_backward(batch, loss_fn="cross_entropy")   # returns at once
    opt = session.optim_step(tt.AdamParams(learning_rate=1e-4))    # pipelined behind it
    print(fb.result().loss, opt.result().step)

Wire details (what the server can rely on):

- Every RPC carries ``authorization: Bearer <api_key>`` metadata when an API
  key is set (argument or ``TOGETHER_TRAIN_API_KEY``).
- Operation RPCs carry an ``OperationHeader``: the session id, a ``seq_id``
  starting at `SessionInfo.next_seq_id` and increasing by one per operation
  (assigned and sent under a per-session lock, so RPCs reach the server in
  seq order), and a fresh uuid4 hex idempotency key. A retried RPC resends the
  same header.
- When an operation RPC is refused, the client reads ``next_seq_id`` back
  with ``GetSession`` (so it works whether or not the server consumed the
  refused seq_id).
- Errors are read from the ``together_train.v1.ErrorDetail`` packed in the
  ``google.rpc.Status`` details (see `together_train.errors`).
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import logging
import os
import pathlib
import threading
import time
import uuid
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence, TypeVar

import grpc
import numpy as np

from together_train._proto import (
    generator_pb2,
    generator_pb2_grpc,
    resource_pb2,
    resource_pb2_grpc,
    session_pb2,
    session_pb2_grpc,
)
from together_train.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    TogetherTrainError,
)
from together_train.futures import DaemonExecutor, OperationFuture, OperationPoller, resolve_operation
from together_train.keepalive import SessionKeepAlive
from together_train.retry import RetryPolicy
from together_train.tensors import to_tensor
from together_train.types import (
    AdamParams,
    Capabilities,
    CheckpointInfo,
    ComputeLogprobsResult,
    ForwardResult,
    LoadStateResult,
    LoraConfig,
    LossSpec,
    OptimStepResult,
    Sample,
    SampleResult,
    SamplingParams,
    SessionInfo,
    TokenArray,
    WeightsSyncResult,
    _as_token_array,
    loss_config_to_proto,
    validate_samples,
)

__all__ = ["ResourceClient", "Session", "DEFAULT_TIMEOUT_S"]

logger = logging.getLogger("together_train")
T = TypeVar("T")

#: Deadline of control RPCs (session management, operation submission), seconds.
DEFAULT_TIMEOUT_S = 60.0

_SYNC_MODES = {"synchronous": session_pb2.SYNCHRONOUS, "background": session_pb2.BACKGROUND}
_SOURCES = {"base": generator_pb2.BASE, "session": generator_pb2.SESSION, "checkpoint": generator_pb2.CHECKPOINT}


def _convert_forward(op: session_pb2.Operation) -> ForwardResult:
    return ForwardResult.from_proto(op.forward)


_CONVERTERS: dict[str, Callable[[session_pb2.Operation], Any]] = {
    "forward": _convert_forward,
    "forward_backward": _convert_forward,
    "custom_forward_backward": _convert_forward,
    "optim_step": lambda op: OptimStepResult.from_proto(op.optim_step),
    "weights_sync": lambda op: WeightsSyncResult.from_proto(op.weights_sync),
    "save_state": lambda op: CheckpointInfo.from_proto(op.checkpoint),
    "save_weights": lambda op: CheckpointInfo.from_proto(op.checkpoint),
    "load_state": lambda op: LoadStateResult.from_proto(op.load_state),
}


def _convert_any(op: session_pb2.Operation) -> Any:
    """Converter for an operation of unknown kind: by the result field set."""
    which = op.WhichOneof("result")
    if which == "forward":
        return ForwardResult.from_proto(op.forward)
    if which == "optim_step":
        return OptimStepResult.from_proto(op.optim_step)
    if which == "weights_sync":
        return WeightsSyncResult.from_proto(op.weights_sync)
    if which == "checkpoint":
        return CheckpointInfo.from_proto(op.checkpoint)
    if which == "load_state":
        return LoadStateResult.from_proto(op.load_state)
    return None


def _normalize_address(address: str) -> str:
    for prefix in ("grpc://", "http://", "dns:///"):
        if address.startswith(prefix):
            return address[len(prefix):].rstrip("/")
    return address


class ResourceClient:
    """Connection to one model resource (``together-train serve``).

    Args:
        address: ``host:port`` of the resource (a ``grpc://`` prefix is accepted).
        api_key: sent as ``authorization: Bearer <key>``; default: the
            ``TOGETHER_TRAIN_API_KEY`` environment variable, else none.
        timeout: deadline in seconds of each control RPC (session management,
            operation submission). Waiting for an operation is not bounded by it.
        max_message_mb: largest message sent or received, MiB.
        generation_timeout: deadline in seconds of one ``Sample`` /
            ``ComputeLogprobs`` RPC (None = no deadline).
        retry: the `RetryPolicy` around every RPC.
        max_workers: threads running client-side calls (``sample``,
            ``compute_logprobs``): how many can be in flight at once.
        tls: use TLS (with `root_certificates` PEM bytes, or the system roots).
            Any of the three certificate arguments below turns TLS on.
        root_certificates: PEM CA bundle the server's certificate must chain to
            (``serve --tls-cert``); None = the system roots.
        certificate_chain, private_key: PEM client certificate and its key, for a
            server with mutual TLS (``serve --tls-client-ca``); give both.
        long_poll_s: how long each ``WaitOperation`` asks the server to wait.
        keepalive_interval_s: keep this client's live `Session` objects from
            expiring on the server (one daemon thread sends ``KeepAlive``,
            see `together_train.keepalive`): ``"auto"`` (default) every quarter
            of the server's idle timeout (``--idle-timeout``, reported in each
            `SessionInfo`), a number of seconds, or None for no keep-alive.

    Thread-safe. Use as a context manager or call `close`.

    Attributes:
        address: the ``host:port`` connected to.
        local_resource: the `LocalResource` that started the server, when the
            client came from `launch_local` (else None).
    """

    local_resource: Any = None

    def __init__(
        self,
        address: str,
        api_key: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_message_mb: int = 256,
        generation_timeout: float | None = 3600.0,
        retry: RetryPolicy | None = None,
        max_workers: int = 64,
        tls: bool = False,
        root_certificates: bytes | None = None,
        certificate_chain: bytes | None = None,
        private_key: bytes | None = None,
        long_poll_s: float = 20.0,
        keepalive_interval_s: float | None | Literal["auto"] = "auto",
    ) -> None:
        from together_train import __version__

        if keepalive_interval_s is not None and keepalive_interval_s != "auto":
            if isinstance(keepalive_interval_s, bool) or not isinstance(keepalive_interval_s, (int, float)) or not (
                0 < keepalive_interval_s < float("inf")
            ):
                raise InvalidArgumentError(
                    f"keepalive_interval_s must be 'auto', None or a positive number of seconds, "
                    f"got {keepalive_interval_s!r}",
                    key="keepalive_interval_s",
                )
        self.address = _normalize_address(address)
        if api_key is None:
            api_key = os.environ.get("TOGETHER_TRAIN_API_KEY") or None
        self._api_key = api_key
        self.timeout = timeout
        self.generation_timeout = generation_timeout
        self.retry = retry or RetryPolicy()
        nbytes = int(max_message_mb) * 1024 * 1024
        options = [
            ("grpc.max_send_message_length", nbytes),
            ("grpc.max_receive_message_length", nbytes),
            ("grpc.primary_user_agent", f"together-train-python/{__version__}"),
            ("grpc.keepalive_time_ms", 60_000),
            ("grpc.keepalive_timeout_ms", 20_000),
        ]
        if (certificate_chain is None) != (private_key is None):
            raise InvalidArgumentError(
                "certificate_chain and private_key go together (mutual TLS): give both or neither",
                key="certificate_chain" if certificate_chain is None else "private_key",
            )
        if tls or root_certificates is not None or certificate_chain is not None:
            creds = grpc.ssl_channel_credentials(
                root_certificates=root_certificates, private_key=private_key, certificate_chain=certificate_chain
            )
            self._channel = grpc.secure_channel(self.address, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(self.address, options=options)
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {api_key}"),) if api_key else ()
        )
        self._resource = resource_pb2_grpc.ResourceServiceStub(self._channel)
        self._sessions = session_pb2_grpc.SessionServiceStub(self._channel)
        self._generator = generator_pb2_grpc.GeneratorServiceStub(self._channel)
        self._executor = DaemonExecutor(max_workers, "together-train-call")
        self._poll_executor = DaemonExecutor(32, "together-train-poll")
        self._long_poll_s = long_poll_s
        self._poller = OperationPoller(self._wait_op, self._get_op, self.retry, self._poll_executor, long_poll_s)
        self._caps: Capabilities | None = None
        self._caps_unavailable = False
        self._caps_lock = threading.Lock()
        self._closed = False
        self._keepalive = SessionKeepAlive(self, keepalive_interval_s) if keepalive_interval_s is not None else None

    # ------------------------------------------------------------------ plumbing
    def _call(
        self,
        method: Any,
        request: Any,
        *,
        what: str,
        timeout: float | None | Literal["default"] = "default",
        idempotent: bool = True,
        retry: RetryPolicy | None = None,
    ) -> Any:
        """One unary RPC with retries; raises the typed TogetherTrainError."""
        self._check_open()
        deadline = self.timeout if timeout == "default" else timeout
        policy = retry or self.retry
        return policy.call(
            lambda: method(request, timeout=deadline, metadata=self._metadata), idempotent=idempotent, what=what
        )

    def _wait_op(self, operation_id: str, timeout_s: float) -> session_pb2.Operation:
        return self._sessions.WaitOperation(
            session_pb2.WaitOperationRequest(operation_id=operation_id, timeout_seconds=timeout_s),
            timeout=timeout_s + max(10.0, self.timeout),
            metadata=self._metadata,
        )

    def _get_op(self, operation_id: str) -> session_pb2.Operation:
        return self._sessions.GetOperation(
            session_pb2.GetOperationRequest(operation_id=operation_id), timeout=self.timeout, metadata=self._metadata
        )

    def _check_open(self) -> None:
        if self._closed:
            raise FailedPreconditionError("the ResourceClient is closed", key="client")

    def _submit_call(
        self, kind: str, fn: Callable[[], T], wait_for: OperationFuture | None = None
    ) -> OperationFuture[T]:
        """Run a blocking call on the worker threads, after `wait_for` ends."""
        self._check_open()

        def run() -> T:
            if wait_for is not None:
                err = wait_for.exception()
                if err is not None:
                    raise FailedPreconditionError(
                        f"this {kind} waits for weights_sync operation {wait_for.operation_id}, which did not "
                        f"succeed ({err}); submit a new weights_sync (or sample with the base model)",
                        key="weights_sync",
                    ) from err
            return fn()

        return OperationFuture(self._executor.submit(run), kind=kind)

    def _known_losses(self) -> dict[str, LossSpec] | None:
        """The resource's loss specs (fetched once), or None when unavailable."""
        caps = self._caps
        if caps is None:
            if self._caps_unavailable:
                return None
            try:
                caps = self.get_capabilities()
            except TogetherTrainError as err:
                if not err.retryable:  # e.g. UNIMPLEMENTED: do not ask again on every call
                    self._caps_unavailable = True
                return None
        return caps.losses or None

    # ------------------------------------------------------------------ resource calls
    def get_capabilities(self, *, refresh: bool = False) -> Capabilities:
        """What the resource offers (model, limits, losses); cached after the first call.

        Raises:
            TogetherTrainError: e.g. UnavailableError when the resource cannot be reached.
        """
        with self._caps_lock:
            if self._caps is None or refresh:
                msg = self._call(self._resource.GetCapabilities, resource_pb2.GetCapabilitiesRequest(), what="GetCapabilities")
                self._caps = Capabilities.from_proto(msg)
            return self._caps

    @property
    def capabilities(self) -> Capabilities:
        """Same as `get_capabilities()` (cached)."""
        return self.get_capabilities()

    def create_session(
        self,
        lora: LoraConfig | None = None,
        name: str | None = None,
        checkpoint_uri: str | None = None,
        with_optimizer: bool = False,
        *,
        validate: bool = True,
    ) -> "Session":
        """Create a training session: a fresh LoRA adapter with its own AdamW
        optimizer and step counter.

        Args:
            lora: adapter shape; default `LoraConfig()` (rank 16, alpha 32), or
                with `checkpoint_uri` the checkpoint's own config (a given one
                must have the checkpoint's rank, alpha, targets, train_unembed).
            name: free-form label shown in listings.
            checkpoint_uri: start from a training checkpoint (``save_state``),
                also one written before the resource restarted. The session's
                step (= policy version) starts at the checkpoint's step, and
                the replicas serve the loaded weights at once.
            with_optimizer: with `checkpoint_uri`, also restore the AdamW
                moments and the dropout RNG stream (exact resume); without, a
                fresh optimizer.
            validate: check `lora` client-side first (False: leave it to the server).

        Raises:
            ResourceExhaustedError: the resource holds `max_sessions` already.
            InvalidArgumentError: e.g. a rank over the limit, unknown target modules,
                or `with_optimizer` without `checkpoint_uri`.
            NotFoundError: unknown checkpoint.
            FailedPreconditionError: the checkpoint's base model or LoRA shape
                differs (the message names what).
            InternalError: the checkpoint is corrupted (DATA_LOSS).

        Not retried on DEADLINE_EXCEEDED (no idempotency key), only on UNAVAILABLE.
        """
        if validate and with_optimizer and not checkpoint_uri:
            raise InvalidArgumentError(
                "with_optimizer restores a checkpoint's optimizer: it needs checkpoint_uri", key="with_optimizer"
            )
        if lora is None and not checkpoint_uri:
            lora = LoraConfig()
        if validate and lora is not None:
            lora.validate()
        req = resource_pb2.CreateSessionRequest(
            lora=lora.to_proto() if lora is not None else None,
            checkpoint_uri=checkpoint_uri or "",
            with_optimizer=with_optimizer,
            name=name or "",
        )
        info = self._call(self._resource.CreateSession, req, what="CreateSession", idempotent=False)
        return Session(self, SessionInfo.from_proto(info))

    def get_session(self, session_id: str) -> SessionInfo:
        """State of a session. Raises NotFoundError when unknown (or another key's)."""
        msg = self._call(self._resource.GetSession, resource_pb2.GetSessionRequest(session_id=session_id), what="GetSession")
        return SessionInfo.from_proto(msg)

    def list_sessions(self) -> list[SessionInfo]:
        """Sessions visible to this API key."""
        msg = self._call(self._resource.ListSessions, resource_pb2.ListSessionsRequest(), what="ListSessions")
        return [SessionInfo.from_proto(s) for s in msg.sessions]

    def session(self, session_id: str) -> "Session":
        """Attach to an existing session (e.g. after a reconnect); its seq_id
        counter continues from the server's ``next_seq_id``.

        Raises:
            NotFoundError: unknown session.
        """
        return Session(self, self.get_session(session_id))

    def stop_session(self, session_id: str) -> SessionInfo:
        """Stop a session: frees its slot; its queued operations are cancelled."""
        msg = self._call(self._resource.StopSession, resource_pb2.StopSessionRequest(session_id=session_id), what="StopSession")
        return SessionInfo.from_proto(msg)

    def keep_alive(self, session_id: str) -> SessionInfo:
        """Push back a session's idle expiry (done in the background for live
        `Session` objects unless ``keepalive_interval_s=None``)."""
        return self._keep_alive_rpc(session_id)

    def _keep_alive_rpc(
        self, session_id: str, *, timeout: float | Literal["default"] = "default", retry: RetryPolicy | None = None
    ) -> SessionInfo:
        msg = self._call(
            self._resource.KeepAlive,
            resource_pb2.KeepAliveRequest(session_id=session_id),
            what="KeepAlive",
            timeout=timeout,
            retry=retry,
        )
        return SessionInfo.from_proto(msg)

    def list_checkpoints(
        self,
        session_id: str | None = None,
        *,
        kind: str | None = None,
        variant: str | None = None,
        base_model: str | None = None,
    ) -> list[CheckpointInfo]:
        """Complete checkpoints in the resource's model registry, oldest first.

        Args:
            session_id: only this session's (None = every session visible to your key).
            kind: ``"weights"`` (inference) or ``"state"`` (training) only.
            variant: ``"adapter"`` or ``"merged"`` only.
            base_model: only those of this base model id.

        Raises:
            InvalidArgumentError: a malformed filter (the message names it).
        """
        return self.list_checkpoints_page(0, session_id=session_id, kind=kind, variant=variant,
                                          base_model=base_model)[0]

    def list_checkpoints_page(
        self,
        limit: int,
        cursor: str = "",
        *,
        session_id: str | None = None,
        kind: str | None = None,
        variant: str | None = None,
        base_model: str | None = None,
    ) -> tuple[list[CheckpointInfo], str]:
        """One page of checkpoints, newest first: ``(checkpoints, next_cursor)``; pass
        ``next_cursor`` back for the next page ("" = this was the last). Filters as
        `list_checkpoints`; ``limit`` 0 = every match, oldest first."""
        msg = self._call(
            self._resource.ListCheckpoints,
            resource_pb2.ListCheckpointsRequest(session_id=session_id or "", kind=kind or "", variant=variant or "",
                                                base_model=base_model or "", limit=int(limit), cursor=cursor or ""),
            what="ListCheckpoints",
        )
        return [CheckpointInfo.from_proto(c) for c in msg.checkpoints], msg.next_cursor

    def delete_checkpoint(self, uri: str) -> None:
        """Delete a checkpoint. Raises NotFoundError when unknown."""
        self._call(self._resource.DeleteCheckpoint, resource_pb2.DeleteCheckpointRequest(uri=uri), what="DeleteCheckpoint")

    def download_checkpoint(self, uri: str, dest_dir: str | os.PathLike) -> pathlib.Path:
        """Download a checkpoint directory into `dest_dir` (created; files
        overwritten). Each file's size and sha256 are checked when the server
        sends them. Returns `dest_dir` as a Path.

        Raises:
            NotFoundError: unknown checkpoint.
            InternalError: a file's size or checksum does not match, or a path
                in the stream escapes `dest_dir`.
        """
        from together_train.errors import InternalError

        dest = pathlib.Path(dest_dir).resolve()

        def download() -> pathlib.Path:
            dest.mkdir(parents=True, exist_ok=True)
            handles: dict[str, Any] = {}
            expect: dict[str, tuple[int, str]] = {}
            try:
                stream = self._resource.DownloadCheckpoint(
                    resource_pb2.DownloadCheckpointRequest(uri=uri), timeout=None, metadata=self._metadata
                )
                for chunk in stream:
                    rel = chunk.relative_path
                    path = (dest / rel).resolve()
                    if dest != path and dest not in path.parents:
                        raise InternalError(f"checkpoint file {rel!r} escapes {dest}")
                    if rel not in handles:
                        path.parent.mkdir(parents=True, exist_ok=True)
                        handles[rel] = open(path, "wb")
                    f = handles[rel]
                    f.seek(chunk.offset)
                    f.write(chunk.data)
                    if chunk.file_size or chunk.sha256:
                        expect[rel] = (int(chunk.file_size), chunk.sha256 or expect.get(rel, (0, ""))[1])
            finally:
                for f in handles.values():
                    f.close()
            for rel, (size, sha) in expect.items():
                path = dest / rel
                if size and path.stat().st_size != size:
                    raise InternalError(f"{rel}: downloaded {path.stat().st_size} bytes, expected {size}")
                if sha:
                    h = hashlib.sha256()
                    with open(path, "rb") as f:
                        for block in iter(lambda: f.read(1 << 20), b""):
                            h.update(block)
                    if h.hexdigest() != sha:
                        raise InternalError(f"{rel}: sha256 mismatch after download")
            return dest

        self._check_open()
        return self.retry.call(download, what="DownloadCheckpoint")

    # ------------------------------------------------------------------ generator (base model / checkpoints)
    def sample(
        self,
        prompt_tokens: TokenArray,
        sampling_params: SamplingParams,
        num_samples: int = 1,
        *,
        prompt_logprobs: bool = False,
        top_k_prompt_logprobs: int = 0,
        validate: bool = True,
    ) -> OperationFuture[SampleResult]:
        """Sample from the **base model** (no adapter). See `Session.sample`."""
        return self._sample(
            "", prompt_tokens, sampling_params, num_samples, prompt_logprobs, top_k_prompt_logprobs, None, validate
        )

    def compute_logprobs(
        self, sequences: Sequence[TokenArray], *, checkpoint_uri: str | None = None
    ) -> OperationFuture[ComputeLogprobsResult]:
        """Score sequences with the base model, or with a saved checkpoint
        (`checkpoint_uri`). See `Session.compute_logprobs`."""
        source = "checkpoint" if checkpoint_uri else "base"
        return self._compute_logprobs("", sequences, source, checkpoint_uri, None)

    def _sample(
        self,
        session_id: str,
        prompt_tokens: TokenArray,
        sampling_params: SamplingParams,
        num_samples: int,
        prompt_logprobs: bool,
        top_k_prompt_logprobs: int,
        wait_for: OperationFuture | None,
        validate: bool = True,
    ) -> OperationFuture[SampleResult]:
        if not isinstance(sampling_params, SamplingParams):
            raise InvalidArgumentError("sampling_params must be a SamplingParams", key="sampling_params")
        if validate:
            prompt = _as_token_array(prompt_tokens, what="prompt_tokens", sample_index=None, key="prompt")
            sampling_params.validate()
            if not isinstance(num_samples, (int, np.integer)) or num_samples < 1:
                raise InvalidArgumentError(f"num_samples must be an integer >= 1, got {num_samples!r}", key="num_samples")
            if top_k_prompt_logprobs < 0:
                raise InvalidArgumentError("top_k_prompt_logprobs must be >= 0", key="top_k_prompt_logprobs")
        else:
            prompt = np.asarray(prompt_tokens).reshape(-1).astype(np.int64)
        req = generator_pb2.SampleRequest(
            session_id=session_id,
            prompt=prompt.tolist(),
            params=sampling_params.to_proto(),
            num_samples=int(num_samples),
            prompt_logprobs=bool(prompt_logprobs),
            top_k_prompt_logprobs=int(top_k_prompt_logprobs),
        )

        def call() -> SampleResult:
            msg = self._call(self._generator.Sample, req, what="Sample", timeout=self.generation_timeout)
            return SampleResult.from_proto(
                msg, prompt_logprobs=prompt_logprobs, top_k=top_k_prompt_logprobs > 0
            )

        return self._submit_call("sample", call, wait_for)

    def _compute_logprobs(
        self,
        session_id: str,
        sequences: Sequence[TokenArray],
        source: str,
        checkpoint_uri: str | None,
        wait_for: OperationFuture | None,
    ) -> OperationFuture[ComputeLogprobsResult]:
        if source not in _SOURCES:
            raise InvalidArgumentError(f"source must be one of {sorted(_SOURCES)}, got {source!r}", key="source")
        if source == "checkpoint" and not checkpoint_uri:
            raise InvalidArgumentError("source='checkpoint' needs checkpoint_uri", key="checkpoint_uri")
        if isinstance(sequences, np.ndarray) and sequences.ndim == 1:
            raise InvalidArgumentError("sequences must be a list of token sequences", key="sequences")
        seqs = [
            _as_token_array(s, what=f"sequences[{i}]", sample_index=i, key="sequences") for i, s in enumerate(sequences)
        ]
        if not seqs:
            raise InvalidArgumentError("sequences is empty", key="sequences")
        req = generator_pb2.ComputeLogprobsRequest(
            session_id=session_id,
            sequences=[generator_pb2.TokenSequence(tokens=s.tolist()) for s in seqs],
            source=_SOURCES[source],
            checkpoint_uri=checkpoint_uri or "",
        )

        def call() -> ComputeLogprobsResult:
            msg = self._call(self._generator.ComputeLogprobs, req, what="ComputeLogprobs", timeout=self.generation_timeout)
            return ComputeLogprobsResult.from_proto(msg)

        return self._submit_call("compute_logprobs", call, wait_for)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close the channel. Pending futures fail with `ClientClosedError`
        (their operations may still run on the server). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._keepalive is not None:
            self._keepalive.close()
        self._poller.close()
        self._executor.shutdown()
        self._poll_executor.shutdown()
        self._channel.close()  # also ends a KeepAlive RPC in flight
        if self._keepalive is not None:
            self._keepalive.join(2.0)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "ResourceClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ResourceClient {self.address}{' closed' if self._closed else ''}>"


class Session:
    """One training session: a LoRA adapter, its optimizer, its step counter.

    Obtained from `ResourceClient.create_session` or `ResourceClient.session`.

    Trainer side (`forward`, `forward_backward`, `custom_forward_backward`,
    `optim_step`, `weights_sync`, `save_weights`, `save_state`, `load_state`,
    `load_state_with_optimizer`) returns an `OperationFuture` as soon as the
    server has queued the operation. Operations run strictly in the order
    submitted; gradients accumulate across ``forward_backward`` calls until
    ``optim_step``.

    Where errors surface: client-side validation errors are raised by the
    call itself, before anything is sent. A request the server refuses at
    submission (unknown or stopped session, bad API key) is raised by the
    call too. An invalid batch is reported by the resource as a FAILED
    operation (it keeps its place in the order and changes nothing), so it
    is raised by ``future.result()``, as is any failure while running.

    Generator side (`sample`, `compute_logprobs`) runs on the generator
    replicas and waits (client side) for the last *synchronous* `weights_sync`
    submitted before it on this session, so it reads that version. Background
    syncs are not waited for; every result names the version it came from.

    Every method has an ``*_async`` coroutine variant returning the result.
    The submission itself (a fast unary RPC) runs synchronously inside it, so
    coroutines started in order submit in order.

    As a context manager, the session is cleaned up on exit (`close`):
    operations that have not started are cancelled, the running one is
    waited for until terminal, then the session is stopped. Wait for the
    results you need inside the block.

    While this object and its client live, the client's keep-alive thread
    keeps the session from expiring on the server (see `ResourceClient`'s
    ``keepalive_interval_s``); once it is stopped, garbage-collected or its
    client closed, the session expires after the server's idle timeout.
    """

    def __init__(self, client: ResourceClient, info: SessionInfo) -> None:
        self.client = client
        self.session_id = info.session_id
        self._info = info
        self._lock = threading.Lock()
        self._next_seq = int(info.next_seq_id)
        self._pending: dict[str, OperationFuture] = {}
        self._pending_lock = threading.Lock()
        self._last_sync: OperationFuture | None = None
        self._stopped = False
        if client._keepalive is not None and info.state == "active":
            client._keepalive.register(self)

    @property
    def id(self) -> str:
        """The session id (same as `session_id`)."""
        return self.session_id

    @property
    def next_seq_id(self) -> int:
        """The seq_id the next operation will carry."""
        return self._next_seq

    def __repr__(self) -> str:
        return f"<Session {self.session_id} next_seq_id={self._next_seq}>"

    # ------------------------------------------------------------------ plumbing
    def _header(self, seq: int) -> session_pb2.OperationHeader:
        return session_pb2.OperationHeader(session_id=self.session_id, seq_id=seq, idempotency_key=uuid.uuid4().hex)

    def _submit(self, kind: str, method: Any, request: Any) -> OperationFuture:
        """Send one operation RPC in seq order and return its future."""
        client = self.client
        client._check_open()
        with self._lock:
            seq = self._next_seq
            request.header.CopyFrom(self._header(seq))
            try:
                op = client._call(method, request, what=kind)
            except TogetherTrainError:
                self._resync_seq(seq)
                raise
            self._next_seq = seq + 1
            inner: cf.Future = cf.Future()
            fut: OperationFuture = OperationFuture(
                inner, kind=op.kind or kind, operation_id=op.operation_id, seq_id=seq, canceller=self._cancel
            )
            with self._pending_lock:
                self._pending[op.operation_id] = fut
            inner.add_done_callback(lambda _f, oid=op.operation_id: self._forget(oid))
            client._poller.track(self.session_id, op, inner, _CONVERTERS.get(kind, _convert_any))
            if kind == "weights_sync" and request.mode != session_pb2.BACKGROUND:
                self._last_sync = fut
        return fut

    def _forget(self, operation_id: str) -> None:
        with self._pending_lock:
            self._pending.pop(operation_id, None)

    def _resync_seq(self, seq: int) -> None:
        """After a refused submission: read next_seq_id back from the server
        (it may or may not have consumed `seq`); keep `seq` if that fails."""
        try:
            info = self.client._call(
                self.client._resource.GetSession,
                resource_pb2.GetSessionRequest(session_id=self.session_id),
                what="GetSession",
                retry=RetryPolicy(max_attempts=2),
            )
            self._next_seq = int(info.next_seq_id)
        except TogetherTrainError:
            self._next_seq = seq

    def _cancel(self, fut: OperationFuture) -> bool:
        try:
            op = self.client._call(
                self.client._sessions.CancelOperation,
                session_pb2.CancelOperationRequest(operation_id=fut.operation_id or ""),
                what="CancelOperation",
            )
        except TogetherTrainError as err:
            logger.debug("cancel of %s refused: %s", fut.operation_id, err)
            return fut.cancelled()
        if op.status == session_pb2.CANCELLED:
            fut._inner.cancel()
            return True
        if op.status in (session_pb2.SUCCEEDED, session_pb2.FAILED):
            resolve_operation(op, fut._inner, _CONVERTERS.get(fut.kind, _convert_any))
        return fut.cancelled()

    def _forward_request(
        self,
        samples: Iterable[Sample],
        loss_fn: str,
        loss_fn_config: Mapping[str, Any] | None,
        return_logprobs: bool,
        return_elementwise_loss: bool,
        validate: bool,
    ) -> session_pb2.ForwardRequest:
        losses = self.client._known_losses()
        listed = losses.get(loss_fn) if losses else None
        # listed but not served (stable_reinforce): no client-side input checks; the resource refuses it saying why
        spec = listed if listed is not None and listed.available else None
        if validate:
            if not isinstance(loss_fn, str) or not loss_fn:
                raise InvalidArgumentError("loss_fn must be a loss name such as 'cross_entropy'", key="loss_fn")
            if losses is not None and listed is None:
                raise InvalidArgumentError(
                    f"unknown loss {loss_fn!r}; this resource offers {sorted(losses)}", key="loss_fn"
                )
        protos = validate_samples(samples, spec=spec, validate=validate)
        return session_pb2.ForwardRequest(
            samples=protos,
            loss_fn=loss_fn,
            loss_fn_config=loss_config_to_proto(loss_fn_config, spec, validate=validate),
            outputs=session_pb2.OutputOptions(logprobs=return_logprobs, elementwise_loss=return_elementwise_loss),
        )

    # ------------------------------------------------------------------ trainer side
    def forward(
        self,
        samples: Sequence[Sample],
        loss_fn: str = "cross_entropy",
        loss_fn_config: Mapping[str, Any] | None = None,
        *,
        return_logprobs: bool = False,
        return_elementwise_loss: bool = False,
        validate: bool = True,
    ) -> OperationFuture[ForwardResult]:
        """Compute the loss (and optionally per-token logprobs) without gradients.

        Args:
            samples: the batch (`Sample`; see DESIGN §4 for the layout).
            loss_fn: a loss name from `Capabilities.losses`: ``cross_entropy``,
                ``importance_sampling``, ``ppo``, ``cispo``, ``dro``, ``gspo``, ``grpo``.
            loss_fn_config: loss parameters (numbers / strings), e.g.
                ``{"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}``.
            return_logprobs: also return float32 [n_i] target-token logprobs per sample.
            return_elementwise_loss: also return float32 [n_i] per-position losses.
            validate: check samples, loss name and parameters client-side first
                (False: send as is, to exercise the server's validation).

        Returns:
            Future of a `ForwardResult` whose ``loss`` is a SUM over samples and positions.

        Raises:
            InvalidArgumentError: at once, when client-side validation fails
                (names the sample index and key: lengths differ, not 1-D, NaN/inf,
                negative token id, unknown/missing key, unknown loss or parameter);
                from ``result()`` when the server refuses the batch (e.g. a token
                id outside the vocabulary, a sample over the context length).
            TogetherTrainError: from ``result()`` when the operation fails.
        """
        req = self._forward_request(samples, loss_fn, loss_fn_config, return_logprobs, return_elementwise_loss, validate)
        return self._submit("forward", self.client._sessions.Forward, req)

    def forward_backward(
        self,
        samples: Sequence[Sample],
        loss_fn: str = "cross_entropy",
        loss_fn_config: Mapping[str, Any] | None = None,
        *,
        return_logprobs: bool = False,
        return_elementwise_loss: bool = False,
        validate: bool = True,
    ) -> OperationFuture[ForwardResult]:
        """Like `forward`, and add the gradient of the (summed) loss into the
        adapter's accumulated gradient (applied by the next `optim_step`).

        A failed or cancelled forward_backward leaves the accumulated gradient
        as it was. Arguments, result and errors as in `forward`.
        """
        req = self._forward_request(samples, loss_fn, loss_fn_config, return_logprobs, return_elementwise_loss, validate)
        return self._submit("forward_backward", self.client._sessions.ForwardBackward, req)

    def custom_forward_backward(
        self,
        samples: Sequence[Sample],
        gradients: Sequence[Sequence[float] | np.ndarray],
        *,
        return_logprobs: bool = True,
        return_elementwise_loss: bool = False,
        validate: bool = True,
    ) -> OperationFuture[ForwardResult]:
        """Backpropagate client-computed gradients ``g = dL/dp`` (p = target-token
        logprob), i.e. the gradient of ``Σ g·p``.

        Args:
            samples: the batch (needs ``target_tokens``).
            gradients: one float [n_i] array per sample, finite.

        Returns:
            Future of a `ForwardResult`; its ``loss`` is ``Σ g·p`` (a sum over samples
            and positions: the surrogate backpropagated, not your loss's value).

        Raises:
            InvalidArgumentError: count or length mismatch, non-finite values (at once;
                from ``result()`` when the server refuses them, naming the sample and
                the key ``gradients``; a sample's ``loss_fn_inputs`` may hold only
                ``target_tokens``).
            UnimplementedError: when the resource does not offer it yet.
        """
        protos = validate_samples(samples, validate=validate)
        if validate and len(gradients) != len(protos):
            raise InvalidArgumentError(
                f"{len(gradients)} gradients for {len(protos)} samples", key="gradients"
            )
        tensors = []
        if not validate:  # send exactly what was given (count, dtype), to exercise the server's checks
            tensors = [to_tensor(np.asarray(g)) for g in gradients]
        for i, (g, s) in enumerate(zip(gradients, protos) if validate else ()):
            arr = np.asarray(g, dtype=np.float32) if not isinstance(g, np.ndarray) else g.astype(np.float32, copy=False)
            if arr.ndim != 1 or arr.shape[0] != len(s.model_input):
                raise InvalidArgumentError(
                    f"gradient has shape {list(arr.shape)}, sample has length {len(s.model_input)}",
                    sample_index=i,
                    key="gradients",
                )
            if not np.all(np.isfinite(arr)):
                raise InvalidArgumentError("gradient holds NaN/inf", sample_index=i, key="gradients")
            tensors.append(to_tensor(arr))
        req = session_pb2.CustomForwardBackwardRequest(
            samples=protos,
            gradients=tensors,
            outputs=session_pb2.OutputOptions(logprobs=return_logprobs, elementwise_loss=return_elementwise_loss),
        )
        return self._submit("custom_forward_backward", self.client._sessions.CustomForwardBackward, req)

    def optim_step(self, adam_params: AdamParams, *, validate: bool = True) -> OperationFuture[OptimStepResult]:
        """Apply one AdamW step with the accumulated gradient, then zero it.

        Every `AdamParams` field is sent (no hidden schedule). The policy
        version becomes the new step number.

        Args:
            adam_params: the hyperparameters of this step.
            validate: check their ranges client-side first (False: leave it to the server).

        Returns:
            Future of `OptimStepResult` (step, pre-clip grad norm, learning rate).
        """
        if not isinstance(adam_params, AdamParams):
            raise InvalidArgumentError("optim_step takes an AdamParams", key="adam_params")
        if validate:
            adam_params.validate()
        req = session_pb2.OptimStepRequest(adam_params=adam_params.to_proto())
        return self._submit("optim_step", self.client._sessions.OptimStep, req)

    def weights_sync(
        self, mode: Literal["synchronous", "background"] = "synchronous"
    ) -> OperationFuture[WeightsSyncResult]:
        """Publish the adapter as it is after every operation submitted before
        this one to all generator replicas.

        Args:
            mode: ``"synchronous"``: the operation ends when every replica serves
                the new version, and this session's later `sample` /
                `compute_logprobs` calls wait for it. ``"background"``: samples
                do not wait; they read whichever version replicas serve (named
                in each result).

        Returns:
            Future of `WeightsSyncResult`.
        """
        if mode not in _SYNC_MODES:
            raise InvalidArgumentError(f"mode must be 'synchronous' or 'background', got {mode!r}", key="mode")
        req = session_pb2.WeightsSyncRequest(mode=_SYNC_MODES[mode])
        return self._submit("weights_sync", self.client._sessions.WeightsSync, req)

    def save_weights(self, name: str, merged: bool = False) -> OperationFuture[CheckpointInfo]:
        """Save an inference checkpoint: a PEFT adapter directory, or with
        ``merged=True`` a full Hugging Face model directory.

        Raises:
            InvalidArgumentError: a bad name (the server rejects path separators, ``..``).
            AlreadyExistsError: from ``result()`` when the name is taken (server-defined).
        """
        req = session_pb2.SaveWeightsRequest(name=name, merged=merged)
        return self._submit("save_weights", self.client._sessions.SaveWeights, req)

    def save_state(self, name: str) -> OperationFuture[CheckpointInfo]:
        """Save a training checkpoint (adapter, optimizer moments, step, RNG, config)."""
        req = session_pb2.SaveStateRequest(name=name)
        return self._submit("save_state", self.client._sessions.SaveState, req)

    def load_state(self, uri: str) -> OperationFuture[LoadStateResult]:
        """Load a training checkpoint's weights with a fresh optimizer."""
        req = session_pb2.LoadStateRequest(uri=uri, with_optimizer=False)
        return self._submit("load_state", self.client._sessions.LoadState, req)

    def load_state_with_optimizer(self, uri: str) -> OperationFuture[LoadStateResult]:
        """Load a training checkpoint's weights, optimizer moments and step, so
        training continues as if never interrupted."""
        req = session_pb2.LoadStateRequest(uri=uri, with_optimizer=True)
        return self._submit("load_state", self.client._sessions.LoadState, req)

    def operation(self, operation_id: str) -> OperationFuture:
        """A future for an operation submitted earlier (e.g. by another client
        or before a reconnect). Raises NotFoundError when unknown or expired."""
        op = self.client._call(
            self.client._sessions.GetOperation,
            session_pb2.GetOperationRequest(operation_id=operation_id),
            what="GetOperation",
        )
        inner: cf.Future = cf.Future()
        fut: OperationFuture = OperationFuture(
            inner, kind=op.kind, operation_id=op.operation_id, seq_id=int(op.seq_id), canceller=self._cancel
        )
        self.client._poller.track(self.session_id, op, inner, _CONVERTERS.get(op.kind, _convert_any))
        return fut

    def pending_operations(self) -> list[OperationFuture]:
        """Futures of this client's operations on the session that are not done, in seq order."""
        with self._pending_lock:
            futs = list(self._pending.values())
        return sorted((f for f in futs if not f.done()), key=lambda f: f.seq_id or 0)

    # ------------------------------------------------------------------ generator side
    def sample(
        self,
        prompt_tokens: TokenArray,
        sampling_params: SamplingParams,
        num_samples: int = 1,
        *,
        prompt_logprobs: bool = False,
        top_k_prompt_logprobs: int = 0,
        validate: bool = True,
    ) -> OperationFuture[SampleResult]:
        """Sample completions with the session's synced adapter.

        Waits first (client side, without blocking the caller) for the last
        synchronous `weights_sync` submitted before this call; if that sync
        failed, the sample fails with FailedPreconditionError. Before any sync
        the replicas serve the base model (policy_version 0: the fresh adapter, B = 0).

        Args:
            prompt_tokens: int [m] token ids.
            sampling_params: `SamplingParams` (max_tokens is required).
            num_samples: completions to draw (each its own seed stream).
            prompt_logprobs: also return m-1 prompt logprobs.
            top_k_prompt_logprobs: also return the top-k alternatives per prompt position.
            validate: check the prompt and parameters client-side first.

        Returns:
            Future of `SampleResult` (tokens, sampled logprobs, stop reasons, versions).
        """
        return self.client._sample(
            self.session_id,
            prompt_tokens,
            sampling_params,
            num_samples,
            prompt_logprobs,
            top_k_prompt_logprobs,
            self._last_sync,
            validate,
        )

    def compute_logprobs(
        self,
        sequences: Sequence[TokenArray],
        source: Literal["session", "base", "checkpoint"] | None = None,
        *,
        checkpoint_uri: str | None = None,
    ) -> OperationFuture[ComputeLogprobsResult]:
        """Score token sequences on a generator replica.

        Args:
            sequences: token id sequences; each gets len - 1 logprobs.
            source: ``"session"`` (the synced adapter; waits for the last
                synchronous weights_sync like `sample`), ``"base"`` (no adapter)
                or ``"checkpoint"`` (`checkpoint_uri`). Default: "checkpoint"
                when `checkpoint_uri` is given, else "session".

        Returns:
            Future of `ComputeLogprobsResult` (float32 arrays, untempered).
        """
        if source is None:
            source = "checkpoint" if checkpoint_uri else "session"
        wait_for = self._last_sync if source == "session" else None
        return self.client._compute_logprobs(self.session_id, sequences, source, checkpoint_uri, wait_for)

    # ------------------------------------------------------------------ async variants
    async def forward_async(
        self,
        samples: Sequence[Sample],
        loss_fn: str = "cross_entropy",
        loss_fn_config: Mapping[str, Any] | None = None,
        *,
        return_logprobs: bool = False,
        return_elementwise_loss: bool = False,
        validate: bool = True,
    ) -> ForwardResult:
        """`forward` and await its result."""
        return await self.forward(
            samples,
            loss_fn,
            loss_fn_config,
            return_logprobs=return_logprobs,
            return_elementwise_loss=return_elementwise_loss,
            validate=validate,
        )

    async def forward_backward_async(
        self,
        samples: Sequence[Sample],
        loss_fn: str = "cross_entropy",
        loss_fn_config: Mapping[str, Any] | None = None,
        *,
        return_logprobs: bool = False,
        return_elementwise_loss: bool = False,
        validate: bool = True,
    ) -> ForwardResult:
        """`forward_backward` and await its result."""
        return await self.forward_backward(
            samples,
            loss_fn,
            loss_fn_config,
            return_logprobs=return_logprobs,
            return_elementwise_loss=return_elementwise_loss,
            validate=validate,
        )

    async def custom_forward_backward_async(
        self,
        samples: Sequence[Sample],
        gradients: Sequence[Sequence[float] | np.ndarray],
        *,
        return_logprobs: bool = True,
        return_elementwise_loss: bool = False,
        validate: bool = True,
    ) -> ForwardResult:
        """`custom_forward_backward` and await its result."""
        return await self.custom_forward_backward(
            samples,
            gradients,
            return_logprobs=return_logprobs,
            return_elementwise_loss=return_elementwise_loss,
            validate=validate,
        )

    async def optim_step_async(self, adam_params: AdamParams, *, validate: bool = True) -> OptimStepResult:
        """`optim_step` and await its result."""
        return await self.optim_step(adam_params, validate=validate)

    async def weights_sync_async(self, mode: Literal["synchronous", "background"] = "synchronous") -> WeightsSyncResult:
        """`weights_sync` and await its result."""
        return await self.weights_sync(mode)

    async def save_weights_async(self, name: str, merged: bool = False) -> CheckpointInfo:
        """`save_weights` and await its result."""
        return await self.save_weights(name, merged)

    async def save_state_async(self, name: str) -> CheckpointInfo:
        """`save_state` and await its result."""
        return await self.save_state(name)

    async def load_state_async(self, uri: str) -> LoadStateResult:
        """`load_state` and await its result."""
        return await self.load_state(uri)

    async def load_state_with_optimizer_async(self, uri: str) -> LoadStateResult:
        """`load_state_with_optimizer` and await its result."""
        return await self.load_state_with_optimizer(uri)

    async def sample_async(
        self,
        prompt_tokens: TokenArray,
        sampling_params: SamplingParams,
        num_samples: int = 1,
        *,
        prompt_logprobs: bool = False,
        top_k_prompt_logprobs: int = 0,
        validate: bool = True,
    ) -> SampleResult:
        """`sample` and await its result."""
        return await self.sample(
            prompt_tokens,
            sampling_params,
            num_samples,
            prompt_logprobs=prompt_logprobs,
            top_k_prompt_logprobs=top_k_prompt_logprobs,
            validate=validate,
        )

    async def compute_logprobs_async(
        self,
        sequences: Sequence[TokenArray],
        source: Literal["session", "base", "checkpoint"] | None = None,
        *,
        checkpoint_uri: str | None = None,
    ) -> ComputeLogprobsResult:
        """`compute_logprobs` and await its result."""
        return await self.compute_logprobs(sequences, source, checkpoint_uri=checkpoint_uri)

    # ------------------------------------------------------------------ lifecycle
    def info(self) -> SessionInfo:
        """Fresh `SessionInfo` from the server (step, synced version, expiry, ...)."""
        self._info = self.client.get_session(self.session_id)
        return self._info

    def keep_alive(self) -> SessionInfo:
        """Push back the idle expiry."""
        self._info = self.client.keep_alive(self.session_id)
        return self._info

    def cancel_pending(self) -> int:
        """Cancel this client's operations on the session that have not started
        (newest first); returns how many were cancelled."""
        n = 0
        for fut in reversed(self.pending_operations()):
            try:
                n += bool(fut.cancel())
            except Exception:  # noqa: BLE001 - best effort
                pass
        return n

    def stop(self) -> SessionInfo:
        """Stop the session and free its slot; operations still queued are
        cancelled by the server. Later calls fail (FailedPreconditionError or
        NotFoundError, as the server decides)."""
        self._info = self.client.stop_session(self.session_id)
        self._stopped = True
        if self.client._keepalive is not None:
            self.client._keepalive.unregister(self)
        return self._info

    def wait_pending(self, timeout: float | None = 60.0) -> bool:
        """Wait until every operation of this client on the session is terminal
        (succeeded, failed or cancelled; errors are not raised here). Returns
        False if some were still running after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for fut in self.pending_operations():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                fut.result(timeout=left)
            except Exception:  # noqa: BLE001 - failures and cancellations are terminal too
                pass
        return not self.pending_operations()

    def close(self, timeout: float | None = 60.0) -> SessionInfo | None:
        """Whitney-style cleanup: cancel the operations that have not started,
        wait (up to `timeout`) until the running one is terminal, then stop the
        session. Returns the final `SessionInfo` (None if it was already gone).
        Idempotent; what the context manager does on exit."""
        if self._stopped:
            return self._info
        self.cancel_pending()
        self.wait_pending(timeout)
        try:
            return self.stop()
        except (NotFoundError, FailedPreconditionError):
            self._stopped = True
            return None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.client.closed or self._stopped:
            return
        try:
            self.close()
        except (NotFoundError, FailedPreconditionError):
            pass  # already stopped or expired
        except TogetherTrainError:
            if exc_type is None:
                raise
            logger.warning("could not stop session %s while handling %s", self.session_id, exc_type.__name__)
