"""The clock cycle: N sessions' small training steps through a real server, batching on vs off (issue 31).

One local resource per mode (``serve --batching on`` then ``--batching off``;
SmolLM2-135M-Instruct by default, float32, CPU, no replicas), the same
sessions (LoRA rank 16 on every linear layer, same seeds) and the same
samples: for each shape ``N x T``, N sessions each submit, per round, one
cross_entropy forward_backward of one T-token sample and an optim_step,
pipelined (every session's step submitted before any result is read, each
session's own operations in order), as N independent clients would. The
first round warms up; the others are timed. Throughput is trained tokens per
second of wall time; ``batched_vs_sequential_<N>x<T>`` is on / off.
``max_loss_diff`` is the largest |loss_on - loss_off| over every step of
every session (the same seeds and samples: only float32 summation order
differs; tests/server/test_clock_cycle.py derives the bound, ``4e-5 * |loss|``),
with ``max_loss_rel`` its relative size. Prints those lines, ``load_avg=``
(``os.getloadavg()`` before and after: timings on a busy machine are not the
machine's) and writes JSON.

    python benchmarks/clock_cycle.py            # 8x32, 16x64, 8x128, 4x256; 3 timed rounds
    python benchmarks/clock_cycle.py --quick    # 8x32, 16x64, 8x128; 1 timed round (under 10 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np

SHAPES = [(8, 32), (16, 64), (8, 128), (4, 256)]


def _samples(n_sessions: int, tokens: int, rounds: int, vocab: int, seed: int):
    """samples[round][session]: one [tokens] sample each (random tokens, weights 1 on the last half)."""
    import together_train as tt

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(rounds):
        row = []
        for _ in range(n_sessions):
            t = rng.integers(0, vocab, tokens + 1)
            w = np.zeros(tokens, np.float32)
            w[tokens // 2:] = 1.0
            row.append([tt.Sample(model_input=t[:-1], loss_fn_inputs={"target_tokens": t[1:], "weights": w})])
        out.append(row)
    return out


def run_mode(model: str, batching: str, shapes, rounds: int, seed: int) -> dict:
    """Per shape: tokens/s of the timed rounds and every loss ([round][session])."""
    import together_train as tt

    results = {}
    extra = ["--batching", batching, "--max-sessions", str(max(n for n, _ in shapes) + 1)]
    with tt.launch_local(model=model, generators=0, extra_args=extra) as client:
        vocab = client.get_capabilities().vocab_size
        adam = tt.AdamParams(learning_rate=1e-4)
        for n, t in shapes:
            sessions = [client.create_session(lora=tt.LoraConfig(rank=16, alpha=32.0, seed=seed + k))
                        for k in range(n)]
            data = _samples(n, t, rounds + 1, vocab, seed)
            losses, t0 = [], 0.0
            for r, row in enumerate(data):
                if r == 1:
                    t0 = time.perf_counter()
                futs = []
                for s, batch in zip(sessions, row):
                    futs.append(s.forward_backward(batch, loss_fn="cross_entropy"))
                    futs.append(s.optim_step(adam))
                losses.append([f.result(timeout=1800).loss for f in futs[0::2]])
                for f in futs[1::2]:
                    f.result(timeout=1800)
            seconds = time.perf_counter() - t0
            for s in sessions:
                s.stop()
            results[f"{n}x{t}"] = {"tokens_per_s": rounds * n * t / seconds, "seconds": seconds, "losses": losses}
            print(f"# batching {batching} {n}x{t}: {rounds * n * t / seconds:.1f} tokens/s ({seconds:.1f} s)",
                  flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8x32, 16x64, 8x128, one timed round")
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", default="runs/bench/clock_cycle.json")
    args = ap.parse_args()
    shapes = SHAPES[:3] if args.quick else SHAPES
    rounds = args.rounds or (1 if args.quick else 3)
    load_before = os.getloadavg()
    on = run_mode(args.model, "on", shapes, rounds, args.seed)
    off = run_mode(args.model, "off", shapes, rounds, args.seed)
    load_after = os.getloadavg()
    diff, rel = 0.0, 0.0
    for key in on:
        a, b = np.asarray(on[key]["losses"]), np.asarray(off[key]["losses"])
        diff = max(diff, float(np.abs(a - b).max()))
        rel = max(rel, float((np.abs(a - b) / np.maximum(np.abs(b), 1e-12)).max()))
        print(f"batched_vs_sequential_{key}={on[key]['tokens_per_s'] / off[key]['tokens_per_s']:.3f}")
    print(f"max_loss_diff={diff:.3g}")
    print(f"max_loss_rel={rel:.3g}")
    print("load_avg=" + " ".join(f"{x:.2f}" for x in load_before) + " -> " + " ".join(f"{x:.2f}" for x in load_after))
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"on": on, "off": off, "max_loss_diff": diff, "max_loss_rel": rel,
                               "load_before": load_before, "load_after": load_after}, indent=1))


if __name__ == "__main__":
    main()
