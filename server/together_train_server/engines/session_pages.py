"""One session's full trainer state as one crash-safe, checksummed file (a "page"): what paging writes.

A page holds everything that makes a session continue bit-exactly after it left the
trainer: the adapter's parameters, its accumulated gradients (when a
``forward_backward`` awaits its ``optim_step``), the AdamW state and param groups, the
session's RNG stream (LoRA dropout) and step counter. Format: one safetensors file:

- tensors ``w::<name>`` (parameters, own dtype), ``g::<name>`` (gradients present),
  ``o::<index>::<key>`` (AdamW state tensors of parameter ``index``), ``rng`` (uint8);
- metadata ``page`` (JSON: ``format``, ``version``, ``adapter_id``, ``step``, ``lora``,
  ``names``, ``param_groups``, ``opt_scalars``) and ``sha256``: the SHA-256 of the
  ``page`` JSON followed by every tensor's bytes in key order, checked on read.

Writing is write-then-rename: the tensors go to ``<page>.tmp-<pid>``, which is fsynced,
renamed over ``<page>`` and the directory fsynced; a crash at any point leaves the
previous page or the new one, whole. A failed write (disk full) removes the temporary
file and raises ``OSError``; nothing else changes.

Tests only: ``TOGETHER_TRAIN_TEST_PAGE_FAULTS`` (never set in production) makes writes
fail or stall, like engines/fault_injection.py: ``enospc:K`` (the K-th page write
writes half its bytes, then raises ``OSError(ENOSPC)``), ``stall:S`` (every page write,
from the ``stall_from:K``-th on, sleeps S seconds between writing the temporary file and
renaming it, printing ``PAGE-WRITE-STALL <path>`` to stderr first, so a test can kill -9
the process there).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Mapping

import torch

__all__ = ["PAGE_FORMAT", "PageCorrupt", "write_page", "read_page", "FAULTS_ENV", "save_session", "load_session"]

PAGE_FORMAT = "together-train/session-page"
PAGE_VERSION = 1
FAULTS_ENV = "TOGETHER_TRAIN_TEST_PAGE_FAULTS"
_writes = 0
_writes_lock = threading.Lock()


class PageCorrupt(ValueError):
    """A page file that is unreadable or fails its checksum (status DATA_LOSS)."""

    grpc_code = "DATA_LOSS"


def _digest(meta_json: str, tensors: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.sha256(meta_json.encode())
    for k in sorted(tensors):
        t = tensors[k].detach().contiguous().reshape(-1)
        h.update(k.encode())
        h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
    return h.hexdigest()


def _faults() -> dict[str, float]:
    spec = os.environ.get(FAULTS_ENV, "")
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, arg = part.partition(":")
        out[name] = float(arg or 0)
    return out


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_page(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> int:
    """Write a page atomically (see the module docstring); returns its size in bytes.

    Args:
        tensors: CPU or device tensors (copied to CPU as they are written), distinct storages.
        meta: JSON-able page metadata (``format`` and ``version`` are added).

    Raises:
        OSError: the write failed (e.g. ENOSPC); the previous page, if any, is untouched.
    """
    from safetensors.torch import save

    global _writes
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    meta_json = json.dumps({"format": PAGE_FORMAT, "version": PAGE_VERSION, **meta}, sort_keys=True)
    blob = save(cpu, metadata={"page": meta_json, "sha256": _digest(meta_json, cpu)})
    faults = _faults()
    with _writes_lock:
        _writes += 1
        n = _writes
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            if faults.get("enospc") == n:
                f.write(blob[: len(blob) // 2])
                raise OSError(errno.ENOSPC, f"No space left on device (injected by {FAULTS_ENV})", str(tmp))
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        if "stall" in faults and n >= faults.get("stall_from", 1):
            print(f"PAGE-WRITE-STALL {path}", file=sys.stderr, flush=True)
            time.sleep(faults["stall"])
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return len(blob)


def read_page(path: str | os.PathLike, adapter_id: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, meta)`` of a page, checksum verified.

    Raises:
        PageCorrupt: missing, unreadable, not a page, of another session, or failing its
            checksum; the message names ``adapter_id`` and the file.
    """
    from safetensors.torch import load

    path = Path(path)
    where = f"the paged-out state of session {adapter_id} ({path})"
    try:
        blob = path.read_bytes()
        tensors = load(blob)
        header_len = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8: 8 + header_len])
        md = header.get("__metadata__") or {}
        meta_json, digest = md["page"], md["sha256"]
        meta = json.loads(meta_json)
    except Exception as err:
        raise PageCorrupt(f"{where} cannot be read ({type(err).__name__}: {err}); "
                          "the session's state is lost, it was not replaced by a fresh adapter") from err
    if meta.get("format") != PAGE_FORMAT or meta.get("adapter_id") != adapter_id:
        raise PageCorrupt(f"{where} is not a page of this session")
    if _digest(meta_json, tensors) != digest:
        raise PageCorrupt(f"{where} fails its checksum (the file changed after it was written); "
                          "the session's state is lost, it was not replaced by a fresh adapter")
    return tensors, meta


def save_session(engine: Any, adapter_id: str, path: str | os.PathLike) -> int:
    """Write adapter ``adapter_id``'s full state of a `TorchTrainerEngine` as a page; returns its bytes.

    The adapter stays in the engine (the caller drops it once the page is written).

    Raises:
        KeyError: unknown adapter. OSError: the write failed (the previous page is untouched).
    """
    from dataclasses import asdict

    st = engine._get(adapter_id)
    names = engine.table.state_names(st)
    tensors: dict[str, torch.Tensor] = {}
    for n, p in zip(names, st.params):
        tensors[f"w::{n}"] = p.detach()
        if p.grad is not None:
            tensors[f"g::{n}"] = p.grad
    sd = engine._optimizer_state_dict(st)
    scalars: dict[str, dict[str, Any]] = {}
    for i, state in sd["state"].items():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                tensors[f"o::{i}::{k}"] = v
            else:
                scalars.setdefault(str(i), {})[k] = v
    if st.rng_state is not None:
        tensors["rng"] = st.rng_state
    meta = {"adapter_id": adapter_id, "step": st.step, "lora": asdict(st.spec), "names": names,
            "param_groups": sd["param_groups"], "opt_scalars": scalars}
    return write_page(path, tensors, meta)


def load_session(engine: Any, adapter_id: str, spec: Any, path: str | os.PathLike) -> int:
    """Create adapter ``adapter_id`` (``spec``) in a `TorchTrainerEngine` from its page; returns its step.

    Parameters, gradients, AdamW state, RNG stream and step come back exactly as written.

    Raises:
        PageCorrupt: the page is unreadable, of another session or shape, or fails its checksum
            (nothing is created). ValueError: the id exists.
    """
    from dataclasses import asdict

    tensors, meta = read_page(path, adapter_id)
    if meta.get("lora") != json.loads(json.dumps(asdict(spec))):
        raise PageCorrupt(f"the paged-out state of session {adapter_id} ({path}) has LoRA config "
                          f"{meta.get('lora')}, not the session's {asdict(spec)}")
    engine.create_adapter(adapter_id, spec)
    try:
        st = engine._get(adapter_id)
        names = engine.table.state_names(st)
        if names != meta["names"]:
            raise PageCorrupt(f"the paged-out state of session {adapter_id} ({path}) names other parameters")
        with torch.no_grad():
            for n, p in zip(names, st.params):
                p.copy_(tensors[f"w::{n}"])
                g = tensors.get(f"g::{n}")
                p.grad = None if g is None else g.to(p.device)
        state: dict[int, dict[str, Any]] = {}
        for k, v in tensors.items():
            if k.startswith("o::"):
                _, i, key = k.split("::", 2)
                state.setdefault(int(i), {})[key] = v
        for i, extra in meta["opt_scalars"].items():
            state.setdefault(int(i), {}).update(extra)
        engine._load_optimizer_state_dict(st, {"state": state, "param_groups": meta["param_groups"]})
        if "rng" in tensors:
            st.rng_state = tensors["rng"]
        st.step = int(meta["step"])
    except BaseException:
        engine.drop_adapter(adapter_id)
        raise
    return st.step
