"""ResourceService and SessionService servicers: translate messages, call the ResourceApi."""

from __future__ import annotations

import json

from together_train._proto import resource_pb2, resource_pb2_grpc, session_pb2, session_pb2_grpc
from together_train_server.service.errors import ServiceError
from together_train_server.service.interfaces import ResourceApi
from together_train_server.wire import convert
from together_train_server.wire.lifecycle_convert import row_to_proto, save_options_from_proto
from together_train_server.wire.errors import abort, handle_errors, owner_of

CHUNK_BYTES = 2 << 20  # DownloadCheckpoint chunk size (2 MiB)


class ResourceServicer(resource_pb2_grpc.ResourceServiceServicer):
    """Capabilities, sessions and checkpoints of the resource."""

    def __init__(self, resource: ResourceApi) -> None:
        self.resource = resource

    @handle_errors
    def GetCapabilities(self, request, context):
        return convert.capabilities_to_proto(self.resource.capabilities())

    @handle_errors
    def CreateSession(self, request, context):
        # No lora message: the checkpoint's config (or the defaults without one).
        s = self.resource.sessions.create_session(
            convert.lora_from_proto(request.lora, True) if request.HasField("lora") else None,
            name=request.name,
            owner=owner_of(context),
            checkpoint_uri=request.checkpoint_uri,
            with_optimizer=request.with_optimizer,
        )
        if request.keep_last:
            self.resource.lifecycle.set_session_keep_last(s.session_id, request.keep_last)
        return convert.session_to_proto(self.resource, s)

    @handle_errors
    def GetSession(self, request, context):
        return convert.session_to_proto(self.resource, self.resource.session_table.get_session(request.session_id, owner_of(context)))

    @handle_errors
    def GetUsage(self, request, context):
        keys, sessions = self.resource.usage(owner_of(context), request.session_id)
        return resource_pb2.GetUsageResponse(keys=[resource_pb2.Usage(**u.as_dict()) for u in keys],
                                             sessions=[resource_pb2.Usage(**u.as_dict()) for u in sessions])

    @handle_errors
    def ListSessions(self, request, context):
        return resource_pb2.ListSessionsResponse(
            sessions=[convert.session_to_proto(self.resource, s) for s in self.resource.session_table.list_sessions(owner_of(context))]
        )

    @handle_errors
    def StopSession(self, request, context):
        return convert.session_to_proto(self.resource, self.resource.sessions.stop_session(request.session_id, owner_of(context)))

    @handle_errors
    def KeepAlive(self, request, context):
        return convert.session_to_proto(self.resource, self.resource.session_table.keep_alive(request.session_id, owner_of(context)))

    @handle_errors
    def ListCheckpoints(self, request, context):
        r = request
        ckpts, nxt = self.resource.checkpoints.page_checkpoints(owner_of(context), session_id=r.session_id, kind=r.kind,
                                                    variant=r.variant, base_model=r.base_model, limit=r.limit,
                                                    cursor=r.cursor)
        return resource_pb2.ListCheckpointsResponse(checkpoints=[convert.checkpoint_to_proto(c) for c in ckpts],
                                                    next_cursor=nxt)

    @handle_errors
    def DeleteCheckpoint(self, request, context):
        self.resource.checkpoints.delete_checkpoint(request.uri, owner_of(context))
        return resource_pb2.DeleteCheckpointResponse()

    @handle_errors
    def SearchCheckpoints(self, request, context):
        r = request
        rows, nxt = self.resource.lifecycle.search(
            owner_of(context), user_metadata=dict(r.user_metadata), type=r.type, base_model=r.base_model,
            session_id=r.session_id, of_owner=r.owner, limit=r.limit, cursor=r.cursor)
        return resource_pb2.SearchCheckpointsResponse(checkpoints=[row_to_proto(x) for x in rows], next_cursor=nxt)

    @handle_errors
    def UpdateCheckpoint(self, request, context):
        r = request
        row = self.resource.lifecycle.update(
            r.uri, owner_of(context), user_metadata=dict(r.user_metadata) if r.set_user_metadata else None,
            ttl_seconds=int(r.ttl_seconds) if r.set_ttl else False, pinned=r.pinned if r.set_pinned else None)
        return row_to_proto(row)

    @handle_errors
    def ImportAdapter(self, request_iterator, context):
        from together_train_server.service.interfaces import UploadChunk

        first = next(request_iterator, None)
        if first is None or not first.HasField("header"):
            raise ServiceError("INVALID_ARGUMENT", "the first ImportAdapter message must carry the header",
                               key="header")
        h = first.header

        def chunks():
            for m in (first, *()), request_iterator:
                for c in m:
                    if c.relative_path:
                        yield UploadChunk(c.relative_path, int(c.offset), bytes(c.data), int(c.file_size), c.sha256)

        ckpt = self.resource.importer.import_stream(
            chunks(), name=h.name, as_type=h.type, owner=owner_of(context),
            options={"user_metadata": dict(h.user_metadata), "ttl_seconds": int(h.ttl_seconds), "pinned": h.pinned},
            upload_id=h.upload_id)
        return convert.checkpoint_to_proto(ckpt)

    @handle_errors
    def GetImportProgress(self, request, context):
        return resource_pb2.ImportProgress(received=self.resource.importer.progress(request.upload_id,
                                                                                   owner_of(context)))

    @handle_errors
    def GetStorageUsage(self, request, context):
        usage = self.resource.lifecycle.usage(owner_of(context))
        return resource_pb2.GetStorageUsageResponse(
            usage=[resource_pb2.StorageUsage(owner=o, bytes=b) for o, b in sorted(usage.items())])

    @handle_errors
    def GetTokenizer(self, request, context):
        tok = self.resource.tokenizer_files()
        return resource_pb2.GetTokenizerResponse(
            model_id=tok.model_id, sha256=tok.sha256,
            files=[resource_pb2.TokenizerFile(name=name, data=data) for name, data in tok.files],
        )

    @handle_errors
    def GetRollout(self, request, context):
        r = self.resource.rollouts.get(owner_of(context), request.rollout_id)
        return resource_pb2.Rollout(rollout_id=r.rollout_id, created=r.created, calls=[
            resource_pb2.RolloutCall(
                model=c.model, prompt_tokens=c.prompt_tokens, messages_json=json.dumps(c.messages), created=c.created,
                choices=[resource_pb2.RolloutChoice(tokens=ch.tokens, logprobs=ch.logprobs,
                                                    policy_versions=ch.policy_versions,
                                                    finish_reason=ch.finish_reason, text=ch.text)
                         for ch in c.choices])
            for c in r.calls])

    @handle_errors
    def DeleteRollout(self, request, context):
        self.resource.rollouts.delete(owner_of(context), request.rollout_id)
        return resource_pb2.DeleteRolloutResponse()

    def DownloadCheckpoint(self, request, context):
        """Stream every file of a verified checkpoint in chunks of at most CHUNK_BYTES.

        Each file starts with a chunk carrying its size and sha256 (an empty
        file is one empty chunk); the client checks both.
        """
        try:
            _, files = self.resource.checkpoints.checkpoint_files(request.uri, owner_of(context))
        except ServiceError as err:
            abort(context, err)
        for rel, path, size, sha in files:
            with open(path, "rb") as f:
                offset, first = 0, True
                while first or offset < size:
                    data = f.read(CHUNK_BYTES)
                    yield resource_pb2.CheckpointChunk(
                        relative_path=rel,
                        offset=offset,
                        data=data,
                        file_size=size if first else 0,
                        sha256=sha if first else "",
                    )
                    offset += len(data)
                    first = False
                    if not data:
                        break


class SessionServicer(session_pb2_grpc.SessionServiceServicer):
    """Trainer-side operations: each returns the queued Operation at once."""

    def __init__(self, resource: ResourceApi) -> None:
        self.resource = resource

    def _header(self, request, context) -> tuple[str, int, str]:
        """(session id, seq_id, idempotency key) of an operation request, after checking the session.

        The order of every check (credentials by the interceptor, then here the session: it exists,
        belongs to the caller, is ACTIVE; only then the payload) so the answer to a call on an
        unknown, another key's or a stopped session never depends on what the call carries.
        """
        h = request.header
        if not h.session_id:
            raise ServiceError("INVALID_ARGUMENT", "header.session_id is required", key="session_id")
        self.resource.session_table.active_session(h.session_id, owner_of(context))
        return h.session_id, h.seq_id, h.idempotency_key

    def _forward(self, request, context, backward: bool):
        sid, seq, key = self._header(request, context)
        rec = self.resource.submissions.submit_forward(
            sid,
            seq,
            key,
            samples=convert.samples_from_proto(request.samples, self.resource.limits),
            loss_fn=request.loss_fn,
            loss_params=convert.loss_params_from_proto(request.loss_fn_config),
            backward=backward,
            return_logprobs=request.outputs.logprobs,
            return_elementwise=request.outputs.elementwise_loss,
            owner=owner_of(context),
        )
        return convert.operation_to_proto(rec)

    @handle_errors
    def Forward(self, request, context):
        return self._forward(request, context, backward=False)

    @handle_errors
    def ForwardBackward(self, request, context):
        return self._forward(request, context, backward=True)

    @handle_errors
    def CustomForwardBackward(self, request, context):
        sid, seq, key = self._header(request, context)
        rec = self.resource.submissions.submit_custom_forward_backward(
            sid,
            seq,
            key,
            samples=convert.samples_from_proto(request.samples, self.resource.limits),
            gradients=convert.gradients_from_proto(request.gradients, request.samples, self.resource.limits),
            return_logprobs=request.outputs.logprobs,
            return_elementwise=request.outputs.elementwise_loss,
            owner=owner_of(context),
        )
        return convert.operation_to_proto(rec)

    @handle_errors
    def OptimStep(self, request, context):
        sid, seq, key = self._header(request, context)
        rec = self.resource.submissions.submit_optim_step(
            sid, seq, key, convert.adam_from_proto(request.adam_params), owner=owner_of(context)
        )
        return convert.operation_to_proto(rec)

    @handle_errors
    def WeightsSync(self, request, context):
        sid, seq, key = self._header(request, context)
        if request.mode not in session_pb2.SyncMode.values():
            # An unknown enum number (proto3 keeps it) must not silently run as synchronous.
            names = ", ".join(f"{n} ({v})" for n, v in session_pb2.SyncMode.items())
            raise ServiceError("INVALID_ARGUMENT", f"unknown weights_sync mode {request.mode}; one of {names}", key="mode")
        background = request.mode == session_pb2.BACKGROUND
        return convert.operation_to_proto(
            self.resource.submit_weights_sync(sid, seq, key, background, owner=owner_of(context))
        )

    @handle_errors
    def SaveWeights(self, request, context):
        sid, seq, key = self._header(request, context)
        return convert.operation_to_proto(
            self.resource.submit_save_weights(sid, seq, key, request.name, request.merged, owner=owner_of(context),
                                              options=save_options_from_proto(request))
        )

    @handle_errors
    def SaveState(self, request, context):
        sid, seq, key = self._header(request, context)
        return convert.operation_to_proto(
            self.resource.submit_save_state(sid, seq, key, request.name, owner=owner_of(context),
                                            options=save_options_from_proto(request))
        )

    @handle_errors
    def LoadState(self, request, context):
        sid, seq, key = self._header(request, context)
        return convert.operation_to_proto(
            self.resource.submit_load_state(
                sid, seq, key, request.uri, request.with_optimizer, owner=owner_of(context)
            )
        )

    @handle_errors
    def Snapshot(self, request, context):
        sid, seq, key = self._header(request, context)
        return convert.operation_to_proto(self.resource.snapshots.submit_snapshot(sid, seq, key, owner=owner_of(context)))

    @handle_errors
    def ReleaseSnapshot(self, request, context):
        if not request.snapshot_id:
            raise ServiceError("INVALID_ARGUMENT", "snapshot_id is required", key="snapshot_id")
        released = self.resource.snapshots.release(request.snapshot_id, owner_of(context))
        return session_pb2.ReleaseSnapshotResponse(released=released)

    @handle_errors
    def GetOperation(self, request, context):
        return convert.operation_to_proto(self.resource.submissions.get_operation(request.operation_id, owner_of(context)))

    @handle_errors
    def WaitOperation(self, request, context):
        rec = self.resource.submissions.wait_operation(request.operation_id, request.timeout_seconds, owner_of(context))
        return convert.operation_to_proto(rec)

    @handle_errors
    def CancelOperation(self, request, context):
        return convert.operation_to_proto(self.resource.submissions.cancel_operation(request.operation_id, owner_of(context)))
