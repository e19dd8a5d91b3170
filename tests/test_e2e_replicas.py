"""Replica recovery: killing a generator replica during a stream of sample requests loses none.

A resource with 2 replicas serves a session whose adapter was synced at
version 2. One replica process is killed (SIGKILL) while sample requests
are in flight: requests on it are retried on the other, the supervisor
restarts it and re-pushes the session's adapter, and every request returns
tokens from version 2.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import numpy as np
import pytest

import together_train as tt


def child_pids(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


@pytest.mark.timeout(300)
def test_killed_replica_loses_no_request(tiny_model_dir, tmp_path):
    with tt.launch_local(
        model=str(tiny_model_dir),
        generators=2,
        storage_dir=tmp_path,
        extra_args=["--trainer-threads", "1", "--generator-threads", "1"],
    ) as client:
        session = client.create_session(lora=tt.LoraConfig(rank=4, seed=0))
        toks = np.arange(1, 30)
        sample = tt.Sample(model_input=toks[:-1], loss_fn_inputs={"target_tokens": toks[1:], "weights": np.ones(28, np.float32)})
        for _ in range(2):
            session.forward_backward([sample], "cross_entropy")
            session.optim_step(tt.AdamParams(learning_rate=1e-2))
        assert session.weights_sync().result(timeout=60).policy_version == 2
        params = tt.SamplingParams(max_tokens=24, seed=3, ignore_eos=True)
        reference = session.sample([5, 6, 7], params).result(timeout=60).sequences[0].tokens

        server_pid = client.local_resource.process.pid
        replicas = child_pids(server_pid)
        assert len(replicas) == 2, replicas
        futures = [session.sample([5, 6, 7], params) for _ in range(24)]
        time.sleep(0.3)
        os.kill(replicas[0], signal.SIGKILL)
        futures += [session.sample([5, 6, 7], params) for _ in range(8)]
        results = [f.result(timeout=120) for f in futures]
        assert all(r.policy_version == 2 for r in results)
        assert all(r.sequences[0].tokens == reference for r in results)  # same seed, same version, same tokens

        # The killed replica comes back with the session's adapter re-pushed.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            now = child_pids(server_pid)
            if len(now) == 2 and replicas[0] not in now:
                break
            time.sleep(0.5)
        assert len(child_pids(server_pid)) == 2
        seen = set()
        for _ in range(12):
            r = session.sample([5, 6, 7], params).result(timeout=60)
            assert r.policy_version == 2 and r.sequences[0].tokens == reference
            seen.add(r.replica_id)
        session.stop()
