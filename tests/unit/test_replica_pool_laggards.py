"""A replica that does not acknowledge a weights push within its sync deadline leaves routing for that
adapter key, without holding the sync (issue 23 item 2), against the pool with in-memory replicas.

`Deadlines.for_sync(bytes)` (``sync_base_s + bytes / sync_bytes_per_s``) bounds how long a
weights_sync waits for a replica beyond the first one that took the version; the call's own push
deadline (`for_bytes`, tens of seconds) stays the backstop that marks a replica down. A laggard is
never routed to for that key until it holds the version (caught up in the background), new pushes do
not queue behind it, and its stall does not starve other keys' pushes. Before, `publish` waited for
every replica's push until its deadline or until the probes took the replica out of routing (13 s
with the default flags in the stuck-replica check).
"""

from __future__ import annotations

import threading
import time

from test_replica_pool_failures import FakeReplica, wait_until
from together_train_server.service.replicas.pool import Deadlines, ReplicaPool

# Backstop deadline 20 s, probes off (no supervise): only the sync deadline can end the wait.
SLOW_BACKSTOP = Deadlines(base_s=20.0, per_token_s=0.01, push_bytes_per_s=1e9, probe_period_s=0.05,
                          probe_timeout_s=0.2, probe_misses=2, wait_for_replica_s=5.0,
                          sync_base_s=0.3, sync_bytes_per_s=1e9)
SLACK_S = 0.5  # thread hand-offs on a loaded machine


class SlowReplica(FakeReplica):
    """Answers pushes only after `delay` seconds (a replica busy, paused, or swapped out)."""

    def __init__(self, replica_id: str) -> None:
        super().__init__(replica_id)
        self.delay = 0.0
        self.release = threading.Event()

    def push(self, key, version, lora, tensors):
        if self.delay:
            self.release.wait(self.delay)
        return super().push(key, version, lora, tensors)


def test_sync_deadline_is_documented_from_the_bytes():
    d = Deadlines(sync_base_s=1.0, sync_bytes_per_s=100e6)
    assert d.for_sync(0) == 1.0 and abs(d.for_sync(50_000_000) - 1.5) < 1e-9
    # The default sync deadline of a rank-32 LoRA of a 135M model (~ 20 MB in float32): a few seconds.
    assert Deadlines().for_sync(20_000_000) < 3.0


def test_laggard_does_not_hold_the_sync_and_is_not_routed_for_the_key():
    a, b = SlowReplica("a"), SlowReplica("b")
    a.deadlines = b.deadlines = SLOW_BACKSTOP
    pool = ReplicaPool([a, b], deadlines=SLOW_BACKSTOP)
    pool.push_all("s1", 1, None, {})
    a.delay = 30.0  # a stops answering pushes
    t0 = time.monotonic()
    _, n = pool.publish("s1", 2, None, {})
    took = time.monotonic() - t0
    bound = SLOW_BACKSTOP.for_sync(0) + SLACK_S
    print(f"sync with a laggard: {took:.2f} s (bound {bound:.2f} s)")
    assert n == 1 and took < bound, (n, took, bound)
    assert not pool.is_down("a")  # only out of routing for s1, not marked down
    # Sampling s1 never reaches the replica that lacks version 2; the base model may use both.
    assert {pool.route(lambda c: c.sample("s1"), key="s1") for _ in range(8)} == {("b", 2)}
    # The next syncs of s1 and of other keys do not queue behind the stalled push (8 keys > the
    # pool's push workers: a stalled replica must not hold them all).
    for v, key in [(3, "s1")] + [(1, f"k{i}") for i in range(8)]:
        t0 = time.monotonic()
        _, n = pool.publish(key, v, None, {})
        took = time.monotonic() - t0
        assert n == 1 and took < bound, (key, v, n, took, bound)
    assert {pool.route(lambda c: c.sample("s1"), key="s1") for _ in range(4)} == {("b", 3)}
    # It answers again: caught up in the background to every key's latest version, then routed to for s1.
    a.delay = 0.0
    a.release.set()
    assert wait_until(lambda: a.held.get("s1") == 3 and all(a.held.get(f"k{i}") == 1 for i in range(8)), 10), a.held
    assert wait_until(lambda: ("a", 3) in {pool.route(lambda c: c.sample("s1"), key="s1") for _ in range(8)}, 10)
    pool.close()


def test_hung_laggard_is_marked_down_by_its_backstop_and_replaced():
    fast_backstop = Deadlines(base_s=1.5, per_token_s=0.01, push_bytes_per_s=1e9, probe_period_s=0.05,
                              probe_timeout_s=0.2, probe_misses=2, wait_for_replica_s=5.0, sync_base_s=0.3)
    a, b = FakeReplica("a"), FakeReplica("b")
    pool = ReplicaPool([a, b], deadlines=fast_backstop)
    pool.push_all("s1", 1, None, {})
    a.hung = True
    t0 = time.monotonic()
    _, n = pool.publish("s1", 2, None, {})
    assert n == 1 and time.monotonic() - t0 < fast_backstop.for_sync(0) + SLACK_S
    assert wait_until(lambda: pool.is_down("a"), fast_backstop.for_bytes(64) + 2)  # the backstop fired
    a.hung = False
    pool.replace("a", a)
    assert a.held == {"s1": 2} and not pool.is_down("a")
    assert wait_until(lambda: ("a", 2) in {pool.route(lambda c: c.sample("s1"), key="s1") for _ in range(8)}, 5)
    pool.close()
