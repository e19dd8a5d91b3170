"""Metric sinks behind one interface (the shape of tinker-cookbook's ``ml_log``): a training loop
calls ``log_metrics(metrics, step)`` on one `Logger` and every sink the run asked for gets the
values.

- `JsonLogger`: always; ``metrics.jsonl`` in the run dir, one ``{"step": k, ...}`` line per call
  (`metrics.MetricsWriter`'s format, so `plotting` and ``--resume`` keep reading it). Resuming
  at step s keeps the earlier run's lines of steps < s (`run_state.resume_metrics`).
- `TensorBoardLogger`: event files under ``<log_dir>/tensorboard`` (tensorboardX, which needs no
  torch; ``tensorboard --logdir <out dir>/tensorboard`` shows them). One scalar per numeric
  value, tag = the key with ``:`` as ``/`` (`tensorboard_tag`), global step = the record's step.
- `WandbLogger`: a Weights & Biases run in ``<log_dir>/wandb`` (``WANDB_MODE=offline``: written
  to disk only, ``wandb sync`` uploads it later). The record's step is logged as the metric
  ``step`` and is every chart's x axis, so the start evaluation (step -1) and a resumed run's
  repeated steps are accepted (W&B's own step only increases). A resumed run continues the same
  W&B run (its id is kept in ``<log_dir>/wandb_run_id``).
- `MultiLogger`: several sinks as one; `setup_logging` builds it from a run's settings.

The recipes' ``Config`` dataclasses carry the flags (`cli.parse_config` makes
``--tensorboard`` / ``--wandb-project NAME``)::

    tensorboard: bool = field(default=False, metadata={"help": "also write TensorBoard event files (OUT_DIR/tensorboard)"})
    wandb_project: str | None = field(default=None, metadata={"help": "also log to this Weights & Biases project"})

and the loop::

    log = setup_logging(out_dir, cfg, tensorboard=cfg.tensorboard, wandb_project=cfg.wandb_project, start_step=start)
    log.log_metrics({"loss": 0.41, "grad_norm": 1.3}, step=k)
    ...
    log.close()          # log.records: the metrics.jsonl records (plots, summaries)

tensorboardX and wandb are imported only when their logger is made (extra ``loggers``:
``pip install 'together-train[loggers]'``); a missing one is a `cli.ConfigError` naming the flag.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from together_train_cookbook.cli import ConfigError
from together_train_cookbook.metrics import write_json
from together_train_cookbook.run_state import resume_metrics


def _config_dict(config: Any) -> dict[str, Any]:
    """A dataclass instance or a mapping as a plain dict (None -> {})."""
    if config is None:
        return {}
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    return dict(config)


def _scalar(value: Any) -> float | None:
    """`value` as a float when it is a number (bool and numpy scalars included), else None."""
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, (bool, int, float)):
        return float(value)
    return None


class Logger(abc.ABC):
    """Where a training loop sends its metrics. Use as a context manager or call `close`."""

    def log_hparams(self, config: Any) -> None:
        """Record the run's settings (a dataclass instance or a dict) once, at the start."""

    @abc.abstractmethod
    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Record `metrics` (name -> value) of optimizer step `step` (0-based; -1: the evaluation
        before the first step; None: a record without a step)."""

    def close(self) -> None:
        """Flush and release the sink (idempotent)."""

    def __enter__(self) -> "Logger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class JsonLogger(Logger):
    """``<log_dir>/metrics.jsonl``: one JSON object per `log_metrics` call, ``{"step": k, ...}``,
    flushed at once (a crashed run keeps every finished step). NaN / inf are written as null.

    Args:
        log_dir: the run dir (created).
        start_step: a resumed run's first step: the file keeps the earlier run's records of
            steps < `start_step` (and the start evaluation, step -1) and the rest is dropped;
            0 starts a new file.
        filename: the file's name in `log_dir`.
    """

    def __init__(self, log_dir: str | os.PathLike, start_step: int = 0, filename: str = "metrics.jsonl") -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.log_dir / filename
        self._writer = resume_metrics(self.path, start_step)

    @property
    def records(self) -> list[dict[str, Any]]:
        """Every record in the file, kept ones first (``{"step": k, name: value, ...}``)."""
        return self._writer.records

    def log_hparams(self, config: Any) -> None:
        """``<log_dir>/config.json`` (what ``--resume`` compares against)."""
        write_json(self.log_dir / "config.json", _config_dict(config))

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self._writer.log(step=step, **metrics)

    def close(self) -> None:
        self._writer.close()


def tensorboard_tag(key: str) -> str:
    """The TensorBoard tag of metric `key`: ``:`` becomes ``/`` (``loss:mean`` -> ``loss/mean``,
    shown in the group ``loss``) and any other character TensorBoard does not allow in a tag
    becomes ``_``."""
    return re.sub(r"[^-/\w.]", "_", key.replace(":", "/"))


class TensorBoardLogger(Logger):
    """TensorBoard event files in `log_dir` (tensorboardX's ``SummaryWriter``; no torch needed).

    `log_metrics` writes one scalar per numeric value (bools as 0/1, NaN kept) at global step
    `step` (a record without a step goes at the last step seen); strings, lists and None are
    skipped. `log_hparams` writes the settings as a JSON text summary named ``config``.

    Raises:
        ConfigError: tensorboardX is not installed.
    """

    def __init__(self, log_dir: str | os.PathLike) -> None:
        try:
            from tensorboardX import SummaryWriter
        except ImportError as e:
            raise ConfigError(f"--tensorboard: needs tensorboardX (pip install 'together-train[loggers]'): {e}") from None
        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(logdir=str(self.log_dir))
        self._last_step = 0
        self._closed = False

    def log_hparams(self, config: Any) -> None:
        text = json.dumps(_config_dict(config), indent=2, default=str)
        self._writer.add_text("config", "```\n" + text + "\n```", global_step=0)

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        if step is not None:
            self._last_step = int(step)
        for key, value in metrics.items():
            x = _scalar(value)
            if x is not None:
                self._writer.add_scalar(tensorboard_tag(key), x, global_step=self._last_step)
        self._writer.flush()

    def close(self) -> None:
        if not self._closed:
            self._writer.close()
            self._closed = True


class WandbLogger(Logger):
    """A Weights & Biases run (``wandb.init(project=..., dir=log_dir)``); its files go to
    ``<log_dir>/wandb/``. Set ``WANDB_MODE=offline`` to write to disk only.

    Every `log_metrics` call is one W&B history row holding the metrics and ``step`` (the x axis
    of every chart, `define_metric`), so steps may repeat or go back (a resumed run, the start
    evaluation at step -1). Non-finite floats are sent as None. The run id is kept in
    ``<log_dir>/wandb_run_id``; with `resume` the run continues under that id.

    Args:
        project: the W&B project.
        log_dir: the run dir.
        name: the run's display name (default: the run dir's name).
        resume: continue the W&B run recorded in `log_dir` (when there is one).

    Raises:
        ConfigError: wandb is not installed.
    """

    def __init__(self, project: str, log_dir: str | os.PathLike, name: str | None = None, resume: bool = False) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ConfigError(f"--wandb-project {project}: needs wandb (pip install 'together-train[loggers]'): {e}") from None
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        id_file = self.log_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else None
        self.run = wandb.init(project=project, dir=str(self.log_dir), name=name or self.log_dir.resolve().name,
                              id=run_id, resume="allow" if run_id else None)
        id_file.write_text(self.run.id + "\n")
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self._closed = False

    def log_hparams(self, config: Any) -> None:
        self.run.config.update(_config_dict(config), allow_val_change=True)

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        row: dict[str, Any] = {}
        for key, value in metrics.items():
            x = _scalar(value)
            if x is not None:
                row[key] = x if math.isfinite(x) else None
            elif isinstance(value, str):
                row[key] = value
        if step is not None:
            row["step"] = int(step)
        self.run.log(row)

    def close(self) -> None:
        if not self._closed:
            self.run.finish()
            self._closed = True


class MultiLogger(Logger):
    """Several sinks as one: each call goes to every logger, in order. `records` are the first
    `JsonLogger`'s records (what the loops plot and summarize)."""

    def __init__(self, loggers: list[Logger]) -> None:
        self.loggers = list(loggers)

    @property
    def records(self) -> list[dict[str, Any]]:
        """The records of the first `JsonLogger` (``metrics.jsonl``).

        Raises:
            AttributeError: no `JsonLogger` among the loggers.
        """
        for lg in self.loggers:
            if isinstance(lg, JsonLogger):
                return lg.records
        raise AttributeError("records: no JsonLogger among the loggers")

    def log_hparams(self, config: Any) -> None:
        for lg in self.loggers:
            lg.log_hparams(config)

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        for lg in self.loggers:
            lg.log_metrics(metrics, step)

    def close(self) -> None:
        for lg in self.loggers:
            lg.close()


def setup_logging(
    log_dir: str | os.PathLike,
    config: Any = None,
    tensorboard: bool = False,
    wandb_project: str | None = None,
    start_step: int = 0,
) -> MultiLogger:
    """The loggers of a run: `JsonLogger` (``<log_dir>/metrics.jsonl``) always, `TensorBoardLogger`
    (``<log_dir>/tensorboard``) when `tensorboard`, `WandbLogger` when `wandb_project` is set;
    `config` (the run's settings) is logged to each (``config.json``, a TensorBoard text, the
    W&B run config).

    Args:
        start_step: a resumed run's first step (> 0: ``metrics.jsonl`` keeps the earlier records
            of steps before it, and W&B continues the run's W&B run).

    Raises:
        ConfigError: a requested sink whose package is not installed.
    """
    loggers: list[Logger] = [JsonLogger(log_dir, start_step=start_step)]
    try:
        if tensorboard:
            loggers.append(TensorBoardLogger(Path(log_dir) / "tensorboard"))
        if wandb_project:
            loggers.append(WandbLogger(wandb_project, log_dir, resume=start_step > 0))
    except BaseException:
        for lg in loggers:
            lg.close()
        raise
    out = MultiLogger(loggers)
    if config is not None:
        out.log_hparams(config)
    return out
