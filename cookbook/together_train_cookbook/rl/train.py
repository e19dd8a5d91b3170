"""The RL loop: rollouts from an `RLDataset`, advantages, one policy-loss step per batch.

`run(cfg, dataset, codec=...)` reads top to bottom:

1. the run dir (``--resume``: the last checkpoint, checked against the saved ``config.json``);
2. a resource (given client, ``--address`` or `launch_local`) and a LoRA session: fresh, from a
   training checkpoint (``--init-from``), or the run's last checkpoint with its optimizer;
3. each step k: `submit_rollouts` of ``dataset.get_batch(k)`` (every env of the batch in flight),
   advantages (default `GroupCentered`), `build_samples` (observation tokens masked),
   ``forward_backward`` with ``cfg.loss``, ``optim_step``, ``weights_sync``;
4. metrics per step to ``metrics.jsonl`` (and TensorBoard / W&B with ``tensorboard`` /
   ``wandb_project``, `ml_log`): ``reward`` (mean episode return), the advantage
   function's metrics (e.g. ``frac_groups_with_signal``), ``env/<name>`` (the envs' step metrics),
   ``kl_sampler`` and ``entropy`` (`rl_math.kl_and_entropy`), ``loss``, ``grad_norm``,
   ``staleness``, ``prompt_cache_hit_rate``, and a time profile (``sample_seconds``: the loop waited for its rollouts;
   ``sampling_seconds``: first request -> last result; ``train_seconds``: forward_backward +
   optim_step; ``weights_sync_seconds``: the previous step's push); the evaluator's metrics
   every ``eval_every`` steps and at the end; ``save_state`` every ``save_every`` steps;
   ``save_weights``, a final ``save_state``, a PNG of the curves and ``summary.json``.

Asynchronous mode (``async_mode``): step k+1's first turn is submitted right after step k's
rollouts are collected, before step k's ``forward_backward``, so the generator samples it while the
trainer trains; it comes from the version of the ``weights_sync`` issued at the end of step k-1
and is trained one version later (``staleness`` 1). Every sampled token carries its version; the
off-policy correction is the losses' importance ratio ``r = exp(p - q)`` with q the sampler's
logprob (``importance_sampling``: ``-Σ r·A``; ``ppo`` / ``grpo`` clip r, ``cispo`` clips the
stop-gradient weight). In synchronous mode r = 1 up to the trainer/sampler numeric gap.

Exact resume: batches are functions of (seed, step), sampler seeds of (seed, step, group, turn,
env), and an async run's checkpoint record carries the batch already sampled for the next step;
so a run stopped and resumed logs what an uninterrupted one does.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import together_train as tt

from together_train_cookbook.checkpoint_refs import explain_not_found, resolve_init_from
from together_train_cookbook.codec import Codec
from together_train_cookbook.connection import connect, local_storage, stop_on_exit, stop_quietly
from together_train_cookbook.display import progress
from together_train_cookbook.metrics import write_json
from together_train_cookbook.ml_log import setup_logging
from together_train_cookbook.plotting import plot_metrics
from together_train_cookbook.rl.advantages import AdvantageFn, GroupCentered
from together_train_cookbook.rl.config import Config
from together_train_cookbook.rl.dataset import RLDataset
from together_train_cookbook.rl.evaluation import Evaluator
from together_train_cookbook.rl.rollouts import PendingRollouts, SamplingSettings, submit_rollouts
from together_train_cookbook.rl.trajectory import RolloutBatch
from together_train_cookbook.rl.training_data import build_samples
from together_train_cookbook.rl_math import kl_and_entropy
from together_train_cookbook.run_state import open_run

PLOT_KEYS = ("reward", "held_out_accuracy", "kl_sampler", "entropy", "staleness")


def open_session(client: tt.ResourceClient, cfg: Config, name: str, last: dict[str, Any] | None,
                 init_uri: str | None, out_dir: Path) -> tuple[tt.Session, int, int]:
    """(session, first step, policy version at step 0): resumed with its optimizer from the run's
    last checkpoint, from ``--init-from`` (fresh optimizer), or a fresh LoRA."""
    if last is not None:
        session = client.create_session(checkpoint_uri=last["uri"], with_optimizer=True, name=name)
        print(f"resumed from {last['uri']} at step {last['step']}", flush=True)
        return session, int(last["step"]), int(last["extra"]["version0"])
    if init_uri:
        with explain_not_found("--init-from", cfg.init_from, init_uri, cfg.address, out_dir):
            session = client.create_session(checkpoint_uri=init_uri, name=name)
        return session, 0, session.info().step
    lora = tt.LoraConfig(rank=cfg.lora_rank, alpha=cfg.lora_alpha, seed=cfg.seed)
    return client.create_session(lora=lora, name=name), 0, 0


def batch_metrics(batch: RolloutBatch) -> dict[str, float]:
    """``reward`` (mean return), ``reward_std`` (population std over the episodes),
    ``response_tokens`` and ``turns`` (means per episode), ``prompt_cache_hit_rate`` (prompt tokens the
    generator served from its prefix cache / all prompt tokens sampled from; multi-turn episodes resend
    their context, so it rises with the turns), and
    ``env/<name>``: the mean of each metric the envs reported, over the steps reporting it."""
    trajs = [t for g in batch.groups for t in g.trajectories]
    returns = [r for g in batch.groups for r in g.total_rewards()]
    env: dict[str, list[float]] = {}
    for t in (t for traj in trajs for t in traj.transitions):
        for k, v in t.metrics.items():
            env.setdefault(f"env/{k}", []).append(v)
    return {
        "reward": float(np.mean(returns)),
        "reward_std": float(np.std(returns)),
        "response_tokens": float(np.mean([sum(len(t.action) for t in traj.transitions) for traj in trajs])),
        "turns": float(np.mean([len(traj.transitions) for traj in trajs])),
        "prompt_cache_hit_rate": batch.prompt_cache_hit_tokens / max(1, batch.prompt_tokens),
        **{k: float(np.mean(v)) for k, v in env.items()},
        **batch.metrics,
    }


def first_last(records: Sequence[dict[str, Any]], key: str) -> tuple[Any, Any]:
    """(first, last) value of `key` over the training steps' records (None when absent)."""
    vals = [r[key] for r in records if r.get("step", -1) >= 0 and r.get(key) is not None]
    return (vals[0], vals[-1]) if vals else (None, None)


def train_metrics(fb: tt.ForwardResult, opt: tt.OptimStepResult, samples: Sequence[tt.Sample],
                  masks: Sequence[np.ndarray], sampler_version: int) -> dict[str, float]:
    """A training step's numbers: ``loss``, ``grad_norm``, the loss's ``*:mean`` metrics,
    ``kl_sampler`` / ``entropy`` over the action tokens (`rl_math.kl_and_entropy`: q = the
    sampler's logprobs, p = the trainer's), and ``staleness`` = the version trained (the optimizer
    step before this one) minus the oldest version that sampled the batch."""
    kl, ent = kl_and_entropy([s.loss_fn_inputs["logprobs"] for s in samples], fb.logprobs, masks)
    return {"loss": fb.loss, "kl_sampler": kl, "entropy": ent, "grad_norm": opt.grad_norm,
            "staleness": (opt.step - 1) - sampler_version,
            **{m: v for m, v in fb.metrics.items() if m.endswith(":mean")}}


def summarize(cfg: Config, records: Sequence[dict[str, Any]], out_dir: Path, name: str, plot_keys: Sequence[str],
              title: str | None, eval_start: dict[str, float] | None, eval_end: dict[str, float], evaluator: Any,
              adapter: tt.CheckpointInfo, state_uri: str, seconds: dict[str, float]) -> dict[str, Any]:
    """The run's summary (``summary.json``) and its plot (``<name>.png`` of `plot_keys`)."""
    recs = [r for r in records if r.get("step", -1) >= 0]
    plotted = any(r.get(key) is not None for r in records for key in plot_keys)
    plot = plot_metrics(records, out_dir / f"{name}.png", keys=plot_keys, title=title or
                        f"{name} ({cfg.loss}, {'async' if cfg.async_mode else 'sync'})") if plotted else None
    reward_first, reward_last = first_last(recs, "reward")
    return {
        "accuracy_start": (eval_start or {}).get("held_out_accuracy"),
        "accuracy_end": eval_end.get("held_out_accuracy"),
        "eval_start": eval_start,
        "eval_end": eval_end,
        "eval_examples": len(evaluator) if hasattr(evaluator, "__len__") else None,
        "steps": cfg.steps,
        "mean_reward_first": reward_first,
        "mean_reward_last": reward_last,
        "adapter_uri": adapter.uri,
        "adapter_path": adapter.path,
        "state_uri": state_uri,
        "plot": str(plot) if plot else None,
        "metrics": str(out_dir / "metrics.jsonl"),
        "seconds": {**seconds, "steps_without_eval": sum(r["seconds"] - r.get("eval_seconds", 0.0) for r in recs)},
    }


def run(cfg: Config, dataset: RLDataset, *, codec: Codec, evaluator: Evaluator | None = None,
        advantages: AdvantageFn | None = None, client: tt.ResourceClient | None = None, name: str = "rl",
        out_dir: Path | None = None, plot_keys: Sequence[str] = PLOT_KEYS, title: str | None = None,
        rollouts: Callable[..., Any] = submit_rollouts) -> dict[str, Any]:
    """Train with RL as configured; returns the summary (also ``summary.json``), or
    ``{"stopped_at": k, ...}`` when ``cfg.stop_after`` stopped the run early.

    Args:
        cfg: the loop's settings (a recipe's Config subclass; validated by the recipe).
        dataset: the env groups of each step. codec: the model's chat codec (stop tokens).
        evaluator: held-out metrics of the session (e.g. ``held_out_accuracy``); None: none.
        advantages: default `GroupCentered()`. client: a connected resource (left open).
        name: session name, checkpoint prefix, default out dir ``runs/<name>-<time>``.
        out_dir: default ``cfg.out_dir`` (or that default).
        rollouts: where a step's episodes come from: ``rollouts(session, builders, sampling, step, seed)``
            returns an object whose ``collect()`` gives the `RolloutBatch` (default `submit_rollouts`:
            the envs; `agents.AgentRollouts.submit`: agents calling the OpenAI endpoint).
    """
    t_start = time.time()
    out_dir = Path(out_dir or cfg.out_dir or f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    states, last = open_run(cfg, out_dir, name)
    sampling = SamplingSettings(cfg.max_tokens, cfg.temperature, codec.stop_token_ids, codec.stop_strings)
    # a run dir's checkpoint is copied into this run's local storage before the resource starts
    init_uri = resolve_init_from(cfg.init_from, local_storage(cfg, out_dir, client)) if cfg.init_from else None

    with connect(cfg, out_dir, client) as client, contextlib.ExitStack() as stack:
        session, start, version0 = open_session(client, cfg, name, last, init_uri, out_dir)
        stop_on_exit(stack, session)
        session.weights_sync().result()
        # metrics.jsonl always (a resumed run keeps the records of earlier steps), TensorBoard / W&B on flags
        log = stack.enter_context(setup_logging(out_dir, cfg, tensorboard=cfg.tensorboard,
                                                wandb_project=cfg.wandb_project, start_step=start))
        loop = _Steps(cfg, dataset, session, version0, log, states, sampling=sampling, rollouts=rollouts,
                      advantages=advantages or GroupCentered(), evaluator=evaluator)
        eval_start = loop.evaluate_start(start, name)
        t_loop = time.time()
        done, stopped = loop.run(start, last, name)
        loop_s = time.time() - t_loop
        if stopped:
            stop_quietly(session)
            return {"stopped_at": done, "seconds": {"loop": loop_s}}
        # no step ran (--steps 0, or --resume of a finished run): evaluate the end
        eval_end = loop.eval_end if loop.eval_end is not None else loop.evaluate()
        ckpt = session.save_weights(f"{cfg.adapter_name}-{session.id[:8]}").result()
        final = states.save(session, cfg.steps, {"version0": version0})
        stop_quietly(session)

    summary = summarize(cfg, log.records, out_dir, name, plot_keys, title, eval_start, eval_end, evaluator,
                        ckpt, final["uri"], {"loop": loop_s, "total": time.time() - t_start})
    write_json(out_dir / "summary.json", summary)
    return summary


class _Steps:
    """The steps of one RL run (module docstring, 3-4) and what is in flight between them: the rollouts
    sampled ahead (``ready``: collected; ``pending``: submitted) and the last ``weights_sync`` future."""

    def __init__(self, cfg: Config, dataset: RLDataset, session: tt.Session, version0: int, log: Any, states: Any,
                 *, sampling: SamplingSettings, rollouts: Callable[..., Any], advantages: AdvantageFn,
                 evaluator: Evaluator | None) -> None:
        self.cfg, self.dataset, self.session, self.version0 = cfg, dataset, session, version0
        self.log, self.states, self.sampling, self.rollouts = log, states, sampling, rollouts
        self.advantages, self.evaluator = advantages, evaluator
        self.loss_config = json.loads(cfg.loss_config) if cfg.loss_config else None
        self.adam = tt.AdamParams(learning_rate=cfg.learning_rate, grad_clip_norm=cfg.grad_clip_norm)
        self.ready: RolloutBatch | None = None
        self.pending: PendingRollouts | None = None
        self.sync: Any = None
        self.eval_end: dict[str, float] | None = None

    def submit(self, k: int) -> PendingRollouts:
        return self.rollouts(self.session, self.dataset.get_batch(k), self.sampling, k, self.cfg.seed)

    def evaluate(self) -> dict[str, float]:
        return self.evaluator(self.session) if self.evaluator is not None else {}

    def evaluate_start(self, start: int, name: str) -> dict[str, float] | None:
        """The start's evaluation: a resumed run's from its records, a fresh run's now (``eval_at_start``)."""
        eval_start = next(({k: v for k, v in r.items() if k != "step"} for r in self.log.records
                           if r.get("step") == -1), None)
        if start == 0 and self.cfg.eval_at_start and self.evaluator is not None:
            eval_start = self.evaluate()
            self.log.log_metrics(eval_start, step=-1)
            print(f"{name} at start: {eval_start}", flush=True)
        return eval_start

    def run(self, start: int, last: dict[str, Any] | None, name: str) -> tuple[int, bool]:
        """Steps ``start .. cfg.steps-1``, each logged; returns (steps done, stopped by ``stop_after``)."""
        cfg = self.cfg
        ready = last["extra"].get("rollouts") if last is not None else None  # async: batch `start`, sampled earlier
        self.ready = RolloutBatch.from_json(ready) if ready is not None else None
        self.pending = None if self.ready is not None or start >= cfg.steps else self.submit(start)
        bar = progress(cfg.steps, name, initial=start)
        done, stopped = start, False
        for k in range(start, cfg.steps):
            rec = self.step(k)
            done = k + 1
            self.log.log_metrics(rec, step=k)
            if bar is not None:
                bar.set_postfix(reward=f"{rec['reward']:.2f}",
                                **{k2: f"{v:.2f}" for k2, v in (self.eval_end or {}).items()})
                bar.update(1)
            if cfg.save_every and done % cfg.save_every == 0 and done < cfg.steps:
                self.checkpoint(done)
            if cfg.stop_after and done - start >= cfg.stop_after and done < cfg.steps:
                stopped = True
                break
        if bar is not None:
            bar.close()
        self.log.close()
        return done, stopped

    def step(self, k: int) -> dict[str, Any]:
        """Step k: its rollouts (sync mode: sampled now; async: step k+1's submitted before training), one
        training step, the evaluation when due; returns its metrics record."""
        t0 = time.time()
        batch = self.ready
        if batch is None:  # sync mode (nothing in flight): sample now, from the version just synced
            batch = (self.pending if self.pending is not None else self.submit(k)).collect()
        self.ready, self.pending = None, None
        t_sampled = time.time()
        if self.cfg.async_mode and k + 1 < self.cfg.steps:  # batch k+1's first turn samples while step k trains
            self.pending = self.submit(k + 1)
        rec, prev_sync = self.train(batch)
        rec["sample_seconds"] = t_sampled - t0  # the loop waited this long for its rollouts
        if batch.sampling_seconds is not None:  # first request -> last result (overlaps training in async)
            rec["sampling_seconds"] = batch.sampling_seconds
        if prev_sync is not None and prev_sync.done() and prev_sync.exception() is None:
            rec["weights_sync_seconds"] = prev_sync.result().seconds  # the previous step's push (server side)
        done = k + 1
        if (self.cfg.eval_every and done % self.cfg.eval_every == 0) or done == self.cfg.steps:
            t_eval = time.time()
            self.eval_end = self.evaluate()
            rec.update(self.eval_end, eval_seconds=time.time() - t_eval)
        rec["seconds"] = time.time() - t0  # the step, including any evaluation
        return rec

    def train(self, batch: RolloutBatch) -> tuple[dict[str, Any], Any]:
        """Advantages, samples, ``forward_backward`` + ``optim_step``, then ``weights_sync``; returns the
        record so far and the previous step's sync future."""
        advs, adv_metrics = self.advantages(batch.groups, self.session)
        samples, masks = build_samples(batch.groups, advs)
        rec: dict[str, Any] = {**batch_metrics(batch), "trained_samples": len(samples), **adv_metrics}
        mv = batch.min_version()
        rec["sampler_version"] = (mv if mv is not None else self.version0) - self.version0
        t_fb = time.time()
        if samples:
            fb = self.session.forward_backward(samples, self.cfg.loss, self.loss_config, return_logprobs=True)
            opt = self.session.optim_step(self.adam)
        prev_sync, self.sync = self.sync, self.session.weights_sync()  # a future; the next sample request waits
        if samples:
            rec.update(train_metrics(fb.result(), opt.result(), samples, masks,
                                     self.version0 + rec["sampler_version"]),
                       train_seconds=time.time() - t_fb)  # submit -> optimizer step done (client view)
        return rec, prev_sync

    def checkpoint(self, done: int) -> None:
        """``save_state`` after ``done`` steps; async: with the batch of step ``done``, sampled from the previous
        version (collected now), so a resumed run trains what an uninterrupted one does."""
        extra: dict[str, Any] = {"version0": self.version0}
        if self.pending is not None:
            self.ready, self.pending = self.pending.collect(), None
            extra["rollouts"] = self.ready.to_json()
        self.states.save(self.session, done, extra)
