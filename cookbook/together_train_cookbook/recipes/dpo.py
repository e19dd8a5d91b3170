"""Direct preference optimisation (DPO; Rafailov et al. 2023, arXiv:2305.18290) through a
together-train resource, with the loss computed in the client.

    python -m together_train_cookbook.recipes.dpo [--data pairs.jsonl] [--init-from runs/sft-...] ...

On the embedded model, from a short SFT start (each command launches its own local resource;
the run dir's checkpoint is copied into the DPO run's storage):

    python -m together_train_cookbook.recipes.sft --steps 10 --out-dir runs/sft10   # 0 % -> 38 %
    python -m together_train_cookbook.recipes.dpo --init-from runs/sft10             # 38 % -> 60 %

(numbers in `Config`). From the base model (plain ``dpo``), which answers with a sentence the
strict checker rejects, the online pairs (bare answer chosen over its own sentence) teach the
format as well: 0 % -> 36 % in the default 30 steps.

Reads top to bottom:

1. codec; preference pairs: for the generated arithmetic task, chosen = the correct answer and
   rejected = a wrong number (the answer plus a seeded offset from ±1, ±2, ±10), or with
   ``--rejected sampled`` the policy's own wrong answer sampled at that step (online DPO, see
   `on_policy_rejected`); or ``--data`` JSONL of ``{"prompt": str | [messages], "chosen": str,
   "rejected": str}``;
   each response is rendered with the chat template into a ``cross_entropy``-layout sample
   whose weights mark the response tokens (`conversation_to_sample`);
2. a resource and two sessions: the *policy* (fresh, ``--init-from`` a training checkpoint, or
   ``--resume``) and a frozen *reference* session that is never stepped (same start weights:
   the base model for a fresh run, the init checkpoint otherwise); reference logprobs come from
   ``reference.forward(..., return_logprobs=True)``;
3. each step k (pairs drawn with a generator seeded by (seed, k)): reference sums
   ``ref = Σ_t w_t·p_ref,t`` per response; `custom_loss.forward_backward_custom` with
   `custom_loss.dpo_loss`: ``forward`` gives the policy's per-token logprobs, the client computes
   ``z = beta·((pi_c - ref_c) - (pi_r - ref_r))``, ``L = -Σ log σ(z)`` (sum over pairs) and
   ``dL/dp``, and ``custom_forward_backward`` backpropagates it; then ``optim_step``;
4. metrics per step: loss per pair, preference accuracy (z > 0), reward margin
   ``mean((pi_c - ref_c) - (pi_r - ref_r))``, chosen / rejected rewards ``beta·(pi - ref)``;
   every ``--eval-every`` steps on the held-out pairs: preference accuracy (z > 0; exactly 0 at
   the start, where policy = reference and every margin is 0), reward margin, and the
   reference-free ranking accuracy ``pi_c > pi_r``; for the arithmetic task also the greedy
   held-out answer accuracy (strict checker) at start and end;
5. ``save_state`` every ``--save-every`` steps, ``--resume``, ``save_weights`` at the end,
   ``metrics.jsonl``, ``dpo.png``, ``summary.json``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import together_train as tt

from together_train_cookbook.codec import Codec
from together_train_cookbook.custom_loss import dpo_loss, forward_backward_custom, sequence_logprobs
from together_train_cookbook.metrics import write_json
from together_train_cookbook.plotting import plot_metrics
from together_train_cookbook.problems import arithmetic_problem
from together_train_cookbook.checkpoint_refs import explain_not_found, resolve_init_from
from together_train_cookbook.cli import ConfigError, cli, parse_config, validate
from together_train_cookbook.connection import connect, local_storage, stop_on_exit, stop_quietly
from together_train_cookbook.display import progress
from together_train_cookbook.evaluation import evaluate
from together_train_cookbook.jsonl import prompt_messages, read_jsonl
from together_train_cookbook.run_state import open_run, resume_metrics
from together_train_cookbook.tokenizer import load_codec
from together_train_cookbook.samples import conversation_to_sample
from together_train_cookbook.tasks import ArithmeticExample, ArithmeticTask, check, format_answer


@dataclass
class Config:
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
    """

    data: str | None = field(default=None, metadata={"help": 'JSONL of {"prompt","chosen","rejected"}; default: arithmetic'})
    model: str | None = field(default=None, metadata={"help": "local HF model dir; default: embedded SmolLM2-135M"})
    address: str | None = field(default=None, metadata={"help": "host:port of a running resource; default: local"})
    api_key: str | None = field(default=None, metadata={"help": "API key for --address"})
    generators: int = field(default=1, metadata={"help": "generator replicas of a local resource"})
    dtype: str | None = field(default=None, metadata={"help": "model dtype of a local resource"})
    init_from: str | None = field(default=None, metadata={"help": "training checkpoint URI or run dir (policy and reference start)"})
    resume: bool = field(default=False, metadata={"help": "continue from the last save_state in --out-dir"})
    lora_rank: int = field(default=16, metadata={"help": "LoRA rank (fresh sessions)"})
    lora_alpha: float = field(default=32.0, metadata={"help": "LoRA alpha (fresh sessions)"})
    rejected: str = field(default="auto", metadata={
        "help": "rejected replies: the pairs' own (given: for the arithmetic task the answer plus a seeded "
                "offset), or the policy's own wrong answer sampled at this step (sampled: online DPO, arithmetic "
                "task only; the given one when all samples are right); auto = sampled for the arithmetic task, "
                "given for --data",
        "choices": ("auto", "given", "sampled")})
    num_samples: int = field(default=4, metadata={"help": "--rejected sampled: completions per prompt (temperature 1)"})
    max_tokens: int = field(default=8, metadata={"help": "--rejected sampled: max new tokens per completion"})
    beta: float = field(default=0.1, metadata={"help": "DPO temperature beta"})
    learning_rate: float = field(default=2e-4, metadata={"help": "AdamW learning rate (constant)"})
    steps: int = field(default=30, metadata={"help": "optimizer steps (0 = evaluate the start, save it)"})
    batch_size: int = field(default=8, metadata={"help": "pairs per step"})
    max_length: int = field(default=512, metadata={"help": "truncate rendered chats to this many tokens"})
    train_examples: int = field(default=2000, metadata={"help": "arithmetic task: training pairs"})
    eval_examples: int = field(default=100, metadata={"help": "held-out pairs / prompts (100 = the sft recipe's evaluation set)"})
    eval_every: int = field(default=15, metadata={"help": "held-out preference accuracy every N steps (0 = end only)"})
    eval_max_tokens: int = field(default=8, metadata={"help": "max new tokens of the greedy answer accuracy"})
    min_digits: int = field(default=2, metadata={"help": "arithmetic task: smallest operand digits"})
    max_digits: int = field(default=2, metadata={"help": "arithmetic task: largest operand digits"})
    seed: int = field(default=0, metadata={"help": "pairs, wrong answers, LoRA init, held-out split"})
    save_every: int = field(default=10, metadata={"help": "save_state every N steps (0 = only at the end)"})
    stop_after: int = field(default=0, metadata={"help": "(testing) stop after N steps of this run, as if killed", "hidden": True})
    out_dir: str | None = field(default=None, metadata={"help": "default runs/dpo-<timestamp>"})
    adapter_name: str = field(default="dpo-final", metadata={"help": "name of the saved adapter"})

    def check(self) -> None:
        """DPO's own settings (`cli.validate` runs this before the shared checks)."""
        if self.rejected == "sampled" and self.data is not None:
            raise ConfigError(f"--rejected sampled needs a checker: the arithmetic task (no --data); "
                              f"with --data {self.data} use --rejected given (or auto)")


def parse_args(argv: list[str] | None = None) -> Config:
    return parse_config(Config, argv, "python -m together_train_cookbook.recipes.dpo", __doc__)


@dataclass
class Pair:
    """A prompt (messages up to the assistant turn) with a preferred and a dispreferred reply."""

    prompt: list[dict[str, Any]]
    chosen: str
    rejected: str
    example: ArithmeticExample | None = None


def wrong_answer(ex: ArithmeticExample, seed: int) -> str:
    """A wrong answer for `ex`, seeded by (seed, problem): answer + one of ±1, ±2, ±10 (>= 0)."""
    rng = random.Random(f"dpo-{seed}-{ex.a}{ex.op}{ex.b}")
    offsets = [d for d in (-10, -2, -1, 1, 2, 10) if ex.answer + d >= 0]
    return format_answer(ex.answer + rng.choice(offsets))


def load_pairs(path: str | os.PathLike) -> list[Pair]:
    """Read ``{"prompt": str | [messages], "chosen": str, "rejected": str}`` lines."""
    out = []
    for lineno, rec in read_jsonl(path):
        if not isinstance(rec, dict) or not {"prompt", "chosen", "rejected"} <= set(rec):
            raise ValueError(f'{path}:{lineno}: expected {{"prompt", "chosen", "rejected"}}')
        out.append(Pair(prompt_messages(rec["prompt"]), str(rec["chosen"]), str(rec["rejected"])))
    if not out:
        raise ValueError(f"{path}: no pairs")
    return out


def make_pairs(cfg: Config) -> tuple[list[Pair], list[Pair], str]:
    """(train, held-out, description)."""
    if cfg.data is None:
        task = ArithmeticTask(cfg.min_digits, cfg.max_digits)
        train, test = task.splits(min(cfg.train_examples, task.num_problems - cfg.eval_examples),
                                  cfg.eval_examples, seed=cfg.seed)
        mk = lambda ex: Pair(ex.prompt_messages(), ex.reference_response(), wrong_answer(ex, cfg.seed), ex)  # noqa: E731
        return [mk(e) for e in train], [mk(e) for e in test], f"arithmetic pairs: {len(train)} train / {len(test)} test"
    pairs = load_pairs(cfg.data)
    n_eval = min(cfg.eval_examples, len(pairs) // 5)
    order = list(range(len(pairs)))
    random.Random(cfg.seed).shuffle(order)
    return ([pairs[i] for i in order[n_eval:]], [pairs[i] for i in order[:n_eval]],
            f"{cfg.data}: {len(pairs) - n_eval} train / {n_eval} held-out pairs")


def pair_samples(codec: Codec, pairs: list[Pair], max_length: int) -> list[tt.Sample]:
    """``[chosen_0, rejected_0, chosen_1, ...]`` samples, weights = the response's tokens."""
    out = []
    for p in pairs:
        for reply in (p.chosen, p.rejected):
            out.append(conversation_to_sample(codec, p.prompt + [{"role": "assistant", "content": reply}], max_length))
    return out


def step_pairs(train: list[Pair], cfg: Config, step: int) -> list[Pair]:
    rng = random.Random(f"dpo-{cfg.seed}-{step}")
    return [train[i] for i in rng.sample(range(len(train)), min(cfg.batch_size, len(train)))]


def on_policy_rejected(session: tt.Session, codec: Codec, pairs: list[Pair], cfg: Config,
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


def preference_stats(pi: np.ndarray, ref: np.ndarray, beta: float) -> dict[str, float]:
    """From per-sample sums ordered chosen, rejected, ...: preference accuracy, reward margin
    ``mean((pi_c - ref_c) - (pi_r - ref_r))``, chosen / rejected rewards ``beta·(pi - ref)``."""
    d = pi - ref
    margin = d[0::2] - d[1::2]
    return {"accuracy": float((margin > 0).mean()), "margin": float(margin.mean()),
            "chosen_reward": float(beta * d[0::2].mean()), "rejected_reward": float(beta * d[1::2].mean())}


def run(cfg: Config, client: tt.ResourceClient | None = None) -> dict[str, Any]:
    """Run DPO as configured; returns the summary dict (also written to summary.json)."""
    validate(cfg)  # bad values: ConfigError (a ValueError) before anything is created
    t_start = time.time()
    out_dir = Path(cfg.out_dir or f"runs/dpo-{time.strftime('%Y%m%d-%H%M%S')}")
    # --resume: the saved config.json must agree (init_from, beta, ...); then config.json
    states, last = open_run(cfg, out_dir, "dpo")

    # 1. codec and pairs
    online = cfg.rejected == "sampled" or (cfg.rejected == "auto" and cfg.data is None)
    codec = load_codec(cfg.model)
    train, test, desc = make_pairs(cfg)
    test_samples = pair_samples(codec, test, cfg.max_length)
    eval_items = [arithmetic_problem(p.example).eval_item() for p in test if p.example is not None]
    print(f"data: {desc}; {cfg.steps} steps x {cfg.batch_size} pairs, beta {cfg.beta}, rejected replies: "
          f"{'sampled from the policy (online)' if online else 'given'}", flush=True)

    # a run dir's checkpoint is copied into this run's local storage when we launch the resource
    init_uri = resolve_init_from(cfg.init_from, local_storage(cfg, out_dir, client)) if cfg.init_from else None

    def init_not_found() -> Any:  # NOT_FOUND for the init checkpoint: say where it lives
        return (explain_not_found("--init-from", cfg.init_from, init_uri, cfg.address, out_dir) if init_uri
                else contextlib.nullcontext())

    with connect(cfg, out_dir, client) as client, contextlib.ExitStack() as stack:
        # 2. policy and frozen reference sessions, stopped however the run ends
        lora = tt.LoraConfig(rank=cfg.lora_rank, alpha=cfg.lora_alpha, seed=cfg.seed)
        if last is not None:
            policy = client.create_session(checkpoint_uri=last["uri"], with_optimizer=True, name="dpo")
            start = int(last["step"])
            print(f"resumed from {last['uri']} at step {start}", flush=True)
        else:
            with init_not_found():
                policy = client.create_session(lora=None if init_uri else lora, checkpoint_uri=init_uri, name="dpo")
            start = 0
        stop_on_exit(stack, policy)
        with init_not_found():
            reference = client.create_session(lora=None if init_uri else lora, checkpoint_uri=init_uri,
                                              name="dpo-ref")
        stop_on_exit(stack, reference)
        ref_test = sequence_logprobs(reference, test_samples) if test_samples else np.zeros(0)
        metrics = resume_metrics(out_dir / "metrics.jsonl", start)

        def held_out() -> dict[str, float]:
            """Held-out pairs under the current policy: ``pref_accuracy`` (implicit reward
            z > 0, DPO's own readout; 0 at the start where policy = reference), ``margin``
            (mean reward margin), ``likelihood_accuracy`` (pi_c > pi_r: the policy itself
            ranks the chosen reply higher, reference-free)."""
            if not test_samples:
                return {}
            pi = sequence_logprobs(policy, test_samples)
            st = preference_stats(pi, ref_test, cfg.beta)
            return {"held_out_pref_accuracy": st["accuracy"], "held_out_margin": st["margin"],
                    "held_out_likelihood_accuracy": float((pi[0::2] > pi[1::2]).mean())}

        answer_start = None
        if start == 0:
            first = held_out()
            if eval_items:
                policy.weights_sync().result()
                answer_start, _ = evaluate(policy, codec, eval_items, cfg.eval_max_tokens)
            metrics.log(step=-1, **first, held_out_answer_accuracy=answer_start)
        else:
            first = next((r for r in metrics.records if r.get("step") == -1), {})
            answer_start = first.get("held_out_answer_accuracy")
        # the latest held-out readout so far (a resumed finished run reports its end)
        last_eval = dict(next((r for r in reversed(metrics.records) if "held_out_pref_accuracy" in r), first))

        # 3-4. the loop
        bar = progress(cfg.steps, "dpo", initial=start)
        t_loop, stopped = time.time(), False
        if online:
            policy.weights_sync().result()
        for k in range(start, cfg.steps):
            t0 = time.time()
            pairs, sampled = step_pairs(train, cfg, k), {}
            if online:
                pairs, sampled = on_policy_rejected(policy, codec, pairs, cfg, k)
            samples = pair_samples(codec, pairs, cfg.max_length)
            ref = sequence_logprobs(reference, samples)
            res = forward_backward_custom(policy, samples, dpo_loss(ref[0::2], ref[1::2], cfg.beta))
            opt = policy.optim_step(tt.AdamParams(learning_rate=cfg.learning_rate)).result()
            if online:
                policy.weights_sync()  # a future: the next step's samples come from this version
            w = [s.loss_fn_inputs["weights"].astype(np.float64) for s in samples]
            pi = np.array([float(np.dot(wi, lp)) for wi, lp in zip(w, res.logprobs)])
            st = preference_stats(pi, ref, cfg.beta)
            rec: dict[str, Any] = {"loss": res.loss / (len(samples) // 2), **st, **sampled, "grad_norm": opt.grad_norm}
            done = k + 1
            if (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.steps:
                last_eval = held_out()
                rec.update(last_eval)
            rec["seconds"] = time.time() - t0
            metrics.log(step=k, **rec)
            if bar is not None:
                bar.set_postfix(loss=f"{rec['loss']:.3f}", acc=f"{st['accuracy']:.2f}")
                bar.update(1)
            if cfg.save_every and done % cfg.save_every == 0 and done < cfg.steps:
                states.save(policy, done)
            if cfg.stop_after and done - start >= cfg.stop_after and done < cfg.steps:
                stopped = True
                break
        if bar is not None:
            bar.close()
        metrics.close()
        loop_s = time.time() - t_loop
        stop_quietly(reference)
        if stopped:
            stop_quietly(policy)
            return {"stopped_at": done}
        answer_end = None
        if eval_items:
            policy.weights_sync().result()
            answer_end, _ = evaluate(policy, codec, eval_items, cfg.eval_max_tokens)
        ckpt = policy.save_weights(f"{cfg.adapter_name}-{policy.id[:8]}").result()
        final = states.save(policy, cfg.steps)
        stop_quietly(policy)

    plot = plot_metrics(metrics.records, out_dir / "dpo.png",
                        keys=("loss", "accuracy", "margin", "held_out_pref_accuracy", "held_out_margin",
                              "held_out_likelihood_accuracy"), title=f"DPO (beta {cfg.beta})")
    summary = {
        "held_out_pref_accuracy_start": first.get("held_out_pref_accuracy"),
        "held_out_pref_accuracy_end": last_eval.get("held_out_pref_accuracy"),
        "held_out_margin_start": first.get("held_out_margin"),
        "held_out_margin_end": last_eval.get("held_out_margin"),
        "held_out_likelihood_accuracy_start": first.get("held_out_likelihood_accuracy"),
        "held_out_likelihood_accuracy_end": last_eval.get("held_out_likelihood_accuracy"),
        "held_out_answer_accuracy_start": answer_start,
        "held_out_answer_accuracy_end": answer_end,
        "init_from": init_uri,
        "steps": cfg.steps,
        "adapter_uri": ckpt.uri,
        "adapter_path": ckpt.path,
        "state_uri": final["uri"],
        "plot": str(plot),
        "metrics": str(out_dir / "metrics.jsonl"),
        "seconds": {"loop": loop_s, "total": time.time() - t_start},
    }
    write_json(out_dir / "summary.json", summary)

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    print(f"\nDPO held-out preference accuracy (implicit reward > 0): "
          f"{pct(summary['held_out_pref_accuracy_start'])} -> {pct(summary['held_out_pref_accuracy_end'])}; "
          f"reward margin {num(summary['held_out_margin_start'])} -> {num(summary['held_out_margin_end'])}; "
          f"policy ranks chosen first {pct(summary['held_out_likelihood_accuracy_start'])} -> "
          f"{pct(summary['held_out_likelihood_accuracy_end'])}"
          + (f"; answer accuracy {pct(answer_start)} -> {pct(answer_end)}" if eval_items else "")
          + f"; loop {loop_s:.0f}s; plot {plot}; run dir {out_dir}")
    return summary


def main(argv: list[str] | None = None) -> int:
    return cli(run, parse_args(argv), "dpo")


if __name__ == "__main__":
    sys.exit(main())
