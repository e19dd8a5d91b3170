"""gRPC client of one generator replica, as the ReplicaPool expects it."""

from __future__ import annotations

import hashlib
import threading
from typing import Any, Iterator

import grpc
import numpy as np

from together_train._proto import common_pb2, generator_pb2, generator_pb2_grpc
from together_train_server.service.errors import ServiceError
from together_train_server.service.replicas import Deadlines, ReplicaLacksWeights, ReplicaUnavailable
from together_train_server.wire import convert
from together_train_server.wire.replica_auth import METADATA_KEY

CHUNK_BYTES = 2 << 20  # DESIGN §3: chunks of at most a few MiB
_GONE = (grpc.StatusCode.UNAVAILABLE,)
_LACKS = "holds no weights for session"  # the replica's FAILED_PRECONDITION (generator_servicer._adapter)
MAX_MESSAGE = 256 << 20


class GrpcReplicaClient:
    """Talks to a replica at `address`; UNAVAILABLE becomes ReplicaUnavailable.

    Args:
        address: ``host:port`` of the replica.
        replica_id: name used in logs and errors (default: the address).
        secret: the replica secret sent on every call (``together-train-replica-secret`` metadata,
            see `wire.replica_auth`); a replica refuses calls without it (UNAUTHENTICATED).
        credentials: TLS channel credentials (`wire.tls.channel_credentials`) for a replica started
            with ``--tls-cert``; None = plaintext (loopback replicas spawned by the resource).
            The certificate is checked against the host part of `address`.
    """

    def __init__(
        self,
        address: str,
        replica_id: str | None = None,
        *,
        secret: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.address = address
        self.replica_id = replica_id or address
        self._metadata = ((METADATA_KEY, secret),) if secret else ()
        options = [("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE)]
        if credentials is not None:
            self._channel = grpc.secure_channel(address, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._stub = generator_pb2_grpc.GeneratorServiceStub(self._channel)
        # Set by the ReplicaPool that adopts this client: every call's deadline comes from it.
        self.deadlines = Deadlines()
        self._inflight: set[grpc.Future] = set()
        self._inflight_lock = threading.Lock()
        self._work_tokens = 0   # tokens of the Sample / ComputeLogprobs calls in flight here

    def _call(self, fn, request, timeout: float, what: str):  # noqa: ANN001, ANN202
        """Run one call with a deadline; cancellable by `cancel_inflight`.

        UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED (the replica was taken out of
        routing) become ReplicaUnavailable naming the replica; "holds no weights"
        becomes ReplicaLacksWeights; other statuses are raised as grpc.RpcError.
        """
        call = fn.future(request, timeout=timeout, metadata=self._metadata)
        with self._inflight_lock:
            self._inflight.add(call)
        try:
            return call.result()
        except grpc.FutureCancelledError as e:
            raise ReplicaUnavailable(f"replica {self.replica_id}: {what} cancelled: the replica was taken out of routing") from e
        except grpc.RpcError as e:
            mapped = self._mapped(e, request, timeout, what)
            if mapped is e:
                raise
            raise mapped from e
        finally:
            with self._inflight_lock:
                self._inflight.discard(call)

    def _mapped(self, e: grpc.RpcError, request, timeout: float, what: str) -> Exception:  # noqa: ANN001
        """The exception a failed call raises (see `_call`): e itself unless the replica is gone or lacks weights."""
        code = e.code()
        if code in _GONE or code == grpc.StatusCode.CANCELLED:
            return ReplicaUnavailable(f"replica {self.replica_id} ({self.address}): {what}: {e.details()}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return ReplicaUnavailable(
                f"replica {self.replica_id} ({self.address}) did not answer {what} within its deadline of {timeout:.1f} s")
        if code == grpc.StatusCode.FAILED_PRECONDITION and _LACKS in (e.details() or ""):
            return ReplicaLacksWeights(getattr(request, "session_id", ""), e.details())
        return e

    def cancel_inflight(self) -> None:
        """Cancel every call in flight: each raises ReplicaUnavailable in its caller (retried elsewhere)."""
        with self._inflight_lock:
            calls = list(self._inflight)
        for call in calls:
            call.cancel()

    def _work_call(self, fn, request, tokens: int, what: str):  # noqa: ANN001, ANN202
        """A call whose deadline covers its own tokens and the tokens already in flight on this replica.

        The replica batches every request in flight into shared decode steps, so
        a request's time grows with the work beside it: 64 concurrent eval
        samples each sized alone missed their deadlines on a busy, healthy
        replica. A hung replica is found by the health probes, not by this deadline.
        """
        with self._inflight_lock:
            ahead = self._work_tokens
            self._work_tokens += tokens
        try:
            return self._call(fn, request, self.deadlines.for_tokens(tokens + ahead), what)
        finally:
            with self._inflight_lock:
                self._work_tokens -= tokens

    def sample(self, request: generator_pb2.SampleRequest) -> generator_pb2.SampleResponse:
        """Deadline: ``deadlines.for_tokens(prompt tokens + num_samples * max_tokens + tokens in flight here)``."""
        tokens = len(request.prompt) + max(1, request.num_samples) * request.params.max_tokens
        return self._work_call(self._stub.Sample, request, tokens, "Sample")

    def sample_stream(self, request: generator_pb2.SampleRequest) -> Iterator[generator_pb2.SampleStreamChunk]:
        """SampleStream: the chunks as the replica sends them (`Sample`'s deadline covers the whole stream).

        Errors are those of `sample` (ReplicaUnavailable, ReplicaLacksWeights, grpc.RpcError), raised
        while iterating; closing the iterator early cancels the call on the replica.
        """
        tokens = len(request.prompt) + max(1, request.num_samples) * request.params.max_tokens
        with self._inflight_lock:
            ahead = self._work_tokens
            self._work_tokens += tokens
        timeout = self.deadlines.for_tokens(tokens + ahead)
        call = self._stub.SampleStream(request, timeout=timeout, metadata=self._metadata)
        with self._inflight_lock:
            self._inflight.add(call)
        try:
            try:
                yield from call
            except grpc.RpcError as e:
                mapped = self._mapped(e, request, timeout, "SampleStream")
                if mapped is e:
                    raise
                raise mapped from e
        finally:
            call.cancel()  # no-op once it ended
            with self._inflight_lock:
                self._inflight.discard(call)
                self._work_tokens -= tokens

    def compute_logprobs(self, request: generator_pb2.ComputeLogprobsRequest) -> generator_pb2.ComputeLogprobsResponse:
        """Deadline: ``deadlines.for_tokens(sum of the sequences' tokens + tokens in flight here)``."""
        tokens = sum(len(s.tokens) for s in request.sequences)
        return self._work_call(self._stub.ComputeLogprobs, request, tokens, "ComputeLogprobs")

    def health(self, timeout: float = 5.0) -> generator_pb2.HealthResponse:
        return self._call(self._stub.Health, generator_pb2.HealthRequest(), timeout, "Health")

    def probe(self) -> dict[str, int]:
        """Health within ``deadlines.probe_timeout_s``: the adapter versions held ({key: version}).

        Raises:
            ReplicaUnavailable: no answer in time (a hung or dead replica).
        """
        return dict(self.health(self.deadlines.probe_timeout_s).loaded_versions)

    def wait_ready(self, timeout: float) -> None:
        """Block until the replica's channel is ready. Raises grpc.FutureTimeoutError."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout)

    def push(self, session_id: str, version: int, lora: Any, tensors: dict[str, Any]) -> int:
        """Stream one adapter version: header, float32 data chunks, sha256 trailer. Returns bytes sent."""
        arrays = {k: np.ascontiguousarray(v.detach().to("cpu").float().numpy()) for k, v in tensors.items()}
        header = generator_pb2.PushWeightsHeader(
            session_id=session_id,
            policy_version=version,
            lora=convert.lora_to_proto(lora),
            tensors=[generator_pb2.TensorMeta(name=k, dtype=common_pb2.FLOAT32, shape=list(a.shape)) for k, a in arrays.items()],
        )
        total = sum(a.nbytes for a in arrays.values())

        def chunks() -> Iterator[generator_pb2.PushWeightsChunk]:
            yield generator_pb2.PushWeightsChunk(header=header)
            h = hashlib.sha256()
            for a in arrays.values():
                view = memoryview(a.astype("<f4", copy=False)).cast("B")
                for i in range(0, len(view), CHUNK_BYTES):
                    piece = bytes(view[i : i + CHUNK_BYTES])
                    h.update(piece)
                    yield generator_pb2.PushWeightsChunk(data=piece)
            yield generator_pb2.PushWeightsChunk(trailer_sha256=h.hexdigest())

        try:
            # Deadline ``deadlines.for_bytes(total)``: a stuck replica fails the push instead of holding it.
            self._call(self._stub.PushWeights, chunks(), self.deadlines.for_bytes(total), f"PushWeights of {session_id} v{version}")
        except grpc.RpcError as e:
            raise ServiceError("INTERNAL", f"replica {self.replica_id} refused the weights push: {e.details()}") from e
        return total

    def drop(self, session_id: str) -> None:
        """DropWeights within ``deadlines.base_s``."""
        self._call(
            self._stub.DropWeights, generator_pb2.DropWeightsRequest(session_id=session_id), self.deadlines.base_s, "DropWeights"
        )

    def close(self) -> None:
        self._channel.close()
