"""Generator replica processes on this host: spawn, wait for readiness, restart when one dies.

The pool's probe threads (`ReplicaPool.supervise`) watch each replica. A
process that exited, or one that misses its health probes (hung, e.g.
SIGSTOP), is killed and started again on a new port (`_Slot.restart`); its
client is handed to `ReplicaPool.replace`, which re-pushes every session's
latest adapter before routing to it. A replica that is alive but was marked
down (a failed call) and answers its probe is put back the same way.
Requests that were on a dead or hung replica are retried elsewhere by the
pool (or wait for the restart when it was the only one).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from together_train_server.service.replicas.pool import ReplicaPool
from together_train_server.wire.replica_auth import write_secret_file
from together_train_server.wire import weights as wt
from together_train_server.wire.replica_client import GrpcReplicaClient
from together_train_server.service.telemetry import log_event

log = logging.getLogger(__name__)


@dataclass
class _Replica:
    replica_id: str
    proc: subprocess.Popen
    port_file: Path
    restarts: int = 0


class ReplicaProcesses:
    """N `together-train generator` child processes of this resource.

    Args:
        n: number of replicas.
        model_dir: model every replica serves.
        workdir: where port files go.
        threads: torch threads per replica.
        dtype, engine, device: passed to `together-train generator`.
        generator_args: more `together-train generator` arguments, appended as given (e.g. the
            ``--vllm-*`` flags of serve).
        secret: the replica secret (`wire.replica_auth`): written to ``workdir/replica-secret``
            (mode 0600, the only way it reaches the children) and sent on every call.
    """

    def __init__(
        self, n: int, model_dir: Path, workdir: Path, *, threads: int, dtype: str, engine: str, device: str, secret: str,
        generator_args: Sequence[str] = (),
    ) -> None:
        self.generator_args = list(generator_args)
        self.model_dir, self.workdir = model_dir, workdir
        self.secret = secret
        self.secret_file = write_secret_file(workdir / "replica-secret", secret)
        self.threads, self.dtype, self.engine, self.device = threads, dtype, engine, device
        # One pool of push segments for all the replicas: a snapshot goes into one segment they all map.
        self.segments = wt.SegmentPool()
        self.replicas = [self._spawn(f"replica-{i}") for i in range(n)]
        self._stop = threading.Event()
        self._pool: ReplicaPool | None = None

    def _spawn(self, replica_id: str, restarts: int = 0) -> _Replica:
        port_file = self.workdir / f"{replica_id}.{restarts}.port"
        cmd = [
            sys.executable, "-m", "together_train_server.cli", "generator",
            "--model", str(self.model_dir), "--host", "127.0.0.1", "--port", "0",
            "--port-file", str(port_file), "--dtype", self.dtype, "--threads", str(self.threads),
            "--engine", self.engine, "--device", self.device, "--replica-id", replica_id,
            "--parent-pid", str(os.getpid()), "--replica-secret-file", str(self.secret_file),
            *self.generator_args,
        ]  # fmt: skip
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": str(self.threads)}
        return _Replica(replica_id, subprocess.Popen(cmd, env=env), port_file, restarts)

    def _client(self, r: _Replica) -> GrpcReplicaClient:
        # Spawned replicas bind loopback only: plaintext, authenticated by the secret; on this host,
        # so weights pushes may go through shared memory (GrpcReplicaClient same_host).
        return GrpcReplicaClient(f"127.0.0.1:{r.port_file.read_text().strip()}", r.replica_id, secret=self.secret,
                                 same_host=True, segments=self.segments)

    def _connect(self, r: _Replica, deadline: float) -> GrpcReplicaClient:
        while not r.port_file.exists():
            if r.proc.poll() is not None:
                raise RuntimeError(f"{r.replica_id} exited during startup with code {r.proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{r.replica_id} did not start in time")
            time.sleep(0.1)
        client = self._client(r)
        client.wait_ready(max(1.0, deadline - time.monotonic()))
        log_event("replica started", replica=r.replica_id, pid=r.proc.pid, address=client.address,
                  restarts=r.restarts)
        return client

    def connect_all(self, timeout: float) -> list[GrpcReplicaClient]:
        """Wait for every replica to serve; returns their clients (pool order = replica order).

        Raises:
            RuntimeError: a replica exited or did not start within `timeout` seconds.
        """
        deadline = time.monotonic() + timeout
        return [self._connect(r, deadline) for r in self.replicas]

    def supervise(self, pool: ReplicaPool, *, startup_timeout: float = 600.0) -> None:
        """Let `pool` probe the replicas and restart one that exited or hangs (`ReplicaPool.supervise`)."""
        self._pool = pool
        pool.supervise({r.replica_id: _Slot(self, i, startup_timeout) for i, r in enumerate(self.replicas)})

    def stop(self) -> None:
        """Stop supervising and terminate every replica process (SIGKILL after 3 s: a replica holds
        nothing to save, and serve's SIGTERM drain must end within 10 s)."""
        self._stop.set()
        if self._pool is not None:
            self._pool.stop_supervising()  # before terminating: a terminated replica is not restarted
        for r in self.replicas:
            r.proc.terminate()
        deadline = time.monotonic() + 3.0
        for r in self.replicas:
            try:
                r.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                r.proc.kill()
        self.segments.close()


class _Slot:
    """`Restarter` of replica slot `i` of a ReplicaProcesses (see `ReplicaPool.supervise`)."""

    def __init__(self, owner: ReplicaProcesses, i: int, startup_timeout: float) -> None:
        self.owner, self.i, self.startup_timeout = owner, i, startup_timeout

    def exited(self) -> bool:
        return self.owner.replicas[self.i].proc.poll() is not None

    def restart(self) -> GrpcReplicaClient:
        """SIGKILL the process (also ends a stopped or hung one), start a new one, connect to it."""
        old = self.owner.replicas[self.i]
        if old.proc.poll() is None:
            old.proc.kill()
        code = old.proc.wait(timeout=30)
        log.warning("%s ended with %s; starting it again (restart %d)", old.replica_id, code, old.restarts + 1)
        if self.owner._stop.is_set():
            raise RuntimeError("the resource is stopping")
        new = self.owner._spawn(old.replica_id, old.restarts + 1)
        self.owner.replicas[self.i] = new
        return self.owner._connect(new, time.monotonic() + self.startup_timeout)
