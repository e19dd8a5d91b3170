"""GeneratorService on a replica process: messages to and from the replica's adapter host.

What a replica decides (versions, residency, locks) is `service.replica_host.ReplicaHost`'s; the bytes
of a push are read by `wire.weights.Receiver`. This servicer only translates.
"""

from __future__ import annotations

import queue
import time
from concurrent.futures import CancelledError, Future
from typing import Iterator

import grpc
import numpy as np

from together_train._proto import generator_pb2, generator_pb2_grpc
from together_train_server.engines.types import GenOutput
from together_train_server.service.errors import ServiceError, internal_error, invalid
from together_train_server.service.interfaces import ReplicaHost, Resolved
from together_train_server.wire import convert, weights as wt
from together_train_server.wire.sampling_params import params_from_proto
from together_train_server.wire.errors import abort, handle_errors


class ReplicaServicer(generator_pb2_grpc.GeneratorServiceServicer):
    """One generator replica's GeneratorService over its `ReplicaHost`.

    A request for a session samples with that session's adapter; a session
    with no adapter pushed here is FAILED_PRECONDITION (retryable), so the
    resource can re-push rather than silently serve base weights. A sample
    reports the version that produced its tokens (`ReplicaHost.outcome`);
    ``ComputeLogprobs`` reports the version that scored.

    Args:
        host: the replica's adapter host (its engine, versions and residency).
        engine_name: ``"torch"`` | ``"vllm"``, reported by Health.
        receiver: reads PushWeights' messages (default a new `wt.Receiver`).
    """

    def __init__(self, host: ReplicaHost, engine_name: str = "torch", receiver: wt.Receiver | None = None) -> None:
        self.host = host
        self.replica_id = host.replica_id
        self.engine_name = engine_name
        self.receiver = receiver if receiver is not None else wt.Receiver()

    @handle_errors
    def Sample(self, request, context):
        resolved = self.host.resolve(request.session_id)
        params = params_from_proto(request.params)
        with self.host.in_flight():
            fut = self._cancellable(context, self._submit(request, resolved, params))
            out, version = self._outcome(fut, resolved, context)
        return convert.gen_output_to_proto(out, version, self.replica_id)

    def _submit(self, request, resolved: Resolved, params, on_token=None) -> Future:
        return self.host.submit(resolved, list(request.prompt), params, request.num_samples,
                                prompt_logprobs=request.prompt_logprobs,
                                top_k_prompt_logprobs=request.top_k_prompt_logprobs, on_token=on_token)

    @staticmethod
    def _cancellable(context, fut: Future) -> Future:
        """`fut`, cancelled when the call ends early (the resource's deadline, a client gone), so abandoned
        work does not hold rows in the batch: under load retried samples otherwise piled up beside their
        abandoned copies (4x the rows)."""
        if not context.add_callback(fut.cancel):  # the call already ended
            fut.cancel()
        return fut

    def _outcome(self, fut: Future, resolved: Resolved, context) -> tuple[GenOutput, int]:
        """The engine's output and served version; a request cancelled because its call ended aborts with
        CANCELLED."""
        try:
            return self.host.outcome(fut, resolved)
        except CancelledError:
            context.abort(grpc.StatusCode.CANCELLED, "sample cancelled: the call ended")
            raise   # abort raises; this line is for the type checker

    def SampleStream(self, request, context):
        """Sample, sending each batch of new tokens as the engine reports them (``on_token``), then the
        whole answer. Errors end the stream with the status `Sample` would give."""
        try:
            resolved = self.host.resolve(request.session_id)
            params = params_from_proto(request.params)
            events: queue.SimpleQueue = queue.SimpleQueue()
            with self.host.in_flight():
                fut = self._cancellable(context, self._submit(
                    request, resolved, params, on_token=lambda s, t, _lp: events.put((s, t, time.time()))))
                fut.add_done_callback(lambda _f: events.put(None))
                yield from self._token_chunks(events, context)
                out, version = self._outcome(fut, resolved, context)
            yield generator_pb2.SampleStreamChunk(done=convert.gen_output_to_proto(out, version, self.replica_id))
        except ServiceError as err:
            abort(context, err)
        except ValueError as err:  # the engine's refusal of a prompt or parameters
            abort(context, invalid(str(err)))
        except Exception as err:
            if context.code() is not None:  # already ended (abort raises)
                raise
            abort(context, internal_error(err, what="SampleStream", session_id=request.session_id))

    @staticmethod
    def _token_chunks(events: queue.SimpleQueue, context) -> Iterator[generator_pb2.SampleStreamChunk]:
        """Chunks of the tokens in `events` until its None: every token waiting is sent in one chunk."""
        while context.is_active():
            item = events.get()
            items = [item]
            while item is not None:
                try:
                    item = events.get_nowait()
                except queue.Empty:
                    break
                items.append(item)
            toks = [x for x in items if x is not None]
            if toks:
                yield generator_pb2.SampleStreamChunk(tokens=generator_pb2.SampleTokens(
                    sequence=[s for s, _, _ in toks], token_ids=[t for _, t, _ in toks], sampled_at=toks[-1][2]))
            if items[-1] is None:
                return

    @handle_errors
    def ComputeLogprobs(self, request, context):
        seqs = [list(s.tokens) for s in request.sequences]
        session = None if request.source == generator_pb2.BASE else request.session_id
        logprobs, version = self.host.compute_logprobs(seqs, session)
        return generator_pb2.ComputeLogprobsResponse(
            sequences=[generator_pb2.LogprobSequence(logprobs=np.asarray(lp, dtype=np.float32).tolist()) for lp in logprobs],
            policy_version=version,
            replica_id=self.replica_id,
        )

    def PushWeights(self, request_iterator, context):
        """Receive one adapter version (header, data chunks or a shared-memory segment, checksum trailer) and
        load it: `wt.Receiver` verifies the bytes before the host loads anything, so a push that fails
        anywhere leaves the previous version serving; an older version than the one held is answered
        with the held one (`ReplicaHost.load`). A segment this replica cannot open is
        FAILED_PRECONDITION "cannot open shared-memory segment" (the client streams instead).
        """
        try:
            with self.receiver.receive(request_iterator) as push:
                header = push.header
                held = self.host.load(header.session_id, convert.lora_from_proto(header.lora, True), push.tensors,
                                      header.policy_version)
            return generator_pb2.PushWeightsResponse(
                session_id=header.session_id, policy_version=held, num_bytes=push.num_bytes,
                replica_id=self.replica_id)
        except ServiceError as err:
            abort(context, err)

    @handle_errors
    def DropWeights(self, request, context):
        self.host.drop(request.session_id)
        return generator_pb2.DropWeightsResponse()

    @handle_errors
    def Health(self, request, context):
        status = self.host.status()
        return generator_pb2.HealthResponse(
            replica_id=self.replica_id,
            ready=True,
            outstanding_requests=status.outstanding,
            loaded_versions=status.versions,
            engine=self.engine_name,
            weights_dtype=wt.wire_dtype(status.dtype),
            shared_memory=wt.shared_memory_available(),
            sampled_tokens=status.sampled_tokens,
        )
