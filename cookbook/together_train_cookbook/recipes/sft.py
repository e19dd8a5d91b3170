"""Supervised fine-tuning (SFT) through a together-train resource.

    python -m together_train_cookbook.recipes.sft [--data chats.jsonl] [--steps 60] ...

Reads top to bottom:

1. tokenizer of the model (the embedded SmolLM2-135M-Instruct by default) and
   its chat-template codec;
2. data: a JSONL of ``{"messages": [...]}`` chats (``--data``), or by default the
   generated arithmetic task ("What is 47 + 85?" -> "132"), rendered into
   ``cross_entropy`` samples that train on assistant tokens only;
3. a resource: ``--address`` attaches to a running one, otherwise
   `together_train.launch_local` starts one on this machine;
4. a LoRA session; accuracy before training, by greedy sampling of every
   evaluation prompt (all requests submitted at once, then collected);
5. the training loop: ``forward_backward`` and ``optim_step`` submitted back to
   back, a few steps ahead of the results being read (pipelined futures);
6. ``weights_sync``, accuracy after training, ``save_weights``;
7. ``metrics.jsonl`` (one line per step), ``loss.png``, ``summary.json`` in
   ``--out-dir``, and a printed summary.

Checkpoints and resume: ``save_state`` every ``--save-every`` steps (recorded in
``<out-dir>/states.jsonl``) and at the end (``summary.json`` ``state_uri``, what
``rl``/``dpo``/``distill --init-from <out-dir>`` start from). ``--resume`` recreates the
session from the last of them with its optimizer state and continues at its step: the batch
plan is a function of (seed, data, steps, batch size) only, and so is the learning rate of
every step, so a stopped and resumed run trains on the same batches with the same updates as
an uninterrupted one (a test compares the metrics). The accuracy before training is carried
in the checkpoint record, not measured again.

Loss reported per step = ``loss:sum / weight sum`` (the resource returns the
loss summed over tokens; the weights are the 0/1 assistant mask, so this is
the mean negative log-likelihood per trained token). The gradient the optimizer
sees is that of the *sum*; Adam is invariant to that scale (up to eps and
clipping), so learning rates transfer from per-token-mean trainers.

Evaluation: for the arithmetic task a response is right when the strict
checker accepts it (the bare number). For ``--data``, the last
``--eval-examples`` chats are held out and a response is right when it equals
the reference final assistant message exactly (after stripping whitespace);
that metric is only meaningful for short, deterministic answers.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import together_train as tt

from together_train_cookbook.metrics import MetricsWriter, write_json
from together_train_cookbook.plotting import plot_loss
from together_train_cookbook.samples import conversation_to_samples
from together_train_cookbook.cli import cli, parse_config, validate
from together_train_cookbook.connection import connect, stop_on_exit, stop_quietly
from together_train_cookbook.display import progress
from together_train_cookbook.evaluation import EvalItem, evaluate
from together_train_cookbook.jsonl import read_jsonl
from together_train_cookbook.run_state import open_run, resume_metrics
from together_train_cookbook.tokenizer import load_codec
from together_train_cookbook.tasks import ArithmeticTask, check

__all__ = ["Config", "EvalItem", "batches", "evaluate", "learning_rate_at", "load_chats", "make_data",
           "parse_args", "run", "main"]


@dataclass
class Config:
    """SFT settings; every field is also a command-line flag (``lora_rank`` -> ``--lora-rank``).

    Defaults were measured on a 2-core CPU with the embedded SmolLM2-135M-Instruct, fp32,
    LoRA rank 16 / alpha 32 on every linear layer of the blocks, 100 held-out 2-digit
    additions, greedy decoding, strict checker:

    - plain in-process torch + peft, batch 16, lr 1e-3 constant: 0 % -> 70 % (20 steps)
      -> 80 % (40) -> 86 % (60); ~2.7 s per step on an otherwise idle machine.
      lr 2e-3 with linear decay: 64 % (20) -> 70 % (40), i.e. worse.
      3-digit additions, lr 1e-3: 0 % -> 49 % after 20 steps.
    - through the service (this recipe, defaults): 0 % -> 89 % after 60 steps.
    """

    data: str | None = field(
        default=None,
        metadata={"help": 'JSONL of {"messages": [...]} chats; default: the generated arithmetic task'},
    )
    model: str | None = field(
        default=None,
        metadata={"help": "local Hugging Face model dir; default: the embedded SmolLM2-135M-Instruct"},
    )
    address: str | None = field(
        default=None,
        metadata={"help": "host:port of a running resource; default: launch one locally"},
    )
    api_key: str | None = field(default=None, metadata={"help": "API key for --address"})
    generators: int = field(default=1, metadata={"help": "generator replicas of a local resource"})
    dtype: str | None = field(
        default=None,
        metadata={"help": "model dtype of a local resource (float32, bfloat16); default: the server's"},
    )
    lora_rank: int = field(default=16, metadata={"help": "LoRA rank"})
    lora_alpha: float = field(default=32.0, metadata={"help": "LoRA alpha (scale = alpha / rank)"})
    learning_rate: float = field(default=1e-3, metadata={"help": "AdamW learning rate (peak)"})
    lr_schedule: str = field(
        default="linear",
        metadata={"help": "linear: decay to 0 at the last step", "choices": ("constant", "linear")},
    )
    warmup_steps: int = field(default=0, metadata={"help": "linear warmup steps"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    grad_clip_norm: float = field(default=0.0, metadata={"help": "clip the summed-loss gradient; 0 = off"})
    batch_size: int = field(default=16, metadata={"help": "chats per optimizer step"})
    steps: int | None = field(
        default=60, metadata={"help": "optimizer steps (>= 0); 0 = --epochs decide (default 1 epoch)"}
    )
    epochs: float | None = field(
        default=None, metadata={"help": "passes over the training data (used when --steps is 0)"}
    )
    max_length: int = field(default=512, metadata={"help": "truncate rendered chats to this many tokens"})
    train_examples: int = field(
        default=0,
        metadata={"help": "arithmetic task: training problems (0 = steps * batch size, no repeats)"},
    )
    eval_examples: int = field(default=100, metadata={"help": "held-out prompts sampled before and after"})
    eval_max_tokens: int = field(
        default=0, metadata={"help": "max new tokens when evaluating (0 = 8 for the task, 256 for --data)"}
    )
    min_digits: int = field(default=2, metadata={"help": "arithmetic task: smallest operand digits"})
    max_digits: int = field(default=2, metadata={"help": "arithmetic task: largest operand digits"})
    seed: int = field(default=0, metadata={"help": "data order, task generation, LoRA init"})
    pipeline_depth: int = field(
        default=2, metadata={"help": "training steps submitted ahead of the results being read"}
    )
    out_dir: str | None = field(default=None, metadata={"help": "default runs/sft-<timestamp>"})
    adapter_name: str = field(default="sft-final", metadata={"help": "name of the saved adapter"})
    save_every: int = field(default=20, metadata={"help": "save_state every N steps (0 = only at the end)"})
    resume: bool = field(default=False, metadata={"help": "continue from the last save_state in --out-dir"})
    stop_after: int = field(default=0, metadata={"help": "(testing) stop after N steps of this run, as if killed", "hidden": True})


# -- command line ----------------------------------------------------------------------


def parse_args(argv: list[str] | None = None, config_cls: type = Config) -> Any:
    """A `config_cls` instance from command-line flags (one per dataclass field)."""
    return parse_config(config_cls, argv, "python -m together_train_cookbook.recipes.sft", __doc__)


# -- data ----------------------------------------------------------------------------------


def load_chats(path: str | os.PathLike) -> list[list[dict[str, Any]]]:
    """Read a JSONL file of ``{"messages": [{"role": ..., "content": ...}, ...]}``.

    Raises:
        ValueError: a line is not JSON, has no "messages" list, or no assistant turn
            (the message names the line number).
    """
    chats = []
    for lineno, record in read_jsonl(path):
        msgs = record.get("messages") if isinstance(record, dict) else None
        if not isinstance(msgs, list) or not msgs:
            raise ValueError(f'{path}:{lineno}: expected {{"messages": [...]}}')
        if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in msgs):
            raise ValueError(f"{path}:{lineno}: no assistant message to train on")
        chats.append(msgs)
    if not chats:
        raise ValueError(f"{path}: no chats")
    return chats


def make_data(cfg: Config) -> tuple[list[list[dict[str, Any]]], list[EvalItem], str]:
    """(training chats, evaluation items, description)."""
    if cfg.data is None:
        task = ArithmeticTask(cfg.min_digits, cfg.max_digits)
        n_train = cfg.train_examples or (cfg.steps or 0) * cfg.batch_size or 2000
        n_train = min(n_train, task.num_problems - cfg.eval_examples)
        train, test = task.splits(n_train, cfg.eval_examples, seed=cfg.seed)
        items = [
            EvalItem(ex.prompt_messages(), ex.reference_response(), (lambda r, ex=ex: check(r, ex)))
            for ex in test
        ]
        desc = (
            f"arithmetic: {cfg.min_digits}-{cfg.max_digits} digit a {task.op} b, "
            f"{len(train)} train / {len(test)} test problems"
        )
        return [ex.messages() for ex in train], items, desc
    chats = load_chats(cfg.data)
    n_eval = min(cfg.eval_examples, len(chats) // 5)  # never hold out more than a fifth
    rng = random.Random(cfg.seed)
    order = list(range(len(chats)))
    rng.shuffle(order)
    held, kept = order[:n_eval], order[n_eval:]
    items = []
    for i in held:
        msgs = chats[i]
        last = max(k for k, m in enumerate(msgs) if m["role"] == "assistant")
        ref = str(msgs[last]["content"]).strip()
        items.append(EvalItem(msgs[:last], ref, (lambda r, ref=ref: r.strip() == ref)))
    return [chats[i] for i in kept], items, f"{cfg.data}: {len(kept)} train / {len(items)} held-out chats"


def batches(samples: list[tt.Sample], cfg: Config) -> tuple[list[list[tt.Sample]], float]:
    """Shuffled batches for the whole run, and how many epochs they make (a float).

    `steps` wins when > 0; otherwise `epochs` (default 1) passes are made. Each epoch
    is a fresh permutation (seeded); the last partial batch of an epoch is carried over.
    """
    if cfg.batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {cfg.batch_size}")
    steps = cfg.steps or 0
    if steps <= 0:
        epochs = cfg.epochs if cfg.epochs else 1.0
        steps = max(1, math.ceil(epochs * len(samples) / cfg.batch_size))
    rng = random.Random(cfg.seed + 1)
    stream: list[tt.Sample] = []
    while len(stream) < steps * cfg.batch_size:
        perm = list(range(len(samples)))
        rng.shuffle(perm)
        stream.extend(samples[i] for i in perm)
    return [stream[i * cfg.batch_size:(i + 1) * cfg.batch_size] for i in range(steps)], (
        steps * cfg.batch_size / len(samples)
    )


def learning_rate_at(step: int, total: int, cfg: Config) -> float:
    """lr of 0-based `step`: linear warmup over `warmup_steps`, then constant or linear
    decay to 0 at `total` (lr(total-1) = peak / (total - warmup))."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.learning_rate
    if cfg.lr_schedule == "linear":
        span = max(1, total - cfg.warmup_steps)
        return cfg.learning_rate * (1.0 - (step - cfg.warmup_steps) / span)
    raise ValueError(f"lr_schedule must be 'constant' or 'linear', got {cfg.lr_schedule!r}")


# -- main ------------------------------------------------------------------------------


def run(cfg: Config, client: tt.ResourceClient | None = None) -> dict[str, Any]:
    """Run SFT as configured; returns the summary dict (also written to summary.json).

    `client`: an already connected resource to use (left open), e.g. by the SFT -> RL
    pipeline (`recipes.main`); default: ``--address`` or a local resource."""
    validate(cfg)  # bad values: ConfigError before anything is created
    t_start = time.time()
    out_dir = Path(cfg.out_dir or f"runs/sft-{time.strftime('%Y%m%d-%H%M%S')}")
    # --resume: the saved config.json must agree (ConfigError otherwise); then config.json
    states, last = open_run(cfg, out_dir, "sft")

    # 1. tokenizer and codec (the model's own chat template)
    codec = load_codec(cfg.model)

    # 2. data -> samples (one value per token in, shifted arrays out)
    chats, eval_items, data_desc = make_data(cfg)
    # one sample per chat, or one per assistant turn for templates that strip earlier reasoning
    samples = [s for msgs in chats for s in conversation_to_samples(codec, msgs, max_length=cfg.max_length)]
    plan, n_epochs = batches(samples, cfg)
    total = len(plan)
    eval_max_tokens = cfg.eval_max_tokens or (8 if cfg.data is None else 256)
    print(f"data: {data_desc}; {total} steps x batch {cfg.batch_size} ({n_epochs:.2f} epochs)", flush=True)

    with connect(cfg, out_dir, client) as client, contextlib.ExitStack() as stack:
        caps = client.get_capabilities()
        print(f"resource: {caps.model_id} ({getattr(client, 'address', cfg.address or 'local')})", flush=True)
        longest = max(s.length + 1 for s in samples)
        if caps.max_seq_len and longest > caps.max_seq_len:
            raise ValueError(
                f"a training chat renders to {longest} tokens, over the resource's context of "
                f"{caps.max_seq_len}; pass --max-length {caps.max_seq_len} (or less)"
            )

        # 3. session: fresh, or (--resume) the last checkpoint of this out dir with its optimizer
        if last is not None:
            session = client.create_session(checkpoint_uri=last["uri"], with_optimizer=True, name="sft")
            start = int(last["step"])
            print(f"resumed from {last['uri']} at step {start}", flush=True)
        else:
            session = client.create_session(
                lora=tt.LoraConfig(rank=cfg.lora_rank, alpha=cfg.lora_alpha, seed=cfg.seed), name="sft"
            )
            start = 0
        stop_on_exit(stack, session)  # stopped however the run ends

        # 4. accuracy before training (version 0 = fresh adapter with B = 0 = base model);
        #    a resumed run takes it from the checkpoint record
        t0 = time.time()
        if last is None:
            session.weights_sync().result()
            acc_before, recs_before = evaluate(session, codec, eval_items, eval_max_tokens)
            print(f"accuracy before: {acc_before:.1%} ({len(eval_items)} prompts, {time.time() - t0:.0f}s)",
                  flush=True)
        else:
            acc_before = last["extra"].get("accuracy_before", float("nan"))
            recs_before = last["extra"].get("eval_before", [])
        eval_before_s = time.time() - t0
        extra = {"accuracy_before": acc_before, "eval_before": recs_before}

        # 5. training loop: keep `pipeline_depth` steps queued on the resource
        metrics = resume_metrics(out_dir / "metrics.jsonl", start)
        bar = progress(total, initial=start)
        pending: list[tuple[int, float, float, Any, Any]] = []
        t_train = time.time()
        last_done = t_train

        def collect() -> None:
            nonlocal last_done
            step, lr, wsum, fb, opt = pending.pop(0)
            fb_res, opt_res = fb.result(), opt.result()
            now = time.time()
            loss = fb_res.loss / wsum if wsum > 0 else float("nan")
            metrics.log(
                step=step,
                loss=loss,
                loss_sum=fb_res.loss,
                weight_sum=wsum,
                lr=opt_res.learning_rate,
                grad_norm=opt_res.grad_norm,
                seconds=now - last_done,
            )
            last_done = now
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")
                bar.update(1)
            elif step % 10 == 0 or step == total - 1:
                print(f"step {step}: loss/token {loss:.4f} lr {lr:.2e}", flush=True)

        stopped = False
        for step in range(start, total):
            batch = plan[step]
            lr = learning_rate_at(step, total, cfg)
            wsum = float(sum(float(s.loss_fn_inputs["weights"].sum()) for s in batch))
            fb = session.forward_backward(batch, loss_fn="cross_entropy")
            opt = session.optim_step(
                tt.AdamParams(
                    learning_rate=lr,
                    weight_decay=cfg.weight_decay,
                    grad_clip_norm=cfg.grad_clip_norm,
                )
            )
            pending.append((step, lr, wsum, fb, opt))
            done = step + 1
            if cfg.save_every and done % cfg.save_every == 0 and done < total:
                while pending:  # metrics of every step <= this one, then the checkpoint after it
                    collect()
                states.save(session, done, extra)
            if cfg.stop_after and done - start >= cfg.stop_after and done < total:
                stopped = True
                break
            while len(pending) > max(0, cfg.pipeline_depth - 1):
                collect()
        while pending:
            collect()
        if bar is not None:
            bar.close()
        metrics.close()
        train_s = time.time() - t_train
        if stopped:  # as if killed here (testing): no final evaluation or checkpoint
            stop_quietly(session)
            return {"stopped_at": done, "seconds": {"train": train_s}}

        # 6. publish the trained adapter to the generators, evaluate, save
        t0 = time.time()
        sync = session.weights_sync().result()
        acc_after, recs_after = evaluate(session, codec, eval_items, eval_max_tokens)
        eval_after_s = time.time() - t0
        ckpt = session.save_weights(cfg.adapter_name).result()
        # a training checkpoint too: `rl --init-from <out_dir>` (or its URI) starts from it
        state = states.save(session, total, extra)
        stop_quietly(session)

    # 7. files and summary
    with open(out_dir / "eval.jsonl", "w", encoding="utf-8") as f:
        for when, recs in (("before", recs_before), ("after", recs_after)):
            for r in recs:
                f.write(json.dumps({"when": when, **r}) + "\n")
    plot_path = plot_loss(
        metrics.records, out_dir / "loss.png", title=f"SFT loss per trained token ({total} steps)"
    )
    summary = {
        "accuracy_before": acc_before,
        "accuracy_after": acc_after,
        "eval_examples": len(eval_items),
        "steps": total,
        "batch_size": cfg.batch_size,
        "final_loss": metrics.records[-1]["loss"] if metrics.records else None,
        "policy_version": sync.policy_version,
        "adapter_uri": ckpt.uri,
        "adapter_path": ckpt.path,
        "state_uri": state["uri"],
        "plot": str(plot_path),
        "metrics": str(out_dir / "metrics.jsonl"),
        "seconds": {
            "train": train_s,
            "eval_before": eval_before_s,
            "eval_after": eval_after_s,
            "total": time.time() - t_start,
        },
    }
    write_json(out_dir / "summary.json", summary)
    print()
    print(f"accuracy before: {acc_before:.1%} after: {acc_after:.1%} ({len(eval_items)} held-out prompts)")
    print(f"loss per token: {metrics.records[0]['loss']:.4f} -> {metrics.records[-1]['loss']:.4f}"
          f" ({total} steps, {train_s:.0f}s of training{' in this run' if start else ''})")
    print(f"loss plot: {plot_path}")
    print(f"adapter: {ckpt.path} ({ckpt.uri})")
    print(f"run dir: {out_dir} (metrics.jsonl, eval.jsonl, summary.json); total {summary['seconds']['total']:.0f}s")
    return summary


def main(argv: list[str] | None = None) -> int:
    return cli(run, parse_args(argv), "sft")


if __name__ == "__main__":
    sys.exit(main())
