"""A SIGSTOPped replica holds no session's weights_sync beyond the sync deadline (issue 23 item 2).

Real processes, the default replica deadlines (30 s push backstop, probes every 2 s with a 5 s
timeout: a stopped replica is found after up to 16 s). Four sessions train on a resource with two
spawned replicas; each one's weights_sync is timed while both replicas answer (the healthy push),
then again, all four at once, with one replica stopped. Every sync must end within the healthy
push + 2 s (the issue's target; `Deadlines.for_sync` is 1 s + bytes / 100 MB/s), and the samples
of each session that follow are served at the synced version by the replica that holds it.
Before, each sync waited until the probes took the stopped replica out of routing (13.2 s measured
in the issue).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import together_train as tt
from test_e2e_stuck_replica import PROMPT, child_pids, replica_id_of, resume, train_step

TARGET_EXTRA_S = 2.0
N_SESSIONS = 4


def _sync_all(sessions) -> list[tuple[float, object]]:
    """Each session's weights_sync at once; (seconds, result) per session."""
    out: list = [None] * len(sessions)

    def one(i: int) -> None:
        t0 = time.monotonic()
        r = sessions[i].weights_sync().result(timeout=120)
        out[i] = (time.monotonic() - t0, r)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(sessions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=150)
    assert all(o is not None for o in out), out
    return out


@pytest.mark.timeout(400)
def test_stopped_replica_does_not_hold_weights_sync(tiny_model_dir, tmp_path):
    with tt.launch_local(model=str(tiny_model_dir), generators=2, storage_dir=tmp_path,
                         extra_args=["--trainer-threads", "1", "--generator-threads", "1"]) as client:
        sessions = [client.create_session(lora=tt.LoraConfig(rank=4, seed=i)) for i in range(N_SESSIONS)]
        for s in sessions:
            train_step(s)
        _sync_all(sessions)  # warm: first pushes
        for s in sessions:
            train_step(s)
        healthy = _sync_all(sessions)
        healthy_s = max(t for t, _ in healthy)
        assert all(r.num_replicas == 2 for _, r in healthy), healthy
        replicas = child_pids(client.local_resource.process.pid)
        assert len(replicas) == 2, replicas
        stopped = replicas[0]
        stopped_id = replica_id_of(stopped)
        for s in sessions:
            train_step(s)
        os.kill(stopped, signal.SIGSTOP)
        try:
            stuck = _sync_all(sessions)
            results = [s.sample(PROMPT, tt.SamplingParams(max_tokens=4, temperature=0.0)).result(timeout=60)
                       for s in sessions]
        finally:
            resume(stopped)
        worst = max(t for t, _ in stuck)
        print(f"healthy sync (4 at once) {healthy_s:.2f} s; with a stopped replica {[round(t, 2) for t, _ in stuck]} s "
              f"(target < {healthy_s + TARGET_EXTRA_S:.2f} s); load {os.getloadavg()}")
        assert worst < healthy_s + TARGET_EXTRA_S, (worst, healthy_s)
        assert all(r.policy_version == 3 and r.num_replicas >= 1 for _, r in stuck), stuck
        for r in results:  # served at the synced version by the replica holding it
            assert r.policy_version == 3 and r.replica_id != stopped_id, r
        for s in sessions:
            s.stop()
