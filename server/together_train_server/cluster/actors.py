"""The Ray actors of a cluster resource: each runs today's single-host process on its node as a child.

`TrainerActor` runs ``together-train serve --generators 0`` with its replicas attached by address;
`ReplicaActor` runs ``together-train generator``. The child watches the actor's process (``--parent-pid``),
so an actor that ends (stopped, or its node lost) takes its child with it. The actor classes carry no
resources: the control plane gives them with ``.options`` from the catalog (catalog.RayResources).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ray

__all__ = ["ReplicaActor", "TrainerActor"]


class _Child:
    """A together-train process started by an actor; its port is read from ``--port-file``."""

    def __init__(self, args: list[str], secret: str, env: dict[str, str] | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="tt-cluster-"))
        self.secret_file = self.dir / "replica.secret"
        self.secret_file.write_text(secret + "\n")
        os.chmod(self.secret_file, 0o600)
        self.port_file = self.dir / "port"
        self.host = ray.util.get_node_ip_address()
        cmd = [sys.executable, "-m", "together_train_server.cli", *args, "--host", self.host, "--port", "0",
               "--port-file", str(self.port_file), "--replica-secret-file", str(self.secret_file),
               "--parent-pid", str(os.getpid())]
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)

    def wait_port(self, timeout: float) -> str:
        """host:port once the child serves.

        Raises:
            RuntimeError: the child exited first (its status) or did not serve within `timeout` seconds.
        """
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            if self.port_file.exists() and self.port_file.read_text().strip():
                return f"{self.host}:{int(self.port_file.read_text())}"
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with status {self.proc.returncode} before serving (its log: the actor's)")
            time.sleep(0.1)
        raise RuntimeError(f"did not serve within {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@ray.remote(num_cpus=0)
class ReplicaActor:
    """One generator replica: ``together-train generator`` on this actor's node."""

    def __init__(self, replica_id: str, model: str, engine: str, secret: str, threads: int) -> None:
        self._child = _Child(["generator", "--model", model, "--engine", engine, "--replica-id", replica_id,
                              "--threads", str(threads)], secret)

    def address(self, timeout: float = 600.0) -> str:
        """host:port of the replica once it serves (RuntimeError: it failed to start)."""
        return self._child.wait_port(timeout)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def stop(self) -> None:
        self._child.stop()


@ray.remote(num_cpus=0)
class TrainerActor:
    """Rank 0 of a resource's trainer: ``together-train serve`` with the given flags, replicas attached."""

    def __init__(self, serve_args: list[str], replica_addresses: list[str], secret: str,
                 env: dict[str, str] | None = None) -> None:
        args = ["serve", "--generators", "0", *serve_args]
        for a in replica_addresses:
            args += ["--generator-address", a]
        self._child = _Child(args, secret, env)

    def address(self, timeout: float = 600.0) -> str:
        """host:port of the resource's gRPC port once it serves (RuntimeError: it failed to start)."""
        return self._child.wait_port(timeout)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def alive(self) -> bool:
        return self._child.proc.poll() is None

    def stop(self) -> None:
        self._child.stop()
