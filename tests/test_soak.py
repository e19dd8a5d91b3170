"""The soak (scripts/soak.py) for 3 minutes: 3 gRPC SDK sessions and 1 tinker SDK session training with
OpenAI chat traffic, while a replica is killed (SIGKILL) and stopped (SIGSTOP/SIGCONT), a client channel is
dropped, an oversized request is refused, a save_state fails (fault hook) and the server is killed
(SIGKILL) and restarted with every session resumed from its last checkpoint. Nothing acknowledged is lost
or applied twice, every checkpoint verifies, the failed save is not listed, and each gRPC session's last
stretch between checkpoints replays bit-exactly on a fresh server. The wall time is the 3 minutes plus
the server's restarts (one to two minutes on a loaded 2-core machine).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tinker")
pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(1500)
def test_soak_three_minutes(tmp_path):
    out = tmp_path / "soak.json"
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--minutes", "3", "--seed", "1",
                        "--out", str(out)], capture_output=True, text=True, timeout=1400)
    tail = "\n".join(p.stdout.splitlines()[-30:]) + "\n" + p.stderr[-3000:]
    assert out.exists(), tail
    rep = json.loads(out.read_text())
    print({k: rep[k] for k in ("acked", "lost", "duplicated", "checkpoints_verified", "pause_s", "replay_exact")})
    assert rep["lost"] == 0 and rep["duplicated"] == 0, rep
    assert rep["acked"] > 0 and rep["checkpoints_verified"] > 0, rep
    assert rep["failed_saves"] >= 1 and rep["failed_save_listed"] == 0, rep
    assert rep["replay_exact"] and rep["replay_sessions"] >= 1, rep
    assert {f[1] for f in rep["faults"]} == {"replica_kill9", "replica_stop", "drop_channel", "oversized",
                                             "server_kill9"}, rep["faults"]
    assert p.returncode == 0, tail
