"""A tinker client whose process dies without `close()` releases its models after the heartbeat timeout.

The tinker SDK heartbeats its client session every 10 s (`_session_heartbeat`:
SESSION_HEARTBEAT_PERIOD_SEC) and warns after 120 s without one that "the session will be
terminated"; the resource releases a client session whose heartbeats stopped for
``--client-heartbeat-timeout-s`` (default 120 s, see service/sessions/heartbeats.py): its models (our
sessions) are stopped, their checkpoints kept, the client session finished (a late heartbeat gets
410, which ends the SDK's loop). Here the timeout is 25 s (above the SDK's 10 s period, so a live
client is never released): a client process killed with SIGKILL frees its model's slot, a live one
keeps its own. Before, nothing acted on the heartbeats: the model stayed ACTIVE for the idle timeout
(3600 s) and, at --max-sessions, the next client was refused.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import together_train as tt

tinker = pytest.importorskip("tinker")

KEY = "k-abandoned"
TIMEOUT_S = 25.0
PERIOD_S = 10.0  # the SDK's heartbeat period

CLIENT = textwrap.dedent('''
    import json, sys, time
    import tinker
    from tinker import types as T
    sc = tinker.ServiceClient(base_url=sys.argv[1], api_key="tml-" + sys.argv[2])
    tc = sc.create_lora_training_client(base_model=sys.argv[3], rank=2, seed=0)
    d = T.Datum(model_input=T.ModelInput.from_ints([1, 2, 3, 4]),
                loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [1.0, 1.0, 1.0, 1.0]})
    tc.forward_backward([d], "cross_entropy").result()
    tc.optim_step(T.AdamParams(learning_rate=1e-3)).result()
    path = tc.save_state("ckpt").result().path
    print(json.dumps({"model_id": tc.model_id, "path": path}), flush=True)
    time.sleep(3600)  # alive (heartbeating) until killed
''')


def _start_client(url: str, model: str) -> tuple[subprocess.Popen, dict]:
    p = subprocess.Popen([sys.executable, "-c", CLIENT, url, KEY, model], stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line, f"the tinker client exited with {p.poll()}"
    return p, json.loads(line)


@pytest.mark.timeout(400)
def test_killed_tinker_client_releases_its_model(tiny_model_dir, tmp_path):
    with tt.launch_local(model=str(tiny_model_dir), generators=0, storage_dir=tmp_path, api_key=KEY, http_port=0,
                         extra_args=["--max-sessions", "2", "--trainer-threads", "1",
                                     "--client-heartbeat-timeout-s", str(TIMEOUT_S)]) as client:
        live, live_info = _start_client(client.http_url, str(tiny_model_dir))
        doomed, info = _start_client(client.http_url, str(tiny_model_dir))
        try:
            assert [s.state for s in client.list_sessions()] == ["active", "active"]
            with pytest.raises(tt.errors.ResourceExhaustedError):  # --max-sessions 2
                client.create_session(lora=tt.LoraConfig(rank=2))
            os.kill(doomed.pid, signal.SIGKILL)
            doomed.wait(timeout=30)
            t_kill = time.monotonic()
            bound = TIMEOUT_S + PERIOD_S + 5.0  # timeout from the last heartbeat (<= 10 s before the kill) + sweep
            while time.monotonic() - t_kill < bound:
                states = {s.name: s.state for s in client.list_sessions()}
                if states[info["model_id"]] != "active":
                    break
                time.sleep(0.5)
            released = time.monotonic() - t_kill
            print(f"released {released:.1f} s after SIGKILL (timeout {TIMEOUT_S} s, bound {bound} s)")
            assert states[info["model_id"]] == "stopped", states
            # The live client heartbeats: its model stays, past the timeout.
            assert states[live_info["model_id"]] == "active", states
            assert live.poll() is None
            # The slot is free again; the checkpoint is kept and loads.
            s = client.create_session(lora=tt.LoraConfig(rank=2))
            ckpts = [c for c in client.list_checkpoints() if c.kind == "state"]
            assert len(ckpts) == 2, ckpts
            s.stop()
        finally:
            for p in (live, doomed):
                if p.poll() is None:
                    p.kill()
                p.wait(timeout=30)
