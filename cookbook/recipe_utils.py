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
- `resolve_init_from(ref, storage_dir)`: ``--init-from`` / ``--teacher-checkpoint`` as a URI; a
  run dir's checkpoint is copied into this recipe's local storage (`import_checkpoint`), so
  ``sft --out-dir A`` then ``dpo --init-from A`` works with two separate local resources.

Imports only the SDK at module level (transformers / the server package inside functions).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
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
    """A `config_cls` instance from command-line flags (one per dataclass field)."""
    parser = build_parser(config_cls, prog, (doc or "").split("\n\n")[0])
    return config_cls(**vars(parser.parse_args(argv)))


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


def resolve_init_from(init_from: str, storage_dir: Path | None = None) -> str:
    """A training-checkpoint URI from ``--init-from``: a URI as is, or a recipe's out dir
    (its ``summary.json`` ``state_uri``).

    `storage_dir`: the storage directory of the resource that will load the checkpoint when it
    is a local resource of this recipe (``out_dir/storage``, see `connect`). A run dir's
    checkpoint lives in *that* run's local storage (``<run dir>/storage``), which another
    local resource does not see; it is copied into `storage_dir` (same layout,
    ``sessions/<session>/<kind>/<name>/`` with its manifest) unless already there. Pass None
    when attaching to a running resource (``--address``) or a shared client."""
    if "://" in init_from:
        return init_from
    summary = Path(init_from) / "summary.json"
    if summary.exists():
        uri = json.loads(summary.read_text()).get("state_uri")
        if uri:
            if storage_dir is not None:
                import_checkpoint(Path(init_from) / "storage", str(uri), Path(storage_dir))
            return str(uri)
    raise SystemExit(f"--init-from {init_from}: not a checkpoint URI nor a run dir with summary.json state_uri")


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


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")
