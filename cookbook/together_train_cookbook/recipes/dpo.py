"""Direct preference optimisation (DPO; Rafailov et al. 2023, arXiv:2305.18290) through a
together-train resource, with the loss computed in the client: a preference dataset on the
shared supervised loop (`supervised.train`) with a client-side loss (`DPO`).

    python -m together_train_cookbook.recipes.dpo [--data pairs.jsonl] [--init-from runs/sft-...] ...

On the embedded model, from a short SFT start (each command launches its own local resource;
the run dir's checkpoint is copied into the DPO run's storage):

    python -m together_train_cookbook.recipes.sft --steps 10 --out-dir runs/sft10   # 0 % -> 38 %
    python -m together_train_cookbook.recipes.dpo --init-from runs/sft10             # 38 % -> 60 %

(numbers in `Config`). From the base model (plain ``dpo``), which answers with a sentence the
strict checker rejects, the online pairs (bare answer chosen over its own sentence) teach the
format as well: 0 % -> 36 % in the default 30 steps.

Reads top to bottom:

1. `Config`; `make_pairs`: for the generated arithmetic task, chosen = the correct answer and
   rejected = a wrong number (the answer plus a seeded offset from ±1, ±2, ±10), or with
   ``--rejected sampled`` the policy's own wrong answer sampled at that step (online DPO, see
   `on_policy_rejected`); or ``--data`` preference rows (`supervised.preference`: JSONL, JSON,
   Parquet or a ``save_to_disk`` dir; ``{"prompt", "chosen", "rejected"}``);
2. `DPO`, the loss (supervised/dpo.py, with `HeldOutPreferences`): a frozen *reference* session that is never stepped (same start as the
   policy: the base model, or ``--init-from``); each step renders the pairs into samples
   ``[chosen_0, rejected_0, ...]`` (weights = reply tokens), takes the reference sums
   ``ref = Σ_t w_t·p_ref,t``, and runs `custom_loss.forward_backward_custom` with
   `custom_loss.dpo_loss`: ``forward`` gives the policy's logprobs, the client computes
   ``z = beta·((pi_c - ref_c) - (pi_r - ref_r))``, ``L = -Σ log σ(z)`` (sum over pairs) and
   ``dL/dp``, ``custom_forward_backward`` backpropagates it; the loop then runs ``optim_step``;
3. metrics per step: loss per pair, preference accuracy (z > 0), reward margin
   ``mean((pi_c - ref_c) - (pi_r - ref_r))``, chosen / rejected rewards ``beta·(pi - ref)``;
   `HeldOutPreferences` every ``--eval-every`` steps: held-out preference accuracy (exactly 0
   at the start, where policy = reference), margin, and the reference-free ranking accuracy
   ``pi_c > pi_r``; for the arithmetic task also the greedy answer accuracy at start and end;
4. the loop's checkpoints, ``--resume``, ``save_weights``; ``metrics.jsonl``, ``dpo.png``,
   ``summary.json``.
"""

from __future__ import annotations

import dataclasses
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import together_train as tt

from together_train_cookbook.cli import ConfigError, cli, parse_config, validate
from together_train_cookbook.codec import Codec
from together_train_cookbook.display import fmt_or_dash
from together_train_cookbook.metrics import write_json
from together_train_cookbook.plotting import plot_metrics
from together_train_cookbook.problems import arithmetic_problem
from together_train_cookbook.supervised import Evaluator, GreedyAccuracy, ShuffledDataset
from together_train_cookbook.supervised.dpo import DPO, HeldOutPreferences
from together_train_cookbook.supervised.preference import PreferencePair, load_pairs, pair_samples
from together_train_cookbook.supervised.train import Config as SupervisedConfig, train
from together_train_cookbook.tasks import ArithmeticExample, ArithmeticTask, check, format_answer
from together_train_cookbook.tokenizer import codec_for

Pair = PreferencePair  # the name this recipe used before the pairs moved to `supervised.preference`


@dataclass
class Config(SupervisedConfig):
    """DPO settings; every field is also a command-line flag.

    Defaults measured on the embedded SmolLM2-135M-Instruct, 2-core CPU under load ~13 from
    other jobs, ``--init-from`` SFT 10 steps (38 % greedy held-out answer accuracy), 30 steps x
    8 pairs, beta 0.1, 100 held-out pairs / prompts (the SFT evaluation set):

    - online (``--rejected sampled``, the default for the task), lr 2e-4: held-out preference
      accuracy 0 % -> 87 %, reward margin 0 -> 2.98 nats, reference-free ranking
      ``pi_c > pi_r`` 89 % -> 92 %, answer accuracy 38 % -> 60 %; the policy's own sample
      accuracy (temperature 1) 12.5 % at step 0 -> ~70 % by step 14; 1308 s loop (~6x less idle).
      lr 1e-4: 83 %, margin 2.20, answer 38 % -> 55 %.
    - the default command from the base model (online, lr 2e-4; load ~10): answer accuracy
      0 % -> 36 %, sample accuracy 0 % (steps 0-5) -> 31 % (step 29), preference accuracy
      0 % -> 88 %, margin 0 -> 4.39, ranking 62 % -> 89 %; 665 s loop.
    - given pairs (``--rejected given``: answer ± 1, 2, 10), lr 5e-4: preference accuracy
      0 % -> 79 %, margin 0 -> 7.0, but ranking 89 % -> 85 % and answer accuracy 38 % -> 30 %:
      the chosen replies' logprobs fell too (chosen reward -0.35 by step 9, the known DPO
      likelihood displacement) and the offset answers are not the mistakes the model makes
      (it already ranked 89 % of them below the right answer while answering 38 % right).

    (Measured when each step drew its pairs independently; pairs now come in seeded epochs.)
    """

    data: str | None = field(default=None, metadata={
        "help": 'pairs {"prompt","chosen","rejected"}: .jsonl/.json/.parquet or a save_to_disk dir; default: arithmetic'})
    eval_data: str | None = field(default=None, metadata={
        "help": "held-out pairs (same formats); default: a fifth of --data, at most --eval-examples"})
    init_from: str | None = field(default=None, metadata={"help": "training checkpoint URI or run dir (policy and reference start)"})
    rejected: str = field(default="auto", metadata={
        "help": "rejected replies: the pairs' own (given: for the arithmetic task the answer plus a seeded "
                "offset), or the policy's own wrong answer sampled at this step (sampled: online DPO, arithmetic "
                "task only; the given one when all samples are right); auto = sampled for the arithmetic task, "
                "given for --data",
        "choices": ("auto", "given", "sampled")})
    num_samples: int = field(default=4, metadata={"help": "--rejected sampled: completions per prompt (temperature 1)"})
    max_tokens: int = field(default=8, metadata={"help": "--rejected sampled: max new tokens per completion"})
    beta: float = field(default=0.1, metadata={"help": "DPO temperature beta"})
    learning_rate: float = field(default=2e-4, metadata={"help": "AdamW learning rate (peak)"})
    lr_schedule: str = field(default="constant", metadata={"help": "linear: decay to 0 at the last step",
                                                           "choices": ("constant", "linear")})
    steps: int = field(default=30, metadata={"help": "optimizer steps (0 = evaluate the start, save it)"})
    batch_size: int = field(default=8, metadata={"help": "pairs per step"})
    train_examples: int = field(default=2000, metadata={"help": "arithmetic task: training pairs"})
    eval_examples: int = field(default=100, metadata={"help": "held-out pairs / prompts (100 = the sft recipe's evaluation set)"})
    eval_every: int = field(default=15, metadata={"help": "held-out preference accuracy every N steps (0 = end only)"})
    eval_max_tokens: int = field(default=8, metadata={"help": "max new tokens of the greedy answer accuracy"})
    min_digits: int = field(default=2, metadata={"help": "arithmetic task: smallest operand digits"})
    max_digits: int = field(default=2, metadata={"help": "arithmetic task: largest operand digits"})
    save_every: int = field(default=10, metadata={"help": "save_state every N steps (0 = only at the end)"})
    adapter_name: str = field(default="dpo-final", metadata={"help": "name of the saved adapter"})

    def check(self) -> None:
        """DPO's own settings (`cli.validate` runs this before the shared checks)."""
        if self.rejected == "sampled" and self.data is not None:
            raise ConfigError(f"--rejected sampled needs a checker: the arithmetic task (no --data); "
                              f"with --data {self.data} use --rejected given (or auto)")

    @property
    def online(self) -> bool:
        """Rejected replies sampled from the policy (``--rejected sampled``, or auto on the task)."""
        return self.rejected == "sampled" or (self.rejected == "auto" and self.data is None)


def parse_args(argv: list[str] | None = None) -> Config:
    return parse_config(Config, argv, "python -m together_train_cookbook.recipes.dpo", __doc__)


# -- data ----------------------------------------------------------------------------------


def wrong_answer(ex: ArithmeticExample, seed: int) -> str:
    """A wrong answer for `ex`, seeded by (seed, problem): answer + one of ±1, ±2, ±10 (>= 0)."""
    rng = random.Random(f"dpo-{seed}-{ex.a}{ex.op}{ex.b}")
    offsets = [d for d in (-10, -2, -1, 1, 2, 10) if ex.answer + d >= 0]
    return format_answer(ex.answer + rng.choice(offsets))


def make_pairs(cfg: Config) -> tuple[list[Pair], list[Pair], str]:
    """(train, held-out, description)."""
    if cfg.data is None:
        task = ArithmeticTask(cfg.min_digits, cfg.max_digits)
        train_set, test = task.splits(min(cfg.train_examples, task.num_problems - cfg.eval_examples),
                                      cfg.eval_examples, seed=cfg.seed)
        mk = lambda ex: Pair(ex.prompt_messages(), ex.reference_response(), wrong_answer(ex, cfg.seed), ex)  # noqa: E731
        return [mk(e) for e in train_set], [mk(e) for e in test], f"arithmetic pairs: {len(train_set)} train / {len(test)} test"
    pairs = load_pairs(cfg.data)
    if cfg.eval_data is not None:
        test = load_pairs(cfg.eval_data)[:cfg.eval_examples]
        return pairs, test, f"{cfg.data}: {len(pairs)} train; {cfg.eval_data}: {len(test)} held-out pairs"
    n_eval = min(cfg.eval_examples, len(pairs) // 5)
    order = list(range(len(pairs)))
    random.Random(cfg.seed).shuffle(order)
    return ([pairs[i] for i in order[n_eval:]], [pairs[i] for i in order[:n_eval]],
            f"{cfg.data}: {len(pairs) - n_eval} train / {n_eval} held-out pairs")


def on_policy_rejected(session: tt.Session, codec: Codec, pairs: Sequence[Pair], cfg: Config,
                       step: int) -> tuple[list[Pair], dict[str, float]]:
    """Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback",
    arXiv:2402.04792) with the task's checker as the annotator: each pair's prompt is sampled
    ``num_samples`` times from the policy's last synced version (temperature 1, seeds from
    (seed, step, pair index)); the first non-empty response the checker rejects becomes the
    rejected reply, so DPO pushes down the mistakes the policy actually makes. A pair whose
    samples are all right keeps its offset answer. Returns (pairs, metrics: ``sample_accuracy``
    = fraction of samples right, ``sampled_rejected`` = fraction of pairs with a sampled reply)."""
    futs = []
    for j, p in enumerate(pairs):
        seed = random.Random(f"dpo-sample-{cfg.seed}-{step}-{j}").randrange(2**31 - 1)
        params = tt.SamplingParams(max_tokens=cfg.max_tokens, temperature=1.0, seed=seed,
                                   stop_token_ids=codec.stop_token_ids, stop=codec.stop_strings)
        futs.append(session.sample(codec.build_generation_prompt(p.prompt), params, num_samples=cfg.num_samples))
    out, right, n, swapped = [], 0, 0, 0
    for p, fut in zip(pairs, futs):
        assert p.example is not None
        responses = [codec.parse_response(seq.tokens) for seq in fut.result().sequences]
        ok = [check(r, p.example) for r in responses]
        right, n = right + sum(ok), n + len(ok)
        wrong = [r for r, good in zip(responses, ok) if not good and r.strip()]
        swapped += bool(wrong)
        out.append(dataclasses.replace(p, rejected=wrong[0]) if wrong else p)
    return out, {"sample_accuracy": right / max(1, n), "sampled_rejected": swapped / max(1, len(pairs))}


# -- main ------------------------------------------------------------------------------


def run(cfg: Config, client: tt.ResourceClient | None = None) -> dict[str, Any]:
    """Run DPO as configured; returns the summary dict (also written to summary.json)."""
    validate(cfg)  # bad values: ConfigError (a ValueError) before anything is loaded or created
    codec = codec_for(cfg, client)
    train_pairs, test, desc = make_pairs(cfg)
    print(f"data: {desc}; {cfg.steps} steps x {cfg.batch_size} pairs, beta {cfg.beta}, rejected replies: "
          f"{'sampled from the policy (online)' if cfg.online else 'given'}", flush=True)
    resample = (lambda session, batch, step: on_policy_rejected(session, codec, batch, cfg, step)) if cfg.online else None
    loss = DPO(codec, cfg.beta, cfg.max_length, resample)
    evaluators: list[Evaluator] = [HeldOutPreferences(loss, pair_samples(codec, test, cfg.max_length))]
    answers = [arithmetic_problem(p.example).eval_item() for p in test if p.example is not None]
    if answers:
        evaluators.append(GreedyAccuracy(codec, answers, cfg.eval_max_tokens, key="held_out_answer_accuracy"))
    dataset = ShuffledDataset(train_pairs, cfg.batch_size, seed=cfg.seed)
    r = train(cfg, dataset, name="dpo", steps=cfg.steps, loss=loss, evaluators=evaluators, client=client)
    if r.stopped_at is not None:  # (testing) stopped as if killed
        return {"stopped_at": r.stopped_at}

    plot = plot_metrics(r.records, r.out_dir / "dpo.png", title=f"DPO (beta {cfg.beta})",
                        keys=("loss", "accuracy", "margin", "held_out_pref_accuracy", "held_out_margin",
                              "held_out_likelihood_accuracy"))
    summary = {f"{k}_{when}": ev.metrics.get(k)
               for k in ("held_out_pref_accuracy", "held_out_margin", "held_out_likelihood_accuracy",
                         "held_out_answer_accuracy")
               for when, ev in (("start", r.eval_start), ("end", r.eval_end))}
    summary.update(plot=str(plot), **r.summary())
    write_json(r.out_dir / "summary.json", summary)
    pct, num = (lambda x: fmt_or_dash(x, ".1%")), (lambda x: fmt_or_dash(x, ".3f"))
    print(f"\nDPO held-out preference accuracy (implicit reward > 0): {pct(summary['held_out_pref_accuracy_start'])}"
          f" -> {pct(summary['held_out_pref_accuracy_end'])}; reward margin {num(summary['held_out_margin_start'])}"
          f" -> {num(summary['held_out_margin_end'])}; policy ranks chosen first "
          f"{pct(summary['held_out_likelihood_accuracy_start'])} -> {pct(summary['held_out_likelihood_accuracy_end'])}"
          + (f"; answer accuracy {pct(summary['held_out_answer_accuracy_start'])} -> "
             f"{pct(summary['held_out_answer_accuracy_end'])}" if answers else "")
          + f"; loop {r.seconds['train']:.0f}s; plot {plot}; run dir {r.out_dir}")
    return summary


def main(argv: list[str] | None = None) -> int:
    return cli(run, parse_args(argv), "dpo")


if __name__ == "__main__":
    sys.exit(main())
