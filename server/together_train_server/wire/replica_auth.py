"""Replica credential: only the resource that owns a generator replica may call it (docs/design.md §10).

A replica's GeneratorService (Sample, ComputeLogprobs, PushWeights,
DropWeights, Health) can read and replace every session's private adapter, so
each call must carry the replica secret in the ``together-train-replica-secret``
metadata. The resource makes a random secret at start (or reads
``serve --replica-secret-file``), hands it to the replicas it spawns through a
0600 file, and sends it on every call. Replicas attached with
``--generator-address`` are started with the same file
(``together-train generator --replica-secret-file F``).

The standard ``grpc.health.v1.Health`` service and reflection stay open: they
say SERVING / list service names and reveal no session id.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from pathlib import Path

import grpc

from together_train_server.wire.auth import _OPEN_PREFIXES

METADATA_KEY = "together-train-replica-secret"


def new_secret() -> str:
    """A fresh random secret: 32 bytes from `secrets`, URL-safe base64 (43 characters)."""
    return secrets.token_urlsafe(32)


def write_secret_file(path: Path, secret: str) -> Path:
    """Create ``path`` (must not exist) readable and writable by this user only (0600), holding `secret`.

    The mode is set at creation (``os.open``), so the secret is never briefly readable by others.

    Raises:
        FileExistsError: ``path`` exists already.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return Path(path)


def read_secret_file(path: Path) -> str:
    """The secret in ``path`` (first line, stripped).

    Raises:
        ValueError: the file is readable or writable by group or others (``chmod 600`` it), or
            holds no secret, a secret shorter than 16 characters, or one that is not printable
            ASCII (gRPC metadata). The message names the file.
        FileNotFoundError: no such file.
    """
    path = Path(path)
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(
            f"replica secret file {path} is accessible by group/others (mode {stat.S_IMODE(mode):o}); "
            f"run `chmod 600 {path}`"
        )
    lines = path.read_text().splitlines()
    secret = lines[0].strip() if lines else ""
    if len(secret) < 16:
        raise ValueError(f"replica secret file {path} holds no secret of at least 16 characters on its first line")
    if not (secret.isascii() and secret.isprintable()):
        # gRPC metadata values are printable ASCII; anything else would fail on every call, not here.
        raise ValueError(f"replica secret file {path}: the secret must be printable ASCII (e.g. base64)")
    return secret


class ReplicaSecretInterceptor(grpc.ServerInterceptor):
    """Refuses every call except gRPC health/reflection with UNAUTHENTICATED unless it carries the secret.

    The secret is compared with `hmac.compare_digest` (constant time). A refused
    client-streaming call (PushWeights) is answered without reading its stream.
    """

    def __init__(self, secret: str) -> None:
        if not secret:
            raise ValueError("the replica secret is empty")
        self._secret = secret.encode()

        def deny(request_or_iterator, context):
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"generator replicas answer only their resource: missing or wrong '{METADATA_KEY}' metadata "
                "(start the resource with the replica's --replica-secret-file)",
            )

        # One deny handler per RPC shape, so a refused stream is not read as a unary request.
        self._deny = {
            (False, False): grpc.unary_unary_rpc_method_handler(deny),
            (True, False): grpc.stream_unary_rpc_method_handler(deny),
            (False, True): grpc.unary_stream_rpc_method_handler(deny),
            (True, True): grpc.stream_stream_rpc_method_handler(deny),
        }

    def _authorized(self, metadata) -> bool:
        ok = False
        for key, value in metadata or ():
            if key == METADATA_KEY:
                given = value.encode() if isinstance(value, str) else bytes(value)
                ok = hmac.compare_digest(given, self._secret) or ok
        return ok

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(_OPEN_PREFIXES):
            return handler
        if self._authorized(handler_call_details.invocation_metadata):
            return handler
        return self._deny[(bool(handler.request_streaming), bool(handler.response_streaming))]
