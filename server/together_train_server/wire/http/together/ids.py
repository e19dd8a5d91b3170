"""The Together API's ids and tables: the model resource, session extras, operations, payloads, checkpoint ids.

Checkpoint ids are ``<session>.<kind>.<name>``: our URI ``together-train://<session>/<kind>/<name>``,
reversible without a table. An operation id is our operation id (the last one of its records).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from together_train_server.service.interfaces import Checkpoint, CheckpointRow, ResourceApi, URI_SCHEME
from together_train_server.service.errors import ServiceError

# Operation entries kept at least (the operation book keeps 10,000 records for an hour); older ones whose
# records the book evicted are forgotten.
OPS_KEPT = 10_000
MERGED_SUFFIX = ".merged"
# Signed URLs (checkpoint files, payload uploads) are valid this long; an uploaded payload is kept this long.
URL_TTL_S = 900.0
PAYLOAD_TTL_S = 3600.0


@dataclass
class SessionExtras:
    """What the Together API keeps about a session that our SessionRecord has no field for (display name and
    metadata live in the model registry, so they outlive a restart)."""

    resume_from_checkpoint_id: str | None = None
    updated_at: float = field(default_factory=time.time)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class OpEntry:
    """A Together operation: its kind, our operation ids (one, or two for an inference
    checkpoint) and what its output needs that the result lacks (request inputs, flags)."""

    kind: str
    session_id: str
    owner: str
    records: list[str]
    extra: dict[str, Any] = field(default_factory=dict)


# A parsed operation: (submit at the session queue's next seq_id -> its operation records, OpEntry.extra).
Prepared = tuple[Callable[[int], list[Any]], dict[str, Any]]


@dataclass
class Payload:
    """A request body uploaded to a signed URL (``payloads/upload-url``), stored at `path` until `expires_at`."""

    payload_id: str
    session_id: str
    owner: str
    path: Path
    expires_at: float
    complete: bool = False


class TogetherIds:
    """The model resource's state, session extras, operation entries, payloads and the URL-signing key."""

    def __init__(self, resource: ResourceApi) -> None:
        self.lock = threading.Lock()
        self.resource_id = f"mr-{uuid.uuid4().hex[:16]}"
        self.status = "MODEL_RESOURCES_STATUS_READY"
        self.created_at = self.updated_at = time.time()
        self.expires_at = 0.0  # extend_expiry's promise (our sessions expire by their own idle timer)
        self.sessions: dict[str, SessionExtras] = {}
        self.ops: dict[str, OpEntry] = {}
        self.by_key: dict[tuple[str, str], str] = {}  # (session id, Idempotency-Key) -> operation id
        self.payloads: dict[str, Payload] = {}
        self.secret = secrets.token_bytes(32)
        self.payload_dir = resource.scratch_dir("payloads")
        # A JSON body is ~3x its binary tensors; beyond this an upload is refused (413).
        self.max_payload_bytes = max(64 << 20, 8 * int(resource.max_request_bytes()))

    def prune(self, resource: ResourceApi) -> None:
        """Forget the oldest operations beyond OPS_KEPT whose records the operation book has evicted
        (caller holds `lock`); their ids then answer 404, as the book's own evicted ids do."""
        gone = set()
        for op_id in list(self.ops)[: len(self.ops) - OPS_KEPT]:
            try:
                resource.submissions.get_operation(self.ops[op_id].records[0], self.ops[op_id].owner)
            except ServiceError:
                del self.ops[op_id]
                gone.add(op_id)
        if gone:
            self.by_key = {k: v for k, v in self.by_key.items() if v not in gone}

    def extras(self, session_id: str) -> SessionExtras:
        """The session's extras (created on first use)."""
        with self.lock:
            return self.sessions.setdefault(session_id, SessionExtras())

    def sign(self, *parts: str) -> str:
        """HMAC-SHA256 (hex) of `parts` under this server run's secret."""
        return hmac.new(self.secret, "|".join(parts).encode(), hashlib.sha256).hexdigest()

    def check_sig(self, sig: str, expires: str, *parts: str) -> None:
        """Raises ServiceError PERMISSION_DENIED for a wrong or expired signature."""
        try:
            exp = float(expires)
        except ValueError:
            exp = 0.0
        if exp < time.time() or not hmac.compare_digest(self.sign(*parts, expires), sig or ""):
            raise ServiceError("PERMISSION_DENIED", "this URL's signature is wrong or has expired; request a new one",
                               key="sig")


def ckpt_id(c: Checkpoint | CheckpointRow) -> str:
    """A checkpoint's Together id ``<session>.<kind>.<name>``."""
    return f"{c.session_id}.{c.kind}.{c.name}"


def uri_of(checkpoint_id: str) -> str:
    """Our checkpoint URI of a Together checkpoint id; NOT_FOUND for one that is not ours."""
    parts = checkpoint_id.split(".", 2)
    if len(parts) != 3 or parts[1] not in ("weights", "state"):
        raise ServiceError("NOT_FOUND", f"unknown checkpoint {checkpoint_id!r}", key="checkpoint_id")
    return f"{URI_SCHEME}{parts[0]}/{parts[1]}/{parts[2]}"


def ckpt_id_of_uri(uri: str) -> str:
    """The Together id of our checkpoint URI (the inverse of `uri_of`)."""
    sid, kind, name = uri[len(URI_SCHEME):].split("/", 2)
    return f"{sid}.{kind}.{name}"
