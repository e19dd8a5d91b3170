"""`ClusterClient`: model resources of a ``together-train cluster`` control plane, from one address.

    with tt.ClusterClient("head:7460") as cluster:
        res = cluster.create_resource("tiny")              # waits until READY (PENDING shows Ray's reason)
        session = res.create_session(lora=tt.LoraConfig(rank=8))   # as on a ResourceClient
        cluster.list_resources(); cluster.stop_resource(res.resource_id)

The Cluster API is ``together_train.cluster.ClusterService`` with JSON bodies; a resource handle is a
`ResourceClient` on the same address whose every call carries ``together-train-resource: <id>`` metadata,
so the control plane forwards it to that resource.
"""

from __future__ import annotations

import json
import time
from typing import Any

import grpc

from together_train.errors import DeadlineExceededError, FailedPreconditionError, from_rpc_error
from together_train.resource_client import ResourceClient

__all__ = ["ClusterClient", "ClusterResource"]

_SERVICE = "together_train.cluster.ClusterService"
_ROUTE_KEY = "together-train-resource"


class ClusterResource(ResourceClient):
    """A `ResourceClient` for one resource of a cluster, reached through the control plane's address.

    Attributes:
        resource_id: the resource's id (``<base_model>-<8 hex>``).
        info: its view when the handle was made (state, address, actors and their Ray nodes).
    """

    def __init__(self, address: str, info: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(address, **kwargs)
        self.resource_id: str = info["resource_id"]
        self.info = info
        self._metadata = (*self._metadata, (_ROUTE_KEY, self.resource_id))


class ClusterClient:
    """The Cluster API of a control plane at `address` (host:port).

    `kwargs` (api_key, timeout, retry, ...) are passed to each `ClusterResource` it returns.
    """

    def __init__(self, address: str, *, timeout: float = 30.0, **kwargs: Any) -> None:
        self.address = address
        self.timeout = timeout
        self._kwargs = kwargs
        self._channel = grpc.insecure_channel(address)

    def _call(self, method: str, body: dict[str, Any]) -> Any:
        stub = self._channel.unary_unary(f"/{_SERVICE}/{method}", request_serializer=lambda v: json.dumps(v).encode(),
                                         response_deserializer=json.loads)
        try:
            return stub(body, timeout=self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def create_resource(self, base_model: str, *, replicas: int | None = None, inactive_timeout: float | None = None,
                        wait: bool = True, timeout: float = 600.0) -> ClusterResource:
        """Create a resource of catalog model `base_model` (replicas: the catalog's default unless given,
        inactive_timeout: seconds, 0 = never stop); with `wait`, return once it is READY.

        Raises:
            InvalidArgumentError: not in the catalog (naming its models), replicas out of the catalog's range.
            FailedPreconditionError: no node of the cluster could ever hold it (naming the resource), or it
                FAILED while starting (its reason).
            DeadlineExceededError: not READY within `timeout` seconds (its state and reason; it keeps starting).
        """
        info = self._call("CreateResource", {"base_model": base_model, "replicas": replicas,
                                             "inactive_timeout": inactive_timeout})
        if wait:
            info = self.wait_ready(info["resource_id"], timeout)
        return ClusterResource(self.address, info, **self._kwargs)

    def resource(self, resource_id: str) -> ClusterResource:
        """A handle on an existing resource (NotFoundError: unknown id)."""
        return ClusterResource(self.address, self.get_resource(resource_id), **self._kwargs)

    def wait_ready(self, resource_id: str, timeout: float = 600.0) -> dict[str, Any]:
        """Poll until the resource is READY; returns its view. Raises as `create_resource`."""
        t_end = time.monotonic() + timeout
        while True:
            info = self.get_resource(resource_id)
            if info["state"] == "READY":
                return info
            if info["state"] in ("FAILED", "STOPPING", "STOPPED"):
                raise FailedPreconditionError(f"resource {resource_id} is {info['state']}: {info['reason']}",
                                              key="resource_id")
            if time.monotonic() > t_end:
                raise DeadlineExceededError(f"resource {resource_id} not READY within {timeout:.0f} s: "
                                            f"{info['state']} {info['reason']}", key="resource_id")
            time.sleep(0.2)

    def get_resource(self, resource_id: str) -> dict[str, Any]:
        """One resource's view: resource_id, base_model, state, reason, address, replicas, actors (name -> node)."""
        return self._call("GetResource", {"resource_id": resource_id})

    def list_resources(self) -> list[dict[str, Any]]:
        """Every resource's view (stopped and failed ones included), oldest first."""
        return self._call("ListResources", {})["resources"]

    def stop_resource(self, resource_id: str) -> dict[str, Any]:
        """Stop a resource (its actors end, its Ray resources are freed, its checkpoints stay); returns its view."""
        return self._call("StopResource", {"resource_id": resource_id})

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> ClusterClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
