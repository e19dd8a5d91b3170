"""ReplicaPool failure handling without a network: hung replicas, lost adapters, reconciling versions.

The fake replica below behaves like GrpcReplicaClient towards the pool: a
"hung" replica answers nothing, so each call blocks until its deadline
(ReplicaUnavailable) or until the pool cancels the calls in flight
(`cancel_inflight`, also ReplicaUnavailable). The end-to-end versions with
real processes and SIGSTOP are in tests/server/test_e2e_stuck_replica.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from together_train_server.service.errors import ServiceError
from together_train_server.service.replicas.pool import (
    Deadlines,
    ReplicaLacksWeights,
    ReplicaPool,
    ReplicaUnavailable,
)

FAST = Deadlines(base_s=1.0, per_token_s=0.01, push_bytes_per_s=1e9, probe_period_s=0.05, probe_timeout_s=0.2,
                 probe_misses=2, wait_for_replica_s=5.0)


class FakeReplica:
    """In-memory replica: holds {key: version}; `hung` makes every call block like a stopped process."""

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self.deadlines = FAST
        self.held: dict[str, int] = {}
        self.hung = False
        self.pushes: list[tuple[str, int]] = []
        self.drops: list[str] = []
        self.served: list[str] = []
        self._cancel = threading.Condition()
        self._generation = 0

    def _block_if_hung(self, timeout: float, what: str) -> None:
        if not self.hung:
            return
        with self._cancel:
            gen = self._generation
            if self._cancel.wait_for(lambda: self._generation != gen, timeout=timeout):
                raise ReplicaUnavailable(f"{self.replica_id}: {what} cancelled")
        raise ReplicaUnavailable(f"{self.replica_id}: {what} missed its deadline of {timeout} s")

    def push(self, key, version, lora, tensors):
        self._block_if_hung(self.deadlines.for_bytes(64), "push")
        self.pushes.append((key, version))
        if self.held.get(key, -1) <= version:  # like a replica: never an older version over a newer one
            self.held[key] = version
        return 64

    def drop(self, key):
        self._block_if_hung(self.deadlines.base_s, "drop")
        self.drops.append(key)
        self.held.pop(key, None)

    def probe(self):
        self._block_if_hung(self.deadlines.probe_timeout_s, "probe")
        return dict(self.held)

    def sample(self, key):
        self._block_if_hung(self.deadlines.for_tokens(10), "sample")
        if key and key not in self.held:
            raise ReplicaLacksWeights(key, f"replica {self.replica_id} holds no weights for session {key}")
        self.served.append(key)
        return self.replica_id, self.held.get(key, -1)

    def cancel_inflight(self) -> None:
        with self._cancel:
            self._generation += 1
            self._cancel.notify_all()

    def close(self) -> None:
        pass


class FakeRestarter:
    """Restarter whose restart hands back a fresh (empty) replica with the same id."""

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self.restarts = 0
        self.new: FakeReplica | None = None

    def exited(self) -> bool:
        return False

    def restart(self) -> FakeReplica:
        self.restarts += 1
        self.new = FakeReplica(self.replica_id)
        return self.new


def wait_until(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_push_to_a_hung_replica_succeeds_on_the_others_and_excludes_it():
    a, b = FakeReplica("a"), FakeReplica("b")
    pool = ReplicaPool([a, b], deadlines=FAST)
    pool.push_all("s1", 1, None, {})
    a.hung = True
    t0 = time.monotonic()
    nbytes, n = pool.publish("s1", 2, None, {})
    elapsed = time.monotonic() - t0
    assert (nbytes, n) == (64, 1)
    assert elapsed < FAST.for_bytes(64) + 0.5, elapsed  # bounded by the push deadline
    # Out of routing for s1 at once (a laggard), marked down when its push deadline passes.
    assert wait_until(lambda: pool.is_down("a"), FAST.for_bytes(64) + 1.0) and not pool.is_down("b")
    assert a.held == {"s1": 1} and b.held == {"s1": 2}
    # Routing never picks the laggard: every sample of s1 is served at version 2.
    assert {pool.route(lambda c: c.sample("s1"), key="s1") for _ in range(6)} == {("b", 2)}
    # It answers again: replace() re-pushes the latest version before it is routed to.
    a.hung = False
    pool.replace("a", a)
    assert a.held == {"s1": 2} and not pool.is_down("a")
    pool.close()


def test_push_with_every_replica_hung_is_unavailable_naming_them():
    a, b = FakeReplica("a"), FakeReplica("b")
    pool = ReplicaPool([a, b], deadlines=FAST)
    a.hung = b.hung = True
    t0 = time.monotonic()
    with pytest.raises(ServiceError) as e:
        pool.publish("s1", 1, None, {})
    assert time.monotonic() - t0 < FAST.for_bytes(64) + 0.5
    assert e.value.code == "UNAVAILABLE" and "a:" in e.value.message and "b:" in e.value.message
    pool.close()


def test_hung_replica_is_detected_its_requests_retried_and_it_is_restarted_and_repushed():
    a, b = FakeReplica("a"), FakeReplica("b")
    slow = Deadlines(**{**FAST.__dict__, "per_token_s": 10.0})  # a sample's own deadline is far away
    pool = ReplicaPool([a, b], deadlines=slow)
    pool.push_all("s1", 3, None, {})
    pool.push_all("ckpt:x", 7, None, {})
    restarter = FakeRestarter("a")
    a.hung = True
    pool.supervise({"a": restarter})
    # Requests that land on the hung replica wait for the probes, are cancelled and retried on b.
    results, times = [], []

    def one() -> None:
        t0 = time.monotonic()
        results.append(pool.route(lambda c: c.sample("s1"), key="s1"))
        times.append(time.monotonic() - t0)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(results) == 4 and all(r[1] == 3 for r in results)
    assert max(times) < slow.detection_bound_s + 1.0, (times, slow.detection_bound_s)
    assert wait_until(lambda: restarter.restarts >= 1 and not pool.is_down("a"), 10)
    new = restarter.new
    assert new.held == {"s1": 3, "ckpt:x": 7}  # every key's latest version before routing to it
    assert pool.route(lambda c: c.sample("s1"), key="s1")[1] == 3
    pool.close()


def test_replica_that_lost_an_adapter_gets_it_repushed_before_serving():
    a = FakeReplica("a")
    pool = ReplicaPool([a], deadlines=FAST)
    pool.push_all("s1", 4, None, {})
    a.held.clear()  # a drop behind the pool's back (restart without the pool noticing, lost push)
    assert pool.route(lambda c: c.sample("s1"), key="s1") == ("a", 4)
    assert a.pushes[-1] == ("s1", 4)
    # A key the pool never pushed stays an error (nothing to re-push).
    with pytest.raises(ServiceError) as e:
        pool.route(lambda c: c.sample("s9"), key="s9")
    assert e.value.code == "FAILED_PRECONDITION"
    pool.close()


def test_probe_repushes_a_lost_adapter_and_reconciles_versions():
    a = FakeReplica("a")
    pool = ReplicaPool([a], deadlines=FAST)
    pool.push_all("s1", 5, None, {})
    pool.supervise()
    a.held.pop("s1")
    assert wait_until(lambda: a.held.get("s1") == 5, 5)  # found by the probe, no request needed
    # An older latest (after load_state of an earlier step) over a newer held version: drop, then push.
    pool.drop_all("s1")
    a.held["s1"] = 9  # the drop was lost
    a.held["stale"] = 1  # an adapter the pool no longer knows
    pool.push_all("s1", 2, None, {})  # the replica keeps 9 (never older over newer) ...
    assert wait_until(lambda: a.held == {"s1": 2}, 5), a.held  # ... until the probe reconciles it
    pool.close()
