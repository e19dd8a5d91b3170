"""The supervised training loop: SFT, DPO and any other batch-in, loss-out recipe run it.

    result = train(cfg, dataset, name="sft", steps=60, evaluators=[GreedyAccuracy(...)])

What it does, in order:

1. checks the settings (`cli.validate`), opens the out dir (``--resume``: the last checkpoint
   of ``states.jsonl``, after checking the saved ``config.json`` agrees);
2. connects (a given client, ``--address``, or a local resource), checks the longest sample
   against the resource's context;
3. the policy session: resumed from the checkpoint with its optimizer, or new from
   ``--init-from`` (fresh optimizer), or a fresh LoRA adapter; ``loss.setup`` may open more
   sessions (DPO's reference); every session is stopped however the run ends;
4. evaluation at the start (a resumed run takes it from the checkpoint record);
5. steps ``start .. steps-1``: ``loss.forward_backward`` and ``optim_step`` (learning rate
   from `schedule`) submitted back to back, up to ``pipeline_depth`` steps ahead of the
   results being read; one metrics record per step (the loss's metrics, ``lr``,
   ``grad_norm``, ``seconds``) to ``metrics.jsonl`` and, on ``--tensorboard`` /
   ``--wandb-project``, TensorBoard / W&B (`ml_log`); periodic evaluators every ``eval_every`` steps and after the
   last; ``save_state`` every ``save_every`` steps (the metrics of every earlier step are
   written first);
6. ``weights_sync``, evaluation at the end, ``save_weights`` (the adapter) and ``save_state``
   (the training checkpoint ``--init-from <out_dir>`` starts from); ``eval.jsonl``.

Exact resume: the batch of a step (`SupervisedDataset` contract), its learning rate and every
seed the loss uses are functions of the step, and the optimizer state is in the checkpoint, so
a run stopped and resumed logs the same numbers as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import together_train as tt

from together_train_cookbook.checkpoint_refs import explain_not_found, resolve_init_from
from together_train_cookbook.cli import validate
from together_train_cookbook.connection import Connection, connect, local_storage, stop_on_exit, stop_quietly
from together_train_cookbook.display import progress
from together_train_cookbook.ml_log import setup_logging
from together_train_cookbook.run_state import open_run
from together_train_cookbook.supervised.dataset import SupervisedDataset
from together_train_cookbook.supervised.evaluators import Evaluation, Evaluator, run_evaluators
from together_train_cookbook.supervised.loss import CrossEntropy, SupervisedLoss
from together_train_cookbook.supervised.schedule import SCHEDULES, Schedule, learning_rate_at

__all__ = ["Config", "Result", "train"]


@dataclass
class Config(Connection):
    """Settings of the loop; a recipe's ``Config`` subclasses it, adds its data fields and
    overrides defaults. Every field is also a command-line flag (``lora_rank`` -> ``--lora-rank``)."""

    init_from: str | None = field(default=None, metadata={"help": "training checkpoint URI or run dir to start from (fresh optimizer)"})
    resume: bool = field(default=False, metadata={"help": "continue from the last save_state in --out-dir"})
    lora_rank: int = field(default=16, metadata={"help": "LoRA rank (fresh sessions)"})
    lora_alpha: float = field(default=32.0, metadata={"help": "LoRA alpha (scale = alpha / rank)"})
    learning_rate: float = field(default=1e-3, metadata={"help": "AdamW learning rate (peak)"})
    lr_schedule: str = field(default="linear", metadata={"help": "linear: decay to 0 at the last step", "choices": SCHEDULES})
    warmup_steps: int = field(default=0, metadata={"help": "linear warmup steps"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    grad_clip_norm: float = field(default=0.0, metadata={"help": "clip the gradient norm; 0 = off"})
    batch_size: int = field(default=16, metadata={"help": "examples per optimizer step"})
    steps: int | None = field(default=60, metadata={"help": "optimizer steps"})
    max_length: int = field(default=512, metadata={"help": "truncate rendered chats to this many tokens"})
    seed: int = field(default=0, metadata={"help": "data order, LoRA init, sampling seeds"})
    eval_every: int = field(default=0, metadata={"help": "periodic evaluations every N steps (0 = start and end only)"})
    save_every: int = field(default=20, metadata={"help": "save_state every N steps (0 = only at the end)"})
    pipeline_depth: int = field(default=2, metadata={"help": "training steps submitted ahead of the results being read"})
    out_dir: str | None = field(default=None, metadata={"help": "default runs/<recipe>-<timestamp>"})
    tensorboard: bool = field(default=False, metadata={"help": "also write TensorBoard event files (OUT_DIR/tensorboard)"})
    wandb_project: str | None = field(default=None, metadata={"help": "also log to this Weights & Biases project"})
    adapter_name: str = field(default="final", metadata={"help": "name of the saved adapter"})
    stop_after: int = field(default=0, metadata={"help": "(testing) stop after N steps of this run, as if killed", "hidden": True})


@dataclass
class Result:
    """What `train` did. `stopped_at` is set (and the end fields empty) when ``stop_after``
    stopped the run as if killed."""

    out_dir: Path
    steps: int
    start_step: int
    records: list[dict[str, Any]]
    eval_start: Evaluation
    eval_end: Evaluation = field(default_factory=Evaluation)
    stopped_at: int | None = None
    init_uri: str | None = None
    policy_version: int | None = None
    adapter_uri: str | None = None
    adapter_path: str | None = None
    state_uri: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """The summary keys every recipe writes (a recipe adds its own)."""
        return {"steps": self.steps, "policy_version": self.policy_version, "init_from": self.init_uri,
                "adapter_uri": self.adapter_uri, "adapter_path": self.adapter_path, "state_uri": self.state_uri,
                "metrics": str(self.out_dir / "metrics.jsonl"), "seconds": self.seconds}


def _evaluate(session: tt.Session, evaluators: Sequence[Evaluator], synced: bool = False) -> Evaluation:
    if not synced and any(e.samples for e in evaluators):
        session.weights_sync().result()
    return run_evaluators(session, evaluators)


def _check_context(caps: Any, dataset: SupervisedDataset) -> None:
    longest = dataset.max_tokens()
    if caps.max_seq_len and longest and longest > caps.max_seq_len:
        raise ValueError(f"a training sample has {longest} tokens, over the resource's context of "
                         f"{caps.max_seq_len}; pass --max-length {caps.max_seq_len} (or less)")


def train(cfg: Config, dataset: SupervisedDataset, *, name: str, steps: int, loss: SupervisedLoss | None = None,
          evaluators: Sequence[Evaluator] = (), schedule: Schedule = learning_rate_at,
          client: tt.ResourceClient | None = None) -> Result:
    """Run the supervised loop (module doc) for `steps` optimizer steps.

    Args:
        cfg: the recipe's settings (a `Config` subclass).
        dataset: batches per step; `loss` must accept its items.
        name: the recipe's name (out dir prefix, session and checkpoint names).
        loss: default `CrossEntropy` (batches of samples).
        evaluators: run at the start and end (and, when periodic, every ``eval_every`` steps).
        schedule: ``(step, steps, cfg) -> learning rate``.
        client: a connected resource to use and leave open; default ``cfg.address`` or local.

    Raises:
        ConfigError: a bad setting, before anything is created.
        ValueError: a sample longer than the resource's context.
        together_train.TogetherTrainError: from the resource (NOT_FOUND for ``--init-from``
            names the flag and where the checkpoint lives).
    """
    validate(cfg)
    t_start = time.time()
    out_dir = Path(cfg.out_dir or f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    states, last = open_run(cfg, out_dir, name)
    init_uri = resolve_init_from(cfg.init_from, local_storage(cfg, out_dir, client)) if cfg.init_from else None
    loss = loss or CrossEntropy()
    periodic = [e for e in evaluators if e.periodic]
    final = [e for e in evaluators if not e.periodic]

    def init_not_found() -> Any:  # NOT_FOUND for the init checkpoint: say where it lives
        return (explain_not_found("--init-from", cfg.init_from, init_uri, cfg.address, out_dir) if init_uri
                else contextlib.nullcontext())

    with connect(cfg, out_dir, client) as client, contextlib.ExitStack() as stack:
        policy, start = _open_policy(client, cfg, dataset, loss, name, last, init_uri, init_not_found, stack)
        # metrics.jsonl always (a resumed run keeps the records of earlier steps), TensorBoard / W&B on flags
        log = stack.enter_context(setup_logging(out_dir, cfg, tensorboard=cfg.tensorboard,
                                                wandb_project=cfg.wandb_project, start_step=start))
        t0 = time.time()
        evals = _Evaluations.at_start(policy, periodic, final, last, log)
        seconds = {"eval_start": time.time() - t0}
        t0 = time.time()
        pipe = _Pipeline(log, progress(steps, name, initial=start), steps)
        stopped_at = _run_steps(cfg, policy, loss, dataset, schedule, range(start, steps), periodic, states, evals, pipe)
        pipe.close()
        seconds["train"] = time.time() - t0
        if stopped_at is not None:  # as if killed here (testing): no end evaluation or checkpoint
            stop_quietly(policy)
            return Result(out_dir, steps, start, log.records, evals.first, stopped_at=stopped_at, init_uri=init_uri,
                          seconds=seconds)

        end, sync, ckpt, state = _finish(cfg, policy, final, states, evals, steps, seconds)
        stop_quietly(policy)

    _write_eval(out_dir, evals.first, end)
    seconds["total"] = time.time() - t_start
    return Result(out_dir, steps, start, log.records, evals.first, end, None, init_uri, sync.policy_version,
                  ckpt.uri, ckpt.path, state["uri"], seconds)


def _finish(cfg: Config, policy: tt.Session, final: Sequence[Evaluator], states: Any, evals: _Evaluations,
            steps: int, seconds: dict[str, float]) -> tuple[Evaluation, Any, Any, dict[str, Any]]:
    """The end: publish the trained weights, evaluate (``seconds["eval_end"]``), save the adapter and a
    training checkpoint. Returns (end evaluation, weights_sync result, adapter checkpoint, state record)."""
    t0 = time.time()
    sync = policy.weights_sync().result()
    end_f = _evaluate(policy, final, synced=True)
    end = Evaluation({**evals.last_periodic, **end_f.metrics}, end_f.records)
    seconds["eval_end"] = time.time() - t0
    ckpt = policy.save_weights(cfg.adapter_name).result()
    return end, sync, ckpt, states.save(policy, steps, evals.extra())


def _open_policy(client: tt.ResourceClient, cfg: Config, dataset: SupervisedDataset, loss: SupervisedLoss,
                 name: str, last: dict[str, Any] | None, init_uri: str | None, init_not_found: Any,
                 stack: contextlib.ExitStack) -> tuple[tt.Session, int]:
    """(policy session, first step): the dataset checked against the resource's context; the session resumed
    from the run's last checkpoint with its optimizer, or new from ``init_uri`` (fresh optimizer) or a fresh
    LoRA; the loss's own sessions (``loss.setup``); every session stopped when ``stack`` closes."""
    caps = client.get_capabilities()
    print(f"resource: {caps.model_id} ({getattr(client, 'address', cfg.address or 'local')})", flush=True)
    _check_context(caps, dataset)
    lora = tt.LoraConfig(rank=cfg.lora_rank, alpha=cfg.lora_alpha, seed=cfg.seed)
    if last is not None:
        policy = client.create_session(checkpoint_uri=last["uri"], with_optimizer=True, name=name)
        print(f"resumed from {last['uri']} at step {last['step']}", flush=True)
    else:
        with init_not_found():
            policy = client.create_session(lora=None if init_uri else lora, checkpoint_uri=init_uri, name=name)
    stop_on_exit(stack, policy)
    with init_not_found():
        loss.setup(client, policy, init_uri=init_uri, lora=lora, stack=stack)
    return policy, int(last["step"]) if last is not None else 0


@dataclass
class _Evaluations:
    """The run's evaluations so far: the start (``first``) and the latest periodic metrics; a checkpoint
    record carries both (`extra`), so a resumed run continues its curves."""

    first: Evaluation
    last_periodic: dict[str, Any]

    @classmethod
    def at_start(cls, policy: tt.Session, periodic: Sequence[Evaluator], final: Sequence[Evaluator],
                 last: dict[str, Any] | None, log: Any) -> _Evaluations:
        """Evaluate at the start (logged at step -1 when periodic); a resumed run has it in its checkpoint record."""
        if last is not None:
            return cls(Evaluation(last["extra"].get("eval_start", {}), last["extra"].get("eval_start_records", [])),
                       last["extra"].get("eval_last", {}))
        t0 = time.time()
        first_p, first_f = _evaluate(policy, periodic), _evaluate(policy, final)
        first = Evaluation({**first_p.metrics, **first_f.metrics}, first_p.records + first_f.records)
        if periodic:  # the start point of the periodic curves
            log.log_metrics(first.metrics, step=-1)
        print(f"evaluation at start: {_fmt(first.metrics)} ({time.time() - t0:.0f}s)", flush=True)
        return cls(first, first_p.metrics)

    def extra(self) -> dict[str, Any]:
        """What a checkpoint record carries besides the weights."""
        return {"eval_start": self.first.metrics, "eval_start_records": self.first.records,
                "eval_last": self.last_periodic}


def _run_steps(cfg: Config, policy: tt.Session, loss: SupervisedLoss, dataset: SupervisedDataset,
               schedule: Schedule, step_range: range, periodic: Sequence[Evaluator], states: Any,
               evals: _Evaluations, pipe: _Pipeline) -> int | None:
    """The steps of ``step_range``, ``pipeline_depth`` of them in flight; periodic evaluations and
    checkpoints on their schedule. Returns the step count ``stop_after`` stopped at, else None."""
    steps, start = step_range.stop, step_range.start
    for step in step_range:
        lr = schedule(step, steps, cfg)
        loss_metrics = loss.forward_backward(policy, dataset.get_batch(step), step)
        opt = policy.optim_step(tt.AdamParams(learning_rate=lr, weight_decay=cfg.weight_decay,
                                              grad_clip_norm=cfg.grad_clip_norm))
        pipe.pending.append((step, loss_metrics, opt))
        done = step + 1
        if periodic and ((cfg.eval_every and done % cfg.eval_every == 0) or done == steps):
            pipe.drain(keep=1)
            evals.last_periodic = _evaluate(policy, periodic).metrics  # queued after this step's optim_step
            pipe.collect(evals.last_periodic)
        if cfg.save_every and done % cfg.save_every == 0 and done < steps:
            pipe.drain()  # metrics of every step <= this one, then the checkpoint after it
            states.save(policy, done, evals.extra())
        if cfg.stop_after and done - start >= cfg.stop_after and done < steps:
            return done
        pipe.drain(keep=max(0, cfg.pipeline_depth - 1))
    return None


class _Pipeline:
    """Submitted steps whose results are not read yet: ``(step, loss metrics, optim_step
    future)``; `collect` reads the oldest and logs its record (with `evaluation` merged)."""

    def __init__(self, log: Any, bar: Any, steps: int) -> None:
        self.log, self.bar, self.steps = log, bar, steps
        self.pending: list[tuple[int, Any, Any]] = []
        self.last_done = time.time()

    def collect(self, evaluation: dict[str, Any] | None = None) -> None:
        step, loss_metrics, opt = self.pending.pop(0)
        rec, o = loss_metrics(), opt.result()
        rec.update(lr=o.learning_rate, grad_norm=o.grad_norm, **(evaluation or {}))
        now = time.time()
        self.log.log_metrics({**rec, "seconds": now - self.last_done}, step=step)
        self.last_done = now
        loss = rec.get("loss", float("nan"))
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{o.learning_rate:.2e}")
            self.bar.update(1)
        elif step % 10 == 0 or step == self.steps - 1:
            print(f"step {step}: loss {loss:.4f} lr {o.learning_rate:.2e}", flush=True)

    def drain(self, keep: int = 0) -> None:
        """Collect until at most `keep` steps are in flight."""
        while len(self.pending) > keep:
            self.collect()

    def close(self) -> None:
        self.drain()
        if self.bar is not None:
            self.bar.close()
        self.log.close()


def _write_eval(out_dir: Path, first: Evaluation, end: Evaluation) -> None:
    """``eval.jsonl``: the per-item records of the start ("before") and end ("after") evaluations."""
    if first.records or end.records:
        with open(out_dir / "eval.jsonl", "w", encoding="utf-8") as f:
            for when, recs in (("before", first.records), ("after", end.records)):
                for r in recs:
                    f.write(json.dumps({"when": when, **r}) + "\n")


def _fmt(metrics: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()) or "-"
