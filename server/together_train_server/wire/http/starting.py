"""The HTTP port while the resource starts: bound at once, every request answered 503 "starting".

Why: `serve` loads the trainer's model and waits for its replicas before the HTTP app exists
(seconds to a minute). A port that is not bound yet refuses connections, and the HTTP SDKs back
off exponentially on refused connections (the tinker SDK's retrieve loop sleeps 1, 2, 4, 8, 16,
30 s): after a restart a client would sleep on for up to 30 s past the moment the resource is
ready. A bound port that answers ``503`` with ``Retry-After`` is retried at once by both SDKs
(5xx is retryable in the tinker and together clients), so a client learns within a quarter of a
second that the resource is back (a 404 for an operation of the previous run, which it then
resubmits).

`StartingListener` owns the listening socket until `hand_over`, which stops answering and gives
the same bound socket (connections waiting in its backlog included) to the real server
(`wire/http/app.HttpServer`). Plain HTTP only: with TLS the port is bound when the app starts.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import threading
import time

log = logging.getLogger(__name__)

# Answered after this delay: the tinker SDK retries a 5xx on retrieve_future without sleeping.
ANSWER_DELAY_S = 0.25
_BODY = json.dumps({
    "detail": "UNAVAILABLE: the resource is starting (loading its model and generator replicas); retry shortly",
    "code": "UNAVAILABLE", "retryable": True,
}).encode()
_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    b"retry-after-ms: 250\r\nConnection: close\r\nContent-Length: " + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY
)


def bind_tcp(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host:port` (IPv6 when `host` contains ":"; SO_REUSEADDR so a restarted
    server rebinds its port at once), not yet listening. Raises OSError (closing the socket)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class StartingListener:
    """Bind `host:port` now and answer every request ``503`` (UNAVAILABLE, retryable) until `hand_over`.

    Args:
        host: bind address (IPv6 when it contains ":").
        port: port to bind; 0 = any free port (see `port`).

    Raises:
        OSError: the port cannot be bound (e.g. in use), at construction.
    """

    def __init__(self, host: str, port: int) -> None:
        self._sock = bind_tcp(host, port)
        self._sock.listen(128)
        self.port = int(self._sock.getsockname()[1])
        self.answered = 0
        self._stop = threading.Event()
        self._answering: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._serve, name="http-starting", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self._sock], [], [], 0.05)
            if not ready or self._stop.is_set():
                continue
            try:
                conn, _ = self._sock.accept()
            except OSError:
                continue
            t = threading.Thread(target=self._answer, args=(conn,), name="http-starting-answer", daemon=True)
            self._answering = [a for a in self._answering if a.is_alive()] + [t]
            t.start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(2.0)
                head = b""
                while b"\r\n\r\n" not in head and len(head) < 65536:  # the request line and headers
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    head += chunk
                time.sleep(ANSWER_DELAY_S)
                conn.sendall(_RESPONSE)
                self.answered += 1
                # Read what the client still sends (a request body) until it closes: closing with unread
                # data would reset the connection and could lose the answer on the client's side.
                conn.shutdown(socket.SHUT_WR)
                deadline = time.monotonic() + 5.0
                while conn.recv(65536) and time.monotonic() < deadline:
                    pass
            except OSError:
                pass

    def hand_over(self) -> socket.socket:
        """Stop answering; return the bound, listening socket (the caller serves it from now on).

        Waits for the 503s being answered (a quarter of a second, or a client still sending), so
        no 503 reaches a client once the caller serves."""
        self._stop.set()
        self._thread.join(timeout=5)
        deadline = time.monotonic() + 6.0
        for t in self._answering:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        if self.answered:
            log.info("answered %d HTTP request(s) 503 while starting", self.answered)
        return self._sock

    def close(self) -> None:
        """Stop answering and close the socket (startup failed)."""
        if not self._stop.is_set():
            self.hand_over()
        self._sock.close()
