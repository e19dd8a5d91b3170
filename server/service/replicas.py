"""Generator replica pool: least-outstanding-requests routing and weight pushes (DESIGN §2, §7).

The pool holds `ReplicaClient` objects (the gRPC client lives in the wire
layer, `together_train_server.wire.replica_client`); here is only the routing
and bookkeeping, so it can be driven in tests without a network.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Protocol, TypeVar

from together_train_server.service.errors import ServiceError

T = TypeVar("T")


class ReplicaUnavailable(Exception):
    """Raised by a ReplicaClient when its replica cannot be reached (retry elsewhere)."""


class ReplicaClient(Protocol):
    """What the pool needs from one replica."""

    replica_id: str

    def push(self, session_id: str, version: int, lora: Any, tensors: dict[str, Any]) -> int: ...

    def drop(self, session_id: str) -> None: ...

    def close(self) -> None: ...


class ReplicaPool:
    """Routes requests to the replica with the fewest outstanding requests.

    A replica that raises ReplicaUnavailable is marked down and the request is
    retried on another; pushes record, per session, the latest version every
    replica holds so a request never reads a version it did not ask for.
    """

    def __init__(self, clients: list[ReplicaClient]) -> None:
        self._clients = list(clients)
        self._outstanding = {c.replica_id: 0 for c in self._clients}
        self._down: set[str] = set()
        self._lock = threading.Lock()
        self._push_locks: dict[str, threading.Lock] = {}
        self._executor = ThreadPoolExecutor(max_workers=max(1, 2 * len(self._clients)), thread_name_prefix="push")

    def __len__(self) -> int:
        return len(self._clients)

    @property
    def replica_ids(self) -> list[str]:
        return [c.replica_id for c in self._clients]

    def _acquire(self, exclude: set[str]) -> ReplicaClient:
        with self._lock:
            live = [c for c in self._clients if c.replica_id not in self._down and c.replica_id not in exclude]
            if not live:
                raise ServiceError(
                    "UNAVAILABLE" if self._clients else "FAILED_PRECONDITION",
                    "no generator replica is available"
                    if self._clients
                    else "this resource has no generator replicas (start it with --generators N)",
                    retryable=bool(self._clients),
                )
            best = min(live, key=lambda c: self._outstanding[c.replica_id])
            self._outstanding[best.replica_id] += 1
            return best

    def _release(self, client: ReplicaClient) -> None:
        with self._lock:
            self._outstanding[client.replica_id] -= 1

    def route(self, call: Callable[[ReplicaClient], T]) -> T:
        """Run `call` on the least-loaded live replica, retrying on others if one is down."""
        tried: set[str] = set()
        while True:
            client = self._acquire(tried)
            try:
                return call(client)
            except ReplicaUnavailable:
                tried.add(client.replica_id)
                with self._lock:
                    self._down.add(client.replica_id)
            finally:
                self._release(client)

    def outstanding(self) -> dict[str, int]:
        with self._lock:
            return dict(self._outstanding)

    def push_all(self, session_id: str, version: int, lora: Any, tensors: dict[str, Any]) -> int:
        """Push one session's adapter version to every live replica; returns bytes sent per replica.

        Pushes of one session are serialised so versions arrive in order.

        Raises:
            ServiceError: UNAVAILABLE when no replica accepted the push.
        """
        with self._lock:
            lock = self._push_locks.setdefault(session_id, threading.Lock())
            targets = [c for c in self._clients if c.replica_id not in self._down]
        if not targets:
            raise ServiceError("FAILED_PRECONDITION", "this resource has no generator replicas to sync to")
        with lock:
            futures = [self._executor.submit(c.push, session_id, version, lora, tensors) for c in targets]
            sizes, errors = [], []
            for c, f in zip(targets, futures):
                try:
                    sizes.append(f.result())
                except ReplicaUnavailable as e:
                    errors.append(f"{c.replica_id}: {e}")
                    with self._lock:
                        self._down.add(c.replica_id)
        if not sizes:
            raise ServiceError("UNAVAILABLE", "weights push failed on every replica: " + "; ".join(errors), retryable=True)
        return sizes[0]

    def drop_all(self, session_id: str) -> None:
        """Forget a session's adapter on every replica (best effort)."""
        for c in self._clients:
            try:
                c.drop(session_id)
            except Exception:
                pass
        with self._lock:
            self._push_locks.pop(session_id, None)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        for c in self._clients:
            c.close()
