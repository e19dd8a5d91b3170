"""The SDK keeps its live sessions from expiring, on a real resource with `--idle-timeout 3`.

- A session of a live client left idle for 3x the idle timeout is still active
  and trains, while a session of a client built with
  ``keepalive_interval_s=None`` expires in the same time.
- "auto" heartbeats every quarter of the idle timeout the server reports.
- A client in another process keeps its session alive while the process
  runs (its main thread asleep); once the process is SIGKILLed the session
  expires. A script that never closes its client still exits (daemon thread).
- The heartbeat stops for a stopped session, a session stopped by someone
  else (logged at DEBUG, nothing raised), a garbage-collected Session object,
  and when the client closes (the thread ends, the session then expires);
  injected transport failures are retried without raising.

The server expires a session once ``now > last_active_at + idle`` at its
sweep (every idle/4), and `get_session` does not touch the idle timer, so the
tests can watch a session without keeping it alive.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import together_train as tt
from together_train import errors
from together_train.keepalive import interval_for

IDLE_S = 3.0
LORA = tt.LoraConfig(rank=4, alpha=8.0, seed=0)
# Expired by the server: idle timeout + one sweep period, with slack for a loaded 2-core machine.
EXPIRE_WITHIN_S = IDLE_S + IDLE_S / 4 + 10.0


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """A resource with a 3 s idle timeout and no replicas; the yielded client has keep-alive off (an observer)."""
    with tt.launch_local(
        model=str(tiny_model_dir),
        generators=0,
        storage_dir=tmp_path_factory.mktemp("keepalive-storage"),
        extra_args=["--idle-timeout", str(IDLE_S), "--max-sessions", "32", "--trainer-threads", "1"],
        client_kwargs={"keepalive_interval_s": None},
    ) as observer:
        yield observer


def _state(observer: tt.ResourceClient, session_id: str) -> str:
    return observer.get_session(session_id).state


def _wait_state(observer: tt.ResourceClient, session_id: str, state: str, within_s: float) -> float:
    """Seconds until `session_id` reaches `state`; fails the test past `within_s`."""
    t0 = time.monotonic()
    while (now := _state(observer, session_id)) != state:
        assert time.monotonic() - t0 < within_s, f"session {session_id} still {now!r} after {within_s} s"
        time.sleep(0.2)
    return time.monotonic() - t0


def _batch(vocab: int) -> list[tt.Sample]:
    tokens = [1, 5, 9, 13, 17, 21]
    return [
        tt.Sample(
            model_input=tokens[:-1],
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
    ]


def test_live_client_keeps_an_idle_session_alive_and_opt_out_expires(server):
    vocab = server.get_capabilities().vocab_size
    with tt.ResourceClient(server.address) as live, tt.ResourceClient(server.address, keepalive_interval_s=None) as off:
        kept = live.create_session(lora=LORA)
        dropped = off.create_session(lora=LORA)
        info = server.get_session(kept.session_id)
        assert info.expires_at - info.last_active_at == pytest.approx(IDLE_S)
        assert interval_for(info, "auto") == pytest.approx(IDLE_S / 4)

        t0 = time.monotonic()
        _wait_state(server, dropped.session_id, "expired", EXPIRE_WITHIN_S)
        time.sleep(max(0.0, 3 * IDLE_S - (time.monotonic() - t0)))  # idle for 3x the timeout
        assert _state(server, kept.session_id) == "active"
        last = server.get_session(kept.session_id).last_active_at
        assert time.time() - last < IDLE_S  # touched by heartbeats, not by this test

        fb = kept.forward_backward(_batch(vocab), loss_fn="cross_entropy").result(timeout=120)
        assert fb.loss > 0
        assert kept.optim_step(tt.AdamParams(learning_rate=1e-3)).result(timeout=120).step == 1
        with pytest.raises(errors.FailedPreconditionError, match="expired"):
            dropped.forward(_batch(vocab), loss_fn="cross_entropy")


_CHILD = textwrap.dedent(
    """
    import sys, time
    import together_train as tt
    client = tt.ResourceClient(sys.argv[1])
    s = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
    print(s.session_id, flush=True)
    if sys.argv[2] == "sleep":
        time.sleep(600)
    # "exit": return without closing the client or stopping the session
    """
)


def _child(address: str, mode: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, address, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    line = proc.stdout.readline().strip()
    if not line:
        proc.kill()
        pytest.fail(f"child client printed no session id: {proc.stderr.read()[-2000:]}")
    return proc, line


def test_killed_client_process_lets_its_session_expire(server):
    proc, sid = _child(server.address, "sleep")
    try:
        time.sleep(2 * IDLE_S)
        assert proc.poll() is None, "child exited early"
        assert _state(server, sid) == "active"  # its heartbeat thread runs while its main thread sleeps
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        _wait_state(server, sid, "expired", EXPIRE_WITHIN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_heartbeat_thread_does_not_keep_the_process_alive(server):
    proc, sid = _child(server.address, "exit")
    try:
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, proc.stderr.read()[-2000:]
    _wait_state(server, sid, "expired", EXPIRE_WITHIN_S)  # abandoned by the exited process


class _CountingStub:
    """Wraps the ResourceService stub: counts KeepAlive calls per session id, optionally failing the first ones."""

    def __init__(self, stub, fail_first: int = 0):
        self._stub, self.calls, self.fail_first, self.failed = stub, {}, fail_first, 0

    def __getattr__(self, name):
        return getattr(self._stub, name)

    def KeepAlive(self, request, **kw):
        self.calls[request.session_id] = self.calls.get(request.session_id, 0) + 1
        if self.failed < self.fail_first:
            self.failed += 1
            raise RuntimeError("injected transport failure")
        return self._stub.KeepAlive(request, **kw)


def test_heartbeat_stops_for_stopped_dropped_and_closed(server, caplog):
    caplog.set_level(logging.DEBUG, logger="together_train")
    client = tt.ResourceClient(server.address, keepalive_interval_s=0.2)
    stub = client._resource = _CountingStub(client._resource, fail_first=3)
    try:
        stopped, foreign, gone, last = (client.create_session(lora=LORA) for _ in range(4))
        gone_id = gone.session_id
        del gone
        gc.collect()  # an unreferenced Session object is abandoned: no heartbeat, it expires
        n_gone = stub.calls.get(gone_id, 0)
        time.sleep(2.0)
        assert stub.failed == 3 and "injected transport failure" in caplog.text  # retried, never raised
        assert stub.calls.get(gone_id, 0) == n_gone
        for s in (stopped, foreign, last):
            assert stub.calls[s.session_id] >= 3

        stopped.stop()
        server.stop_session(foreign.session_id)  # stopped behind the client's back
        n_stopped = stub.calls[stopped.session_id]
        time.sleep(1.5)
        assert stub.calls[stopped.session_id] == n_stopped
        assert {s.session_id for s in client._keepalive.sessions()} == {last.session_id}
        assert f"keep-alive of session {foreign.session_id} stopped" in caplog.text
        assert _state(server, last.session_id) == "active"
        _wait_state(server, gone_id, "expired", EXPIRE_WITHIN_S)

        thread = client._keepalive.thread
        assert thread is not None and thread.daemon and thread.is_alive()
        client.close()
        assert not thread.is_alive()
        n_last = stub.calls[last.session_id]
        _wait_state(server, last.session_id, "expired", EXPIRE_WITHIN_S)
        assert stub.calls[last.session_id] == n_last
    finally:
        client.close()


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), "fast", True])
def test_bad_keepalive_interval_is_refused(bad):
    with pytest.raises(errors.InvalidArgumentError, match="keepalive_interval_s") as info:
        tt.ResourceClient("127.0.0.1:1", keepalive_interval_s=bad)
    assert info.value.key == "keepalive_interval_s"
