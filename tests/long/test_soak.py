"""The soak (scripts/soak.py) for 90 seconds, every fault kind once (long runs: the script itself):
2 gRPC SDK sessions, 1 tinker SDK session and 1 together SDK session training at once
with OpenAI chat traffic, while a replica is killed (SIGKILL) and stopped
(SIGSTOP/SIGCONT), the gRPC client is closed under its sessions, an oversized request is refused, a
save_state fails (fault hook) and the server is killed (SIGKILL) and restarted with every session resumed
from its last checkpoint through its own SDK. Nothing acknowledged is lost or applied twice, every
acknowledged checkpoint is listed and verifies, the failed save leaves nothing listed, and every session's
last stretch between checkpoints replays bit-exactly on a fresh server. The wall time is the 90 seconds plus
the server's starts (one to two minutes on a loaded 2-core machine).

The pauses (``pause_s``, ``pause_outside_restart_s``) are printed, not asserted: on the shared 2-core CI
machine a step's own time varies by seconds with the load (speed is measured, never asserted in timed
tests); the 60-minute run's figures are in docs/operating.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tinker")
pytest.importorskip("together")
pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(1500)
def test_soak_ninety_seconds(tmp_path):
    out = tmp_path / "soak.json"
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--minutes", "1.5", "--seed", "1",
                        "--out", str(out)], capture_output=True, text=True, timeout=1400)
    tail = "\n".join(p.stdout.splitlines()[-40:]) + "\n" + p.stderr[-3000:]
    assert out.exists(), tail
    rep = json.loads(out.read_text())
    print({k: rep[k] for k in ("acked", "lost", "duplicated", "checkpoints_verified", "pause_s",
                               "pause_outside_restart_s", "median_step_gap_s", "server_restart_s", "replay",
                               "load_avg")})
    assert rep["lost"] == 0 and rep["duplicated"] == 0, rep
    assert set(rep["steps"]) == {"grpc-0", "grpc-1", "tinker-2", "together-3"}, rep["steps"]
    assert all(n > 0 for n in rep["steps"].values()), rep["steps"]
    assert rep["acked"] > 0 and rep["checkpoints_verified"] > 0 and rep["checkpoints_missing"] == [], rep
    assert rep["failed_saves"] >= 1 and rep["failed_save_listed"] == 0, rep["failed_save_detail"]
    assert rep["replay_exact"] and rep["replay_sessions"] == 4, rep["replay"]
    assert {f["fault"] for f in rep["faults"]} == {"replica_kill9", "replica_stop", "drop_channel", "oversized",
                                                   "server_kill9"}, rep["faults"]
    assert all(f["note"] == "ok" or f["note"].startswith("refused") for f in rep["faults"]), rep["faults"]
    assert p.returncode == 0, tail
