"""Many LoRA sessions on one resource: resident memory and aggregate training throughput.

One local resource (SmolLM2-135M-Instruct, fp32, CPU, no replicas,
``--max-sessions 8``) measured side by side in one run:

- memory per session: a resource process started with
  ``TOGETHER_TRAIN_TRIM_AFTER=optim_step`` (after every optim_step the server
  runs ``gc.collect()`` + glibc ``malloc_trim(0)``, so freed activations and
  gradients kept in the allocator's free lists do not count). Sessions
  (rank 16, every linear layer) are added one at a time, each trained one
  step (which allocates its AdamW moments); after each, the resident set
  size (RSS, median of 3 reads) is recorded. ``mem_per_session_mb`` is the
  median of the 7 increments from 1 to 8 sessions (MiB);
  ``state_mb_per_session`` is trainable parameters x 16 bytes (fp32 weights,
  gradients, two AdamW moments; MiB); prints
  ``mem_per_session_ratio=<mem_per_session_mb / state_mb_per_session>``
  (target <= 1.2). Gradients are freed by optim_step, so the floor at rest
  is 12 bytes per parameter (ratio 0.75) plus peft's per-layer modules.
  ``mem_ratio_8_vs_1=<rss8 / rss1>`` of that run is information only (it
  mostly measures the base model's size).
  The plain allocator (no trimming) is measured too, on the throughput
  server: ``mem_per_session_untrimmed_mb`` (information: what RSS shows
  when nobody trims; freed blocks stay resident).
- throughput: forward_backward + optim_step tokens/s of 1 session alone vs
  4 sessions trained at once from 4 client threads (operations pipelined;
  the trainer runs them one at a time, switching adapters). Prints
  ``throughput_ratio_4_vs_1=<aggregate 4-session tokens/s / 1-session tokens/s>``
  (target >= 0.95).

The numbers go to JSON too (``--json-out``).

    python benchmarks/sessions.py            # batch 8 x 128, 2 rounds x 6 timed steps per session
    python benchmarks/sessions.py --quick    # batch 2 x 64, 2 rounds x 2 steps (a few minutes)

On a shared machine the throughput ratio is only as good as the load is
steady: run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np


@dataclass
class Config:
    batch_size: int = 8
    seq_len: int = 128
    steps: int = 6
    warmup_steps: int = 1
    rounds: int = 2
    concurrent_sessions: int = 4
    max_sessions: int = 8
    rank: int = 16
    alpha: float = 32.0
    learning_rate: float = 1e-4
    dtype: str = "float32"
    model: str = "embedded"
    json_out: str = "runs/bench/sessions.json"


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (psutil when installed, else /proc/<pid>/status VmRSS)."""
    try:
        import psutil

        return int(psutil.Process(pid).memory_info().rss)
    except ImportError:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS for pid {pid}") from None


def make_samples(cfg: Config, vocab: int, seed: int):
    import together_train as tt

    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=(cfg.batch_size, cfg.seq_len + 1), dtype=np.int64)
    weights = np.ones((cfg.batch_size, cfg.seq_len), dtype=np.float32)
    return [
        tt.Sample(model_input=tokens[b, :-1], loss_fn_inputs={"target_tokens": tokens[b, 1:], "weights": weights[b]})
        for b in range(cfg.batch_size)
    ]


def run_steps(session, batches, adam) -> None:
    """Submit forward_backward + optim_step per batch back to back, then wait for all."""
    futs = []
    for samples in batches:
        futs.append(session.forward_backward(samples, loss_fn="cross_entropy"))
        futs.append(session.optim_step(adam))
    for f in futs:
        f.result(timeout=3600)


def rss_median(pid: int, reads: int = 3, gap_s: float = 0.2) -> int:
    """Median of ``reads`` RSS readings ``gap_s`` apart (bytes)."""
    vals = []
    for k in range(reads):
        if k:
            time.sleep(gap_s)
        vals.append(rss_bytes(pid))
    return int(np.median(vals))


def measure_memory(cfg: Config, model_dir, lora, adam) -> dict:
    """RSS of a resource process (allocator trimmed after each optim_step) with 1 ... max_sessions sessions.

    Returns a dict: ``rss_by_sessions_bytes`` (list, index k-1 = k sessions),
    ``increments_bytes`` (k-1 -> k), ``mem_per_session_bytes`` (their median),
    ``slope_bytes`` (least-squares RSS vs sessions), ``trainable_params``.
    """
    import together_train as tt
    from together_train_server.engines.memory import ENV_VAR

    with tt.launch_local(
        model=str(model_dir), generators=0, dtype=cfg.dtype,
        extra_args=["--max-sessions", str(cfg.max_sessions)],
        env={ENV_VAR: "optim_step"},
    ) as client:
        pid = client.local_resource.process.pid
        vocab = client.get_capabilities().vocab_size
        rss, sessions = [], []
        for i in range(cfg.max_sessions):
            s = client.create_session(lora=lora)
            run_steps(s, [make_samples(cfg, vocab, i)], adam)
            sessions.append(s)
            rss.append(rss_median(pid))
        n_params = sessions[0].info().num_trainable_params
        for s in sessions:
            s.stop()
    inc = np.diff(np.asarray(rss, dtype=np.float64))
    slope = float(np.polyfit(np.arange(1, len(rss) + 1), rss, 1)[0])
    return {
        "rss_by_sessions_bytes": rss,
        "increments_bytes": inc.tolist(),
        "mem_per_session_bytes": float(np.median(inc)),
        "slope_bytes": slope,
        "trainable_params": int(n_params),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="batch 2 x 64, 2 rounds x 2 steps (under two minutes)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    cfg = Config()
    if args.quick:
        cfg.batch_size, cfg.seq_len, cfg.steps, cfg.rounds = 2, 64, 2, 2
    if args.steps:
        cfg.steps = args.steps
    if args.json_out:
        cfg.json_out = args.json_out

    import together_train as tt
    from together_train_server.engines.model_loading import resolve_model_dir

    model_dir = resolve_model_dir(None if cfg.model == "embedded" else cfg.model)
    lora = tt.LoraConfig(rank=cfg.rank, alpha=cfg.alpha, seed=0)
    adam = tt.AdamParams(learning_rate=cfg.learning_rate)
    t_start = time.perf_counter()
    mem = measure_memory(cfg, model_dir, lora, adam)
    with tt.launch_local(
        model=str(model_dir),
        generators=0,
        dtype=cfg.dtype,
        extra_args=["--max-sessions", str(cfg.max_sessions)],
    ) as client:
        pid = client.local_resource.process.pid
        vocab = client.get_capabilities().vocab_size
        rss_idle = rss_bytes(pid)

        # --- plain allocator (no trimming): 1 trained session, then 8 (information) -------
        sessions = [client.create_session(lora=lora)]
        run_steps(sessions[0], [make_samples(cfg, vocab, 0)], adam)
        time.sleep(0.5)
        rss_1 = rss_bytes(pid)
        for i in range(1, cfg.max_sessions):
            s = client.create_session(lora=lora)
            run_steps(s, [make_samples(cfg, vocab, i)], adam)
            sessions.append(s)
        time.sleep(0.5)
        rss_8 = rss_bytes(pid)

        # --- throughput: 1 session alone vs 4 at once, in alternating rounds ---------------
        # (alternating keeps a drift in machine load from favouring either side)
        tokens_per_step = cfg.batch_size * cfg.seq_len
        batches = [make_samples(cfg, vocab, 100 + k) for k in range(cfg.steps)]
        group = sessions[: cfg.concurrent_sessions]
        for s in group:
            run_steps(s, [make_samples(cfg, vocab, 98)] * cfg.warmup_steps, adam)
        errors: list[BaseException] = []

        def worker(s) -> None:
            try:
                run_steps(s, batches, adam)
            except BaseException as e:
                errors.append(e)

        one_s = many_s = 0.0
        for _ in range(cfg.rounds):
            t0 = time.perf_counter()
            run_steps(sessions[0], batches, adam)
            one_s += time.perf_counter() - t0
            threads = [threading.Thread(target=worker, args=(s,)) for s in group]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            many_s += time.perf_counter() - t0
            if errors:
                raise errors[0]
        one = cfg.rounds * cfg.steps * tokens_per_step / one_s
        many = cfg.rounds * len(group) * cfg.steps * tokens_per_step / many_s
        for s in sessions:
            s.stop()

    n_params = mem["trainable_params"]
    state_b = n_params * 16
    per_session_b = mem["mem_per_session_bytes"]
    mem_ratio = mem["rss_by_sessions_bytes"][-1] / mem["rss_by_sessions_bytes"][0]
    thr_ratio = many / one
    result = {
        "config": asdict(cfg),
        "memory_trimmed": mem,
        "state_bytes_per_session": state_b,
        "mem_per_session_ratio": per_session_b / state_b,
        "mem_ratio_8_vs_1": mem_ratio,
        "rss_idle_bytes": rss_idle,
        "untrimmed_rss_1_session_bytes": rss_1,
        "untrimmed_rss_8_sessions_bytes": rss_8,
        "untrimmed_mem_per_session_bytes": (rss_8 - rss_1) / (cfg.max_sessions - 1),
        "trainable_params_per_session": n_params,
        "tokens_per_s_1_session": one,
        "tokens_per_s_4_sessions": many,
        "throughput_ratio_4_vs_1": thr_ratio,
        "seconds_total": time.perf_counter() - t_start,
    }
    Path(cfg.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(cfg.json_out).write_text(json.dumps(result, indent=2))
    mib = 2**20
    print(f"rss_1_session_mb={mem['rss_by_sessions_bytes'][0] / mib:.1f}")
    print(f"rss_8_sessions_mb={mem['rss_by_sessions_bytes'][-1] / mib:.1f}")
    print("mem_increments_mb=" + ",".join(f"{x / mib:.1f}" for x in mem["increments_bytes"]))
    print(f"mem_slope_mb={mem['slope_bytes'] / mib:.1f}")
    print(f"mem_per_session_untrimmed_mb={result['untrimmed_mem_per_session_bytes'] / mib:.1f}")
    print(f"trainable_params_per_session={n_params}")
    print(f"tokens_per_s_1_session={one:.1f}")
    print(f"tokens_per_s_{len(group)}_sessions={many:.1f}")
    print(f"json={cfg.json_out}")
    print(f"mem_ratio_8_vs_1={mem_ratio:.3f}")
    print(f"state_mb_per_session={state_b / mib:.1f}")
    print(f"mem_per_session_mb={per_session_b / mib:.1f}")
    print(f"mem_per_session_ratio={per_session_b / state_b:.3f}")
    print(f"throughput_ratio_4_vs_1={thr_ratio:.3f}")


if __name__ == "__main__":
    main()
