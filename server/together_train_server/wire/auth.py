"""API-key authentication (docs/design.md §10): `authorization: Bearer <key>` metadata."""

from __future__ import annotations

from pathlib import Path

import grpc

# Health checks and reflection stay open so load balancers and grpcurl work.
_OPEN_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


def read_api_keys(path: Path) -> set[str]:
    """One key per line; blank lines and '#' comments ignored.

    Raises:
        ValueError: when the file holds no key.
    """
    keys = {ln.strip() for ln in Path(path).read_text().splitlines() if ln.strip() and not ln.startswith("#")}
    if not keys:
        raise ValueError(f"{path} holds no API key")
    return keys


class ApiKeyInterceptor(grpc.ServerInterceptor):
    """Refuses calls without a known key with UNAUTHENTICATED."""

    def __init__(self, keys: set[str]) -> None:
        self._keys = frozenset(keys)

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown API key (authorization: Bearer <key>)")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(_OPEN_PREFIXES):
            return continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization" and value.startswith("Bearer ") and value[7:] in self._keys:
                return continuation(handler_call_details)
        return self._deny
