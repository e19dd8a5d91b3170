"""The replica pool's supervision: health probes, suspicion of a slow replica, restarts (docs/design.md §7).

`ReplicaSupervisionMixin` is part of `ReplicaPool` (service/replicas/pool.py) and reads its state
(``_lock``, ``_clients``, ``_down``, ``_suspect``, ...). One probe thread per replica:

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
from typing import TYPE_CHECKING, Protocol

from together_train_server.service.replicas.errors import ReplicaUnavailable

if TYPE_CHECKING:
    from together_train_server.service.replicas.pool import ReplicaClient

log = logging.getLogger("together_train_server.service.replicas.pool")


class Restarter(Protocol):
    """A replica process the resource spawned: `supervise` kills and restarts it when it hangs."""

    def exited(self) -> bool:
        """True when the process is gone."""
        ...

    def restart(self) -> "ReplicaClient":
        """Kill the process (if alive), start a new one and return its connected client.

        Raises:
            Exception: it did not come up (the supervisor retries next period).
        """
        ...


class ReplicaSupervisionMixin:
    """Probe threads, suspicion and restarts of `ReplicaPool` (see the module docstring)."""

    def supervise(self, restarters: dict[str, Restarter] | None = None) -> None:
        """Start one probe thread per replica (`Deadlines` probe policy).

        Each round (every ``probe_period_s``): a spawned replica whose process
        exited is restarted; otherwise Health is probed with ``probe_timeout_s``
        (suspect after ``suspect_after_s`` without an answer, see the module docstring).
        ``probe_misses`` misses in a row mark it down (in-flight calls cancelled)
        and, with a `Restarter`, kill and restart it. A down replica that
        answers is brought back with `replace`; a live one that lost an adapter
        gets it re-pushed.
        """
        restarters = restarters or {}
        for rid in self.replica_ids:
            t = threading.Thread(target=self._watch, args=(rid, restarters.get(rid)), name=f"probe-{rid}", daemon=True)
            t.start()
            self._watchers.append(t)

    def _set_suspect(self, replica_id: str, suspect: bool) -> None:
        with self._lock:
            was = replica_id in self._suspect
            if suspect == was:
                return
            if suspect:
                self._suspect.add(replica_id)
            else:
                self._suspect.discard(replica_id)
            self._up.notify_all()  # wakes hedged calls waiting on this replica (route)
        if suspect:
            log.warning("replica %s did not answer a health probe within %.2f s: requests go to the others "
                        "until it does", replica_id, self.deadlines.suspect_after_s)
        else:
            log.warning("replica %s answers again", replica_id)

    def _probe(self, replica_id: str, client: "ReplicaClient") -> dict[str, int]:
        """One Health probe; the replica is suspect from ``suspect_after_s`` until a probe answers."""
        timer = threading.Timer(self.deadlines.suspect_after_s, self._set_suspect, args=(replica_id, True))
        timer.daemon = True
        timer.start()
        try:
            held = client.probe()
        finally:
            timer.cancel()
        self._set_suspect(replica_id, False)
        return held

    def _adopt(self, replica_id: str, client: "ReplicaClient") -> None:
        """Put a restarted replica's client in its slot, still out of routing, so the probes reach
        the new process even when the first `replace` fails (the next probe round retries it)."""
        client.deadlines = self.deadlines
        with self._lock:
            i = next(i for i, c in enumerate(self._clients) if c.replica_id == replica_id)
            old, self._clients[i] = self._clients[i], client
            client.replica_id = replica_id
            self._down.add(replica_id)
        if old is not client:
            old.close()

    def _restart(self, replica_id: str, restarter: Restarter) -> None:
        self.mark_down(replica_id, "restarting")
        with self._lock:
            self._restarting.add(replica_id)
        try:
            new = restarter.restart()
            with self._lock:
                self._restarts[replica_id] = self._restarts.get(replica_id, 0) + 1
            log.warning("replica %s restarted (restart %d)", replica_id, self._restarts[replica_id])
            if self._stop.is_set():
                new.close()
                return
            self._adopt(replica_id, new)
            self.replace(replica_id, new)
        finally:
            with self._lock:
                self._restarting.discard(replica_id)

    def _watch(self, replica_id: str, restarter: Restarter | None) -> None:
        d, misses = self.deadlines, 0
        while not self._stop.wait(d.probe_period_s):
            try:
                if restarter is not None and restarter.exited():
                    log.warning("replica %s exited; restarting", replica_id)
                    self._restart(replica_id, restarter)
                    misses = 0
                    continue
                client = self._client(replica_id)
                try:
                    held = self._probe(replica_id, client)
                except ReplicaUnavailable as e:
                    misses += 1
                    if misses >= d.probe_misses:
                        self.mark_down(replica_id, f"missed {misses} health probes ({e})")
                        if restarter is not None:
                            log.warning("replica %s is unresponsive; killing and restarting it", replica_id)
                            self._restart(replica_id, restarter)
                            misses = 0
                    continue
                misses = 0
                with self._lock:
                    self._held[replica_id] = dict(held)
                if self.is_down(replica_id):
                    self.replace(replica_id, client)
                else:
                    self._reconcile(client, held, blocking=False)
            except ReplicaUnavailable as e:
                self.mark_down(replica_id, str(e))
            except Exception as e:  # keep supervising; the next round retries
                if not self._stop.is_set():
                    log.warning("replica %s not recovered yet: %s", replica_id, e)

    def stop_supervising(self) -> None:
        """Stop the probe threads (before replica processes are terminated on shutdown)."""
        self._stop.set()
        for t in self._watchers:
            t.join(timeout=1.0)
