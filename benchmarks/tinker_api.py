"""The Tinker API's cost: the same work through the tinker SDK over HTTP and our SDK over gRPC, one run.

One local resource (SmolLM2-135M-Instruct by default, CPU) serves both
protocols (`launch_local(http_port=0)`). Training: a LoRA r16 session on each
side (alpha 32, attention + MLP, no lm_head), SFT steps of ``batch x seq``
tokens, each step ``forward_backward`` + ``optim_step`` submitted back to
back without waiting (pipelined), ``steps`` per block; blocks alternate
between the two protocols (and which goes first) so drift and load from other
processes hit both. Sampling: ``prompts`` prompts x ``num_samples`` x
``max_tokens`` from the base model, all submitted at once, per block.
Throughput per protocol = work / its fastest block (as ``timeit``: other
processes only add time). Prints ``tinker_api_ratio=`` (HTTP training
throughput / gRPC's, target >= 0.9) and ``tinker_sample_ratio=`` and writes JSON.

    python benchmarks/tinker_api.py            # 8 x 128 tokens, 3 steps a block, 4 blocks each
    python benchmarks/tinker_api.py --quick    # 2 x 64, 2 steps, 3 blocks each (a few minutes)
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

ATTN_MLP = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class Config:
    batch_size: int = 8
    seq_len: int = 128
    steps: int = 3
    blocks: int = 4
    rank: int = 16
    prompts: int = 8
    num_samples: int = 4
    max_tokens: int = 32
    model: str = "embedded"
    seed: int = 0
    json_out: str = "runs/bench/tinker_api.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 x 64 tokens, 2 steps, 3 blocks, 4 prompts x 2 x 16")
    parser.add_argument("--model", default=None, help="model directory (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    cfg = Config()
    if args.quick:
        cfg.batch_size, cfg.seq_len, cfg.steps, cfg.blocks = 2, 64, 2, 3
        cfg.prompts, cfg.num_samples, cfg.max_tokens = 4, 2, 16
    if args.model:
        cfg.model = args.model
    if args.json_out:
        cfg.json_out = args.json_out

    import tinker
    from tinker import types as T

    import together_train as tt
    from together_train_server.engines.model_loading import resolve_model_dir

    model_dir = resolve_model_dir(None if cfg.model == "embedded" else cfg.model)
    rng = np.random.default_rng(cfg.seed)
    adam = dict(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0)
    key = "bench-key"
    with tt.launch_local(model=str(model_dir), generators=1, api_key=key, http_port=0) as client:
        vocab = client.get_capabilities().vocab_size
        n = cfg.seq_len
        toks = rng.integers(0, vocab, size=(cfg.batch_size, n + 1))
        w = np.ones(n, np.float32)
        samples = [tt.Sample(model_input=t[:-1], loss_fn_inputs={"target_tokens": t[1:], "weights": w}) for t in toks]
        datums = [T.Datum(model_input=T.ModelInput.from_ints(t[:-1].tolist()),
                          loss_fn_inputs={"target_tokens": t[1:].astype(np.int64), "weights": w}) for t in toks]
        prompts = [rng.integers(0, vocab, size=16) for _ in range(cfg.prompts)]

        session = client.create_session(lora=tt.LoraConfig(rank=cfg.rank, alpha=32.0, seed=cfg.seed,
                                                           target_modules=ATTN_MLP))
        service = tinker.ServiceClient(base_url=client.http_url, api_key="tml-" + key)
        tc = service.create_lora_training_client(base_model=str(model_dir), rank=cfg.rank, seed=cfg.seed,
                                                 train_unembed=False).result()
        sc = service.create_sampling_client(base_model=str(model_dir)).result()

        def train_grpc() -> None:
            futs = []
            for _ in range(cfg.steps):
                futs += [session.forward_backward(samples, "cross_entropy"), session.optim_step(tt.AdamParams(**adam))]
            for f in futs:
                f.result(600)

        def train_http() -> None:
            futs = []
            for _ in range(cfg.steps):
                futs += [tc.forward_backward(datums, "cross_entropy"), tc.optim_step(T.AdamParams(**adam))]
            for f in futs:
                f.result()

        sp = tt.SamplingParams(max_tokens=cfg.max_tokens, temperature=1.0, ignore_eos=True)
        tsp = T.SamplingParams(max_tokens=cfg.max_tokens, temperature=1.0, stop=[])  # [] = no EOS stop

        def sample_grpc() -> None:
            for f in [client.sample(p, sp, cfg.num_samples) for p in prompts]:
                f.result(600)

        def sample_http() -> None:
            for f in [sc.sample(T.ModelInput.from_ints(p.tolist()), cfg.num_samples, tsp) for p in prompts]:
                f.result()

        jobs = {"train_grpc": train_grpc, "train_http": train_http, "sample_grpc": sample_grpc,
                "sample_http": sample_http}
        for fn in jobs.values():  # warm-up: first calls load and compile paths
            fn()
        times: dict[str, list[float]] = {k: [] for k in jobs}
        for b in range(cfg.blocks):
            for kind in ("train", "sample"):
                order = ("grpc", "http") if b % 2 == 0 else ("http", "grpc")
                for proto in order:
                    t0 = time.perf_counter()
                    jobs[f"{kind}_{proto}"]()
                    times[f"{kind}_{proto}"].append(time.perf_counter() - t0)
        session.stop()
        service.close("success").result()

    train_tokens = cfg.steps * cfg.batch_size * cfg.seq_len
    sample_tokens = cfg.prompts * cfg.num_samples * cfg.max_tokens
    tps = {k: (train_tokens if k.startswith("train") else sample_tokens) / float(np.min(v)) for k, v in times.items()}
    ratio = tps["train_http"] / tps["train_grpc"]
    sample_ratio = tps["sample_http"] / tps["sample_grpc"]
    result = {"config": asdict(cfg), "model_dir": str(model_dir), "tokens_per_s": tps, "block_seconds": times,
              "tinker_api_ratio": ratio, "tinker_sample_ratio": sample_ratio, "target": 0.9}
    Path(cfg.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(cfg.json_out).write_text(json.dumps(result, indent=2))
    for k, v in tps.items():
        print(f"tokens_per_s_{k}={v:.1f}")
    print(f"json={cfg.json_out}")
    print(f"tinker_api_ratio={ratio:.3f}")
    print(f"tinker_sample_ratio={sample_ratio:.3f}")


if __name__ == "__main__":
    main()
