"""A stuck (SIGSTOP) generator replica stalls nothing, against real processes.

Short deadlines and probe periods via the ``serve --replica-*`` flags (README
"Failures"). Bounds asserted, each derived from the flags:

- push deadline  = timeout + bytes / rate  (tiny adapter: ~timeout)
- sample deadline = timeout + per_token * (prompt + num_samples * max_tokens)
- hang detection <= misses * (period + probe timeout) + period

1. Spawned replicas: a replica is stopped while a stream of samples is in
   flight and a weights_sync runs, while another session trains. The sync
   succeeds on the healthy replica within the push deadline, the other
   session's steps keep completing during the sync (the trainer worker does
   not wait on the push), every sample returns within two sample deadlines,
   and the resource kills and restarts the stopped replica, re-pushes the
   adapter, and the restarted replica serves the synced version with the
   trainer's logprobs.
2. An attached replica (the resource did not spawn it, so it is not killed):
   stopped, a weights_sync is UNAVAILABLE naming it within the push deadline;
   after SIGCONT the probes bring it back with the latest adapter; then a
   DropWeights behind the resource's back is noticed and re-pushed before
   the session's next sample is served there.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

import together_train as tt
from together_train.errors import UnavailableError

TIMEOUT_S, PER_TOKEN_S, PERIOD_S, PROBE_TIMEOUT_S, MISSES = 6.0, 0.05, 1.0, 2.0, 3
FLAGS = [
    "--replica-timeout-s", str(TIMEOUT_S), "--replica-timeout-per-token-s", str(PER_TOKEN_S),
    "--replica-probe-period-s", str(PERIOD_S), "--replica-probe-timeout-s", str(PROBE_TIMEOUT_S),
    "--replica-probe-misses", str(MISSES), "--replica-wait-s", "60",
    "--trainer-threads", "1", "--generator-threads", "1",
]  # fmt: skip
PUSH_BOUND_S = TIMEOUT_S + 2.0  # tiny adapter (KBs at >= 10 MB/s) + queueing behind the other session and round trips on a loaded machine
DETECTION_S = MISSES * (PERIOD_S + PROBE_TIMEOUT_S) + PERIOD_S
PROMPT = [5, 6, 7]
PARAMS = tt.SamplingParams(max_tokens=24, seed=3, ignore_eos=True)
SAMPLE_DEADLINE_S = TIMEOUT_S + PER_TOKEN_S * (len(PROMPT) + PARAMS.max_tokens)
LOGPROB_ATOL = 1e-4  # as tests/server/test_e2e_versions.py (fp32 CPU)


def child_pids(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def replica_id_of(pid: int) -> str:
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return args[args.index(b"--replica-id") + 1].decode()


def batch(n: int = 29) -> list[tt.Sample]:
    toks = np.arange(1, n + 1)
    return [tt.Sample(model_input=toks[:-1], loss_fn_inputs={"target_tokens": toks[1:], "weights": np.ones(n - 1, np.float32)})]


def train_step(session) -> None:
    session.forward_backward(batch(), "cross_entropy")
    session.optim_step(tt.AdamParams(learning_rate=1e-2)).result(timeout=60)


class Trainer(threading.Thread):
    """Another session training (forward_backward + optim_step pairs) until stopped; records each pair."""

    def __init__(self, session) -> None:
        super().__init__(daemon=True)
        self.session, self.pairs, self.error = session, [], None
        self.halt = threading.Event()

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                t0 = time.monotonic()
                train_step(self.session)
                self.pairs.append((t0, time.monotonic()))
        except Exception as e:  # reported by the test
            self.error = e

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=60)
        assert self.error is None, self.error


def trainer_logprobs(session, tokens: list[int]) -> np.ndarray:
    toks = np.asarray(tokens)
    s = tt.Sample(model_input=toks[:-1], loss_fn_inputs={"target_tokens": toks[1:], "weights": np.zeros(len(toks) - 1, np.float32)})
    return np.asarray(session.forward([s], "cross_entropy", return_logprobs=True).result(timeout=60).logprobs[0])


def check_served_version(session, result, version: int) -> None:
    """The sample names `version` and its logprobs are the trainer's (the synced adapter served it)."""
    assert result.policy_version == version
    seq = result.sequences[0]
    lp = trainer_logprobs(session, PROMPT + list(seq.tokens))
    np.testing.assert_allclose(seq.logprobs, lp[len(PROMPT) - 1 :], atol=LOGPROB_ATOL)


def resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


@pytest.mark.timeout(400)
def test_stopped_spawned_replica_during_sync_and_samples(tiny_model_dir, tmp_path):
    with tt.launch_local(model=str(tiny_model_dir), generators=2, storage_dir=tmp_path, extra_args=FLAGS) as client:
        s1 = client.create_session(lora=tt.LoraConfig(rank=4, seed=0))
        s2 = client.create_session(lora=tt.LoraConfig(rank=4, seed=1))
        for _ in range(2):
            train_step(s1)
        assert s1.weights_sync().result(timeout=60).policy_version == 2
        server_pid = client.local_resource.process.pid
        replicas = child_pids(server_pid)
        assert len(replicas) == 2, replicas
        stopped = replicas[0]
        stopped_id = replica_id_of(stopped)
        train_step(s1)  # version 3, synced while the replica is stopped

        other = Trainer(s2)
        other.start()
        while len(other.pairs) < 2:  # training is under way before the replica stops
            time.sleep(0.05)
        os.kill(stopped, signal.SIGSTOP)  # never resumed: the resource must kill and restart it
        try:
            t0 = time.monotonic()
            samples = [s1.sample(PROMPT, PARAMS) for _ in range(12)]  # half are routed to the stopped replica
            sync = s1.weights_sync().result(timeout=120)
            t_sync = time.monotonic()
            results = [(f.result(timeout=120), time.monotonic()) for f in samples]
            other.stop()
        except BaseException:
            resume(stopped)
            raise

        print(f"sync {t_sync - t0:.2f} s (bound {PUSH_BOUND_S}), other session: {len(other.pairs)} steps, "
              f"slowest {max(b - a for a, b in other.pairs):.2f} s; slowest sample {max(t for _, t in results) - t0:.2f} s "
              f"(bound {2 * SAMPLE_DEADLINE_S:.1f})")
        # The sync ended within the push deadline, on the healthy replica only.
        assert sync.policy_version == 3 and sync.num_replicas == 1, sync
        assert t_sync - t0 < PUSH_BOUND_S, t_sync - t0
        # The other session trained while the push waited: the worker was not held by it.
        during = [p for p in other.pairs if p[0] >= t0 and p[1] <= t_sync]
        assert len(during) >= 2, (len(during), t_sync - t0)
        assert max(b - a for a, b in other.pairs) < TIMEOUT_S, max(b - a for a, b in other.pairs)
        # Every sample returned within its bound: at most one deadline (or detection) on the
        # stopped replica, then a fresh deadline on the healthy one. Versions: 2 before the sync.
        for r, t in results:
            assert t - t0 < 2 * SAMPLE_DEADLINE_S, t - t0
            assert r.policy_version in (2, 3)

        # The resource killed the stopped replica and started it again.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (stopped in child_pids(server_pid) or len(child_pids(server_pid)) < 2):
            time.sleep(0.25)
        now = child_pids(server_pid)
        print(f"restarted after {time.monotonic() - t0:.1f} s (detection bound {DETECTION_S} s + startup)")
        assert stopped not in now and len(now) == 2, now
        # Once routed to again it serves version 3 with the trainer's logprobs.
        served_by_restarted = None
        while time.monotonic() < deadline and served_by_restarted is None:
            for f in [s1.sample(PROMPT, PARAMS) for _ in range(6)]:
                r = f.result(timeout=60)
                assert r.policy_version == 3
                if r.replica_id == stopped_id:
                    served_by_restarted = r
        assert served_by_restarted is not None, f"{stopped_id} never served again"
        check_served_version(s1, served_by_restarted, 3)
        s1.stop()
        s2.stop()


@pytest.fixture()
def attached_replica(tiny_model_dir, tmp_path):
    """A `together-train generator` process started by the test (not by the resource)."""
    secret = tmp_path / "replica-secret"
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"stuck-replica-test-secret-0123456789\n")
    os.close(fd)
    port_file = tmp_path / "replica.port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "together_train_server.cli", "generator", "--model", str(tiny_model_dir),
         "--port", "0", "--port-file", str(port_file), "--threads", "1", "--replica-id", "attached-0",
         "--replica-secret-file", str(secret)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "replica did not start"
            time.sleep(0.1)
        yield proc, f"127.0.0.1:{port_file.read_text().strip()}", secret
    finally:
        resume(proc.pid)
        proc.kill()
        proc.wait(timeout=30)


@pytest.mark.timeout(400)
def test_stopped_attached_replica_sync_is_unavailable_then_recovers(tiny_model_dir, tmp_path, attached_replica):
    proc, address, secret = attached_replica
    with tt.launch_local(
        model=str(tiny_model_dir), generators=0, storage_dir=tmp_path / "storage",
        extra_args=[*FLAGS, "--generator-address", address, "--replica-secret-file", str(secret)],
    ) as client:  # fmt: skip
        s1 = client.create_session(lora=tt.LoraConfig(rank=4, seed=0))
        s2 = client.create_session(lora=tt.LoraConfig(rank=4, seed=1))
        train_step(s1)
        assert s1.weights_sync().result(timeout=60).policy_version == 1
        train_step(s1)

        other = Trainer(s2)
        other.start()
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(UnavailableError) as e:
                s1.weights_sync().result(timeout=120)
            elapsed = time.monotonic() - t0
            steps_during = len([p for p in other.pairs if p[0] >= t0 and p[1] <= t0 + elapsed])
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        other.stop()
        print(f"sync UNAVAILABLE after {elapsed:.2f} s (bound {PUSH_BOUND_S}); {steps_during} steps of the other session meanwhile")
        # The only replica did not take the push: UNAVAILABLE naming it, within the push deadline.
        assert address in str(e.value), str(e.value)
        assert elapsed < PUSH_BOUND_S, elapsed
        assert steps_during >= 2, steps_during

        # After SIGCONT the probes bring it back (not restarted: the resource did not spawn it)
        # with the latest adapter; a new sync succeeds and the sample serves version 2.
        deadline = time.monotonic() + DETECTION_S + 60
        while True:
            try:
                sync = s1.weights_sync().result(timeout=120)
                break
            except UnavailableError:
                assert time.monotonic() < deadline, "the replica was not routed to again after SIGCONT"
                time.sleep(PERIOD_S)
        assert proc.poll() is None
        assert (sync.policy_version, sync.num_replicas) == (2, 1)
        check_served_version(s1, s1.sample(PROMPT, PARAMS).result(timeout=60), 2)

        # The replica loses the adapter behind the resource's back (a DropWeights with the secret):
        # the resource re-pushes it before the session's next request is served there.
        from together_train._proto import generator_pb2, generator_pb2_grpc
        from together_train_server.wire.replica_auth import METADATA_KEY

        with grpc.insecure_channel(address) as ch:
            stub = generator_pb2_grpc.GeneratorServiceStub(ch)
            meta = ((METADATA_KEY, secret.read_text().strip()),)
            stub.DropWeights(generator_pb2.DropWeightsRequest(session_id=s1.session_id), metadata=meta, timeout=10)
            assert s1.session_id not in stub.Health(generator_pb2.HealthRequest(), metadata=meta, timeout=10).loaded_versions
            check_served_version(s1, s1.sample(PROMPT, PARAMS).result(timeout=60), 2)
            assert stub.Health(generator_pb2.HealthRequest(), metadata=meta, timeout=10).loaded_versions[s1.session_id] == 2
        s1.stop()
        s2.stop()
