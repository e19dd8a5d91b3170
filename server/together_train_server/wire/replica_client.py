"""gRPC client of one generator replica, as the ReplicaPool expects it (plain types in, plain types out).

The ``*_message`` methods speak the wire messages for the resource's own GeneratorService
(wire/router_servicer.py), which relays a replica's answers and error statuses as they are.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, Iterator, Mapping, Sequence

import grpc
import xxhash

from together_train._proto import generator_pb2, generator_pb2_grpc
from together_train_server.engines.types import GenSequence, LoraConfig
from together_train_server.service.interfaces import (
    CallerGone, Deadlines, LogprobsOutput, ReplicaError, ReplicaLacksWeights, ReplicaUnavailable, SampleCancelled,
    SampleOutput, SampleRequest, TokenBatch)
from together_train_server.service.errors import ServiceError
from together_train_server.wire import convert, weights as wt
from together_train_server.wire.replica_auth import METADATA_KEY
from together_train_server.wire.sampling_params import params_to_proto

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
# Data chunks of a streamed push: large enough that per-message costs vanish (8 MiB: loopback
# gRPC moved 2 MiB chunks at ~0.8x the rate of 8 MiB ones), far below MAX_MESSAGE.
CHUNK_BYTES = 8 << 20
# TOGETHER_TRAIN_PUSH_SHM=0 forces the streamed push for replicas on this host (benchmarks, debugging).
_SHM_ENV = "TOGETHER_TRAIN_PUSH_SHM"
_NO_SEGMENT = "cannot open shared-memory segment"  # the replica's FAILED_PRECONDITION (generator_servicer)
_GONE = (grpc.StatusCode.UNAVAILABLE,)
_LACKS = "holds no weights for session"  # the replica's FAILED_PRECONDITION (generator_servicer._adapter)
MAX_MESSAGE = 256 << 20


def sample_message(req: SampleRequest) -> generator_pb2.SampleRequest:
    """A plain `SampleRequest` as the generator's SampleRequest message."""
    return generator_pb2.SampleRequest(session_id=req.key, prompt=list(req.prompt), params=params_to_proto(req.params),
                                       num_samples=req.num_samples, prompt_logprobs=req.prompt_logprobs,
                                       top_k_prompt_logprobs=req.top_k_prompt_logprobs)


def sample_output(resp: generator_pb2.SampleResponse) -> SampleOutput:
    """The generator's SampleResponse as a plain `SampleOutput`."""
    return SampleOutput(
        sequences=[_sequence(q) for q in resp.sequences],
        prompt_logprobs=list(resp.prompt_logprobs),
        top_k_prompt_logprobs=[(list(t.token_ids), list(t.logprobs)) for t in resp.top_k_prompt_logprobs],
        policy_version=int(resp.policy_version), replica_id=resp.replica_id,
        prompt_cache_hit_tokens=int(resp.prompt_cache_hit_tokens))


def _sequence(q: generator_pb2.SampledSequence) -> GenSequence:
    """One SampledSequence as a `GenSequence` (untempered / top logprobs None when the replica sent none)."""
    return GenSequence(list(q.tokens), list(q.logprobs), "length" if q.stop_reason == generator_pb2.LENGTH else "stop",
                       untempered_logprobs=list(q.untempered_logprobs) if q.untempered_logprobs else None,
                       top_logprobs=[(list(t.token_ids), list(t.logprobs)) for t in q.top_logprobs] or None)


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
        same_host: the replica runs on this host (the resource spawned it, on loopback): weights
            pushes go through a shared-memory segment when the replica also says it reads them
            (Health ``shared_memory``) and can open it; else, and when ``TOGETHER_TRAIN_PUSH_SHM=0``,
            they stream.
        segments: the `wt.SegmentPool` of shared-memory pushes, shared with the resource's other
            same-host clients (one segment per snapshot for all of them); None = one of its own.
    """

    def __init__(
        self,
        address: str,
        replica_id: str | None = None,
        *,
        secret: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        same_host: bool = False,
        segments: wt.SegmentPool | None = None,
    ) -> None:
        self.address = address
        self.same_host = same_host and os.environ.get(_SHM_ENV, "1") != "0"
        self._wire: tuple[str, bool] | None = None  # (wire dtype, shared memory), from the first Health
        # Shared-memory segments of pushes (reused: no page faults); shared by the clients of one
        # resource's same-host replicas when given, so a snapshot is packed once for all of them.
        self._own_segments = segments is None
        self._segments = segments if segments is not None else wt.SegmentPool()
        self.replica_id = replica_id or address
        self._metadata = ((METADATA_KEY, secret),) if secret else ()
        options = [("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE)]
        if credentials is not None:
            self._channel = grpc.secure_channel(address, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._stub = generator_pb2_grpc.GeneratorServiceStub(self._channel)
        # PushWeights with pre-serialized frames (wt.chunk_frames copies each payload once).
        self._push_frames = self._channel.stream_unary(
            "/together_train.v1.GeneratorService/PushWeights",
            request_serializer=None,
            response_deserializer=generator_pb2.PushWeightsResponse.FromString,
        )
        # Set by the ReplicaPool that adopts this client: every call's deadline comes from it.
        self.deadlines = Deadlines()
        self._inflight: set[grpc.Future] = set()
        self._inflight_lock = threading.Lock()
        self._work_tokens = 0   # tokens of the Sample / ComputeLogprobs calls in flight here

    def _call(self, fn, request, timeout: float, what: str, gone: CallerGone | None = None):
        """Run one call with a deadline; cancellable by `cancel_inflight` and by `gone`.

        UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED (the replica was taken out of
        routing) become ReplicaUnavailable naming the replica; "holds no weights"
        becomes ReplicaLacksWeights; a call cancelled because `gone` was set raises
        SampleCancelled; other statuses are raised as grpc.RpcError.
        """
        call = fn.future(request, timeout=timeout, metadata=self._metadata)
        with self._inflight_lock:
            self._inflight.add(call)
        unregister = gone.register(call.cancel) if gone is not None else None
        try:
            return call.result()
        except grpc.FutureCancelledError as e:
            self._raise_if_gone(gone, what)
            raise ReplicaUnavailable(f"replica {self.replica_id}: {what} cancelled: the replica was taken out of routing") from e
        except grpc.RpcError as e:
            self._raise_if_gone(gone, what)
            mapped = self._mapped(e, request, timeout, what)
            if mapped is e:
                raise
            raise mapped from e
        finally:
            if unregister is not None:
                unregister()
            with self._inflight_lock:
                self._inflight.discard(call)

    def _raise_if_gone(self, gone: CallerGone | None, what: str) -> None:
        """SampleCancelled when the call failed because its caller went away (not the replica's fault)."""
        if gone is not None and gone.is_set():
            raise SampleCancelled(f"{what} on replica {self.replica_id} cancelled: its caller went away") from None

    def _mapped(self, e: grpc.RpcError, request, timeout: float, what: str) -> Exception:
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

    def _work_call(self, fn, request, tokens: int, what: str, gone: CallerGone | None = None):
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
            return self._call(fn, request, self.deadlines.for_tokens(tokens + ahead), what, gone)
        finally:
            with self._inflight_lock:
                self._work_tokens -= tokens

    def sample(self, request: SampleRequest) -> SampleOutput:
        """Sample in plain types (`ReplicaClient.sample`): a replica's error status becomes ReplicaError."""
        try:
            return sample_output(self.sample_message(sample_message(request), gone=request.gone))
        except grpc.RpcError as e:
            raise ReplicaError(e.code().name, e.details() or "generator replica error") from None

    def sample_stream(self, request: SampleRequest) -> Iterator[TokenBatch | SampleOutput]:
        """SampleStream in plain types: a TokenBatch per message of new tokens, then the SampleOutput."""
        try:
            for chunk in self.sample_stream_messages(sample_message(request), gone=request.gone):
                if chunk.HasField("done"):
                    yield sample_output(chunk.done)
                    return
                t = chunk.tokens
                yield TokenBatch(list(zip(t.sequence, t.token_ids)), t.sampled_at)
        except grpc.RpcError as e:
            raise ReplicaError(e.code().name, e.details() or "generator replica error") from None

    def sample_message(self, request: generator_pb2.SampleRequest,
                       gone: CallerGone | None = None) -> generator_pb2.SampleResponse:
        """Sample with the wire messages (the resource's GeneratorService relays them as they are).

        Deadline: ``deadlines.for_tokens(prompt tokens + num_samples * max_tokens + tokens in flight here)``.
        `gone` set cancels the call (SampleCancelled): the replica drops the request at its next step.
        """
        tokens = len(request.prompt) + max(1, request.num_samples) * request.params.max_tokens
        return self._work_call(self._stub.Sample, request, tokens, "Sample", gone)

    def sample_stream_messages(self, request: generator_pb2.SampleRequest,
                               gone: CallerGone | None = None) -> Iterator[generator_pb2.SampleStreamChunk]:
        """SampleStream: the chunks as the replica sends them (`Sample`'s deadline covers the whole stream).

        Errors are those of `sample_message` (ReplicaUnavailable, ReplicaLacksWeights, grpc.RpcError,
        SampleCancelled once `gone` is set), raised while iterating; closing the iterator early
        cancels the call on the replica.
        """
        tokens = len(request.prompt) + max(1, request.num_samples) * request.params.max_tokens
        with self._inflight_lock:
            ahead = self._work_tokens
            self._work_tokens += tokens
        timeout = self.deadlines.for_tokens(tokens + ahead)
        call = self._stub.SampleStream(request, timeout=timeout, metadata=self._metadata)
        with self._inflight_lock:
            self._inflight.add(call)
        unregister = gone.register(call.cancel) if gone is not None else None
        try:
            try:
                yield from call
            except grpc.RpcError as e:
                self._raise_if_gone(gone, "SampleStream")
                mapped = self._mapped(e, request, timeout, "SampleStream")
                if mapped is e:
                    raise
                raise mapped from e
        finally:
            call.cancel()  # no-op once it ended
            if unregister is not None:
                unregister()
            with self._inflight_lock:
                self._inflight.discard(call)
                self._work_tokens -= tokens

    def compute_logprobs(self, key: str, sequences: Sequence[Sequence[int]]) -> LogprobsOutput:
        """Score `sequences` with adapter `key` ("" = base model) in plain types; an error status is ReplicaError."""
        msg = generator_pb2.ComputeLogprobsRequest(
            session_id=key, sequences=[generator_pb2.TokenSequence(tokens=list(s)) for s in sequences],
            source=generator_pb2.SESSION if key else generator_pb2.BASE)
        try:
            r = self.compute_logprobs_message(msg)
        except grpc.RpcError as e:
            raise ReplicaError(e.code().name, e.details() or "generator replica error") from None
        return LogprobsOutput([list(q.logprobs) for q in r.sequences], int(r.policy_version), r.replica_id)

    def compute_logprobs_message(self, request: generator_pb2.ComputeLogprobsRequest) -> generator_pb2.ComputeLogprobsResponse:
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
        h = self.health(self.deadlines.probe_timeout_s)
        if self._wire is None:
            self._wire = self._mode_of(h)
        return dict(h.loaded_versions)

    def wait_ready(self, timeout: float) -> None:
        """Block until the replica's channel is ready. Raises grpc.FutureTimeoutError."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout)

    def wire_mode(self) -> tuple[str, bool]:
        """(wire dtype, shared memory) of pushes to this replica, asked once from its Health.

        The dtype is the replica's ``weights_dtype`` (its model dtype: float32,
        bfloat16, float16); shared memory needs ``same_host`` and the replica's
        ``shared_memory``. Raises ReplicaUnavailable.
        """
        if self._wire is None:
            self._wire = self._mode_of(self.health(self.deadlines.probe_timeout_s))
        return self._wire

    def _mode_of(self, h: generator_pb2.HealthResponse) -> tuple[str, bool]:
        return wt.wire_dtype(h.weights_dtype), bool(self.same_host and h.shared_memory and wt.shared_memory_available())

    @property
    def known_wire_dtype(self) -> str | None:
        """The wire dtype of pushes here once a Health answered (`wire_mode`, `probe`); None before."""
        return self._wire[0] if self._wire is not None else None

    def push(self, session_id: str, version: int, lora: LoraConfig, tensors: Mapping[str, torch.Tensor]) -> int:
        """Send one adapter version in the replica's dtype; returns the tensor bytes pushed.

        Same host: the tensors are written (converted) into a shared-memory
        segment whose name goes in the header, with the xxh3-128 trailer (one
        segment for every same-host replica pushed the same snapshot, see
        `wt.SegmentPool`); reused once its pushes were answered. A replica that
        cannot open it gets the stream from then on. Otherwise: header,
        ``CHUNK_BYTES`` data chunks, xxh3-128 trailer. Deadline
        ``deadlines.for_bytes(bytes)``: a stuck replica fails the push instead of holding it.

        Raises:
            ReplicaUnavailable: the replica is gone or missed the deadline.
            ServiceError: INTERNAL, the replica refused the weights (naming it and why).
        """
        dtype, shm = self.wire_mode()
        header = generator_pb2.PushWeightsHeader(session_id=session_id, policy_version=version,
                                                 lora=convert.lora_to_proto(lora))
        what = f"PushWeights of {session_id} v{version}"
        try:
            if shm:
                try:
                    return self._push_segment(header, tensors, dtype, what)
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.FAILED_PRECONDITION or _NO_SEGMENT not in (e.details() or ""):
                        raise
                    log.warning("replica %s cannot read this host's shared memory (%s): pushing by stream",
                                self.replica_id, e.details())
                    self._wire = (dtype, False)
            return self._push_stream(header, tensors, dtype, what)
        except grpc.RpcError as e:
            raise ServiceError("INTERNAL", f"replica {self.replica_id} refused the weights push: {e.details()}") from e

    def _push_segment(self, header, tensors: Mapping[str, torch.Tensor], dtype: str, what: str) -> int:
        # One segment per snapshot for every same-host replica (packed and checksummed once).
        lease = self._segments.acquire(tensors, dtype)
        answered = False
        try:
            header.tensors.extend(lease.metas)
            assert lease.segment is not None  # acquire gives a segment or raises
            header.segment.name, header.segment.size = lease.segment.name, lease.nbytes
            frames = [generator_pb2.PushWeightsChunk(header=header).SerializeToString(),
                      generator_pb2.PushWeightsChunk(trailer_xxh3_128=lease.digest).SerializeToString()]
            self._call(self._push_frames, iter(frames), self.deadlines.for_bytes(lease.nbytes), what)
            answered = True
        finally:
            # Reused only after answered pushes: after a failure the replica may still be reading it.
            self._segments.release(lease, answered)
        return lease.nbytes

    def _push_stream(self, header, tensors: Mapping[str, torch.Tensor], dtype: str, what: str) -> int:
        packed = wt.pack(tensors, dtype)
        header.tensors.extend(packed.metas)

        def frames() -> Iterator[bytes]:
            yield generator_pb2.PushWeightsChunk(header=header).SerializeToString()
            hasher = xxhash.xxh3_128()   # fed chunk by chunk: the trailer's digest is ready with the last chunk
            yield from wt.chunk_frames(packed.data, CHUNK_BYTES, hasher)
            yield generator_pb2.PushWeightsChunk(trailer_xxh3_128=hasher.hexdigest()).SerializeToString()

        self._call(self._push_frames, frames(), self.deadlines.for_bytes(packed.nbytes), what)
        return packed.nbytes

    def drop(self, session_id: str) -> None:
        """DropWeights within ``deadlines.base_s``."""
        self._call(
            self._stub.DropWeights, generator_pb2.DropWeightsRequest(session_id=session_id), self.deadlines.base_s, "DropWeights"
        )

    def close(self) -> None:
        """Close the channel and free the push segments (a shared pool's are its owner's to free)."""
        if self._own_segments:
            self._segments.close()
        self._channel.close()
