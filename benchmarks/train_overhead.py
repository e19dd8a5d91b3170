"""Service overhead on SFT steps: together-train vs a plain in-process torch + peft loop.

The same SFT steps (SmolLM2-135M-Instruct, LoRA rank 16, batch 8 x 128
tokens, CPU, AdamW) run twice in one process's lifetime: once in a plain
in-process loop written as a user would (transformers + peft, log_softmax,
weighted sum, backward, AdamW), once through a local resource over gRPC
with pipelined futures (forward_backward and optim_step submitted back to
back, results collected afterwards). Prints tokens/s of both and, as its last
line, `ratio=<service throughput / plain throughput>` (target >= 0.95),
and writes the numbers as JSON.

    python benchmarks/train_overhead.py            # full: 8 x 128, 12 steps
    python benchmarks/train_overhead.py --quick    # under a minute: 4 x 64, 4 steps
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


@dataclass
class Config:
    batch_size: int = 8
    seq_len: int = 128
    steps: int = 12
    warmup_steps: int = 2
    rank: int = 16
    alpha: float = 32.0
    learning_rate: float = 1e-4
    dtype: str = "float32"
    model: str = "embedded"
    seed: int = 0
    json_out: str = "runs/bench/train_overhead.json"


def make_batches(cfg: Config, vocab_size: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Random token batches (tokens [B, T+1] int64, weights [B, T] float32: last half weighted)."""
    rng = np.random.default_rng(cfg.seed)
    out = []
    for _ in range(cfg.warmup_steps + cfg.steps):
        tokens = rng.integers(0, vocab_size, size=(cfg.batch_size, cfg.seq_len + 1), dtype=np.int64)
        weights = np.zeros((cfg.batch_size, cfg.seq_len), dtype=np.float32)
        weights[:, cfg.seq_len // 2 :] = 1.0
        out.append((tokens, weights))
    return out


def run_plain(cfg: Config, model_dir: Path, batches) -> float:
    """Plain in-process transformers + peft loop; returns trained tokens per second."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(cfg.seed)
    dtype = getattr(torch, cfg.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    lora = LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    model = get_peft_model(model, lora)
    model.eval()  # no dropout, as the service runs a rank-16 adapter with dropout 0
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.learning_rate, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    t0 = 0.0
    for i, (tokens, weights) in enumerate(batches):
        if i == cfg.warmup_steps:
            t0 = time.perf_counter()
        inp = torch.from_numpy(tokens[:, :-1])
        tgt = torch.from_numpy(tokens[:, 1:])
        w = torch.from_numpy(weights)
        logits = model(input_ids=inp).logits
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
        loss = -(w * logp).sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
    seconds = time.perf_counter() - t0
    del model, opt
    return cfg.steps * cfg.batch_size * cfg.seq_len / seconds


def run_service(cfg: Config, model_dir: Path, batches, allocator: str = "auto") -> float:
    """The same steps through a local resource with pipelined futures; tokens per second."""
    import together_train as tt

    with tt.launch_local(model=str(model_dir), generators=0,
                         extra_args=["--dtype", cfg.dtype, "--allocator", allocator]) as client:
        session = client.create_session(lora=tt.LoraConfig(rank=cfg.rank, alpha=cfg.alpha, seed=cfg.seed))
        adam = tt.AdamParams(learning_rate=cfg.learning_rate)
        futures = []
        t0 = 0.0
        for i, (tokens, weights) in enumerate(batches):
            if i == cfg.warmup_steps:
                for f in futures:
                    f.result()
                futures = []
                t0 = time.perf_counter()
            samples = [
                tt.Sample(model_input=tokens[b, :-1], loss_fn_inputs={"target_tokens": tokens[b, 1:], "weights": weights[b]})
                for b in range(cfg.batch_size)
            ]
            futures.append(session.forward_backward(samples, loss_fn="cross_entropy"))
            futures.append(session.optim_step(adam))
        for f in futures:
            f.result()
        seconds = time.perf_counter() - t0
        session.stop()
    return cfg.steps * cfg.batch_size * cfg.seq_len / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 x 64 tokens, 4 steps (under a minute)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--allocator", default="auto", choices=["auto", "tcmalloc", "glibc"],
                        help="the server's --allocator (default auto: tcmalloc when installed)")
    args = parser.parse_args()
    cfg = Config()
    if args.quick:
        cfg.batch_size, cfg.seq_len, cfg.steps, cfg.warmup_steps = 4, 64, 4, 1
    if args.steps:
        cfg.steps = args.steps
    if args.dtype:
        cfg.dtype = args.dtype
    if args.json_out:
        cfg.json_out = args.json_out

    from together_train_server.engines.model_loading import resolve_model_dir

    model_dir = resolve_model_dir(None if cfg.model == "embedded" else cfg.model)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    batches = make_batches(cfg, vocab)
    plain = run_plain(cfg, model_dir, batches)
    service = run_service(cfg, model_dir, batches, args.allocator)
    ratio = service / plain
    result = {"config": asdict(cfg), "plain_tokens_per_s": plain, "service_tokens_per_s": service, "ratio": ratio}
    Path(cfg.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(cfg.json_out).write_text(json.dumps(result, indent=2))
    print(f"plain_tokens_per_s={plain:.1f}")
    print(f"service_tokens_per_s={service:.1f}")
    print(f"json={cfg.json_out}")
    print(f"ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
