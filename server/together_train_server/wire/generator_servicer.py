"""GeneratorService on a replica process: sampling and scoring over a generator engine."""

from __future__ import annotations

import hashlib
import queue
import threading
import time
import uuid
from concurrent.futures import CancelledError, Future
from typing import Iterator

import grpc
import numpy as np
import xxhash

from together_train._proto import common_pb2, generator_pb2, generator_pb2_grpc
from together_train_server.engines.adapter_residency import AdapterResidency
from together_train_server.engines.interfaces import GeneratorEngine
from together_train_server.engines.types import GenOutput
from together_train_server.service.errors import ServiceError, internal_error, invalid
from together_train_server.wire import convert, weights_transfer as wt
from together_train_server.wire.sampling_params import params_from_proto
from together_train_server.wire.errors import abort, handle_errors

_NP = {common_pb2.FLOAT32: np.float32, common_pb2.INT64: np.int64}


class ReplicaServicer(generator_pb2_grpc.GeneratorServiceServicer):
    """One generator replica: holds each session's latest pushed adapter version.

    A request for a session samples with that session's adapter; a session
    with no adapter pushed here is FAILED_PRECONDITION (retryable), so the
    resource can re-push rather than silently serve base weights.

    Versions: pushes are tagged (``load_adapter(..., version=v)``) and a
    sample reports the engine's ``GenOutput.adapter_version`` (the version
    that produced its tokens, even when a push landed while it was queued or
    decoding). ``ComputeLogprobs`` and a push of the same session are
    serialised so the reported version is the one that scored.

    Args:
        engine: the `GeneratorEngine` (torch or vLLM).
        replica_id: the name in answers and logs (default a random one).
        engine_name: ``"torch"`` | ``"vllm"``, reported by Health.
    """

    def __init__(self, engine: GeneratorEngine, replica_id: str | None = None, engine_name: str = "torch",
                 max_adapters: int = 0) -> None:
        self.engine = engine
        # At most max_adapters loaded in the engine, least recently used evicted (0 = no limit).
        self.residency = AdapterResidency(max_adapters)
        self.replica_id = replica_id or f"replica-{uuid.uuid4().hex[:8]}"
        self.engine_name = engine_name
        self.versions: dict[str, int] = {}
        self._lock = threading.Lock()
        self._outstanding = 0
        self._session_locks: dict[str, threading.Lock] = {}
        self._segments = wt.SegmentReader()  # pushers' shared-memory segments, mapped once
        self._buffers = wt.ReceiveBuffers()  # streamed pushes' buffers, reused by the next of that layout

    def _session_lock(self, session_id: str) -> threading.Lock:
        with self._lock:
            return self._session_locks.setdefault(session_id, threading.Lock())

    def _adapter(self, session_id: str) -> tuple[str | None, int]:
        if not session_id:
            return None, -1
        with self._lock:
            if session_id not in self.versions or self.residency.is_evicted(session_id):
                raise self._lacks(session_id)
            self.residency.touch(session_id)
            return session_id, self.versions[session_id]

    def _lacks(self, session_id: str) -> ServiceError:
        """The "holds no weights" answer: the resource's pool re-pushes the adapter and retries."""
        why = (f" (evicted: this replica keeps the {self.residency.capacity} most recently used adapters, "
               "--max-adapters)" if self.residency.is_evicted(session_id) else "")
        return ServiceError("FAILED_PRECONDITION", f"replica {self.replica_id} holds no weights for session "
                            f"{session_id}{why}", key="session_id", retryable=True)

    def _evict(self, keys: list[str]) -> None:
        """Drop evicted adapters from the engine (requests already using one finish on it)."""
        for key in keys:
            with self._session_lock(key):
                with self._lock:
                    still = self.residency.is_evicted(key)   # not pushed again meanwhile
                if still:
                    try:
                        self.engine.drop_adapter(key)
                    except KeyError:
                        pass

    @handle_errors
    def Sample(self, request, context):
        adapter, version = self._adapter(request.session_id)
        params = params_from_proto(request.params)
        with self._lock:
            self._outstanding += 1
        args = (list(request.prompt), params, max(1, request.num_samples), adapter)
        kw = dict(prompt_logprobs=request.prompt_logprobs, top_k_prompt_logprobs=request.top_k_prompt_logprobs)
        try:
            out = self._result(self._submit_cancellable(context, self.engine.submit, *args, **kw), context)
        except KeyError:   # evicted between the table lookup and the engine's
            raise self._lacks(request.session_id) from None
        finally:
            with self._lock:
                self._outstanding -= 1
        return convert.gen_output_to_proto(out, self._served_version(out, adapter, version), self.replica_id)

    @staticmethod
    def _submit_cancellable(context, submit, *args, **kw) -> Future:
        """``submit(*args, **kw)`` whose engine request is cancelled when the call ends early (the
        resource's deadline, a client gone), so abandoned work does not hold rows in the batch: under
        load retried samples otherwise piled up beside their abandoned copies (4x the rows)."""
        fut = submit(*args, **kw)
        if not context.add_callback(fut.cancel):  # the call already ended
            fut.cancel()
        return fut

    @staticmethod
    def _result(fut: Future, context):
        """The engine's output; a request cancelled because its call ended aborts with CANCELLED."""
        try:
            return fut.result()
        except CancelledError:
            context.abort(grpc.StatusCode.CANCELLED, "sample cancelled: the call ended")

    @staticmethod
    def _served_version(out: GenOutput, adapter: str | None, version: int) -> int:
        """The version tag of the adapter that served ``out`` (the engine's, when it reports one)."""
        served = out.adapter_version
        return int(served) if adapter is not None and served is not None else version

    def SampleStream(self, request, context):
        """Sample, sending each batch of new tokens as the engine reports them (``on_token``), then the
        whole answer. Errors end the stream with the status `Sample` would give."""
        try:
            adapter, version = self._adapter(request.session_id)
            params = params_from_proto(request.params)
            events: queue.SimpleQueue = queue.SimpleQueue()
            with self._lock:
                self._outstanding += 1
            try:
                fut = self._submit_cancellable(
                    context, self.engine.submit, list(request.prompt), params, max(1, request.num_samples), adapter,
                    prompt_logprobs=request.prompt_logprobs, top_k_prompt_logprobs=request.top_k_prompt_logprobs,
                    on_token=lambda s, t, _lp: events.put((s, t, time.time())))
                fut.add_done_callback(lambda _f: events.put(None))
                yield from self._token_chunks(events, context)
                out = self._result(fut, context)
            finally:
                with self._lock:
                    self._outstanding -= 1
            yield generator_pb2.SampleStreamChunk(done=convert.gen_output_to_proto(
                out, self._served_version(out, adapter, version), self.replica_id))
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
        if request.source == generator_pb2.BASE:
            adapter, version = None, -1
            logprobs = self.engine.compute_logprobs(seqs, None)
        else:
            with self._session_lock(request.session_id):  # no push between version read and scoring
                adapter, version = self._adapter(request.session_id)
                logprobs = self.engine.compute_logprobs(seqs, adapter)
        return generator_pb2.ComputeLogprobsResponse(
            sequences=[generator_pb2.LogprobSequence(logprobs=np.asarray(lp, dtype=np.float32).tolist()) for lp in logprobs],
            policy_version=version,
            replica_id=self.replica_id,
        )

    def PushWeights(self, request_iterator, context):
        """Receive one adapter version (header, data chunks or a shared-memory segment, checksum trailer).

        The bytes go straight into one buffer sized from the header (or are
        mapped from the segment), the checksum (xxh3-128, or sha256 from older
        clients) is checked over all of them, and only then is the adapter
        loaded: a push that fails anywhere leaves the previous version serving.
        A segment this replica cannot open is FAILED_PRECONDITION "cannot open
        shared-memory segment" (the client streams instead).
        """
        segment = arr = None
        ok = False
        kept: tuple | None = None  # (metas, buffer, views): given back to self._buffers at the end
        try:
            header, data, digest, algo, views = None, None, None, None, None
            received = 0
            hasher = xxhash.xxh3_128()   # over the streamed chunks as they arrive
            for msg in request_iterator:
                part = msg.WhichOneof("part")
                if part == "header":
                    header = msg.header
                    if header.HasField("segment") and header.segment.name:
                        try:
                            segment = header.segment.name
                            data = self._segments.open(segment, header.segment.size)
                        except ValueError as e:
                            raise invalid(str(e), key="segment") from None
                        except wt.SegmentError as e:
                            raise ServiceError("FAILED_PRECONDITION", str(e), key="segment", retryable=True) from None
                        received = data.numel()
                    else:
                        try:
                            data, views = self._buffers.take(header.tensors)
                        except (ValueError, RuntimeError) as e:
                            raise invalid(f"PushWeights header: {e}", key="tensors") from None
                        arr = data.numpy()
                elif part == "data":
                    if data is None or segment is not None:
                        raise invalid("PushWeights data chunks need a header without a segment first", key="data")
                    n = len(msg.data)
                    if received + n > data.numel():
                        raise invalid(f"PushWeights carried more than the {data.numel()} bytes its header describes",
                                      key="data")
                    arr[received: received + n] = np.frombuffer(msg.data, dtype=np.uint8)
                    hasher.update(msg.data)   # while the next chunk is on its way
                    received += n
                elif part == "trailer_sha256":
                    digest, algo = msg.trailer_sha256, "sha256"
                elif part == "trailer_xxh3_128":
                    digest, algo = msg.trailer_xxh3_128, "xxh3_128"
            if header is None or digest is None:
                raise invalid("PushWeights needs a header first and a trailer last", key="part")
            if received != data.numel():
                raise invalid(f"PushWeights carried {received} bytes, the header describes {data.numel()}", key="data")
            if algo == "xxh3_128" and segment is None:
                got = hasher.hexdigest()
            else:
                buf = data.numpy()
                got = hashlib.sha256(buf).hexdigest() if algo == "sha256" else wt.checksum(buf)
                del buf
            if got != digest:
                raise ServiceError("DATA_LOSS", "PushWeights checksum mismatch", retryable=True)
            try:
                tensors = views if views is not None else wt.unpack(header.tensors, data)
            except ValueError as e:
                raise invalid(f"PushWeights: {e}", key="tensors") from None
            if segment is None:  # the engine copies the tensors (GeneratorEngine.load_adapter): reusable
                kept = (header.tensors, data, tensors)
            data = arr = None
            with self._lock:
                if self.versions.get(header.session_id, -1) > header.policy_version:
                    # An older version arriving late never replaces a newer one.
                    return generator_pb2.PushWeightsResponse(
                        session_id=header.session_id,
                        policy_version=self.versions[header.session_id],
                        num_bytes=received,
                        replica_id=self.replica_id,
                    )
            lora = convert.lora_from_proto(header.lora, True)
            with self._session_lock(header.session_id):
                try:
                    self.engine.load_adapter(header.session_id, lora, tensors, version=header.policy_version)
                except ValueError as e:
                    raise invalid(f"pushed adapter rejected: {e}", key="tensors") from None
                with self._lock:
                    self.versions[header.session_id] = header.policy_version
                    victims = self.residency.loaded(header.session_id)
            self._evict(victims)
            ok = True
            return generator_pb2.PushWeightsResponse(
                session_id=header.session_id,
                policy_version=header.policy_version,
                num_bytes=received,
                replica_id=self.replica_id,
            )
        except ServiceError as err:
            abort(context, err)
        finally:
            if kept is not None:
                self._buffers.give(*kept)
            if segment is not None and not ok:
                tensors = data = None
                self._segments.forget(segment)  # the pusher drops a segment whose push failed

    @handle_errors
    def DropWeights(self, request, context):
        with self._lock:
            known = self.versions.pop(request.session_id, None)
            loaded = self.residency.forget(request.session_id)
        if known is not None and loaded:
            self.engine.drop_adapter(request.session_id)
        return generator_pb2.DropWeightsResponse()

    @handle_errors
    def Health(self, request, context):
        with self._lock:
            return generator_pb2.HealthResponse(
                replica_id=self.replica_id,
                ready=True,
                outstanding_requests=self._outstanding,
                loaded_versions=dict(self.versions),
                engine=self.engine_name,
                weights_dtype=wt.wire_dtype(str(self.engine.dtype)),
                shared_memory=wt.shared_memory_available(),
                sampled_tokens=int(getattr(self.engine, "stats", {}).get("sampled_tokens", 0)),
            )
