"""Many tenants on one resource: session paging (memory, create latency, page-in/out cost).

One local resource on the embedded SmolLM2-135M-Instruct (fp32, CPU, no replicas), rank-16 LoRA on
every linear layer, ``--session-memory-mb 1024`` (13 resident sessions at 78 MB each), allocator
trimmed after each create/optim_step (``TOGETHER_TRAIN_TRIM_AFTER``), paging on idle off. Figures,
one function each, printed as ``key=value`` lines:

- ``create_ms_8``, ``create_ms_<N>``: median wall time of ``create_session`` for sessions 5-8 and the
  last 4 up to N (256; 64 with ``--quick``), through the SDK over gRPC, paging included.
  ``create_ratio_<N>_vs_8`` is their ratio (the issue's target: <= 2 at 256).
- ``rss_growth_mb_256``: the resource's RSS with 256 sessions minus before the first (MiB); with
  ``--quick`` projected from N sessions by the slope between N/2 and N (``rss_growth_basis`` says
  which). Target: < 6144.
- ``page_out_ms``, ``page_in_ms``: median server-side time to write out / read back one trained
  rank-16 session (weights, AdamW moments: a 58 MB page), from the server's ``paged out/in`` log
  lines while 16 trained sessions are cycled through a 13-session budget.
- ``fair_wait_ratio``: key B's median small step (forward_backward of 64 tokens + optim_step, submit to
  result) while key A keeps 7 sessions of 512-token steps in flight, over B's median step alone, with
  ``--scheduler fair``; ``fifo_wait_ratio`` the same with ``--scheduler fifo`` (one queue in arrival
  order). ``solo_step_ms``, ``fair_step_ms``, ``fifo_step_ms`` are the medians, ``flood_op_ms`` the
  median server-side run time of one of A's 512-token operations, and ``fair_within_bound`` whether
  ``fair_step_ms <= solo_step_ms + 2 * flood_op_ms`` (the issue's target). Fairness runs on the
  tiny random model of tests/_models.py (hidden 64) with ``--quick``, on the embedded model without.
- ``load_1m``: ``os.getloadavg()`` at the end (the machine is shared: label figures with it).

    python benchmarks/multitenant.py            # 256 sessions
    python benchmarks/multitenant.py --quick    # 64 sessions (a few minutes on 2 cores)
    python benchmarks/multitenant.py --quick --part fairness   # only the scheduler's figures
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sessions import rss_median  # benchmarks/sessions.py

BUDGET_MB = 1024
RANK = 16


def launch(storage: Path, log: Path, max_sessions: int):
    import together_train as tt
    from together_train_server.engines.memory import ENV_VAR

    return tt.launch_local(
        model=None, generators=0, storage_dir=storage, log_file=log,
        extra_args=["--max-sessions", str(max_sessions), "--session-memory-mb", str(BUDGET_MB),
                    "--page-out-idle", "0", "--trainer-threads", "1"],
        env={ENV_VAR: "create_adapter,optim_step,drop_adapter"},
    )


def batch(vocab: int, seed: int):
    import together_train as tt

    rng = np.random.default_rng(seed)
    toks = rng.integers(0, vocab, size=(2, 33), dtype=np.int64)
    return [tt.Sample(model_input=t[:-1], loss_fn_inputs={"target_tokens": t[1:], "weights": np.ones(32, np.float32)})
            for t in toks]


def create_and_rss(client, n: int) -> tuple[dict[str, float], list]:
    """Create n sessions one at a time: create latency at 8 and n, RSS growth (measured or projected) to 256."""
    import together_train as tt

    pid = client.local_resource.process.pid
    rss0 = rss_median(pid)
    lora = tt.LoraConfig(rank=RANK, alpha=2.0 * RANK)
    times, rss, sessions = [], {}, []
    for i in range(1, n + 1):
        t0 = time.perf_counter()
        sessions.append(client.create_session(lora=lora))
        times.append((time.perf_counter() - t0) * 1000)
        if i in (n // 2, n):
            rss[i] = rss_median(pid) - rss0
    out = {"create_ms_8": statistics.median(times[4:8]), f"create_ms_{n}": statistics.median(times[-4:])}
    out[f"create_ratio_{n}_vs_8"] = out[f"create_ms_{n}"] / out["create_ms_8"]
    slope = max(0.0, (rss[n] - rss[n // 2]) / (n - n // 2))   # trimming can make it negative: never project down
    out["rss_growth_mb_256"] = (rss[n] + slope * (256 - n)) / (1 << 20)
    out[f"rss_growth_mb_{n}"] = rss[n] / (1 << 20)
    out["rss_growth_basis"] = "measured" if n == 256 else f"projected_from_{n}"
    return out, sessions


def page_costs(client, sessions: list, log: Path) -> dict[str, float]:
    """Train 16 sessions one step each, twice round: every call pages one trained session in and another out."""
    import together_train as tt

    vocab = client.get_capabilities().vocab_size
    adam = tt.AdamParams(learning_rate=1e-4)
    start = len(log.read_text())
    for rnd in range(2):
        for k, s in enumerate(sessions[:16]):
            s.forward_backward(batch(vocab, 100 * rnd + k), loss_fn="cross_entropy").result(timeout=600)
            s.optim_step(adam).result(timeout=600)
    text = log.read_text()[start:]
    outs = [float(m) for b, m in re.findall(r"paged out session \S+ \((\d+) bytes, ([\d.]+) ms\)", text)
            if int(b) > 40 << 20]
    ins = [float(m) for m in re.findall(r"paged in session \S+ \(([\d.]+) ms\)", text)]
    return {"page_out_ms": statistics.median(outs) if outs else float("nan"),
            "page_in_ms": statistics.median(ins) if ins else float("nan"),
            "page_outs_measured": len(outs), "page_ins_measured": len(ins)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="64 sessions instead of 256; fairness on a tiny model")
    ap.add_argument("--part", choices=["all", "paging", "fairness"], default="all", help="which figures to take")
    args = ap.parse_args()
    n = 64 if args.quick else 256
    figures: dict[str, object] = {}
    if args.part in ("all", "paging"):
        with tempfile.TemporaryDirectory(prefix="multitenant-") as tmp:
            storage, log = Path(tmp) / "storage", Path(tmp) / "server.log"
            with launch(storage, log, n + 8) as client:
                created, sessions = create_and_rss(client, n)
                figures.update(created)
                figures.update(page_costs(client, sessions, log))
                for s in sessions:
                    s.stop()
    if args.part in ("all", "fairness"):
        from multitenant_fairness import fairness  # benchmarks/multitenant_fairness.py

        figures.update(fairness(args.quick))
    figures["load_1m"] = os.getloadavg()[0]
    for k, v in figures.items():
        print(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}", flush=True)


if __name__ == "__main__":
    main()
