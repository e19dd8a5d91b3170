"""The resource a recipe trains on: a given client, ``--address``, or a local resource launched
for the run (checkpoints under ``out_dir/storage``, log ``out_dir/server.log``); sessions
stopped however the run ends. `Connection`: the settings (flags) that choose it, which every
loop's ``Config`` inherits.

Imports only the SDK.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import together_train as tt


@dataclass
class Connection:
    """Which resource a run uses (each field is also a flag: ``--address``, ``--api-key`` ...)."""

    model: str | None = field(default=None, metadata={"help": "local HF model dir; default: embedded SmolLM2-135M"})
    address: str | None = field(default=None, metadata={"help": "host:port of a running resource; default: launch one locally"})
    api_key: str | None = field(default=None, metadata={"help": "API key for --address"})
    generators: int = field(default=1, metadata={"help": "generator replicas of a local resource"})
    dtype: str | None = field(default=None, metadata={"help": "model dtype of a local resource (float32, bfloat16); default: the server's"})


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
        http_port=getattr(cfg, "http_port", None),  # the OpenAI endpoint, for recipes that need it (agent_rl)
    ) as c:
        yield c


def local_storage(cfg: Any, out_dir: Path, client: tt.ResourceClient | None) -> Path | None:
    """``out_dir/storage`` when `connect` will launch a local resource, else None."""
    return None if client is not None or getattr(cfg, "address", None) else Path(out_dir) / "storage"


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

