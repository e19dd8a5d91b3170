"""A script using launch_local that is killed without cleanup
(SIGTERM from a scheduler or `timeout`, SIGKILL) left the resource and its
replicas running forever. The server now watches its launcher (--parent-pid)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import together_train as tt
    lr = tt.launch_local(model=sys.argv[1], generators=1, storage_dir=sys.argv[2],
                         extra_args=["--trainer-threads", "1", "--generator-threads", "1"])
    with lr as client:
        print(lr.process.pid, flush=True)
        time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def test_server_exits_when_launcher_is_killed(tiny_model_dir, tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, str(tiny_model_dir), str(tmp_path / "store")],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    server_pid = None
    try:
        server_pid = int(proc.stdout.readline())
        replicas = _children(server_pid)
        assert replicas, "the resource should have spawned its generator replica"
        proc.send_signal(signal.SIGKILL)  # no atexit, no finally: only the server's own watch helps
        proc.wait(timeout=10)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (_alive(server_pid) or any(map(_alive, replicas))):
            time.sleep(0.2)
        assert not _alive(server_pid), "the resource outlived its launcher"
        assert not any(map(_alive, replicas)), "a generator replica outlived the resource"
    finally:
        if proc.poll() is None:
            proc.kill()
        if server_pid is not None and _alive(server_pid):
            os.killpg(server_pid, signal.SIGKILL)  # launch_local starts it as its own process group
