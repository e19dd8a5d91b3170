"""Build gRPC servers: servicers + standard health checking and reflection."""

from __future__ import annotations

from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from together_train._proto import generator_pb2, generator_pb2_grpc, resource_pb2, resource_pb2_grpc, session_pb2, session_pb2_grpc
from together_train_server.wire import weights as wt

if TYPE_CHECKING:
    from together_train_server.service.interfaces import ResourceApi

MAX_MESSAGE_BYTES = 256 << 20
# Shortest interval between client keepalive pings the servers accept (the SDK pings every 60 s).
MIN_CLIENT_PING_INTERVAL_MS = 5_000


def _new_server(max_workers: int, interceptors=(), max_receive_bytes: int = MAX_MESSAGE_BYTES) -> grpc.Server:
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        interceptors=list(interceptors),
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", int(max_receive_bytes)),
            ("grpc.so_reuseport", 0),
            # The SDK pings every 60 s while a call is open (a long WaitOperation, a big sample); gRPC's
            # default answers pings more often than every 5 min without data with GOAWAY too_many_pings.
            ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
            ("grpc.keepalive_permit_without_calls", 1),
        ],
    )


def _add_health_and_reflection(server: grpc.Server, service_names: list[str]) -> health.HealthServicer:
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ["", *service_names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return health_servicer


def bind(
    server: grpc.Server, host: str, port: int, port_file: Path | None, credentials: grpc.ServerCredentials | None = None
) -> int:
    """Bind host:port (0 = any free port); write the bound port to port_file atomically.

    With `credentials` (see `wire.tls.server_credentials`) the port speaks TLS only.

    Raises:
        ValueError: host:port cannot be bound (names ``--port``).
    """
    try:
        if credentials is not None:
            bound = server.add_secure_port(f"{host}:{port}", credentials)
        else:
            bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpc's "Failed to bind": the CLI prints a ValueError as one line
        bound = 0
    if bound == 0:
        raise ValueError(f"--port {port}: cannot bind {host}:{port} (in use by another process, or not an "
                         f"address of this host; --port 0 picks a free port)")
    if port_file is not None:
        tmp = Path(f"{port_file}.tmp")
        tmp.write_text(str(bound))
        tmp.rename(port_file)
    return bound


class _GeneratedHandlers:
    """Stands in for a server in a generated ``add_*Servicer_to_server`` to collect its method handlers.

    `handlers` (method name -> ``grpc.RpcMethodHandler``) can then be changed
    before `add_to` registers them on a real server, as the generated code would.
    """

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, Any] = {}

    def add_generic_rpc_handlers(self, generic_handlers) -> None:
        pass  # the generated code registers the same handlers by name too (add_registered_method_handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.service, self.handlers = service, dict(handlers)

    def add_to(self, server: grpc.Server) -> None:
        if not self.handlers:
            raise RuntimeError("the generated gRPC code registered no method handlers (regenerate with grpcio-tools >= 1.63)")
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(self.service, self.handlers),))
        server.add_registered_method_handlers(self.service, self.handlers)


def build_resource_server(resource: ResourceApi, api_keys: set[str] | None = None) -> grpc.Server:
    """ResourceService + SessionService + GeneratorService (routing) + health (``server.health``) + reflection."""
    from together_train_server.wire.auth import ApiKeyInterceptor
    from together_train_server.wire.resource_servicer import ResourceServicer, SessionServicer
    from together_train_server.wire.router_servicer import RouterServicer

    # Routed Sample calls hold a thread each while a replica batches them. Requests larger than the
    # resource's limits allow are refused by gRPC before they are parsed (bounded memory).
    server = _new_server(256, [ApiKeyInterceptor(api_keys)] if api_keys else [],
                         max_receive_bytes=resource.max_request_bytes())
    resource_pb2_grpc.add_ResourceServiceServicer_to_server(ResourceServicer(resource), server)
    session_pb2_grpc.add_SessionServiceServicer_to_server(SessionServicer(resource), server)
    generator_pb2_grpc.add_GeneratorServiceServicer_to_server(RouterServicer(resource), server)
    # Kept on the server so the CLI can report a broken trainer (NOT_SERVING).
    server.health = _add_health_and_reflection(
        server,
        [
            resource_pb2.DESCRIPTOR.services_by_name["ResourceService"].full_name,
            session_pb2.DESCRIPTOR.services_by_name["SessionService"].full_name,
            generator_pb2.DESCRIPTOR.services_by_name["GeneratorService"].full_name,
        ],
    )
    return server


def build_generator_server(servicer, replica_secret: str) -> grpc.Server:
    """A replica's GeneratorService + health + reflection.

    Every GeneratorService call must carry `replica_secret` (`wire.replica_auth`); others get
    UNAUTHENTICATED. gRPC health and reflection stay open (they reveal no session).
    """
    from together_train_server.wire.replica_auth import ReplicaSecretInterceptor

    # Sample calls block while the engine batches them: enough threads for a full batch of requests.
    server = _new_server(256, [ReplicaSecretInterceptor(replica_secret)])
    # PushWeights' data chunks are read without protobuf's copy of each payload (wt.parse_chunk).
    handlers = _GeneratedHandlers()
    generator_pb2_grpc.add_GeneratorServiceServicer_to_server(servicer, handlers)
    push = handlers.handlers["PushWeights"]
    handlers.handlers["PushWeights"] = push._replace(request_deserializer=wt.parse_chunk)
    handlers.add_to(server)
    _add_health_and_reflection(server, [generator_pb2.DESCRIPTOR.services_by_name["GeneratorService"].full_name])
    return server
