"""Reinforcement learning with verifiable rewards (GRPO-style) through a together-train resource.

    python -m together_train_cookbook.recipes.rl [--init-from runs/sft-...] [--steps 20] [--async-mode] ...

The task: the generated arithmetic problems (reward 1 when the strict checker accepts the bare
number, else 0), or ``--data prompts.jsonl`` of ``{"prompt": ..., "answer": ...}`` (exact match),
as single-turn envs (`rl.ProblemDataset`: ``batch_size`` prompts per step, ``num_samples``
attempts each); held-out accuracy (greedy) on a disjoint split, the same prompts the SFT recipe
evaluates for the same seed and sizes. The loop (`rl.train.run`): rollouts, group-centred
advantages (``r - mean(group)``, ``--scale-by-std`` divides by the std), the policy loss
(``--loss``), sync or ``--async-mode``, evaluation every ``--eval-every`` steps, ``save_state``
every ``--save-every``, ``--resume``; ``rl.png`` and ``summary.json`` in ``--out-dir``.

Any other task (multi-turn envs included) trains the same way: ``run(cfg, dataset=...)``.

Loss scale: the resource returns sums over tokens (``importance_sampling``/``ppo``/``cispo``), or
``grpo``'s normalised aggregate; Adam is nearly invariant to the overall scale. The sampler
logprobs are of the temperature-scaled distribution (``--temperature``; keep 1.0 so q and p
describe the same distribution).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import together_train as tt

from together_train_cookbook import rl
from together_train_cookbook.cli import cli, parse_config, validate
from together_train_cookbook.display import fmt_or_dash
from together_train_cookbook.problems import Problem, make_problems
from together_train_cookbook.rl import train
from together_train_cookbook.rl.config import LOSSES  # noqa: F401  (recipes.main, benchmarks)
from together_train_cookbook.tokenizer import codec_for


@dataclass
class Config(rl.Config):
    """RL settings; every field is also a command-line flag (``num_samples`` -> ``--num-samples``).

    Defaults measured on the embedded SmolLM2-135M-Instruct (LoRA r16, 2-digit additions, 200
    held-out prompts, async, 8 prompts x 8 samples): from a 12-step SFT checkpoint (44.5 %) lr
    1e-4 gains (51 % after 12 steps); from a 30-step one (69 %), lr 4e-4 is destructive (at step 3,
    on the same prompts, sampled reward 0.25 vs 0.67 at lr 1e-4; ``kl_sampler`` 0.43 per token
    after one step) and lr 2e-4 moves the policy by ``kl_sampler`` 0.11 in one step. With 4
    samples per prompt a policy at ~80 % sampled reward leaves most groups all correct (no
    signal; ``frac_groups_with_signal``); with 8, 25-75 % of the groups are trained.
    """

    data: str | None = field(default=None, metadata={"help": 'JSONL of {"prompt", "answer"}; default: arithmetic'})
    batch_size: int = field(default=8, metadata={"help": "prompts per step"})
    num_samples: int = field(default=8, metadata={"help": "completions per prompt (group size)"})
    scale_by_std: bool = field(default=False, metadata={"help": "divide advantages by the group std (GRPO); off = Dr. GRPO"})
    train_examples: int = field(default=2000, metadata={"help": "training prompts (arithmetic task)"})
    eval_examples: int = field(default=100, metadata={"help": "held-out prompts"})
    eval_max_tokens: int = field(default=8, metadata={"help": "max new tokens when evaluating (greedy)"})
    min_digits: int = field(default=2, metadata={"help": "arithmetic task: smallest operand digits"})
    max_digits: int = field(default=2, metadata={"help": "arithmetic task: largest operand digits"})


def parse_args(argv: list[str] | None = None) -> Config:
    return parse_config(Config, argv, "python -m together_train_cookbook.recipes.rl", __doc__)


def run(cfg: Config, client: tt.ResourceClient | None = None,
        problems: tuple[list[Problem], list[Problem]] | None = None,
        dataset: rl.RLDataset | None = None, evaluator: rl.Evaluator | None = None) -> dict[str, Any]:
    """Run RL as configured; returns the summary dict (also written to summary.json).

    Args:
        client: an already connected resource (left open), e.g. from `recipes.main`;
            default: ``--address`` or a local resource.
        problems: (train, held-out) `Problem` lists with any checker; default: ``--data`` /
            the arithmetic task. dataset / evaluator: any `rl.RLDataset` (e.g. multi-turn envs)
            and its `rl.Evaluator`, instead of problems.
    """
    validate(cfg)  # bad values (loss, steps, --loss-config, ...): ConfigError before anything is created
    codec = codec_for(cfg, client)
    if dataset is None:
        train_p, test_p, desc = (*problems, "given problems") if problems else make_problems(
            cfg.data, cfg.train_examples, cfg.eval_examples, cfg.seed, cfg.min_digits, cfg.max_digits)
        dataset = rl.ProblemDataset(train_p, codec, cfg.batch_size, cfg.num_samples, cfg.seed)
        evaluator = rl.ProblemEvaluator(test_p, codec, cfg.eval_max_tokens)
        print(f"data: {desc}; {cfg.steps} steps x {cfg.batch_size} prompts x {cfg.num_samples} samples"
              f" ({'async' if cfg.async_mode else 'sync'}, loss {cfg.loss})", flush=True)
    s = train.run(cfg, dataset, codec=codec, evaluator=evaluator, advantages=rl.GroupCentered(cfg.scale_by_std),
                  client=client, name="rl", title=f"RL ({cfg.loss}, {'async' if cfg.async_mode else 'sync'})")
    if "stopped_at" not in s:
        # accuracy_start is None when the start was not evaluated (the main job evaluates after SFT itself)
        start = "" if s["accuracy_start"] is None else f"start: {s['accuracy_start']:.1%} "
        acc = (f"RL accuracy {start}end: {fmt_or_dash(s['accuracy_end'], '.1%')} ({s['eval_examples']} held-out "
               "prompts); " if s["accuracy_end"] is not None else "RL: ")
        print(f"\n{acc}reward {fmt_or_dash(s['mean_reward_first'], '.2f')} -> "
              f"{fmt_or_dash(s['mean_reward_last'], '.2f')}; loop {s['seconds']['loop']:.0f}s")
        print(f"plot: {s['plot']}; adapter: {s['adapter_path']}; run dir: {s['metrics'].rsplit('/', 1)[0]}")
    return s


def main(argv: list[str] | None = None) -> int:
    return cli(run, parse_args(argv), "rl")


if __name__ == "__main__":
    sys.exit(main())
