"""Replica recovery: killing a generator replica during a stream of sample requests loses none.

A resource with 2 replicas serves a session whose adapter was synced at
version 2. One replica process is killed (SIGKILL) while sample requests
are in flight on it (its own Health reports them outstanding, and each asks
for 200 tokens, so they are far from done): requests on it are retried on
the other, the supervisor restarts it and re-pushes the session's adapter,
and every request returns tokens from version 2; afterwards both replicas,
the restarted one included, serve version 2.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pathlib
from typing import Callable

import grpc
import numpy as np
import pytest

import together_train as tt
from together_train._proto import generator_pb2, generator_pb2_grpc


def child_pids(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def replica_health(pid: int) -> Callable[[], "generator_pb2.HealthResponse"]:
    """A function returning the Health of the replica process `pid`, called on its own port (read from
    its ``--port-file``) with its credential (``--replica-secret-file``, when it has one), as its resource does."""
    argv = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    arg = lambda name: argv[argv.index(name) + 1] if name in argv else None  # noqa: E731
    port = pathlib.Path(arg("--port-file")).read_text().strip()
    metadata = ()
    if arg("--replica-secret-file"):
        from together_train_server.wire.replica_auth import METADATA_KEY, read_secret_file

        metadata = ((METADATA_KEY, read_secret_file(pathlib.Path(arg("--replica-secret-file")))),)
    stub = generator_pb2_grpc.GeneratorServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    return lambda: stub.Health(generator_pb2.HealthRequest(), timeout=5, metadata=metadata)


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
        # 200 new tokens (context 256): a request is in flight for many decode steps
        params = tt.SamplingParams(max_tokens=200, seed=3, ignore_eos=True)
        reference = session.sample([5, 6, 7], params).result(timeout=120).sequences[0].tokens
        assert len(reference) == 200

        server_pid = client.local_resource.process.pid
        replicas = child_pids(server_pid)
        assert len(replicas) == 2, replicas
        victim = replica_health(replicas[0])
        assert victim().outstanding_requests == 0
        futures = [session.sample([5, 6, 7], params) for _ in range(12)]
        deadline = time.monotonic() + 60
        while (in_flight := victim().outstanding_requests) < 1:
            assert time.monotonic() < deadline, "no request reached the replica to kill within 60 s"
            time.sleep(0.005)
        os.kill(replicas[0], signal.SIGKILL)  # with `in_flight` requests decoding on it
        futures += [session.sample([5, 6, 7], params) for _ in range(4)]
        results = [f.result(timeout=240) for f in futures]
        assert in_flight >= 1
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
        # Both replicas serve version 2 again, the restarted one with the re-pushed adapter: concurrent
        # requests (least-outstanding routing spreads them) until each replica has answered.
        seen: set[str] = set()
        deadline = time.monotonic() + 120
        while len(seen) < 2:
            assert time.monotonic() < deadline, f"only {seen} answered within 120 s of the restart"
            for r in [f.result(timeout=240) for f in [session.sample([5, 6, 7], params) for _ in range(6)]]:
                assert r.policy_version == 2 and r.sequences[0].tokens == reference
                seen.add(r.replica_id)
        assert len(seen) == 2, seen
        session.stop()
