"""launch_local: start, readiness, shutdown of the whole process group, startup failures.

The server here is the fake CLI in test_sdk_fakes.py (same flags as
``together_train_server.cli serve``), so these tests run without torch or a model.
"""

from __future__ import annotations

import pathlib
import sys
import time

import numpy as np
import pytest

import together_train as tt

FAKE_CLI = [sys.executable, str(pathlib.Path(__file__).resolve().parents[1] / "unit" / "test_sdk_fakes.py")]


def _gone(pid: int) -> bool:
    """True when pid does not exist or is a zombie (killed, not yet reaped by init)."""
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    return state in ("Z", "X")


def _wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.05)
    return _gone(pid)


def launch(**kw):
    kw.setdefault("startup_timeout", 60)
    return tt.launch_local(server_command=FAKE_CLI, **kw)


def test_launch_serve_and_leave_no_process(tmp_path):
    child_pid_file = tmp_path / "child.pid"
    lr = launch(generators=2, storage_dir=tmp_path / "store", dtype="float32",
                extra_args=["--child-pid-file", str(child_pid_file)])
    with lr as client:
        assert client.address.startswith("127.0.0.1:") and client.local_resource is lr
        cmd = lr.command
        i = cmd.index("serve")
        assert cmd[i:i + 11] == ["serve", "--model", "embedded", "--generators", "2", "--host", "127.0.0.1",
                                 "--port", "0", "--port-file", cmd[i + 10]]
        assert ["--storage", str(tmp_path / "store")] == cmd[i + 11:i + 13]
        assert "--dtype" in cmd and "float32" in cmd
        assert client.get_capabilities().model_id == "fake"
        session = client.create_session()
        fb = session.forward_backward([tt.Sample.for_cross_entropy(np.arange(1, 6))])
        assert fb.result(timeout=10).loss == 4.0
        server_pid = lr.process.pid
        child_pid = int(child_pid_file.read_text())
        assert not _gone(server_pid) and not _gone(child_pid)
    assert client.closed
    assert _wait_gone(server_pid)
    assert _wait_gone(child_pid), "a process of the server's group (ignoring SIGTERM) was left behind"


def test_server_dying_during_startup_raises_with_log_tail():
    lr = launch(extra_args=["--crash"])
    with pytest.raises(tt.ServerStartError) as ei:
        lr.start()
    err = ei.value
    assert err.returncode == 3
    assert "model directory does not exist" in err.log_tail
    assert "model directory does not exist" in str(err)


def test_startup_timeout_kills_server():
    lr = launch(extra_args=["--no-port"], startup_timeout=1.5)
    t0 = time.monotonic()
    with pytest.raises(tt.ServerStartError) as ei:
        lr.start()
    assert time.monotonic() - t0 < 20
    assert "did not" in str(ei.value) and ei.value.returncode is None
    assert lr.process.poll() is not None


def test_sigterm_ignored_then_sigkill():
    lr = launch(extra_args=["--ignore-term"], shutdown_timeout=0.5)
    lr.start()
    pid = lr.process.pid
    t0 = time.monotonic()
    rc = lr.stop()
    assert time.monotonic() - t0 < 10
    assert rc == -9 and _wait_gone(pid)
    assert lr.stop() == -9 and _wait_gone(pid)  # idempotent: a second stop returns the same status, raises nothing


def test_exception_in_block_still_stops():
    lr = launch()
    with pytest.raises(RuntimeError, match="boom"):
        with lr as client:
            pid = lr.process.pid
            client.get_capabilities()
            raise RuntimeError("boom")
    assert _wait_gone(pid)


def test_keyboard_interrupt_during_startup_leaves_nothing(monkeypatch):
    lr = launch()

    def interrupted(self, client, deadline):
        raise KeyboardInterrupt

    monkeypatch.setattr(tt.LocalResource, "_wait_until_serving", interrupted)
    with pytest.raises(KeyboardInterrupt):
        lr.start()
    assert lr.process.poll() is not None


def test_api_key_and_kept_log_file(tmp_path):
    log = tmp_path / "logs" / "server.log"
    with launch(api_key="k-123", log_file=log) as client:
        assert client.create_session().session_id
        with tt.ResourceClient(client.address, api_key="wrong") as other:
            with pytest.raises(tt.UnauthenticatedError):
                other.list_sessions()
    assert "fake server listening" in log.read_text()
    assert "--api-key-file" in log.read_text()


def test_missing_server_module_fails_fast():
    lr = tt.launch_local(server_command=[sys.executable, "-m", "no_such_module_for_tt"], startup_timeout=30)
    with pytest.raises(tt.ServerStartError) as ei:
        lr.start()
    assert "No module named" in ei.value.log_tail
