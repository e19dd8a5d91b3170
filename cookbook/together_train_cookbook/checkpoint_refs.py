"""Checkpoints named on the command line (``--init-from``, ``--teacher-checkpoint``): a URI, or a
run dir whose ``summary.json`` holds ``state_uri``.

A run dir's checkpoint lives in *that* run's local storage; `resolve_init_from` copies it into
this run's local storage (`import_checkpoint`), so ``sft --out-dir A`` then ``dpo --init-from A``
works with two separate local resources. `explain_not_found` turns the resource's NOT_FOUND
for it into a message saying where the checkpoint lives and which ``--address`` to use.

Imports only the SDK.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Iterator

import together_train as tt


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

