"""A hedged call (sample, compute_logprobs) leaves a suspect replica only for one `_acquire` would pick.

Without a network (the in-memory replica of test_replica_pool_failures). The suspicion comes from the
probes (service/replicas/supervision.py); here it is set the way the probe's timer sets it. The state
under test: the only other replica lags behind the session's latest version without a push in
flight (between a late push's end and its catch-up, `_laggard_done` -> `_catch_up`). Re-issuing the
call then would route it straight back to the suspect replica, over and over; it must wait on the
suspect replica until the other one holds the version, then move there once.
"""

from __future__ import annotations

import threading
import time

from test_replica_pool_failures import FakeReplica, wait_until
from together_train_server.service.replicas.pool import Deadlines, ReplicaPool

# Long work deadlines: only the suspicion can move the call.
SLOW = Deadlines(base_s=30.0, per_token_s=0.01, push_bytes_per_s=1e9, probe_period_s=0.05, probe_timeout_s=0.2,
                 probe_misses=2, wait_for_replica_s=5.0)


class CountingReplica(FakeReplica):
    """Counts the sample calls it was given (answered or not)."""

    def __init__(self, replica_id: str) -> None:
        super().__init__(replica_id)
        self.calls = 0

    def sample(self, key):
        self.calls += 1
        return super().sample(key)


def test_suspect_replica_keeps_its_call_until_an_alternative_holds_the_version():
    a, b = CountingReplica("a"), CountingReplica("b")
    pool = ReplicaPool([a, b], deadlines=SLOW)
    pool.push_all("s", 1, None, {})
    with pool._lock:
        pool._lagging["s"] = {"b": 2}  # b must hold version 2 before it serves "s"; no push in flight
    a.held["s"] = 2
    a.hung = True
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=pool.route(lambda c: c.sample("s"), key="s", hedge=True)))
    t.start()
    try:
        assert wait_until(lambda: a.calls == 1, 5), a.calls
        pool.set_suspect("a", True)
        time.sleep(1.0)
        print(f"calls while b lags: a {a.calls}, b {b.calls}")
        assert (a.calls, b.calls) == (1, 0), (a.calls, b.calls)
        # b catches up: the call moves there once and is answered at version 2.
        b.held["s"] = 2
        pool._acknowledged(b, "s", 2)
        t.join(timeout=5)
        assert out.get("r") == ("b", 2), out
        assert (a.calls, b.calls) == (1, 1), (a.calls, b.calls)
    finally:
        a.cancel_inflight()  # the abandoned call on a ends
        t.join(timeout=5)
        pool.close()
