"""Does the RL recipe learn on the embedded model, and what does the asynchronous mode buy?

One local resource (SmolLM2-135M-Instruct by default, CPU):

1. warm start: a short SFT run (`recipes.sft`, a few steps) so the policy answers in the strict
   format part of the time (the base model answers with a sentence: 0 % under the strict checker,
   so every group's rewards are equal and RL from the base has no signal on this task);
2. RL (`recipes.rl`) from that training checkpoint in synchronous mode, N steps;
3. RL from the same checkpoint in asynchronous mode (sampling step k+1 while training step k),
   the same N steps, prompts and seeds.

Prints ``accuracy_start=`` (held-out greedy accuracy at the RL start = after the warm start),
``accuracy_end=`` (after the async RL run; the sync run's is ``accuracy_end_sync=``) and
``async_speedup=`` = (sync seconds) / (async seconds) over the N training steps, evaluation time
excluded; writes JSON with both runs' per-step metrics summaries and the machine load.

    python benchmarks/rl_learning.py            # <= 20 min on an idle 2-core CPU
    python benchmarks/rl_learning.py --quick    # <= 5 min
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import together_train as tt  # noqa: E402

from together_train_cookbook.recipes import rl, sft  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="shorter budget (<= 5 min)")
    ap.add_argument("--model", default=None, help="model dir (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--sft-steps", type=int, default=None)
    ap.add_argument("--rl-steps", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=8, help="RL prompts per step")
    ap.add_argument("--num-samples", type=int, default=4)
    ap.add_argument("--learning-rate", type=float, default=1e-4)
    ap.add_argument("--loss", default="importance_sampling", choices=rl.LOSSES)
    ap.add_argument("--eval-examples", type=int, default=None)
    ap.add_argument("--json-out", default="runs/bench/rl_learning.json")
    args = ap.parse_args()
    sft_steps = args.sft_steps if args.sft_steps is not None else (8 if args.quick else 15)
    rl_steps = args.rl_steps if args.rl_steps is not None else (6 if args.quick else 20)
    n_eval = args.eval_examples or (50 if args.quick else 100)

    t0 = time.time()
    load_start = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="rl-bench-"))
    with tt.launch_local(model=args.model, generators=1, storage_dir=work / "storage",
                         log_file=work / "server.log") as client:
        t_up = time.time()
        warm = sft.run(sft.Config(model=args.model, steps=sft_steps, batch_size=16, eval_examples=n_eval,
                                  out_dir=str(work / "sft")), client=client)
        runs = {}
        for mode in ("sync", "async"):
            runs[mode] = rl.run(rl.Config(
                model=args.model, init_from=warm["state_uri"], steps=rl_steps, batch_size=args.batch_size,
                num_samples=args.num_samples, learning_rate=args.learning_rate, loss=args.loss,
                async_mode=(mode == "async"), eval_examples=n_eval, eval_every=0,
                eval_at_start=(mode == "sync"), save_every=0, out_dir=str(work / f"rl-{mode}")), client=client)
    t_sync = runs["sync"]["seconds"]["steps_without_eval"]
    t_async = runs["async"]["seconds"]["steps_without_eval"]
    result = {
        "accuracy_start": runs["sync"]["accuracy_start"],
        "accuracy_end": runs["async"]["accuracy_end"],
        "accuracy_end_sync": runs["sync"]["accuracy_end"],
        "accuracy_base": warm["accuracy_before"],
        "async_speedup": t_sync / t_async if t_async > 0 else float("nan"),
        "seconds_sync_steps": t_sync,
        "seconds_async_steps": t_async,
        "rl_steps": rl_steps,
        "sft_warm_start_steps": sft_steps,
        "batch_size": args.batch_size,
        "num_samples": args.num_samples,
        "learning_rate": args.learning_rate,
        "loss": args.loss,
        "eval_examples": n_eval,
        "quick": args.quick,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        "seconds_total": time.time() - t0,
        "seconds_resource_start": t_up - t0,
        "runs": {m: {k: v for k, v in r.items() if k != "adapter_path"} for m, r in runs.items()},
        "work_dir": str(work),
    }
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"accuracy_start={result['accuracy_start']:.3f} accuracy_end={result['accuracy_end']:.3f} "
          f"accuracy_end_sync={result['accuracy_end_sync']:.3f}")
    print(f"async_speedup={result['async_speedup']:.2f} (sync {t_sync:.0f}s, async {t_async:.0f}s over {rl_steps} steps)")
    print(f"total_seconds={result['seconds_total']:.0f} loadavg_start={load_start[0]:.1f} "
          f"loadavg_end={result['loadavg_end'][0]:.1f} json={out}")


if __name__ == "__main__":
    main()
