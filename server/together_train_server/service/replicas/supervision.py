"""The replica pool's supervision: health probes, suspicion of a slow replica, restarts (docs/design.md §7).

`ReplicaSupervisor` is an object `ReplicaPool` (service/replicas/pool.py) holds: it drives the pool
through the pool's public methods (`SupervisedPool`) and keeps its own state (probe threads, restarts,
the versions each probe saw). One probe thread per replica:

- every ``probe_period_s`` the replica's Health is probed with ``probe_timeout_s``;
  ``probe_misses`` misses in a row mark it down (its calls in flight are cancelled and
  retried elsewhere) and restart a replica the resource spawned;
- a probe not answered within ``suspect_after_s`` makes the replica *suspect* until a probe
  answers: new requests go to the other replicas while one of them is not suspect, and a
  hedged call in flight there (`ReplicaPool.route`'s sample / compute_logprobs) is re-issued
  on another replica at once. Why: a replica stopped (SIGSTOP, a stuck driver) holds the
  requests it has for the whole ``misses * (period + timeout)`` detection time otherwise; a
  suspicion costs at most one duplicated request, so it can be quick (half a second by default).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from together_train_server.service.replicas.client import ReplicaConnection
from together_train_server.service.replicas.deadlines import Deadlines
from together_train_server.service.replicas.errors import ReplicaUnavailable

log = logging.getLogger("together_train_server.service.replicas.pool")
C = TypeVar("C", bound=ReplicaConnection)
C_co = TypeVar("C_co", bound=ReplicaConnection, covariant=True)


class Restarter(Protocol[C_co]):
    """A replica process the resource spawned: `supervise` kills and restarts it when it hangs."""

    def exited(self) -> bool:
        """True when the process is gone."""
        ...

    def restart(self) -> C_co:
        """Kill the process (if alive), start a new one and return its connected client.

        Raises:
            Exception: it did not come up (the supervisor retries next period).
        """
        ...


class SupervisedPool(Protocol[C]):
    """What the supervisor needs from the pool (`ReplicaPool`'s public methods)."""

    deadlines: Deadlines

    @property
    def replica_ids(self) -> list[str]: ...

    def client(self, replica_id: str) -> C: ...

    def mark_down(self, replica_id: str, reason: str = "") -> None: ...

    def is_down(self, replica_id: str) -> bool: ...

    def set_suspect(self, replica_id: str, suspect: bool) -> None: ...

    def adopt(self, replica_id: str, client: C) -> None: ...

    def replace(self, replica_id: str, client: C) -> None: ...

    def refresh(self, client: C, held: dict[str, int]) -> None: ...


@dataclass
class SupervisedState:
    """What the supervisor saw of one replica (`ReplicaPool.snapshot`).

    Attributes:
        restarting: its process is being restarted now.
        restarts: processes restarted since the pool started.
        versions: {adapter key: version} at its last answered probe ({} before the first).
    """

    restarting: bool = False
    restarts: int = 0
    versions: dict[str, int] = field(default_factory=dict)


class ReplicaSupervisor(Generic[C]):
    """Probe threads, suspicion and restarts of a pool's replicas (see the module docstring).

    Args:
        pool: the replicas to supervise, driven through its public methods only.
    """

    def __init__(self, pool: SupervisedPool[C]) -> None:
        self.pool = pool
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watchers: list[threading.Thread] = []
        self._state: dict[str, SupervisedState] = {rid: SupervisedState() for rid in pool.replica_ids}

    def state(self, replica_id: str) -> SupervisedState:
        """A copy of what the supervisor saw of `replica_id`."""
        with self._lock:
            s = self._state.setdefault(replica_id, SupervisedState())
            return SupervisedState(s.restarting, s.restarts, dict(s.versions))

    @property
    def stopped(self) -> bool:
        """True once `stop` was called (the pool is closing)."""
        return self._stop.is_set()

    def start(self, restarters: dict[str, Restarter[C]] | None = None) -> None:
        """Start one probe thread per replica (`Deadlines` probe policy).

        Each round (every ``probe_period_s``): a spawned replica whose process
        exited is restarted; otherwise Health is probed with ``probe_timeout_s``
        (suspect after ``suspect_after_s`` without an answer, see the module docstring).
        ``probe_misses`` misses in a row mark it down (in-flight calls cancelled)
        and, with a `Restarter`, kill and restart it. A down replica that
        answers is brought back with `ReplicaPool.replace`; a live one that lost an adapter
        gets it re-pushed (`ReplicaPool.refresh`).
        """
        restarters = restarters or {}
        for rid in self.pool.replica_ids:
            t = threading.Thread(target=self._watch, args=(rid, restarters.get(rid)), name=f"probe-{rid}", daemon=True)
            t.start()
            self._watchers.append(t)

    def stop(self) -> None:
        """Stop the probe threads (before replica processes are terminated on shutdown)."""
        self._stop.set()
        for t in self._watchers:
            t.join(timeout=1.0)

    def _probe(self, replica_id: str, client: C) -> dict[str, int]:
        """One Health probe; the replica is suspect from ``suspect_after_s`` until a probe answers."""
        timer = threading.Timer(self.pool.deadlines.suspect_after_s, self.pool.set_suspect, args=(replica_id, True))
        timer.daemon = True
        timer.start()
        try:
            held = client.probe()
        finally:
            timer.cancel()
        self.pool.set_suspect(replica_id, False)
        return held

    def _restart(self, replica_id: str, restarter: Restarter[C]) -> None:
        self.pool.mark_down(replica_id, "restarting")
        with self._lock:
            state = self._state.setdefault(replica_id, SupervisedState())
            state.restarting = True
        try:
            new = restarter.restart()
            with self._lock:
                state.restarts += 1
            log.warning("replica %s restarted (restart %d)", replica_id, state.restarts)
            if self._stop.is_set():
                new.close()
                return
            self.pool.adopt(replica_id, new)
            self.pool.replace(replica_id, new)
        finally:
            with self._lock:
                state.restarting = False

    def _watch(self, replica_id: str, restarter: Restarter[C] | None) -> None:
        d, misses = self.pool.deadlines, 0
        while not self._stop.wait(d.probe_period_s):
            try:
                if restarter is not None and restarter.exited():
                    log.warning("replica %s exited; restarting", replica_id)
                    self._restart(replica_id, restarter)
                    misses = 0
                    continue
                client = self.pool.client(replica_id)
                try:
                    held = self._probe(replica_id, client)
                except ReplicaUnavailable as e:
                    misses += 1
                    if misses >= d.probe_misses:
                        self.pool.mark_down(replica_id, f"missed {misses} health probes ({e})")
                        if restarter is not None:
                            log.warning("replica %s is unresponsive; killing and restarting it", replica_id)
                            self._restart(replica_id, restarter)
                            misses = 0
                    continue
                misses = 0
                with self._lock:
                    self._state.setdefault(replica_id, SupervisedState()).versions = dict(held)
                if self.pool.is_down(replica_id):
                    self.pool.replace(replica_id, client)
                else:
                    self.pool.refresh(client, held)
            except ReplicaUnavailable as e:
                self.pool.mark_down(replica_id, str(e))
            except Exception as e:  # keep supervising; the next round retries
                if not self._stop.is_set():
                    log.warning("replica %s not recovered yet: %s", replica_id, e)
