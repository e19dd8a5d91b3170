"""The fairness half of benchmarks/multitenant.py: another key's small step under a one-key flood.

Key A keeps 7 sessions busy, each thread submitting a 512-token forward_backward and an optim_step and
waiting for them, round after round; key B times its small steps (a 64-token forward_backward and an
optim_step, submit to result), first alone, then under the flood, once with ``--scheduler fair`` and once
with ``--scheduler fifo`` (B's solo median is taken on the fair resource, with nothing else queued: the
scheduler plays no part then). Two API keys via ``--api-key-file``; no replicas.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

KEYS = ("bench-key-a", "bench-key-b")
FLOOD_SESSIONS, FLOOD_TOKENS, SMALL_TOKENS = 7, 512, 64


def _samples(vocab: int, tokens: int, per: int, seed: int):
    import together_train as tt

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(max(1, tokens // per)):
        t = rng.integers(1, vocab, size=per + 1)
        out.append(tt.Sample(model_input=t[:-1], loss_fn_inputs={"target_tokens": t[1:],
                                                                 "weights": np.ones(per, np.float32)}))
    return out


def _launch(tmp: Path, scheduler: str, model: str | None):
    import together_train as tt

    keys = tmp / "keys"
    keys.write_text("\n".join(KEYS) + "\n")
    keys.chmod(0o600)
    return tt.launch_local(model=model, generators=0, storage_dir=tmp / f"storage-{scheduler}", api_key=KEYS[0],
                           log_file=tmp / f"server-{scheduler}.log",
                           extra_args=["--api-key-file", str(keys), "--scheduler", scheduler,
                                       "--max-sessions", "16", "--trainer-threads", "1"])


def _small_steps(session, vocab: int, n: int) -> list[float]:
    """Wall ms of `n` small steps of key B, one after the other."""
    import together_train as tt

    out = []
    for i in range(n):
        t0 = time.perf_counter()
        session.forward_backward(_samples(vocab, SMALL_TOKENS, SMALL_TOKENS, 1000 + i))
        session.optim_step(tt.AdamParams(learning_rate=1e-4)).result(timeout=1800)
        out.append((time.perf_counter() - t0) * 1000)
    return out


def _flood(sessions, vocab: int, stop: threading.Event, ran_ms: list[float]) -> list[threading.Thread]:
    import together_train as tt

    def loop(k: int, s) -> None:
        r = 0
        try:
            while not stop.is_set():
                fb = s.forward_backward(_samples(vocab, FLOOD_TOKENS, FLOOD_TOKENS // 4, 100 * k + r))
                s.optim_step(tt.AdamParams(learning_rate=1e-4)).result(timeout=1800)
                op = s.operation_status(fb.operation_id)
                ran_ms.append((op.finished_at - op.started_at) * 1000)
                r += 1
        except Exception:  # the resource stops under the flood at the end of the measurement
            return

    threads = [threading.Thread(target=loop, args=(k, s), daemon=True) for k, s in enumerate(sessions)]
    for t in threads:
        t.start()
    return threads


def _one(tmp: Path, scheduler: str, model: str | None, steps: int, solo: bool) -> dict[str, float]:
    import together_train as tt

    out: dict[str, float] = {}
    lora = tt.LoraConfig(rank=16, alpha=32.0)
    with _launch(tmp, scheduler, model) as a:
        b = tt.ResourceClient(a.address, api_key=KEYS[1])
        vocab = a.capabilities.vocab_size
        small = b.create_session(lora=lora)
        flooders = [a.create_session(lora=lora) for _ in range(FLOOD_SESSIONS)]
        _small_steps(small, vocab, 1)  # warm-up
        if solo:
            out["solo_step_ms"] = statistics.median(_small_steps(small, vocab, steps))
        stop, ran = threading.Event(), []
        threads = _flood(flooders, vocab, stop, ran)
        while len(ran) < 2:  # the flood is under way (7 sessions with a step each in the queue)
            time.sleep(0.05)
        out[f"{scheduler}_step_ms"] = statistics.median(_small_steps(small, vocab, steps))
        stop.set()
        out[f"{scheduler}_flood_op_ms"] = statistics.median(ran)
        b.close()
    # Leaving the block stopped the resource: queued flood operations failed (UNAVAILABLE), threads ended.
    for t in threads:
        t.join(timeout=60)
    return out


def fairness(quick: bool) -> dict[str, object]:
    """``fair_wait_ratio``, ``fifo_wait_ratio`` and their parts (benchmarks/multitenant.py's doc)."""
    model = None
    steps = 4 if quick else 9
    with tempfile.TemporaryDirectory(prefix="multitenant-fair-") as tmp_s:
        tmp = Path(tmp_s)
        if quick:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from _models import build_tiny_model

            model = str(build_tiny_model(tmp / "tiny", arch="llama", seed=0))
        fig = _one(tmp, "fair", model, steps, solo=True)
        fig.update(_one(tmp, "fifo", model, steps, solo=False))
    solo = fig["solo_step_ms"]
    out: dict[str, object] = {
        "fair_wait_ratio": fig["fair_step_ms"] / solo, "fifo_wait_ratio": fig["fifo_step_ms"] / solo,
        "solo_step_ms": solo, "fair_step_ms": fig["fair_step_ms"], "fifo_step_ms": fig["fifo_step_ms"],
        "flood_op_ms": fig["fair_flood_op_ms"],
        "fair_within_bound": fig["fair_step_ms"] <= solo + 2 * fig["fair_flood_op_ms"],
        "fairness_model": "tiny" if quick else "embedded",
    }
    return out
