"""On-policy distillation through a together-train resource: the student samples, a teacher
scores every sampled token, and the student is trained to lower the per-token reverse KL.

    python -m together_train_cookbook.recipes.distill --teacher-checkpoint runs/sft-... [--init-from runs/sft-...]
    python -m together_train_cookbook.recipes.distill --teacher-address host:port   # e.g. a larger model

On the embedded model (the measured example; each command launches its own local resource,
and a run dir's checkpoint is copied into the next run's storage):

    python -m together_train_cookbook.recipes.sft --out-dir runs/sft60             # teacher: 60 steps, 0 % -> 89 %
    python -m together_train_cookbook.recipes.sft --steps 10 --out-dir runs/sft10  # student start: 38 %
    python -m together_train_cookbook.recipes.distill --teacher-checkpoint runs/sft60 --init-from runs/sft10

The student must already answer in roughly the teacher's format: from the base model
(which writes a sentence of working, never the bare number, in 8 sampled tokens) the
reverse KL did not fall (lr 5e-4: 3.8 -> 6.5 nats/token in 9 steps with the entropy rising;
lr 1e-4: ~4-5 for 8 steps): the per-token advantage only pushes down the sampled sentence
tokens and the student almost never samples the teacher's first token to be pulled toward.

Method (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes" (GKD), arXiv:2306.13649; Lu & Thinking Machines 2025, "On-Policy
Distillation"): for a completion y ~ student(.|x), each sampled token t gets the advantage

    A_t = log p_teacher(y_t | x, y_<t) - log q_student(y_t | x, y_<t)

(minus the single-sample estimate of the reverse KL ``KL(student || teacher)`` at that token);
the ``importance_sampling`` loss ``-Σ r_t·A_t`` with ``r_t = exp(p_t - q_t)`` then follows the
gradient of ``-E_student[Σ_t A_t]``, i.e. lowers the reverse KL on the student's own samples.
No reward or checker is needed (the held-out accuracy is only a readout for the arithmetic task).

Reads top to bottom:

1. codec; prompts (arithmetic task, or ``--data`` JSONL ``{"prompt", "answer"}``);
2. the student's resource and session (fresh, ``--init-from``, or ``--resume``), and the teacher:
   ``--teacher-checkpoint`` (a training/inference checkpoint URI or run dir, scored on this or the
   teacher's resource), ``--teacher-address`` (another resource: its base model, e.g. a larger
   model with the same tokenizer), or by default this resource's base model
   (``compute_logprobs(source="base")``; useful when the student starts from a fine-tuned
   checkpoint and should be pulled back toward the base);
3. each step k: prompts and sampler seeds from (seed, k) as in `recipes.rl`; the teacher scores
   ``prompt + completion`` with ``compute_logprobs``; `distill_samples` builds policy samples
   (mask and A = 0 on the prompt); ``forward_backward(importance_sampling)``, ``optim_step``,
   ``weights_sync``;
4. metrics per step: ``reverse_kl`` = mean of ``q - teacher`` over sampled tokens, ``kl_sampler``,
   ``entropy``, held-out accuracy every ``--eval-every`` steps; ``save_state`` every
   ``--save-every``, ``--resume``, ``save_weights`` at the end; ``distill.png``.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import together_train as tt

from together_train_cookbook.metrics import write_json
from together_train_cookbook.plotting import plot_metrics
from together_train_cookbook.problems import Problem, make_problems
from together_train_cookbook.checkpoint_refs import explain_not_found, resolve_init_from
from together_train_cookbook.cli import cli, parse_config, validate
from together_train_cookbook.connection import connect, local_storage, stop_on_exit, stop_quietly
from together_train_cookbook.display import fmt_or_dash, progress
from together_train_cookbook.evaluation import evaluate
from together_train_cookbook.run_state import open_run, resume_metrics
from together_train_cookbook.tokenizer import load_codec
from together_train_cookbook.recipes.rl import collect_rollouts, submit_rollouts
from together_train_cookbook.rl_math import kl_and_entropy
from together_train_cookbook.samples import build_policy_sample


@dataclass
class Config:
    """Distillation settings; every field is also a command-line flag.

    Defaults measured on the embedded SmolLM2-135M-Instruct (2-core CPU, load ~13 from other
    jobs; commands in the module docstring): teacher = SFT 60 steps (89 % held-out), student =
    SFT 10 steps (38 %), 40 steps x 8 prompts x 2 samples, lr 2e-4: reverse KL per sampled token
    1.43 (mean of steps 0-9) -> 0.91 (10-19) -> 0.65 (20-29) -> 0.75 (30-39); student sample
    reward 0.26 -> 0.45; greedy held-out accuracy 38 % -> 44 % (step 20) -> 69 % (step 40),
    100 prompts; ~26 s per step under that load (1139 s loop). lr 5e-4 from the base model
    diverged (see above); per-step reverse KL over 16 samples is noisy, read its trend.
    """

    data: str | None = field(default=None, metadata={"help": 'JSONL of {"prompt","answer"}; default: arithmetic'})
    model: str | None = field(default=None, metadata={"help": "local HF model dir; default: embedded SmolLM2-135M"})
    address: str | None = field(default=None, metadata={"help": "host:port of the student's resource; default: local"})
    api_key: str | None = field(default=None, metadata={"help": "API key for --address"})
    generators: int = field(default=1, metadata={"help": "generator replicas of a local resource"})
    dtype: str | None = field(default=None, metadata={"help": "model dtype of a local resource"})
    teacher_checkpoint: str | None = field(default=None, metadata={"help": "teacher: checkpoint URI or run dir"})
    teacher_address: str | None = field(default=None, metadata={"help": "teacher: another resource (its base model)"})
    init_from: str | None = field(default=None, metadata={"help": "student: training checkpoint URI or run dir"})
    resume: bool = field(default=False, metadata={"help": "continue from the last save_state in --out-dir"})
    lora_rank: int = field(default=16, metadata={"help": "LoRA rank (fresh student)"})
    lora_alpha: float = field(default=32.0, metadata={"help": "LoRA alpha (fresh student)"})
    learning_rate: float = field(default=2e-4, metadata={"help": "AdamW learning rate (constant)"})
    steps: int = field(default=40, metadata={"help": "optimizer steps (0 = evaluate the start, save it)"})
    batch_size: int = field(default=8, metadata={"help": "prompts per step"})
    num_samples: int = field(default=2, metadata={"help": "completions per prompt"})
    temperature: float = field(default=1.0, metadata={"help": "student sampling temperature"})
    max_tokens: int = field(default=8, metadata={"help": "max new tokens per completion"})
    train_examples: int = field(default=2000, metadata={"help": "training prompts (arithmetic task)"})
    eval_examples: int = field(default=100, metadata={"help": "held-out prompts"})
    eval_every: int = field(default=20, metadata={"help": "held-out accuracy every N steps (0 = end only)"})
    eval_max_tokens: int = field(default=8, metadata={"help": "max new tokens when evaluating (greedy)"})
    min_digits: int = field(default=2, metadata={"help": "arithmetic task: smallest operand digits"})
    max_digits: int = field(default=2, metadata={"help": "arithmetic task: largest operand digits"})
    seed: int = field(default=0, metadata={"help": "prompts, sampler seeds, LoRA init"})
    save_every: int = field(default=10, metadata={"help": "save_state every N steps (0 = only at the end)"})
    stop_after: int = field(default=0, metadata={"help": "(testing) stop after N steps of this run, as if killed", "hidden": True})
    out_dir: str | None = field(default=None, metadata={"help": "default runs/distill-<timestamp>"})
    adapter_name: str = field(default="distill-final", metadata={"help": "name of the saved adapter"})


def parse_args(argv: list[str] | None = None) -> Config:
    return parse_config(Config, argv, "python -m together_train_cookbook.recipes.distill", __doc__)


def distill_samples(batch: dict[str, Any], teacher_logprobs: list[np.ndarray]) -> tuple[list[tt.Sample], list[np.ndarray]]:
    """Policy samples with per-token reverse-KL advantages.

    Args:
        batch: `rl.collect_rollouts` output (groups of prompt, completions, sampler logprobs q).
        teacher_logprobs: one float [m_i - 1] array per completion, in batch order: the teacher's
            logprob of tokens 1.. of ``prompt + completion`` (as `compute_logprobs` returns).

    Returns:
        (samples, masks): for ``full = prompt + completion`` (m tokens, n_p prompt tokens), per token
        j: ``logprobs = q_j``, ``advantages = teacher_j - q_j`` and ``mask = 1`` on the completion
        (j >= n_p), all 0 on the prompt; shifted by `build_policy_sample`. Masks are per position.
    """
    samples, masks, i = [], [], 0
    for g in batch["groups"]:
        n_p = len(g["prompt"])
        for toks, q in zip(g["tokens"], g["logprobs"]):
            t = np.asarray(teacher_logprobs[i], np.float64)
            i += 1
            if not toks:
                continue
            m = n_p + len(toks)
            if t.shape[0] != m - 1:
                raise ValueError(f"teacher gave {t.shape[0]} logprobs for a {m}-token sequence")
            q_tok = np.concatenate([np.zeros(n_p), np.asarray(q, np.float64)])
            t_tok = np.concatenate([[0.0], t])
            mask = np.concatenate([np.zeros(n_p), np.ones(len(toks))])
            adv = (t_tok - q_tok) * mask
            s = build_policy_sample(g["prompt"] + list(toks), q_tok, adv, mask=mask)
            samples.append(s)
            masks.append(s.loss_fn_inputs["mask"])
    return samples, masks


def run(cfg: Config, client: tt.ResourceClient | None = None,
        problems: tuple[list[Problem], list[Problem]] | None = None) -> dict[str, Any]:
    """Run on-policy distillation; returns the summary dict (also written to summary.json)."""
    validate(cfg)  # bad values: ConfigError (a ValueError) before anything is created
    t_start = time.time()
    out_dir = Path(cfg.out_dir or f"runs/distill-{time.strftime('%Y%m%d-%H%M%S')}")
    # --resume: the saved config.json must agree (teacher, init_from, lr, ...); then config.json
    states, last = open_run(cfg, out_dir, "distill")

    # 1. codec and prompts
    codec = load_codec(cfg.model)
    if problems is not None:
        train, test = problems
    else:
        train, test, _ = make_problems(cfg.data, cfg.train_examples, cfg.eval_examples, cfg.seed,
                                       cfg.min_digits, cfg.max_digits)
    eval_items = [p.eval_item() for p in test]

    # run dirs' checkpoints are copied into this run's local storage when we launch the resource
    storage = local_storage(cfg, out_dir, client)
    init_uri = resolve_init_from(cfg.init_from, storage) if cfg.init_from else None
    teacher_uri = (resolve_init_from(cfg.teacher_checkpoint, None if cfg.teacher_address else storage,
                                     "--teacher-checkpoint")
                   if cfg.teacher_checkpoint else None)
    with connect(cfg, out_dir, client) as client, contextlib.ExitStack() as stack:
        # 2. student session and teacher (closed / stopped however the run ends)
        teacher_client = client
        if cfg.teacher_address:
            teacher_client = stack.enter_context(tt.ResourceClient(cfg.teacher_address, api_key=cfg.api_key))
        teacher_name = (cfg.teacher_address or "this resource") + (f" checkpoint {teacher_uri}" if teacher_uri else " base model")
        if last is not None:
            session = client.create_session(checkpoint_uri=last["uri"], with_optimizer=True, name="distill")
            start = int(last["step"])
        elif init_uri:
            with explain_not_found("--init-from", cfg.init_from, init_uri, cfg.address, out_dir):
                session = client.create_session(checkpoint_uri=init_uri, name="distill")
            start = 0
        else:
            session = client.create_session(
                lora=tt.LoraConfig(rank=cfg.lora_rank, alpha=cfg.lora_alpha, seed=cfg.seed), name="distill")
            start = 0
        stop_on_exit(stack, session)
        print(f"distill: student {session.id}, teacher {teacher_name}; {cfg.steps} steps x {cfg.batch_size} "
              f"prompts x {cfg.num_samples}", flush=True)
        session.weights_sync().result()
        metrics = resume_metrics(out_dir / "metrics.jsonl", start)
        acc_start = None
        if start == 0:
            acc_start, _ = evaluate(session, codec, eval_items, cfg.eval_max_tokens)
            metrics.log(step=-1, held_out_accuracy=acc_start)
        else:
            acc_start = next((r["held_out_accuracy"] for r in metrics.records if r.get("step") == -1), None)

        # 3-4. the loop
        bar = progress(cfg.steps, "distill", initial=start)
        t_loop, stopped, acc = time.time(), False, None
        for k in range(start, cfg.steps):
            t0 = time.time()
            batch = collect_rollouts(submit_rollouts(session, codec, train, cfg, k), codec, train)
            seqs = [g["prompt"] + list(t) for g in batch["groups"] for t in g["tokens"]]
            with (explain_not_found("--teacher-checkpoint", cfg.teacher_checkpoint, teacher_uri,
                                    cfg.teacher_address or cfg.address, out_dir)
                  if teacher_uri else contextlib.nullcontext()):
                teacher = teacher_client.compute_logprobs(seqs, checkpoint_uri=teacher_uri).result().logprobs
            samples, masks = distill_samples(batch, teacher)
            fb = session.forward_backward(samples, "importance_sampling", return_logprobs=True)
            opt = session.optim_step(tt.AdamParams(learning_rate=cfg.learning_rate))
            session.weights_sync()
            fb_res, opt_res = fb.result(), opt.result()
            q = [s.loss_fn_inputs["logprobs"] for s in samples]
            kl, ent = kl_and_entropy(q, fb_res.logprobs, masks)
            rev = float(np.mean(np.concatenate([-s.loss_fn_inputs["advantages"][m != 0] for s, m in zip(samples, masks)])))
            rec: dict[str, Any] = {
                "reverse_kl": rev, "kl_sampler": kl, "entropy": ent, "loss": fb_res.loss,
                "grad_norm": opt_res.grad_norm,
                "sample_reward": float(np.mean([r for g in batch["groups"] for r in g["rewards"]])),
            }
            done = k + 1
            if (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.steps:
                acc, _ = evaluate(session, codec, eval_items, cfg.eval_max_tokens)
                rec["held_out_accuracy"] = acc
            rec["seconds"] = time.time() - t0
            metrics.log(step=k, **rec)
            if bar is not None:
                bar.set_postfix(reverse_kl=f"{rev:.3f}")
                bar.update(1)
            if cfg.save_every and done % cfg.save_every == 0 and done < cfg.steps:
                states.save(session, done)
            if cfg.stop_after and done - start >= cfg.stop_after and done < cfg.steps:
                stopped = True
                break
        if bar is not None:
            bar.close()
        metrics.close()
        loop_s = time.time() - t_loop
        if stopped:
            stop_quietly(session)
            return {"stopped_at": done}
        if acc is None:  # no step ran (--steps 0, or --resume of a finished run): evaluate the end
            acc, _ = evaluate(session, codec, eval_items, cfg.eval_max_tokens)
        ckpt = session.save_weights(f"{cfg.adapter_name}-{session.id[:8]}").result()
        final = states.save(session, cfg.steps)
        stop_quietly(session)

    recs = [r for r in metrics.records if r.get("step", -1) >= 0]
    plot = plot_metrics(metrics.records, out_dir / "distill.png",
                        keys=("reverse_kl", "held_out_accuracy", "entropy"), title="on-policy distillation")
    summary = {
        "accuracy_start": acc_start,
        "accuracy_end": acc,
        "reverse_kl_first": recs[0]["reverse_kl"] if recs else None,
        "reverse_kl_last": recs[-1]["reverse_kl"] if recs else None,
        "teacher": teacher_name,
        "steps": cfg.steps,
        "adapter_uri": ckpt.uri,
        "adapter_path": ckpt.path,
        "state_uri": final["uri"],
        "plot": str(plot),
        "metrics": str(out_dir / "metrics.jsonl"),
        "seconds": {"loop": loop_s, "total": time.time() - t_start},
    }
    write_json(out_dir / "summary.json", summary)
    print(f"\ndistill: reverse KL {fmt_or_dash(summary['reverse_kl_first'], '.4f')} -> "
          f"{fmt_or_dash(summary['reverse_kl_last'], '.4f')}; held-out accuracy {fmt_or_dash(acc_start, '.1%')} -> "
          f"{fmt_or_dash(acc, '.1%')}; loop {loop_s:.0f}s; plot {plot}")
    return summary



def main(argv: list[str] | None = None) -> int:
    return cli(run, parse_args(argv), "distill")


if __name__ == "__main__":
    sys.exit(main())
