"""The control plane's gRPC port: the Cluster API and every resource's services, forwarded as bytes.

Calls of the Cluster API (service ``together_train.cluster.ClusterService``: CreateResource, GetResource,
ListResources, StopResource; JSON request and response bodies) are answered here. Every other call is
forwarded unchanged to the resource its ``together-train-resource`` metadata names (the SDK's
`ClusterClient` handles add it): messages are relayed as bytes, never parsed, so the resource does the
work and its status, details and trailing metadata come back as it sent them. Unary and streaming
methods take the same road (a stream of one message is a unary call on the wire).
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent import futures
from typing import Any, Callable, Iterator

import grpc

from together_train_server.cluster.control import ClusterError, ControlPlane
from together_train_server.service.errors import ServiceError
from together_train_server.wire.errors import abort

__all__ = ["CLUSTER_SERVICE", "ROUTE_KEY", "build_router"]

log = logging.getLogger("together_train_server.cluster")

CLUSTER_SERVICE = "together_train.cluster.ClusterService"
ROUTE_KEY = "together-train-resource"
_MAX_MESSAGE = 256 << 20
_OPTIONS = [("grpc.max_send_message_length", _MAX_MESSAGE), ("grpc.max_receive_message_length", _MAX_MESSAGE)]


def _method_kinds() -> dict[str, tuple[bool, bool]]:
    """'/pkg.Service/Method' -> (client streaming, server streaming) of the resource's own services."""
    from together_train._proto import generator_pb2, resource_pb2, session_pb2

    out = {}
    for module in (resource_pb2, session_pb2, generator_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for m in service.methods:
                out[f"/{service.full_name}/{m.name}"] = (m.client_streaming, m.server_streaming)
    return out


_KINDS = _method_kinds()


class _Status(grpc.Status):
    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: Any) -> None:
        self.code, self.details, self.trailing_metadata = code, details, trailing_metadata


def _abort(context: grpc.ServicerContext, err: ClusterError) -> None:
    """End the call with the control plane's refusal, as the resources' errors are (an ErrorDetail: the SDK
    retries only what is marked retryable, so a lost trainer is not retried for long)."""
    abort(context, ServiceError(err.code, str(err), key="resource_id", retryable=err.retryable))


class _Router(grpc.GenericRpcHandler):
    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        admin: dict[str, Callable[[dict], Any]] = {
            "CreateResource": lambda r: self.plane.create(r["base_model"], r.get("replicas"),
                                                          r.get("inactive_timeout")),
            "GetResource": lambda r: self.plane.get(r["resource_id"]),
            "ListResources": lambda r: {"resources": self.plane.list()},
            "StopResource": lambda r: self.plane.stop(r["resource_id"]),
        }
        self._admin = {f"/{CLUSTER_SERVICE}/{name}": grpc.unary_unary_rpc_method_handler(
            self._admin_call(fn), request_deserializer=json.loads,
            response_serializer=lambda v: json.dumps(v).encode()) for name, fn in admin.items()}

    def _admin_call(self, fn: Callable[[dict], Any]) -> Callable[[dict, grpc.ServicerContext], Any]:
        def call(request: dict, context: grpc.ServicerContext) -> Any:
            try:
                if not isinstance(request, dict):
                    raise ClusterError("INVALID_ARGUMENT", "the request body must be a JSON object")
                return fn(request)
            except KeyError as e:
                abort(context, ServiceError("INVALID_ARGUMENT", f"missing field {e.args[0]!r}", key=str(e.args[0])))
            except ClusterError as e:
                _abort(context, e)
        return call

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if method in self._admin:
            return self._admin[method]
        if method.startswith(f"/{CLUSTER_SERVICE}/"):
            return None  # UNIMPLEMENTED
        if _KINDS.get(method) == (False, False):  # unary: gRPC's unary path is much cheaper than a stream's
            return grpc.unary_unary_rpc_method_handler(lambda req, ctx: self._forward_unary(method, req, ctx))
        return grpc.stream_stream_rpc_method_handler(lambda it, ctx: self._forward(method, it, ctx))

    def _target(self, context: grpc.ServicerContext) -> tuple[str | None, str, list[tuple[str, Any]], float | None]:
        """(resource id, its address, the metadata to forward, the deadline left) of a call to forward."""
        md = context.invocation_metadata() or ()
        rid = next((str(v) for k, v in md if k == ROUTE_KEY), None)
        try:
            address = self.plane.route(rid)
        except ClusterError as e:
            _abort(context, e)
        forwarded = [(k, v) for k, v in md if k != ROUTE_KEY and not k.startswith(("grpc-", ":"))]
        remaining = context.time_remaining()
        return rid, address, forwarded, remaining if remaining is not None and remaining < 1e8 else None

    def _failed(self, context: grpc.ServicerContext, rid: str | None, e: grpc.RpcError) -> None:
        """End the call as the resource ended it; a lost trainer is named instead of the connection error."""
        code = e.code()  # type: ignore[attr-defined]
        if code == grpc.StatusCode.UNAVAILABLE:
            self.plane.check_trainer(rid)
            try:
                self.plane.route(rid)
            except ClusterError as lost:
                _abort(context, lost)
        context.abort_with_status(_Status(code, e.details(),  # type: ignore[attr-defined]
                                          e.trailing_metadata() or ()))  # type: ignore[attr-defined]

    def _forward_unary(self, method: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        rid, address, md, timeout = self._target(context)
        try:
            response, call = self._channel(address).unary_unary(method).with_call(request, metadata=md, timeout=timeout)
        except grpc.RpcError as e:
            self._failed(context, rid, e)
            raise  # not reached: _failed aborts
        if call.trailing_metadata():
            context.set_trailing_metadata(call.trailing_metadata())
        return response

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = grpc.insecure_channel(address, options=_OPTIONS)
            return ch

    def _forward(self, method: str, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        rid, address, md, timeout = self._target(context)
        call = self._channel(address).stream_stream(method)(requests, metadata=md, timeout=timeout)
        context.add_callback(call.cancel)
        try:
            initial = call.initial_metadata()
            if initial:
                context.send_initial_metadata(initial)
            yield from call
            trailing = call.trailing_metadata()
            if trailing:
                context.set_trailing_metadata(trailing)
        except grpc.RpcError as e:
            self._failed(context, rid, e)


def build_router(plane: ControlPlane, host: str, port: int, max_workers: int = 64) -> tuple[grpc.Server, int]:
    """The control plane's gRPC server bound on host:port (0 = any free port), started; returns it and its port.

    Raises:
        OSError: the port cannot be bound.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="cluster-route"),
                         handlers=[_Router(plane)], options=_OPTIONS)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise OSError(f"cannot bind {host}:{port}")
    server.start()
    return server, bound
