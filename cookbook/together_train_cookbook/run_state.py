"""A run's out dir across restarts: its saved ``config.json``, its training checkpoints
(`StateLog`, ``states.jsonl``) and its metrics kept up to the resumed step.

- `open_run(cfg, out_dir, prefix)`: (``--resume``) the last checkpoint, checked against the saved
  ``config.json`` (`check_resume_config`; the fields in `MAY_CHANGE_ON_RESUME` may differ), then
  the out dir and this invocation's ``config.json``.
- `StateLog`: ``save_state`` every K steps, recorded in ``out_dir/states.jsonl``; ``--resume``
  reads the last record back (`StateLog.latest`) and the recipe recreates the session from it
  with its optimizer (``create_session(checkpoint_uri, with_optimizer=True)``), so the run
  continues exactly (the recipes derive all client-side randomness from (seed, step)).
- `resume_metrics(path, start_step)`: keep the metric lines of steps < start_step, append after.

Imports only the SDK.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import together_train as tt

from together_train_cookbook.cli import ConfigError, flag
from together_train_cookbook.metrics import MetricsWriter, read_metrics, write_json


class StateLog:
    """Training checkpoints of a run, recorded one JSON line each in ``out_dir/states.jsonl``:
    ``{"step": k, "uri": ..., "extra": {...}}`` where k = optimizer steps completed *in this
    run* (the next step to run after a resume) and `extra` holds recipe state that the
    server checkpoint does not (e.g. rollouts already sampled for step k in async RL)."""

    def __init__(self, out_dir: Path, prefix: str) -> None:
        self.path = Path(out_dir) / "states.jsonl"
        self.prefix = prefix

    def save(self, session: tt.Session, step: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """``session.save_state`` (waits for it) and append the record."""
        name = f"{self.prefix}-step{step:06d}-{session.id[:8]}"
        info = session.save_state(name).result()
        rec = {"step": int(step), "uri": info.uri, "extra": extra or {}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
        return rec

    def latest(self) -> dict[str, Any] | None:
        """The last record, or None when the run has saved none."""
        if not self.path.exists():
            return None
        recs = read_metrics(self.path)
        return recs[-1] if recs else None


#: Config fields a ``--resume`` may change: how far and how often (``steps``: extending a run is
#: fine; sft with ``--lr-schedule linear`` then decays over the new total, and with
#: ``--train-examples 0`` draws its problems for the new total), where the resource is, and
#: testing / naming knobs. Every other field defines the run (data, seeds, model, init, teacher,
#: batch sizes, learning rate, loss, ...) and must equal the saved ``config.json``.
MAY_CHANGE_ON_RESUME = frozenset({
    "steps", "epochs", "resume", "stop_after", "address", "api_key", "out_dir", "generators",
    "save_every", "eval_every", "eval_at_start", "pipeline_depth", "adapter_name", "tensorboard", "wandb_project",
})


def check_resume_config(saved: dict[str, Any], cfg: Any) -> None:
    """Raise `ConfigError` listing each field of `cfg` that defines the run and differs from
    the run's saved config (``--batch-size: run has 8, now 4``). Fields the saved config lacks
    (written by an older version) are not compared."""
    now = dataclasses.asdict(cfg)
    diffs = [f"{flag(k)}: run has {saved[k]!r}, now {v!r}" for k, v in now.items()
             if k not in MAY_CHANGE_ON_RESUME and k in saved and saved[k] != v]
    if diffs:
        raise ConfigError("--resume with settings that differ from the run's config.json "
                          f"(pass the run's values): {'; '.join(diffs)}")


def open_run(cfg: Any, out_dir: Path, prefix: str) -> tuple[StateLog, dict[str, Any] | None]:
    """The start of every recipe's run: (``--resume``) the last checkpoint of `out_dir`, checked
    against the run's saved ``config.json`` (`check_resume_config`, raises before anything is
    written); then the out dir and ``config.json`` (this invocation's settings). ``--resume`` on
    an out dir without a checkpoint prints a notice and starts from scratch.

    Returns:
        (the run's `StateLog`, its last record or None for a fresh start).
    """
    states = StateLog(out_dir, prefix)
    last = states.latest() if getattr(cfg, "resume", False) else None
    if last is not None:
        saved_path = Path(out_dir) / "config.json"
        if saved_path.exists():
            check_resume_config(json.loads(saved_path.read_text()), cfg)
    elif getattr(cfg, "resume", False):
        print(f"--resume: no checkpoint in {out_dir} ({states.path.name}), starting from scratch",
              file=sys.stderr, flush=True)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    write_json(Path(out_dir) / "config.json", dataclasses.asdict(cfg))
    return states, last


def resume_metrics(path: Path, start_step: int) -> MetricsWriter:
    """A MetricsWriter on `path` holding the earlier run's records of steps < start_step
    (records without a step, e.g. evaluations, are kept when their "after_step" < start_step)."""
    kept: list[dict[str, Any]] = []
    if start_step > 0 and Path(path).exists():
        for r in read_metrics(path):
            if r.get("step", r.get("after_step", -1)) < start_step:
                kept.append(r)
    w = MetricsWriter(path)
    for r in kept:
        r = dict(r)
        step = r.pop("step", None)
        w.log(step=step, **r)
    return w

