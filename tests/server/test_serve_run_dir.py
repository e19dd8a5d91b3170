"""`together-train serve` removes its temporary directory (replica secret, port files) on SIGTERM, and a
directory left by a ``kill -9`` is removed at the next start.

Real serve processes on the tiny model with their own ``TMPDIR`` (so only their directories are seen).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def _start(model: Path, tmp: Path, name: str) -> tuple[subprocess.Popen, Path]:
    """A serve process (1 replica) and, once it serves, its run directory (owner.pid names it)."""
    port_file = tmp / f"{name}.port"
    proc = subprocess.Popen([sys.executable, "-m", "together_train_server.cli", "serve", "--model", str(model),
                             "--port", "0", "--port-file", str(port_file), "--storage", str(tmp / f"{name}-store"),
                             "--trainer-threads", "1", "--generator-threads", "1"],
                            env={**os.environ, "TMPDIR": str(tmp / "sys-tmp")}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not port_file.exists():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "serve did not start"
        time.sleep(0.2)
    (run_dir,) = [d for d in (tmp / "sys-tmp").iterdir() if (d / "owner.pid").is_file()
                  and (d / "owner.pid").read_text() == str(proc.pid)]
    assert (run_dir / "replica-secret").is_file()
    return proc, run_dir


def test_run_dir_removed_on_sigterm_and_after_kill_9(tiny_model_dir, tmp_path):
    (tmp_path / "sys-tmp").mkdir()
    killed, stale = _start(tiny_model_dir, tmp_path, "a")
    killed.kill()  # SIGKILL: no cleanup (its replica follows: it watches its parent)
    killed.wait(60)
    assert stale.is_dir()
    proc, run_dir = _start(tiny_model_dir, tmp_path, "b")
    try:
        assert not stale.exists()  # removed when b started
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
        assert not run_dir.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
