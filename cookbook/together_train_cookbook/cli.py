"""A recipe's command line: its ``Config`` dataclass becomes flags, the values are checked before
anything is created, and errors become one line naming the flag.

- `parse_config(Config, argv, prog)`: one flag per dataclass field (``lora_rank`` ->
  ``--lora-rank``; ``help`` / ``choices`` from the field metadata; bools get ``--x`` / ``--no-x``;
  ``metadata={"hidden": True}`` keeps a flag that exists only for tests out of ``--help``).
- `validate(cfg)`: the checks every recipe's ``run`` makes first; raises `ConfigError`
  (a ValueError) naming the flag and its value.
- `cli(run, cfg)`: a recipe's ``main``: `ConfigError` and the SDK's typed errors become a
  one-line exit (the flag named) instead of a traceback; `run` itself keeps raising them.

Imports only the SDK.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any, Callable

import together_train as tt
from together_train.config_flags import add_flags, flag
from together_train_cookbook.jsonl import DataError


def build_parser(config_cls: type, prog: str, description: str = "") -> argparse.ArgumentParser:
    """An argparse parser with one flag per field of the dataclass `config_cls`
    (`together_train.config_flags.add_flags`: the server's ``serve`` flags are built the same way).

    Field metadata: ``help``, ``choices``, and ``hidden`` (True: the flag works but is left out
    of ``--help``, for settings that exist only for tests)."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_flags(parser, config_cls)
    return parser


def parse_config(config_cls: type, argv: list[str] | None = None, prog: str = "", doc: str | None = None) -> Any:
    """A `config_cls` instance from command-line flags (one per dataclass field). Values are
    checked by the recipe's ``run`` (`validate`, first thing) and a bad one becomes a one-line
    exit in `cli`."""
    parser = build_parser(config_cls, prog, (doc or "").split("\n\n")[0])
    return config_cls(**vars(parser.parse_args(argv)))


class ConfigError(ValueError):
    """A recipe setting that cannot work (the message names the flag and its value)."""


def validate(cfg: Any) -> None:
    """Check the settings every recipe shares (each only when `cfg` has the field) and the
    recipe's own (``cfg.check()`` when the Config defines it). Runs before anything is created.

    - ``steps`` >= 0 (sft: 0 = ``--epochs`` decide; rl / dpo / distill: 0 = no training step,
      the start is evaluated and saved as the final checkpoint);
    - ``batch_size``, ``num_samples`` >= 1; ``save_every``, ``eval_every``, ``stop_after`` >= 0;
    - ``learning_rate`` finite and >= 0; ``beta`` (dpo) finite and > 0;
    - ``data``, ``eval_data``: an existing file or directory (`data.load_rows`); ``loss_config``: a JSON object; ``init_from`` /
      ``teacher_checkpoint``: a URI or a run dir with ``summary.json``.

    The recipe's own ``cfg.check()`` runs first.

    Raises:
        ConfigError: the first bad value, as ``--flag VALUE: why``.
    """
    check = getattr(cfg, "check", None)
    if callable(check):  # the recipe's own first (e.g. dpo --rejected sampled with --data)
        check()

    def bad(name: str, why: str) -> ConfigError:
        return ConfigError(f"{flag(name)} {getattr(cfg, name)}: {why}")

    def has(name: str) -> bool:
        return hasattr(cfg, name) and getattr(cfg, name) is not None

    if has("steps") and cfg.steps < 0:
        raise bad("steps", "must be >= 0")
    for name in ("batch_size", "num_samples"):
        if has(name) and getattr(cfg, name) < 1:
            raise bad(name, "must be >= 1")
    for name in ("save_every", "eval_every", "stop_after", "eval_examples"):
        if has(name) and getattr(cfg, name) < 0:
            raise bad(name, "must be >= 0")
    if has("learning_rate") and not (math.isfinite(cfg.learning_rate) and cfg.learning_rate >= 0):
        raise bad("learning_rate", "must be a finite number >= 0")
    if has("beta") and not (math.isfinite(cfg.beta) and cfg.beta > 0):
        raise bad("beta", "must be a finite number > 0")
    for name in ("data", "eval_data"):  # a file or a save_to_disk dir (`data.load_rows`)
        if has(name) and not Path(getattr(cfg, name)).expanduser().exists():
            raise bad(name, "no such file or directory (local data only: a hub dataset is never downloaded; "
                            "save it once with datasets' save_to_disk and pass that directory)")
    for name in ("init_from", "teacher_checkpoint"):  # a URI, or a run dir with summary.json
        ref = getattr(cfg, name, None)
        if ref and "://" not in ref and not (Path(ref) / "summary.json").is_file():
            raise bad(name, "not a checkpoint URI nor a run dir with summary.json state_uri")
    if getattr(cfg, "loss_config", None):
        try:
            lc = json.loads(cfg.loss_config)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--loss-config {cfg.loss_config!r}: not JSON ({e})") from None
        if not isinstance(lc, dict):
            raise ConfigError(f"--loss-config {cfg.loss_config!r}: expected a JSON object, e.g. "
                              '\'{"clip_high_threshold": 1.3}\'')


def _flag_of_error(cfg: Any, err: Exception) -> str:
    """The flag an SDK error at startup most likely comes from."""
    if isinstance(err, (tt.UnavailableError, tt.DeadlineExceededError)) and getattr(cfg, "address", None):
        return f"--address {cfg.address}"
    if isinstance(err, (tt.PermissionDeniedError,)) and getattr(cfg, "address", None):
        return f"--address {cfg.address} (--api-key)"
    if isinstance(err, tt.ServerStartError):
        return f"--model {getattr(cfg, 'model', None) or '(embedded default)'} (local resource)"
    return ""


def cli(run: Callable[[Any], Any], cfg: Any, prog: str = "") -> int:
    """A recipe's command-line entry: ``run(cfg)``; a `ConfigError` or a together_train error
    (NOT_FOUND checkpoint, unreachable ``--address``, ...) exits with one line naming the flag
    instead of a traceback. Library callers of ``run`` still get the exceptions."""
    name = prog or "error"
    try:
        run(cfg)
    except (ConfigError, DataError) as e:
        raise SystemExit(f"{name}: {e}") from None
    except tt.TogetherTrainError as e:
        if e.message.startswith("--"):  # already names its flag (explain_not_found)
            raise SystemExit(f"{name}: {e.message} [{e.code}]") from None
        where = _flag_of_error(cfg, e)
        raise SystemExit(f"{name}: {where + ': ' if where else ''}{e}") from None
    return 0

