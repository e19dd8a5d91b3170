"""Server TLS (``--tls-cert/--tls-key``, mutual TLS with ``--tls-client-ca``) and the resource's TLS to replicas.

Files are PEM. A server with ``--tls-cert`` accepts TLS only: a plaintext
client fails its handshake (UNAVAILABLE on the client). With
``--tls-client-ca`` a client must also present a certificate signed by that
CA bundle (mutual TLS).
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

import grpc


def _read(path: Path | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"{flag} {path}: {err.strerror or err}") from None
    if b"-----BEGIN" not in data:
        raise ValueError(f"{flag} {path}: not a PEM file (no '-----BEGIN' line)")
    return data


def server_credentials(cert: Path | None, key: Path | None, client_ca: Path | None = None) -> grpc.ServerCredentials | None:
    """gRPC server credentials from PEM files; None (plaintext) when no certificate is given.

    Args:
        cert: the server's certificate chain (``--tls-cert``).
        key: its private key (``--tls-key``).
        client_ca: CA bundle that client certificates must chain to (``--tls-client-ca``); when
            given, a client without a valid certificate is refused during the handshake.

    Raises:
        ValueError: only one of cert/key given, ``--tls-client-ca`` without a certificate, or a file
            missing or not PEM (the message names the flag and the file).
    """
    if cert is None and key is None:
        if client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
        return None
    if cert is None or key is None:
        raise ValueError("--tls-cert and --tls-key go together: give both")
    ca = _read(client_ca, "--tls-client-ca")
    return grpc.ssl_server_credentials(
        [(_read(key, "--tls-key"), _read(cert, "--tls-cert"))],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


def channel_credentials(root_ca: Path | None, cert: Path | None = None, key: Path | None = None) -> grpc.ChannelCredentials:
    """Client credentials of the resource towards TLS replicas.

    Args:
        root_ca: CA bundle the replica's certificate must chain to (None: the system roots).
        cert, key: the resource's client certificate and key, for replicas that require mutual TLS.

    Raises:
        ValueError: a file missing or not PEM (the message names the flag and the file).
    """
    return grpc.ssl_channel_credentials(
        root_certificates=_read(root_ca, "--generator-tls-ca"),
        private_key=_read(key, "--tls-key"),
        certificate_chain=_read(cert, "--tls-cert"),
    )


def is_loopback(host: str) -> bool:
    """True when ``host`` (a bind address or ``host`` of ``host:port``) only reaches this machine."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name or a wildcard like 0.0.0.0 / :: : reachable from outside
