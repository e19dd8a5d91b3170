"""Reinforcement learning with verifiable rewards (GRPO-style) through a together-train resource.

    python -m together_train_cookbook.recipes.rl [--init-from runs/sft-...] [--steps 20] [--async-mode] ...

Reads top to bottom:

1. codec of the model's chat template; problems: the generated arithmetic task (reward 1 when
   the strict checker accepts the answer, else 0), or ``--data prompts.jsonl`` of
   ``{"prompt": ..., "answer": ...}`` (exact match); a held-out split for accuracy;
2. a resource (``--address`` or `launch_local`) and a LoRA session: fresh, from a training
   checkpoint (``--init-from`` URI or an SFT run dir, e.g. the SFT recipe's out dir), or from the
   last checkpoint of this out dir (``--resume``);
3. each step k: ``batch_size`` prompts (drawn with a generator seeded by (seed, k)), each
   sampled ``num_samples`` times (a *group*; sampler seed derived from (seed, k, prompt index),
   so a run is reproducible and a resumed run continues exactly);
4. rewards -> group-normalised advantages (`rl_math.group_advantages`: ``r - mean(group)``,
   optionally ``/ std``); groups with all-equal rewards carry no signal and are not trained;
5. ``forward_backward`` with the chosen loss (``importance_sampling``, ``ppo``, ``cispo``, ``grpo``)
   on policy samples built by `build_policy_sample` (prompt tokens masked out, q = the sampler's
   logprobs, A broadcast over the completion), ``optim_step``, ``weights_sync`` every step;
6. metrics per step to ``metrics.jsonl``: ``reward`` (mean over the batch's samples),
   ``kl_sampler`` (KL to the sampler, `rl_math.kl_and_entropy`), ``entropy``, ``loss``,
   ``staleness``, the learning signal (``frac_groups_with_signal``, ``frac_groups_solved``,
   ``frac_groups_unsolved``, ``trained_samples``) and a time profile (``sample_seconds``: the loop
   waited for its rollouts; ``sampling_seconds``: submission -> last sample; ``train_seconds``:
   forward_backward + optim_step; ``weights_sync_seconds``: the previous step's push);
   ``held_out_accuracy`` (greedy, the strict checker) every ``--eval-every`` steps (1 = every
   step; each is a full pass over the held-out prompts) and at the end; ``save_state`` every
   ``--save-every`` steps; ``save_weights`` and a final ``save_state`` at the end; ``rl.png``
   with the curves.

Asynchronous mode (``--async-mode``): the samples for step k+1 are requested right after step
k's samples arrive, before step k's ``forward_backward`` is submitted, so the generator samples
batch k+1 while the trainer trains on batch k. Batch k+1 then comes from policy version
``v0 + k`` (the ``weights_sync`` issued at the end of step k-1, which is a future the loop never
waits on) and is trained at version ``v0 + k + 1``: one step stale. Every sampled token carries
the version that produced it (``SampleResult.policy_version`` / ``version_spans``; logged as
``staleness``). The off-policy correction is the importance ratio the losses already use:
q = the behaviour (sampler) policy's logprob, p = the current policy's, ``r = exp(p - q)``
reweights each token from the sampler's distribution to the current policy's
(``importance_sampling``: ``-Σ r·A``; ``ppo`` / ``grpo`` clip r, ``cispo`` clips the stop-gradient
weight), so stale samples give an unbiased (or clipped) policy gradient. In synchronous mode
r = 1 up to the trainer/sampler numeric gap (``kl_sampler`` ~ 0).

Loss scale: the resource returns sums over tokens (``importance_sampling``/``ppo``/``cispo``), or
``grpo``'s normalised aggregate; Adam is nearly invariant to the overall scale.

The sampler logprobs are of the temperature-scaled distribution (``--temperature``; keep 1.0 so
q and p describe the same distribution).
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import together_train as tt

from together_train_cookbook.codec import Codec
from together_train_cookbook.metrics import write_json
from together_train_cookbook.plotting import plot_metrics
from together_train_cookbook.problems import Problem, make_problems
from together_train_cookbook.checkpoint_refs import explain_not_found, resolve_init_from
from together_train_cookbook.cli import ConfigError, cli, parse_config, validate
from together_train_cookbook.connection import connect, local_storage, stop_on_exit, stop_quietly
from together_train_cookbook.display import fmt_or_dash, progress
from together_train_cookbook.evaluation import evaluate
from together_train_cookbook.run_state import open_run, resume_metrics
from together_train_cookbook.tokenizer import load_codec
from together_train_cookbook.rl_math import group_advantages, kl_and_entropy
from together_train_cookbook.samples import build_policy_sample

LOSSES = ("importance_sampling", "ppo", "cispo", "grpo")


@dataclass
class Config:
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
    model: str | None = field(default=None, metadata={"help": "local HF model dir; default: embedded SmolLM2-135M"})
    address: str | None = field(default=None, metadata={"help": "host:port of a running resource; default: local"})
    api_key: str | None = field(default=None, metadata={"help": "API key for --address"})
    generators: int = field(default=1, metadata={"help": "generator replicas of a local resource"})
    dtype: str | None = field(default=None, metadata={"help": "model dtype of a local resource"})
    init_from: str | None = field(
        default=None, metadata={"help": "training checkpoint URI or SFT run dir to start from (fresh optimizer)"}
    )
    resume: bool = field(default=False, metadata={"help": "continue from the last save_state in --out-dir"})
    lora_rank: int = field(default=16, metadata={"help": "LoRA rank (fresh sessions)"})
    lora_alpha: float = field(default=32.0, metadata={"help": "LoRA alpha (fresh sessions)"})
    loss: str = field(default="importance_sampling", metadata={"help": "policy loss", "choices": LOSSES})
    loss_config: str = field(default="", metadata={"help": 'loss parameters as JSON, e.g. {"clip_high_threshold": 1.3}'})
    learning_rate: float = field(default=1e-4, metadata={"help": "AdamW learning rate (constant)"})
    grad_clip_norm: float = field(default=0.0, metadata={"help": "0 = off"})
    steps: int = field(default=20, metadata={"help": "optimizer steps (0 = evaluate the start, save it)"})
    batch_size: int = field(default=8, metadata={"help": "prompts per step"})
    num_samples: int = field(default=8, metadata={"help": "completions per prompt (group size)"})
    scale_by_std: bool = field(default=False, metadata={"help": "divide advantages by the group std (GRPO); off = Dr. GRPO"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature"})
    max_tokens: int = field(default=8, metadata={"help": "max new tokens per completion"})
    async_mode: bool = field(default=False, metadata={"help": "sample step k+1 while training step k (1-step off-policy)"})
    train_examples: int = field(default=2000, metadata={"help": "training prompts (arithmetic task)"})
    eval_examples: int = field(default=100, metadata={"help": "held-out prompts"})
    eval_every: int = field(default=5, metadata={"help": "held-out accuracy every N steps (and at the end); 0 = end only"})
    eval_at_start: bool = field(default=True, metadata={"help": "evaluate before the first step"})
    eval_max_tokens: int = field(default=8, metadata={"help": "max new tokens when evaluating (greedy)"})
    min_digits: int = field(default=2, metadata={"help": "arithmetic task: smallest operand digits"})
    max_digits: int = field(default=2, metadata={"help": "arithmetic task: largest operand digits"})
    seed: int = field(default=0, metadata={"help": "prompts, sampler seeds, LoRA init, held-out split"})
    save_every: int = field(default=10, metadata={"help": "save_state every N steps (0 = only at the end)"})
    stop_after: int = field(default=0, metadata={"help": "(testing) stop after N steps of this run, as if killed", "hidden": True})
    out_dir: str | None = field(default=None, metadata={"help": "default runs/rl-<timestamp>"})
    adapter_name: str = field(default="rl-final", metadata={"help": "name of the saved adapter"})

    def check(self) -> None:
        """RL's own settings (`cli.validate` runs this before the shared checks)."""
        if self.loss not in LOSSES:
            raise ConfigError(f"--loss {self.loss}: must be one of {', '.join(LOSSES)}")


def parse_args(argv: list[str] | None = None) -> Config:
    return parse_config(Config, argv, "python -m together_train_cookbook.recipes.rl", __doc__)


# -- rollouts -----------------------------------------------------------------------------


def step_problems(train: list[Problem], cfg: Config, step: int) -> list[int]:
    """Indices of the prompts of `step` (a generator seeded by (seed, step): no state carried)."""
    rng = random.Random(f"rl-{cfg.seed}-{step}")
    return rng.sample(range(len(train)), min(cfg.batch_size, len(train)))


def sampler_seed(seed: int, step: int, j: int) -> int:
    """Sampler seed of prompt j of `step`; its `num_samples` streams use (seed, i) server-side."""
    return (seed * 1_000_003 + step * 10_007 + j) % (2**31 - 1)


def submit_rollouts(session: tt.Session, codec: Codec, train: list[Problem], cfg: Config, step: int) -> dict[str, Any]:
    """Submit the sample requests of `step` (returns at once)."""
    idx = step_problems(train, cfg, step)
    futs = []
    for j, i in enumerate(idx):
        params = tt.SamplingParams(
            max_tokens=cfg.max_tokens, temperature=cfg.temperature, seed=sampler_seed(cfg.seed, step, j),
            stop_token_ids=codec.stop_token_ids, stop=codec.stop_strings,
        )
        prompt = codec.build_generation_prompt(train[i].messages)
        futs.append((i, prompt, session.sample(prompt, params, num_samples=cfg.num_samples)))
    done_at: list[float] = []  # client-side completion times (profile only)
    for _, _, f in futs:
        f.add_done_callback(lambda _f: done_at.append(time.time()))
    return {"step": step, "futures": futs, "submitted_at": time.time(), "done_at": done_at}


def collect_rollouts(pending: dict[str, Any], codec: Codec, train: list[Problem]) -> dict[str, Any]:
    """Wait for a step's samples; grade them. Returns a JSON-serialisable batch:
    ``{"step", "groups": [{"problem", "prompt", "tokens": [[...]], "logprobs": [[...]],
    "rewards": [...], "version": v}]}``."""
    groups = []
    for i, prompt, fut in pending["futures"]:
        res = fut.result()
        seqs = res.sequences
        rewards = [train[i].reward(codec.parse_response(s.tokens)) for s in seqs]
        versions = {sp.policy_version for s in seqs for sp in s.version_spans} or {res.policy_version}
        groups.append({
            "problem": i, "prompt": list(prompt), "tokens": [list(s.tokens) for s in seqs],
            "logprobs": [list(s.logprobs) for s in seqs], "rewards": rewards, "version": min(versions),
        })
    # wall time from submission to the last group's samples (they may have queued behind a sync)
    span = max(pending["done_at"], default=time.time()) - pending["submitted_at"]
    return {"step": pending["step"], "groups": groups, "sampling_seconds": span}


def group_stats(batch: dict[str, Any]) -> dict[str, float]:
    """How much learning signal a batch carries (rewards are 0/1 here, `Problem.reward`): the
    fraction of groups whose rewards are not all equal (``frac_groups_with_signal``; only those
    are trained: equal rewards give A = 0), all 1 (``frac_groups_solved``) and all 0
    (``frac_groups_unsolved``)."""
    rewards = [np.asarray(g["rewards"], np.float64) for g in batch["groups"]]
    signal = [bool(np.ptp(r) > 0) for r in rewards]
    return {
        "groups_with_signal": int(sum(signal)),
        "frac_groups_with_signal": float(np.mean(signal)),
        "frac_groups_solved": float(np.mean([bool(np.all(r == 1.0)) for r in rewards])),
        "frac_groups_unsolved": float(np.mean([bool(np.all(r == 0.0)) for r in rewards])),
    }


def build_samples(batch: dict[str, Any], cfg: Config) -> tuple[list[tt.Sample], list[np.ndarray]]:
    """Policy samples of the groups with any advantage != 0, and their completion masks
    (per position, [n_i]). Sample ``prompt + completion``: q = 0 and mask = 0 on the prompt,
    the sampler logprobs and mask = 1 on the completion, A = the sample's group advantage."""
    samples, masks = [], []
    for g in batch["groups"]:
        adv = group_advantages(g["rewards"], cfg.scale_by_std)
        if not np.any(adv != 0):
            continue
        for toks, lps, a in zip(g["tokens"], g["logprobs"], adv):
            if not toks:
                continue
            n_p = len(g["prompt"])
            full = g["prompt"] + toks
            mask = [0.0] * n_p + [1.0] * len(toks)
            s = build_policy_sample(full, [0.0] * n_p + list(lps), float(a), mask=mask)
            samples.append(s)
            masks.append(s.loss_fn_inputs["mask"])
    return samples, masks


# -- main ------------------------------------------------------------------------------


def run(
    cfg: Config,
    client: tt.ResourceClient | None = None,
    problems: tuple[list[Problem], list[Problem]] | None = None,
) -> dict[str, Any]:
    """Run RL as configured; returns the summary dict (also written to summary.json).

    Args:
        client: an already connected resource (left open), e.g. from `recipes.main`;
            default: ``--address`` or a local resource.
        problems: (train, held-out) `Problem` lists with any checker (library use);
            default: from ``--data`` / the arithmetic task.
    """
    validate(cfg)  # bad values (loss, steps, --loss-config, ...): ConfigError before anything is created
    t_start = time.time()
    out_dir = Path(cfg.out_dir or f"runs/rl-{time.strftime('%Y%m%d-%H%M%S')}")
    # --resume: the saved config.json must agree (init_from, loss, lr, ...); then config.json
    states, last = open_run(cfg, out_dir, "rl")
    loss_config = json.loads(cfg.loss_config) if cfg.loss_config else None

    # 1. codec and problems
    codec = load_codec(cfg.model)
    if problems is not None:
        train, test = problems
        desc = f"{len(train)} train / {len(test)} held-out prompts (given)"
    else:
        train, test, desc = make_problems(cfg.data, cfg.train_examples, cfg.eval_examples, cfg.seed,
                                          cfg.min_digits, cfg.max_digits)
    eval_items = [p.eval_item() for p in test]
    print(f"data: {desc}; {cfg.steps} steps x {cfg.batch_size} prompts x {cfg.num_samples} samples"
          f" ({'async' if cfg.async_mode else 'sync'}, loss {cfg.loss})", flush=True)

    # a run dir's checkpoint is copied into this run's local storage when we launch the resource
    init_uri = resolve_init_from(cfg.init_from, local_storage(cfg, out_dir, client)) if cfg.init_from else None
    with connect(cfg, out_dir, client) as client, contextlib.ExitStack() as stack:
        # 2. session: resumed, initialised from a checkpoint, or fresh; stopped however the run ends
        if last is not None:
            session = client.create_session(checkpoint_uri=last["uri"], with_optimizer=True, name="rl")
            start, version0 = int(last["step"]), int(last["extra"]["version0"])
            print(f"resumed from {last['uri']} at step {start}", flush=True)
        elif init_uri:
            with explain_not_found("--init-from", cfg.init_from, init_uri, cfg.address, out_dir):
                session = client.create_session(checkpoint_uri=init_uri, name="rl")
            start, version0 = 0, session.info().step
        else:
            session = client.create_session(
                lora=tt.LoraConfig(rank=cfg.lora_rank, alpha=cfg.lora_alpha, seed=cfg.seed), name="rl")
            start, version0 = 0, 0
        stop_on_exit(stack, session)
        session.weights_sync().result()
        metrics = resume_metrics(out_dir / "metrics.jsonl", start)

        acc_start = None
        if start == 0 and cfg.eval_at_start:
            acc_start, _ = evaluate(session, codec, eval_items, cfg.eval_max_tokens)
            metrics.log(step=-1, held_out_accuracy=acc_start)
            print(f"accuracy at start: {acc_start:.1%} ({len(eval_items)} prompts)", flush=True)
        elif start > 0:
            acc_start = next((r["held_out_accuracy"] for r in metrics.records if r.get("step") == -1), None)

        # 3-6. the loop
        ready = last["extra"].get("rollouts") if last is not None else None  # async: batch `start`, sampled earlier
        pending = None if ready is not None or start >= cfg.steps else submit_rollouts(session, codec, train, cfg, start)
        bar = progress(cfg.steps, "rl", initial=start)
        t_loop, stopped, acc, sync = time.time(), False, None, None
        for k in range(start, cfg.steps):
            t0 = time.time()
            if ready is None and pending is None:  # sync mode: sample now, from the version just synced
                pending = submit_rollouts(session, codec, train, cfg, k)
            batch = ready if ready is not None else collect_rollouts(pending, codec, train)
            ready, pending = None, None
            t_sampled = time.time()
            if cfg.async_mode and k + 1 < cfg.steps:  # batch k+1 samples while step k trains
                pending = submit_rollouts(session, codec, train, cfg, k + 1)
            samples, masks = build_samples(batch, cfg)
            fb = opt = None
            t_fb = time.time()
            if samples:
                fb = session.forward_backward(samples, cfg.loss, loss_config, return_logprobs=True)
                opt = session.optim_step(tt.AdamParams(learning_rate=cfg.learning_rate,
                                                       grad_clip_norm=cfg.grad_clip_norm))
            prev_sync, sync = sync, session.weights_sync()  # a future; the next sample request waits for it
            rewards = [r for g in batch["groups"] for r in g["rewards"]]
            rec: dict[str, Any] = {
                "reward": float(np.mean(rewards)),
                "trained_samples": len(samples),
                **group_stats(batch),
                "response_tokens": float(np.mean([len(t) for g in batch["groups"] for t in g["tokens"]])),
                "sampler_version": min(g["version"] for g in batch["groups"]) - version0,
            }
            if fb is not None:
                fb_res, opt_res = fb.result(), opt.result()
                rec["train_seconds"] = time.time() - t_fb  # submit -> optimizer step done (client view)
                kl, ent = kl_and_entropy([s.loss_fn_inputs["logprobs"] for s in samples], fb_res.logprobs, masks)
                rec.update(loss=fb_res.loss, kl_sampler=kl, entropy=ent, grad_norm=opt_res.grad_norm,
                           staleness=(opt_res.step - 1 - version0) - rec["sampler_version"],
                           **{k2: v for k2, v in fb_res.metrics.items() if k2.endswith(":mean")})
            rec["sample_seconds"] = t_sampled - t0  # the loop waited this long for its rollouts
            if batch.get("sampling_seconds") is not None:  # submission -> last sample (overlaps training in async)
                rec["sampling_seconds"] = batch["sampling_seconds"]
            if prev_sync is not None and prev_sync.done() and prev_sync.exception() is None:
                rec["weights_sync_seconds"] = prev_sync.result().seconds  # the previous step's push (server side)
            done = k + 1
            if (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.steps:
                t_eval = time.time()
                acc, _ = evaluate(session, codec, eval_items, cfg.eval_max_tokens)
                rec["held_out_accuracy"] = acc
                rec["eval_seconds"] = time.time() - t_eval
            rec["seconds"] = time.time() - t0  # the step, including any evaluation
            metrics.log(step=k, **rec)
            if bar is not None:
                bar.set_postfix(reward=f"{rec['reward']:.2f}", acc="-" if acc is None else f"{acc:.0%}")
                bar.update(1)
            if cfg.save_every and done % cfg.save_every == 0 and done < cfg.steps:
                extra: dict[str, Any] = {"version0": version0}
                if pending is not None:  # async: batch `done` was sampled from the previous version
                    ready = collect_rollouts(pending, codec, train)
                    pending, extra["rollouts"] = None, ready
                states.save(session, done, extra)
            if cfg.stop_after and done - start >= cfg.stop_after and done < cfg.steps:
                stopped = True
                break
        if bar is not None:
            bar.close()
        metrics.close()
        loop_s = time.time() - t_loop
        if stopped:
            stop_quietly(session)
            return {"stopped_at": done, "seconds": {"loop": loop_s}}
        if acc is None:  # no step ran (--steps 0, or --resume of a finished run): evaluate the end
            acc, _ = evaluate(session, codec, eval_items, cfg.eval_max_tokens)
        ckpt = session.save_weights(f"{cfg.adapter_name}-{session.id[:8]}").result()
        final = states.save(session, cfg.steps, {"version0": version0})
        stop_quietly(session)

    recs = [r for r in metrics.records if r.get("step", -1) >= 0]
    plot = plot_metrics(metrics.records, out_dir / "rl.png",
                        keys=("reward", "held_out_accuracy", "kl_sampler", "entropy", "staleness"),
                        title=f"RL ({cfg.loss}, {'async' if cfg.async_mode else 'sync'})")
    summary = {
        "accuracy_start": acc_start,
        "accuracy_end": acc,
        "eval_examples": len(eval_items),
        "steps": cfg.steps,
        "mean_reward_first": recs[0]["reward"] if recs else None,
        "mean_reward_last": recs[-1]["reward"] if recs else None,
        "adapter_uri": ckpt.uri,
        "adapter_path": ckpt.path,
        "state_uri": final["uri"],
        "plot": str(plot),
        "metrics": str(out_dir / "metrics.jsonl"),
        "seconds": {"loop": loop_s, "total": time.time() - t_start,
                    "steps_without_eval": sum(r["seconds"] - r.get("eval_seconds", 0.0) for r in recs)},
    }
    write_json(out_dir / "summary.json", summary)
    # acc_start is None when the start was not evaluated (the main job evaluates after SFT itself).
    start_text = "" if acc_start is None else f"start: {acc_start:.1%} "
    print(f"\nRL accuracy {start_text}end: {fmt_or_dash(acc, '.1%')} ({len(eval_items)} held-out prompts); reward "
          f"{fmt_or_dash(summary['mean_reward_first'], '.2f')} -> {fmt_or_dash(summary['mean_reward_last'], '.2f')}; "
          f"loop {loop_s:.0f}s")
    print(f"plot: {plot}; adapter: {ckpt.path}; run dir: {out_dir}")
    return summary



def main(argv: list[str] | None = None) -> int:
    return cli(run, parse_args(argv), "rl")


if __name__ == "__main__":
    sys.exit(main())
