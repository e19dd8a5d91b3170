"""The gRPC channel a `ResourceClient` talks over: address form, message limits, reconnect, TLS, auth metadata.

Built once in `ResourceClient.__init__`; everything here is configuration, nothing holds state.
"""

from __future__ import annotations

import grpc

from together_train.errors import InvalidArgumentError

__all__ = ["normalize_address", "open_channel", "auth_metadata"]


def normalize_address(address: str) -> str:
    """``host:port`` from an address that may carry a ``grpc://``, ``http://`` or ``dns:///`` prefix."""
    for prefix in ("grpc://", "http://", "dns:///"):
        if address.startswith(prefix):
            return address[len(prefix):].rstrip("/")
    return address


def channel_options(max_message_mb: int, user_agent: str) -> list[tuple[str, int | str]]:
    """The channel's options: `max_message_mb` MiB each way, the user agent, keep-alive and fast reconnect."""
    nbytes = int(max_message_mb) * 1024 * 1024
    return [
        ("grpc.max_send_message_length", nbytes),
        ("grpc.max_receive_message_length", nbytes),
        ("grpc.primary_user_agent", user_agent),
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        # Reconnect within a second once the server is back (gRPC's default backoff grows to 120 s,
        # so a channel could stay failed long after a restarted server answered).
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


def open_channel(
    address: str,
    *,
    max_message_mb: int,
    user_agent: str,
    tls: bool,
    root_certificates: bytes | None,
    certificate_chain: bytes | None,
    private_key: bytes | None,
) -> grpc.Channel:
    """A channel to ``host:port`` `address`: TLS when `tls` or any certificate argument is given, else plaintext.

    Raises:
        InvalidArgumentError: only one of `certificate_chain` / `private_key` (mutual TLS needs both).
    """
    options = channel_options(max_message_mb, user_agent)
    if (certificate_chain is None) != (private_key is None):
        raise InvalidArgumentError(
            "certificate_chain and private_key go together (mutual TLS): give both or neither",
            key="certificate_chain" if certificate_chain is None else "private_key",
        )
    if tls or root_certificates is not None or certificate_chain is not None:
        creds = grpc.ssl_channel_credentials(
            root_certificates=root_certificates, private_key=private_key, certificate_chain=certificate_chain
        )
        return grpc.secure_channel(address, creds, options=options)
    return grpc.insecure_channel(address, options=options)


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata every RPC carries: ``authorization: Bearer <api_key>``, or nothing without a key."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()
