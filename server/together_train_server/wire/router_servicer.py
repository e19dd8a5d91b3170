"""GeneratorService on the resource: translates Sample / SampleStream onto the resource's one sampling road
(`Sampling`: checks, routing, telemetry) and routes ComputeLogprobs to a replica (least outstanding)."""

from __future__ import annotations

import dataclasses

import grpc

from together_train._proto import generator_pb2, generator_pb2_grpc
from together_train_server.service.interfaces import CallerGone, ResourceApi, SampleOutput, SampleRequest, check_counts
from together_train_server.service.errors import ServiceError, invalid
from together_train_server.wire import convert
from together_train_server.wire.errors import abort, handle_errors, owner_of
from together_train_server.wire.sampling_params import params_from_proto


class RouterServicer(generator_pb2_grpc.GeneratorServiceServicer):
    """Clients need one address: the resource serves sampling by routing to its replicas."""

    def __init__(self, resource: ResourceApi) -> None:
        self.resource = resource

    def _weights(self, session_id: str, checkpoint_uri: str, snapshot_id: str, context) -> tuple[str, int, str]:
        """(replica adapter key, version, session metered) of what a call names: at most one of a session
        (its synced weights), a checkpoint or a snapshot; none = the base model. A checkpoint is only
        looked up here (NOT_FOUND naming it): `_request` loads it once the request passed its checks."""
        r, owner = self.resource, owner_of(context)
        named = [k for k, v in (("session_id", session_id), ("checkpoint_uri", checkpoint_uri),
                                ("snapshot_id", snapshot_id)) if v]
        if len(named) > 1:
            raise invalid(f"give one of session_id, checkpoint_uri and snapshot_id, not {' and '.join(named)}",
                          key=named[1])
        if checkpoint_uri:
            r.checkpoints.get_checkpoint(checkpoint_uri, owner)
            return "", -1, ""
        if snapshot_id:
            snap = r.snapshots.get(snapshot_id, owner)
            return snap.key, snap.version, snap.session_id
        return (*r.sessions.check_sample_session(session_id, owner), session_id)

    def _request(self, request, context) -> tuple[SampleRequest, int, str]:
        """A Sample request checked by the resource's one sampling road (the caller's session, the limits,
        the memory budget): (the plain request, the version it names, the session metered)."""
        r = self.resource
        key, version, scope = self._weights(request.session_id, request.checkpoint_uri, request.snapshot_id, context)
        req = r.sampling.request(key, request.prompt, params_from_proto(request.params),
                                 num_samples=request.num_samples or 1, prompt_logprobs=request.prompt_logprobs,
                                 top_k_prompt_logprobs=request.top_k_prompt_logprobs,
                                 gone=self._caller_gone(context))
        if request.checkpoint_uri:  # its adapter is pushed to the replicas under a synthetic key
            key, version = r.checkpoints.checkpoint_scoring_key(request.checkpoint_uri, owner_of(context))
            req = dataclasses.replace(req, key=key)
        return req, version, scope

    @staticmethod
    def _caller_gone(context: grpc.ServicerContext) -> CallerGone:
        """Set when this call ends (the client cancelled it, its deadline passed, or it finished): the
        replica call serving it is cancelled then, so a client's ``cancel()`` reaches the replica's batch."""
        gone = CallerGone()
        if not context.add_callback(gone.set):  # the call already ended
            gone.set()
        return gone

    @staticmethod
    def _response(out: SampleOutput, version: int) -> generator_pb2.SampleResponse:
        """The answer's message; a base-model answer to a fresh session (version 0) carries that version."""
        served = version if version >= 0 and out.policy_version < 0 else out.policy_version
        return convert.gen_output_to_proto(out, served, out.replica_id)

    @handle_errors
    def Sample(self, request, context):
        req, version, scope = self._request(request, context)
        out = self.resource.sampling.sample(req, scope=scope, record="call")
        return self._response(out, version)

    def SampleStream(self, request, context):
        """Sample with the tokens sent as the replica samples them (checked and routed as `Sample`)."""
        try:
            req, version, scope = self._request(request, context)
            for item in self.resource.sampling.sample_stream(req, scope=scope, record="call"):
                if isinstance(item, SampleOutput):
                    yield generator_pb2.SampleStreamChunk(done=self._response(item, version))
                else:
                    seqs, toks = zip(*item.tokens) if item.tokens else ((), ())
                    yield generator_pb2.SampleStreamChunk(tokens=generator_pb2.SampleTokens(
                        sequence=seqs, token_ids=toks, sampled_at=item.sampled_at))
        except ServiceError as e:
            abort(context, e)

    @handle_errors
    def ComputeLogprobs(self, request, context):
        r = self.resource
        checkpoint = request.source == generator_pb2.CHECKPOINT
        if checkpoint and not request.checkpoint_uri:
            raise invalid("source=CHECKPOINT needs checkpoint_uri", key="checkpoint_uri")
        snapshot = request.source == generator_pb2.SNAPSHOT
        if snapshot and not request.snapshot_id:
            raise invalid("source=SNAPSHOT needs snapshot_id", key="snapshot_id")
        use_session = not checkpoint and not snapshot and (
            request.source == generator_pb2.SESSION
            or (request.source == generator_pb2.LOGPROB_SOURCE_UNSPECIFIED and bool(request.session_id))
        )
        adapter_key, version, scope = "", -1, request.session_id
        if snapshot:
            snap = r.snapshots.get(request.snapshot_id, owner_of(context))
            adapter_key, version, scope = snap.key, snap.version, snap.session_id
        if use_session:
            if not request.session_id:
                raise invalid("source=SESSION needs session_id", key="session_id")
            adapter_key, version = r.sessions.check_sample_session(request.session_id, owner_of(context))
        if not request.sequences:
            raise invalid("no sequences to score", key="sequences")
        # Counts from the message first: an oversized request is refused before any list is built.
        check_counts([len(s.tokens) for s in request.sequences], r.limits, key="tokens")
        for i, seq in enumerate(request.sequences):
            n = len(seq.tokens)
            if n < 2:
                raise invalid("a sequence needs at least 2 tokens to score", sample_index=i, key="tokens")
            if n > r.limits.max_seq_len:
                raise invalid(
                    f"sequence of {n} tokens is longer than the context length {r.limits.max_seq_len}",
                    sample_index=i,
                    key="tokens",
                )
            bad = [t for t in seq.tokens if not 0 <= t < r.limits.vocab_size]
            if bad:
                raise invalid(
                    f"token id {bad[0]} is outside the vocabulary [0, {r.limits.vocab_size})", sample_index=i, key="tokens"
                )
        r.admission.check_scoring([len(s.tokens) for s in request.sequences], "compute_logprobs")
        if checkpoint:
            # The checkpoint's adapter is pushed to the replicas under a synthetic key.
            adapter_key, version = r.checkpoints.checkpoint_scoring_key(request.checkpoint_uri, owner_of(context))
        out = r.sampling.score(adapter_key, [list(s.tokens) for s in request.sequences], scope=scope)
        if checkpoint or snapshot:
            served = version
        else:
            served = max(version, out.policy_version) if use_session else -1
        return generator_pb2.ComputeLogprobsResponse(
            sequences=[generator_pb2.LogprobSequence(logprobs=lp) for lp in out.logprobs],
            policy_version=served, replica_id=out.replica_id)

    @handle_errors
    def PushWeights(self, request_iterator, context):
        raise ServiceError(
            "UNIMPLEMENTED", "the resource pushes weights to its replicas itself: call weights_sync on the session"
        )

    @handle_errors
    def DropWeights(self, request, context):
        raise ServiceError("UNIMPLEMENTED", "stop the session to drop its weights from the replicas")

    @handle_errors
    def Health(self, request, context):
        # One ReplicaStatus per replica; adapter versions of other API keys' sessions are left out.
        view = self.resource.session_rows.replica_view(owner_of(context))
        return generator_pb2.HealthResponse(
            replica_id="router",
            ready=any(r["state"] == "healthy" for r in view),
            outstanding_requests=sum(r["outstanding"] for r in view),
            engine=self.resource.generator_engine,
            replicas=[
                generator_pb2.ReplicaStatus(
                    replica_id=r["replica_id"], address=r["address"], state=r["state"],
                    loaded_versions=r["versions"], outstanding_requests=r["outstanding"], restarts=r["restarts"],
                )
                for r in view
            ],
        )
