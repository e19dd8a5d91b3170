"""`CheckpointRegistry`: the checkpoint calls of a `ResourceClient` (``client.checkpoints``).

Listing, search, metadata/TTL/pin updates, deletion and storage usage of the resource's checkpoints, the
resumable import of a PEFT adapter and the checked download of a checkpoint directory. The client builds one
and keeps its old method names (``client.list_checkpoints`` ...) as calls into it; like Tinker's
``RestClient``, it is the registry side of the resource, apart from sessions and sampling.

It calls through its client (`ClientHandle`): the same channel, API key metadata, retry policy and
``storage_dir``, read at each call (a `ClusterResource` adds its routing metadata after construction).
"""

from __future__ import annotations

import os
import pathlib
from typing import TYPE_CHECKING, Any

from together_train._proto import resource_pb2
from together_train.checkpoint_download import write_checkpoint_stream
from together_train.types import CheckpointInfo

if TYPE_CHECKING:
    from together_train._client_handle import ClientHandle

__all__ = ["CheckpointRegistry", "UNSET"]

#: `CheckpointRegistry.update_checkpoint`'s "leave as it is" (None means "never expires" for a TTL).
UNSET: Any = object()


class CheckpointRegistry:
    """The checkpoints of one resource, as its `ResourceClient` (``client``) reaches them. Thread-safe."""

    def __init__(self, client: "ClientHandle") -> None:
        self._client = client

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
        msg = self._client._call(
            self._client._resource.ListCheckpoints,
            resource_pb2.ListCheckpointsRequest(session_id=session_id or "", kind=kind or "", variant=variant or "",
                                                base_model=base_model or "", limit=int(limit), cursor=cursor or ""),
            what="ListCheckpoints",
        )
        return [CheckpointInfo.from_proto(c, self._client.storage_dir) for c in msg.checkpoints], msg.next_cursor

    def search_checkpoints(self, *, user_metadata: dict[str, str] | None = None, type: str | None = None,
                           base_model: str | None = None, session_id: str | None = None, owner: str | None = None,
                           limit: int = 50, cursor: str = "") -> tuple[list[CheckpointInfo], str]:
        """Checkpoints matching every filter, newest first: ``(checkpoints, next_cursor)`` ("" = last page).

        Args:
            user_metadata: pairs that must all match exactly.
            type: ``"training"``, ``"sampler"`` or ``"merged"``.
            base_model, session_id: only those.
            owner: another key's owner tag (`CheckpointInfo.owner`) or ``"*"`` for every key's:
                needs an admin key (serve ``--admin-key-file``); None = yours.
            limit: 1-200 per page. cursor: the previous page's ``next_cursor``.

        Each result carries user_metadata, expires_at, pinned, size_bytes.

        Raises:
            InvalidArgumentError: a limit out of 1-200, an unknown type, a bad cursor or metadata.
            PermissionDeniedError: `owner` without an admin key.
        """
        msg = self._client._call(
            self._client._resource.SearchCheckpoints,
            resource_pb2.SearchCheckpointsRequest(user_metadata=user_metadata or {}, type=type or "",
                                                  base_model=base_model or "", session_id=session_id or "",
                                                  owner=owner or "", limit=int(limit), cursor=cursor or ""),
            what="SearchCheckpoints",
        )
        return [CheckpointInfo.from_proto(c, self._client.storage_dir) for c in msg.checkpoints], msg.next_cursor

    def update_checkpoint(self, uri: str, *, user_metadata: dict[str, str] | None = None,
                          ttl_seconds: int | None | Any = UNSET, pinned: bool | None = None) -> CheckpointInfo:
        """Change a checkpoint's user metadata (replaced as a whole; {} clears), TTL (seconds from now;
        None or 0 = never expires) or pin; arguments left out stay as they are. Returns the updated info.

        Raises:
            InvalidArgumentError: bad URI, metadata or TTL (naming it). NotFoundError: unknown or another key's.
        """
        req = resource_pb2.UpdateCheckpointRequest(uri=uri)
        if user_metadata is not None:
            req.set_user_metadata = True
            req.user_metadata.update(user_metadata)
        if ttl_seconds is not UNSET:
            req.set_ttl, req.ttl_seconds = True, int(ttl_seconds or 0)
        if pinned is not None:
            req.set_pinned, req.pinned = True, bool(pinned)
        msg = self._client._call(self._client._resource.UpdateCheckpoint, req, what="UpdateCheckpoint")
        return CheckpointInfo.from_proto(msg, self._client.storage_dir)

    def import_adapter(self, path: str | os.PathLike, name: str, *, type: str = "training",
                       user_metadata: dict[str, str] | None = None, ttl_seconds: int | None = None,
                       pinned: bool = False, chunk_bytes: int = 2 << 20) -> CheckpointInfo:
        """Import a PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``,
        from peft or another trainer) as a checkpoint of this resource, streamed in `chunk_bytes` pieces.

        Args:
            path: the adapter directory.
            name: the checkpoint's name (1-128 of ``[A-Za-z0-9._-]``).
            type: ``"training"`` (a step-0 training checkpoint: ``create_session(checkpoint_uri=info.uri)``
                trains on with a fresh optimizer) or ``"sampler"`` (for ``compute_logprobs`` / OpenAI serving).
            user_metadata, ttl_seconds, pinned: as for `Session.save_weights`.

        Returns the stored checkpoint (``together-train://import-<id>/<state|weights>/<name>``).

        Resumable: the upload's id is derived from name, type and the files' sha256; when a stream breaks
        (the retry policy's transient errors) the next attempt asks the resource how many bytes of each
        file it kept (``GetImportProgress``) and sends only the rest.

        Raises:
            InvalidArgumentError: the adapter does not fit the base model (another base model, a target
                module it lacks, a shape that disagrees with the rank, NaN/inf, an unreadable dtype or key
                layout, an unsupported setting): the message names the file and tensor, and nothing is stored.
            FileNotFoundError: a file is missing locally.
        """
        from together_train.adapter_upload import adapter_files, upload_id_for, upload_messages

        files = adapter_files(os.fspath(path))
        uid = upload_id_for(name, type, files)
        header = resource_pb2.ImportAdapterHeader(name=name, type=type, user_metadata=user_metadata or {},
                                                  ttl_seconds=int(ttl_seconds or 0), pinned=pinned, upload_id=uid)

        def attempt() -> Any:  # each attempt continues where the resource's copy stops (resumable upload)
            got = self._client._call(self._client._resource.GetImportProgress, resource_pb2.GetImportProgressRequest(upload_id=uid),
                             what="GetImportProgress")
            return self._client._resource.ImportAdapter(upload_messages(header, files, chunk_bytes, dict(got.received)),
                                                timeout=None, metadata=self._client._metadata)

        self._client._check_open()
        msg = self._client.retry.call(attempt, idempotent=True, what="ImportAdapter")
        return CheckpointInfo.from_proto(msg, self._client.storage_dir)

    def storage_usage(self) -> dict[str, int]:
        """Checkpoint bytes per owner tag: your key's (an admin key: every key's)."""
        msg = self._client._call(self._client._resource.GetStorageUsage, resource_pb2.GetStorageUsageRequest(), what="GetStorageUsage")
        return {u.owner: int(u.bytes) for u in msg.usage}

    def delete_checkpoint(self, uri: str) -> None:
        """Delete a checkpoint. Raises NotFoundError when unknown."""
        self._client._call(self._client._resource.DeleteCheckpoint, resource_pb2.DeleteCheckpointRequest(uri=uri), what="DeleteCheckpoint")

    def download_checkpoint(self, uri: str, dest_dir: str | os.PathLike) -> pathlib.Path:
        """Download a checkpoint directory into `dest_dir` (created; files
        overwritten). Each file's size and sha256 are checked when the server
        sends them. Returns `dest_dir` as a Path.

        Raises:
            NotFoundError: unknown checkpoint.
            InternalError: a file's size or checksum does not match, or a path
                in the stream escapes `dest_dir`.
        """
        dest = pathlib.Path(dest_dir).resolve()

        def download() -> pathlib.Path:
            stream = self._client._resource.DownloadCheckpoint(
                resource_pb2.DownloadCheckpointRequest(uri=uri), timeout=None, metadata=self._client._metadata
            )
            return write_checkpoint_stream(stream, dest)

        self._client._check_open()
        return self._client.retry.call(download, what="DownloadCheckpoint")
