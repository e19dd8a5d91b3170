"""The resource's HTTP port: one FastAPI app, one route module per API, served by uvicorn in a thread.

A second wire protocol beside gRPC (docs/design.md §2), over the same service layer
(`Resource`). Route modules hold no math and no state beyond translating
their API's ids to ours. Today: the Tinker API (the `tinker` package, under
``/api/v1``). A later API adds its module to `ROUTE_MODULES`: a module
exposes ``router`` (a FastAPI ``APIRouter``) and optionally
``install(app, resource)`` to set up its id tables on ``app.state``.

Authentication (when the resource has API keys): the ``X-API-Key`` header
(what the tinker SDK sends) or ``Authorization: Bearer <key>``. A key
``tml-<k>`` is accepted when ``<k>`` is one of the resource's keys, so one
line in the key file serves both protocols (gRPC with ``<k>``, the tinker
SDK with ``tml-<k>``, which it requires) and both see the same sessions and
checkpoints; a key written in the file with its ``tml-`` prefix works too.
Without keys every request is served, as on gRPC.
"""

from __future__ import annotations

import importlib
import logging
import socket
import threading
from pathlib import Path
from typing import Any, Iterable, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from together_train_server.service.errors import ServiceError
from together_train_server.service.interfaces import ResourceApi
from together_train_server.wire.http.deps import Services

log = logging.getLogger(__name__)

ROUTE_MODULES = (
    "together_train_server.wire.http.tinker",
    # The Together RL API (/v1/rl/...): the together SDK's post_training runs unchanged against it.
    "together_train_server.wire.http.together",
    # Checkpoint search, metadata/TTL/pin edits and storage usage (/v1/checkpoints/...).
    "together_train_server.wire.http.checkpoint_routes",
    # Observability: Prometheus /metrics and the web dashboard at / (they check keys themselves:
    # a request without a key gets only what reveals no session, see metrics_routes.viewer).
    "together_train_server.wire.http.metrics_routes",
    "together_train_server.wire.http.dashboard_routes",
    # Usage per API key and session: GET /v1/usage.
    "together_train_server.wire.http.usage_routes",
    # OpenAI-compatible inference: /v1/models, /v1/completions, /v1/chat/completions (errors in OpenAI's shape).
    "together_train_server.wire.http.openai",
    # Anthropic's Messages API: /v1/messages (after the OpenAI package: it uses its InferenceService).
    "together_train_server.wire.http.anthropic",
)

# Paths answered without a key (load balancers, liveness probes).
OPEN_PATHS = frozenset({"/api/v1/healthz", "/healthz"})

# Service error code -> HTTP status. Client errors the tinker SDK must not
# retry stay in 4xx other than 408/409/429 (which it retries).
HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "FAILED_PRECONDITION": 400,
    "OUT_OF_RANGE": 400,
    "UNIMPLEMENTED": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 400,
    "RESOURCE_EXHAUSTED": 429,
    "CANCELLED": 400,
    "ABORTED": 409,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
    "DATA_LOSS": 500,
    "INTERNAL": 500,
}


def owner_for(presented: str | None, keys: frozenset[str] | None) -> str | None:
    """The owner tag (our API key) for a presented key, or None when it is refused.

    Without keys every caller is the anonymous owner "".
    """
    if keys is None:
        return ""
    if not presented:
        return None
    if presented in keys:
        return presented
    if presented.startswith("tml-") and presented[4:] in keys:
        return presented[4:]
    return None


def error_body(err: ServiceError) -> dict[str, Any]:
    """JSON body of an HTTP error: message, code and where (sample index, key)."""
    body: dict[str, Any] = {"detail": str(err), "code": err.code, "retryable": err.retryable}
    if err.sample_index is not None:
        body["sample_index"] = err.sample_index
    if err.key:
        body["key"] = err.key
    return body


def error_response(err: ServiceError, status: int | None = None) -> JSONResponse:
    """An HTTP error for a ServiceError; ``x-should-retry`` tells the SDK's client whether to retry."""
    status = status or HTTP_STATUS.get(err.code, 500)
    return JSONResponse(
        error_body(err), status_code=status, headers={"x-should-retry": "true" if err.retryable else "false"}
    )


# JSON spells a token id in <= 20 bytes and a float in <= 25 where protobuf uses <= 10 and <= 8,
# so a body at the resource's limits is at most ~3x its protobuf size: 4x bounds every valid body.
JSON_BODY_FACTOR = 4


class BodyLimit:
    """ASGI middleware: refuse a request body over ``max_bytes`` with 413 before the app reads it.

    A declared ``Content-Length`` over the limit is answered at once, without
    reading the body; a chunked body is buffered while it arrives and refused as
    soon as it passes the limit, so memory per request stays under ``max_bytes``.
    The limit is ``JSON_BODY_FACTOR`` x the resource's gRPC receive limit
    (``Resource.max_request_bytes``, raised by ``--max-tokens-per-batch`` /
    ``--max-samples-per-batch``): no valid request is larger.
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, int(max_bytes)

    async def _refuse(self, send: Any, size: str) -> None:
        err = ServiceError("INVALID_ARGUMENT", f"request body of {size} bytes is larger than this server's limit of "
                           f"{self.max_bytes} bytes (raise --max-tokens-per-batch / --max-samples-per-batch)")
        await error_response(err, status=413)({"type": "http"}, None, send)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            if declared.isdigit() and int(declared) > self.max_bytes:
                return await self._refuse(send, declared.decode())
            return await self.app(scope, receive, send)
        if scope.get("method") in ("GET", "HEAD", "DELETE", "OPTIONS"):
            return await self.app(scope, receive, send)
        messages, total = [], 0
        while True:   # chunked: buffer up to the limit, then replay to the app
            msg = await receive()
            messages.append(msg)
            if msg["type"] != "http.request":
                break
            total += len(msg.get("body", b""))
            if total > self.max_bytes:
                return await self._refuse(send, f"more than {total}")
            if not msg.get("more_body"):
                break

        async def replay() -> dict:
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)


class Served(Protocol):
    """What an app can serve besides a `Resource`: ``deploy``'s `Deployment` (the OpenAI routes only)."""

    def max_request_bytes(self) -> int:
        """The largest request body the served object takes, in protobuf-equivalent bytes."""
        ...


def create_app(resource: ResourceApi | Served, api_keys: Iterable[str] | None = None,
               modules: Iterable[str] = ROUTE_MODULES) -> FastAPI:
    """The HTTP app over `resource` (a `Resource`; ``deploy`` serves its `Deployment`).

    Args:
        resource: the service layer the gRPC servicers use too.
        api_keys: the resource's API keys (None = no authentication).
        modules: route modules to mount (see the module docstring).
    """
    app = FastAPI(title="together-train", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.services = Services(resource)  # what routes are handed, typed (wire/http/deps.py)
    keys = frozenset(api_keys) if api_keys else None
    app.state.api_keys = keys
    # Route modules may list paths (OPEN_PATHS) and prefixes (OPEN_PREFIXES) they authenticate themselves.
    open_paths, open_prefixes = set(OPEN_PATHS), []
    # Route modules may answer errors under their paths in their API's shape: ERROR_PREFIXES + error_response(err).
    shapes: list[tuple[tuple[str, ...], Any]] = []

    def respond(request: Request, err: ServiceError):
        for prefixes, fn in shapes:
            if request.url.path.startswith(prefixes):
                return fn(err)
        return error_response(err)

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if request.url.path in open_paths or request.url.path.startswith(tuple(open_prefixes)):
            request.state.owner = ""
            return await call_next(request)
        presented = request.headers.get("x-api-key")
        auth = request.headers.get("authorization", "")
        if not presented and auth.startswith("Bearer "):
            presented = auth[7:]
        owner = owner_for(presented, keys)
        if owner is None:
            return respond(request, ServiceError(
                "UNAUTHENTICATED", "missing or unknown API key (header X-API-Key: tml-<key>, or Authorization: Bearer <key>)"
            ))
        request.state.owner = owner
        return await call_next(request)

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, err: ServiceError):
        return respond(request, err)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return respond(request, ServiceError("INVALID_ARGUMENT", f"{where}: {first.get('msg', 'invalid request')}",
                                             key=where or None))

    for name in modules:
        module = importlib.import_module(name)
        open_paths.update(getattr(module, "OPEN_PATHS", ()))
        open_prefixes.extend(getattr(module, "OPEN_PREFIXES", ()))
        if hasattr(module, "ERROR_PREFIXES"):
            shapes.append((tuple(module.ERROR_PREFIXES), module.error_response))
        if hasattr(module, "install"):
            module.install(app, resource)
        app.include_router(module.router)
    app.add_middleware(BodyLimit, max_bytes=JSON_BODY_FACTOR * int(resource.max_request_bytes()))
    return app


class HttpServer:
    """uvicorn serving an app on a thread of the resource process.

    Args:
        app: the ASGI app (see `create_app`).
        host: bind address.
        port: port to bind; 0 = any free port (see `port` after `start`).
        tls: ``(cert, key, client_ca)`` PEM file paths, the same files as the
            gRPC port's ``--tls-cert/--tls-key/--tls-client-ca``: the HTTP
            port then speaks HTTPS only, and with ``client_ca`` it requires a
            client certificate signed by that CA (mutual TLS). None = plain HTTP.
        sock: a socket already bound to `host`/`port` to serve instead of binding one
            (`wire/http/starting.StartingListener.hand_over`: the port answered 503 while
            the resource started).
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                 tls: "tuple[str | None, str | None, str | None] | None" = None,
                 sock: socket.socket | None = None) -> None:
        import ssl

        import uvicorn

        from together_train_server.wire.http.starting import bind_tcp

        self._sock = sock if sock is not None else bind_tcp(host, port)
        self.host = host
        self.port = int(self._sock.getsockname()[1])
        # One worker loop; blocking service calls go to threads (FastAPI runs sync routes in its pool).
        cert, key, client_ca = tls or (None, None, None)
        self.scheme = "https" if cert else "http"
        ssl_kw: dict[str, Any] = {}
        if cert:
            ssl_kw = {"ssl_certfile": str(cert), "ssl_keyfile": str(key)}
            if client_ca:
                ssl_kw.update(ssl_ca_certs=str(client_ca), ssl_cert_reqs=ssl.CERT_REQUIRED)
        # timeout_graceful_shutdown: a stop cuts long-polls (retrieve_future waits up to 40 s; the SDKs
        # retry) so SIGTERM drains within 10 s (cli.cmd_serve).
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_keep_alive=75,
                                access_log=False, timeout_graceful_shutdown=2, **ssl_kw)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="http-server", daemon=True)

    def _run(self) -> None:
        self._server.run(sockets=[self._sock])

    def start(self, timeout: float = 30.0) -> int:
        """Start serving; returns the bound port.

        Raises:
            RuntimeError: uvicorn did not start within `timeout` seconds.
        """
        self._thread.start()
        deadline = threading.Event()
        waited = 0.0
        while not self._server.started:
            if not self._thread.is_alive() or waited > timeout:
                raise RuntimeError(f"the HTTP server did not start on {self.host}:{self.port}")
            deadline.wait(0.02)
            waited += 0.02
        return self.port

    def stop(self) -> None:
        """Stop accepting, let in-flight requests end (uvicorn's graceful shutdown), join the thread."""
        self._server.should_exit = True
        self._thread.join(timeout=3)


def start_http(resource: ResourceApi, api_keys: Iterable[str] | None, host: str, port: int,
               port_file: "Path | None" = None,
               tls: "tuple[str | None, str | None, str | None] | None" = None,
               sock: socket.socket | None = None) -> HttpServer:
    """`together-train serve --http-port`: start the HTTP app; write the bound port to `port_file` atomically.

    ``tls``, ``sock``: as `HttpServer` (serve passes its ``--tls-cert/--tls-key/--tls-client-ca``, and
    the socket its `StartingListener` bound at start).
    """
    from pathlib import Path

    server = HttpServer(create_app(resource, api_keys), host, port, tls=tls, sock=sock)
    bound = server.start()
    if port_file is not None:
        tmp = Path(f"{port_file}.tmp")
        tmp.write_text(str(bound))
        tmp.rename(port_file)
    print(f"together-train HTTP API (Tinker: base_url={server.scheme}://{host}:{bound}) on {host}:{bound}", flush=True)
    return server
