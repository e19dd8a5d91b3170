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
    retried on another; when none is live, a request waits up to
    `wait_for_replica_s` for a restarted one (see `replace`). The pool keeps
    each session's latest pushed adapter so a restarted replica gets every
    session's current version before it serves again.
    """

    def __init__(self, clients: list[ReplicaClient], *, wait_for_replica_s: float = 60.0) -> None:
        self._clients = list(clients)
        self._outstanding = {c.replica_id: 0 for c in self._clients}
        self._down: set[str] = set()
        self._lock = threading.Lock()
        self._up = threading.Condition(self._lock)
        self._push_locks: dict[str, threading.Lock] = {}
        # session_id -> (version, lora, tensors) last pushed, re-pushed to restarted replicas.
        self._latest: dict[str, tuple[int, Any, dict[str, Any]]] = {}
        self._wait_for_replica_s = wait_for_replica_s
        self._executor = ThreadPoolExecutor(max_workers=max(1, 2 * len(self._clients)), thread_name_prefix="push")

    def __len__(self) -> int:
        return len(self._clients)

    @property
    def replica_ids(self) -> list[str]:
        return [c.replica_id for c in self._clients]

    def _acquire(self, exclude: set[str]) -> ReplicaClient:
        with self._lock:
            def live_now() -> list[ReplicaClient]:
                return [c for c in self._clients if c.replica_id not in self._down and c.replica_id not in exclude]

            live = live_now()
            if not live and self._clients:
                # Every replica is down or already tried: wait for a restart (replace()).
                exclude.clear()
                self._up.wait_for(lambda: bool(live_now()), timeout=self._wait_for_replica_s)
                live = live_now()
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
        """Run `call` on the least-loaded live replica, retrying on others if one is down.

        Raises:
            ServiceError: UNAVAILABLE (retryable) when no replica came back in
                time; FAILED_PRECONDITION on a resource without replicas.
        """
        tried: set[str] = set()
        while True:
            client = self._acquire(tried)
            try:
                return call(client)
            except ReplicaUnavailable:
                tried.add(client.replica_id)
                self.mark_down(client.replica_id)
            finally:
                self._release(client)

    def mark_down(self, replica_id: str) -> None:
        """Stop routing to a replica until `replace` brings it back."""
        with self._lock:
            self._down.add(replica_id)

    def is_down(self, replica_id: str) -> bool:
        with self._lock:
            return replica_id in self._down

    def replace(self, replica_id: str, client: ReplicaClient) -> None:
        """Swap in a restarted replica: re-push every session's latest adapter, then route to it.

        Raises:
            ReplicaUnavailable: the new replica failed a re-push (it stays down).
        """
        pushed: dict[str, int] = {}
        while True:
            with self._lock:
                todo = {k: v for k, v in self._latest.items() if pushed.get(k) != v[0]}
                if not todo:
                    # Up to date: swap in under the same lock, so a push_all that starts
                    # later includes this replica and one that started earlier is in todo.
                    i = next(i for i, c in enumerate(self._clients) if c.replica_id == replica_id)
                    if self._clients[i] is not client:
                        self._clients[i].close()
                    client.replica_id = replica_id
                    self._clients[i] = client
                    self._outstanding[replica_id] = 0
                    self._down.discard(replica_id)
                    self._up.notify_all()
                    return
            for session_id, (version, lora, tensors) in todo.items():
                client.push(session_id, version, lora, tensors)
                pushed[session_id] = version

    def outstanding(self) -> dict[str, int]:
        with self._lock:
            return dict(self._outstanding)

    def push_all(self, session_id: str, version: int, lora: Any, tensors: dict[str, Any]) -> int:
        """Push one session's adapter version to every live replica; returns bytes sent per replica.

        Pushes of one session are serialised so versions arrive in order.

        Raises:
            ServiceError: UNAVAILABLE when no replica accepted the push.
        """
        if not self._clients:
            raise ServiceError("FAILED_PRECONDITION", "this resource has no generator replicas to sync to")
        with self._lock:
            lock = self._push_locks.setdefault(session_id, threading.Lock())
            if self._latest.get(session_id, (-1,))[0] <= version:
                self._latest[session_id] = (version, lora, tensors)

            def live() -> list[ReplicaClient]:
                return [c for c in self._clients if c.replica_id not in self._down]

            # All down (restarting): a replica that comes back gets this version in replace().
            self._up.wait_for(lambda: bool(live()), timeout=self._wait_for_replica_s)
            targets = live()
        if not targets:
            raise ServiceError("UNAVAILABLE", "no generator replica is up to receive the weights", retryable=True)
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
            self._latest.pop(session_id, None)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        for c in self._clients:
            c.close()
