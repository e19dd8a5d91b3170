"""forward_backward throughput of every loss relative to cross_entropy, through the service.

One local resource (SmolLM2-135M-Instruct by default, LoRA rank 16, CPU) and
one session; the same batch of token sequences is trained with every loss
(sampler logprobs built from the model's own logprobs with offsets, advantages
of both signs, a prompt mask, reference logprobs for grpo's KL). Rounds
interleave the losses (each round times one forward_backward of every loss,
in alternating order), so drift and load from other processes hit all alike;
each loss's throughput is tokens / its *fastest* call time (best of the
rounds, as ``timeit`` does: interference from other processes only adds
time, so the minimum estimates the loss's own cost); the JSON also holds
every call time and the median-based ratios. Prints ``tokens_per_s_<loss>=`` and ``ratio_<loss>=``
(throughput / cross_entropy's; target >= 0.95) lines and writes JSON.

    python benchmarks/losses.py            # full: 8 x 128 tokens, 9 rounds
    python benchmarks/losses.py --quick    # under a minute: 2 x 64, 5 rounds
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np

# name -> (loss_fn, params, extra inputs)
LOSSES = {
    "cross_entropy": ("cross_entropy", {}),
    "importance_sampling": ("importance_sampling", {}),
    "ppo": ("ppo", {}),
    "cispo": ("cispo", {}),
    "dro": ("dro", {"beta": 0.1}),
    "grpo": ("grpo", {}),
    "grpo_gspo_kl": ("grpo", {"ratio_type": "sequence", "beta": 0.05, "aggregation": "sequence_mean"}),
    "custom": ("custom", {}),
}


@dataclass
class Config:
    batch_size: int = 8
    seq_len: int = 128
    rounds: int = 9
    rank: int = 16
    model: str = "embedded"
    seed: int = 0
    json_out: str = "runs/bench/losses.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 x 64 tokens, 5 rounds (under a minute)")
    parser.add_argument("--model", default=None, help="model directory (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    cfg = Config()
    if args.quick:
        cfg.batch_size, cfg.seq_len, cfg.rounds = 2, 64, 5
    if args.model:
        cfg.model = args.model
    if args.json_out:
        cfg.json_out = args.json_out

    import together_train as tt
    from together_train_server.engines.model_loading import resolve_model_dir

    model_dir = resolve_model_dir(None if cfg.model == "embedded" else cfg.model)
    rng = np.random.default_rng(cfg.seed)
    with tt.launch_local(model=str(model_dir), generators=0) as client:
        vocab = client.get_capabilities().vocab_size
        session = client.create_session(lora=tt.LoraConfig(rank=cfg.rank, alpha=2.0 * cfg.rank, seed=cfg.seed))
        n = cfg.seq_len
        toks = rng.integers(0, vocab, size=(cfg.batch_size, n + 1))
        mask = np.zeros(n, np.float32)
        mask[n // 4:] = 1.0
        ce = [tt.Sample(model_input=t[:-1], loss_fn_inputs={"target_tokens": t[1:], "weights": mask}) for t in toks]
        p = session.forward(ce, "cross_entropy", return_logprobs=True).result().logprobs
        batches = {}
        for name, (loss_fn, _) in LOSSES.items():
            if loss_fn == "cross_entropy":
                batches[name] = ce
                continue
            if loss_fn == "custom":
                batches[name] = [tt.Sample(model_input=t[:-1], loss_fn_inputs={"target_tokens": t[1:]}) for t in toks]
                continue
            out = []
            for t, pi in zip(toks, p):
                inputs = {
                    "target_tokens": t[1:],
                    "logprobs": (pi - np.log(rng.choice([0.7, 0.95, 1.0, 1.1, 1.5], n))).astype(np.float32),
                    "advantages": rng.choice([-1.0, 0.0, 0.5, 1.0], n).astype(np.float32),
                    "mask": mask,
                }
                if loss_fn == "grpo":
                    inputs["reference_logprobs"] = (pi + rng.normal(0, 0.1, n)).astype(np.float32)
                out.append(tt.Sample(model_input=t[:-1], loss_fn_inputs=inputs))
            batches[name] = out
        grads = [(-mask * rng.uniform(0.5, 1.5, n)).astype(np.float32) for _ in toks]

        def submit(name: str):
            loss_fn, params = LOSSES[name]
            if loss_fn == "custom":
                return session.custom_forward_backward(batches[name], grads, return_logprobs=False)
            return session.forward_backward(batches[name], loss_fn, params)

        for name in LOSSES:  # warm-up, and a check that each loss runs
            submit(name).result()
        times: dict[str, list[float]] = {name: [] for name in LOSSES}
        for r in range(cfg.rounds):
            order = list(LOSSES) if r % 2 == 0 else list(reversed(LOSSES))
            for name in order:
                t0 = time.perf_counter()
                submit(name).result()
                times[name].append(time.perf_counter() - t0)
        session.stop()

    tokens = cfg.batch_size * cfg.seq_len
    tps = {name: tokens / float(np.min(t)) for name, t in times.items()}
    ratios = {name: tps[name] / tps["cross_entropy"] for name in LOSSES if name != "cross_entropy"}
    median_ratios = {name: float(np.median(times["cross_entropy"]) / np.median(times[name]))
                     for name in LOSSES if name != "cross_entropy"}
    result = {"config": asdict(cfg), "model_dir": str(model_dir), "tokens_per_s": tps, "ratios": ratios,
              "call_seconds": times, "median_ratios": median_ratios,
              "target": 0.95, "min_ratio": min(ratios.values())}
    Path(cfg.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(cfg.json_out).write_text(json.dumps(result, indent=2))
    for name, v in tps.items():
        print(f"tokens_per_s_{name}={v:.1f}")
    print(f"json={cfg.json_out}")
    for name, v in ratios.items():
        print(f"ratio_{name}={v:.3f}")


if __name__ == "__main__":
    main()
