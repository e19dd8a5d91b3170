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
Distillation"): RL (`rl.train.run`) whose advantage is the teacher's judgement: for a completion
y ~ student(.|x), each sampled token t gets

    A_t = log p_teacher(y_t | x, y_<t) - log q_student(y_t | x, y_<t)

(minus the single-sample estimate of the reverse KL ``KL(student || teacher)`` at that token);
the ``importance_sampling`` loss ``-Σ r_t·A_t`` with ``r_t = exp(p_t - q_t)`` then follows the
gradient of ``-E_student[Σ_t A_t]``, i.e. lowers the reverse KL on the student's own samples.
No reward is needed (the arithmetic reward and held-out accuracy are only readouts).

The teacher: ``--teacher-checkpoint`` (a training/inference checkpoint URI or run dir, scored on
this or the teacher's resource), ``--teacher-address`` (another resource: its base model, e.g. a
larger model with the same tokenizer), or by default this resource's base model (useful when the
student starts from a fine-tuned checkpoint and should be pulled back toward the base). Metrics:
``reverse_kl`` = mean of ``q - teacher`` over sampled tokens, and the loop's; ``distill.png``.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import together_train as tt

from together_train_cookbook import rl
from together_train_cookbook.checkpoint_refs import explain_not_found, resolve_init_from
from together_train_cookbook.cli import cli, parse_config, validate
from together_train_cookbook.connection import local_storage
from together_train_cookbook.display import fmt_or_dash
from together_train_cookbook.metrics import read_metrics, write_json
from together_train_cookbook.problems import Problem, make_problems
from together_train_cookbook.rl import train
from together_train_cookbook.tokenizer import codec_for


@dataclass
class Config(rl.Config):
    """Distillation settings; every field is also a command-line flag.

    Defaults measured on the embedded SmolLM2-135M-Instruct (2-core CPU, load ~13 from other
    jobs; commands in the module docstring): teacher = SFT 60 steps (89 % held-out), student =
    SFT 10 steps (38 %), 40 steps x 8 prompts x 2 samples, lr 2e-4: reverse KL per sampled token
    1.43 (mean of steps 0-9) -> 0.91 (10-19) -> 0.65 (20-29) -> 0.75 (30-39); student sample
    reward 0.26 -> 0.45; greedy held-out accuracy 38 % -> 44 % (step 20) -> 69 % (step 40),
    100 prompts; ~26 s per step under that load (1139 s loop). lr 5e-4 from the base model
    diverged (see above); per-step reverse KL over 16 samples is noisy, read its trend.
    """

    init_from: str | None = field(default=None, metadata={"help": "student: training checkpoint URI or run dir"})
    learning_rate: float = field(default=2e-4, metadata={"help": "AdamW learning rate (constant)"})
    steps: int = field(default=40, metadata={"help": "optimizer steps (0 = evaluate the start, save it)"})
    eval_every: int = field(default=20, metadata={"help": "held-out accuracy every N steps (0 = end only)"})
    adapter_name: str = field(default="distill-final", metadata={"help": "name of the saved adapter"})
    data: str | None = field(default=None, metadata={"help": 'JSONL of {"prompt","answer"}; default: arithmetic'})
    teacher_checkpoint: str | None = field(default=None, metadata={"help": "teacher: checkpoint URI or run dir"})
    teacher_address: str | None = field(default=None, metadata={"help": "teacher: another resource (its base model)"})
    batch_size: int = field(default=8, metadata={"help": "prompts per step"})
    num_samples: int = field(default=2, metadata={"help": "completions per prompt"})
    train_examples: int = field(default=2000, metadata={"help": "training prompts (arithmetic task)"})
    eval_examples: int = field(default=100, metadata={"help": "held-out prompts"})
    eval_max_tokens: int = field(default=8, metadata={"help": "max new tokens when evaluating (greedy)"})
    min_digits: int = field(default=2, metadata={"help": "arithmetic task: smallest operand digits"})
    max_digits: int = field(default=2, metadata={"help": "arithmetic task: largest operand digits"})


def parse_args(argv: list[str] | None = None) -> Config:
    return parse_config(Config, argv, "python -m together_train_cookbook.recipes.distill", __doc__)


def teacher_advantages(groups: Sequence[rl.TrajectoryGroup], teacher_logprobs: Sequence[np.ndarray]) -> rl.advantages.Advantages:
    """Per-token reverse-KL advantages ``teacher - q`` on every action token.

    Args:
        groups: the step's rollouts.
        teacher_logprobs: one float [m - 1] array per transition (in group, episode, turn order):
            the teacher's logprobs of tokens 1.. of ``observation + action`` (as `compute_logprobs`
            returns), m tokens in all.

    Returns:
        advantages[g][e][t]: float64 [len(action)], ``teacher_j - q_j`` for the action's tokens.

    Raises:
        ValueError: a teacher array whose length is not m - 1.
    """
    out, i = [], 0
    for g in groups:
        out.append([])
        for traj in g.trajectories:
            out[-1].append([])
            for t in traj.transitions:
                lp = np.asarray(teacher_logprobs[i], np.float64)
                i += 1
                m = len(t.observation) + len(t.action)
                if lp.shape[0] != m - 1:
                    raise ValueError(f"teacher gave {lp.shape[0]} logprobs for a {m}-token sequence")
                out[-1][-1].append(lp[len(lp) - len(t.action):] - np.asarray(t.logprobs, np.float64))
    return out


class Teacher:
    """The advantage function of distillation (an `rl.AdvantageFn`): scores every transition's
    ``observation + action`` with the teacher; metric ``reverse_kl``. `client`: the teacher's
    resource (None: the student's); `uri`: its checkpoint (None: that resource's base model)."""

    def __init__(self, uri: str | None, client: tt.ResourceClient | None, explain: Any = contextlib.nullcontext) -> None:
        self.uri, self.client, self.explain = uri, client, explain

    def __call__(self, groups: Sequence[rl.TrajectoryGroup], session: tt.Session) -> tuple[Any, dict[str, float]]:
        seqs = [t.observation + t.action for g in groups for traj in g.trajectories for t in traj.transitions]
        with self.explain():
            scored = (self.client or session.client).compute_logprobs(seqs, checkpoint_uri=self.uri).result()
        advs = teacher_advantages(groups, scored.logprobs)
        flat = [a for g in advs for traj in g for a in traj if len(a)]
        return advs, {"reverse_kl": float(-np.mean(np.concatenate(flat))) if flat else float("nan")}


def run(cfg: Config, client: tt.ResourceClient | None = None,
        problems: tuple[list[Problem], list[Problem]] | None = None) -> dict[str, Any]:
    """Run on-policy distillation; returns the summary dict (also written to summary.json)."""
    validate(cfg)  # bad values: ConfigError (a ValueError) before anything is created
    codec = codec_for(cfg, client)
    train_p, test_p, _ = (*problems, "") if problems else make_problems(
        cfg.data, cfg.train_examples, cfg.eval_examples, cfg.seed, cfg.min_digits, cfg.max_digits)
    out_dir = Path(cfg.out_dir or f"runs/distill-{time.strftime('%Y%m%d-%H%M%S')}")
    uri = None
    if cfg.teacher_checkpoint:  # a run dir's checkpoint is copied into this run's local storage
        storage = None if cfg.teacher_address else local_storage(cfg, out_dir, client)
        uri = resolve_init_from(cfg.teacher_checkpoint, storage, "--teacher-checkpoint")
    teacher = (cfg.teacher_address or "this resource") + (f" checkpoint {uri}" if uri else " base model")
    print(f"distill: teacher {teacher}; {cfg.steps} steps x {cfg.batch_size} prompts x {cfg.num_samples}", flush=True)
    with contextlib.ExitStack() as stack:
        teacher_client = (stack.enter_context(tt.ResourceClient(cfg.teacher_address, api_key=cfg.api_key))
                          if cfg.teacher_address else None)
        explain = (lambda: explain_not_found("--teacher-checkpoint", cfg.teacher_checkpoint, uri,
                                             cfg.teacher_address or cfg.address, out_dir)) if uri else contextlib.nullcontext
        s = train.run(cfg, rl.ProblemDataset(train_p, codec, cfg.batch_size, cfg.num_samples, cfg.seed), codec=codec,
                      evaluator=rl.ProblemEvaluator(test_p, codec, cfg.eval_max_tokens),
                      advantages=Teacher(uri, teacher_client, explain), client=client, name="distill", out_dir=out_dir,
                      plot_keys=("reverse_kl", "held_out_accuracy", "entropy"), title="on-policy distillation")
    if "stopped_at" in s:
        return s
    first, last = train.first_last(read_metrics(s["metrics"]), "reverse_kl")
    s.update(reverse_kl_first=first, reverse_kl_last=last, teacher=teacher)
    write_json(out_dir / "summary.json", s)
    print(f"\ndistill: reverse KL {fmt_or_dash(first, '.4f')} -> {fmt_or_dash(last, '.4f')}; held-out accuracy "
          f"{fmt_or_dash(s['accuracy_start'], '.1%')} -> {fmt_or_dash(s['accuracy_end'], '.1%')}; "
          f"loop {s['seconds']['loop']:.0f}s; plot {s['plot']}")
    return s


def main(argv: list[str] | None = None) -> int:
    return cli(run, parse_args(argv), "distill")


if __name__ == "__main__":
    sys.exit(main())
