"""Host-memory housekeeping: give the C heap's free pages back to the OS.

On CPU, torch allocates tensors with plain ``malloc``; glibc keeps freed
blocks (a forward's activations, a step's gradients) in its arenas, and
persistent tensors allocated later (an adapter's AdamW moments) can pin the
pages around them. The process's resident set then grows by more than the
live tensors; ``malloc_trim(0)`` returns every free whole page to the OS
(glibc >= 2.8 releases pages inside the heap too, not only at its top).
Nothing here changes any tensor.

``TOGETHER_TRAIN_TRIM_AFTER`` (an ops/benchmark knob, unset = off) names
engine methods after which the allocator is trimmed, e.g.
``TOGETHER_TRAIN_TRIM_AFTER=optim_step,create_adapter,drop_adapter``.
Each trim costs a few milliseconds plus re-faulting the pages the next
forward touches, so it is off by default; ``benchmarks/sessions.py`` sets it
to measure memory per session without allocator noise.

``set_mmap_threshold`` (called by ``serve`` at start; ``TOGETHER_TRAIN_MMAP_THRESHOLD``
bytes, default 1 MiB, 0 = glibc's own) makes glibc serve every block of at
least that size with its own ``mmap`` and unmap it on free. glibc's default
raises its threshold dynamically up to 32 MiB (and its trim threshold to 64 MiB)
after the first large free, so a long forward's activations (a few MB each)
then come from the heap, and the pages freed there stay resident: on the tiny
test model a 1,500-token forward_backward peaked 373-405 MB above the trainer
with glibc's dynamic threshold or a fixed 32 MiB, against its 329 MB estimate.
The price of 1 MiB is a page fault per fresh page of every such block, also in
short steps (``train_overhead --quick`` 0.75 of the plain loop, idle). A fixed
8 MiB (above short steps' blocks: SmolLM2, 1,024 positions, 6.3 MB at most)
kept the tiny model's peaks under their estimates (74-165 MB) and SmolLM2's 4K
peak at 270 MB, but its 8K forward_backward peaked at 2,009 MB (1 MiB: 738-930
MB), over the 2,000 MB target of ``benchmarks/long_context.py``: reverted.
docs/operating.md has the figures.

``short_steps.run_sized`` (the trainer calls it around each micro-batch)
takes short steps off that tax on a thread and arena of their own.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
from typing import Any, Callable, Mapping, Sequence, TypeVar

from . import allocator, short_steps
from .interfaces import TrainerEngine
from .wrapped import WrappedTrainerEngine, check_method_names, wrap

__all__ = ["ENV_VAR", "MMAP_ENV_VAR", "DEFAULT_MMAP_THRESHOLD", "trim_allocator", "TrimAllocator", "install_trim",
           "install_trim_from_env", "set_mmap_threshold"]

T = TypeVar("T")

ENV_VAR = "TOGETHER_TRAIN_TRIM_AFTER"
MMAP_ENV_VAR = "TOGETHER_TRAIN_MMAP_THRESHOLD"
DEFAULT_MMAP_THRESHOLD = 1 << 20   # 8 MiB was tried: long_context's 8K peak 2,009 MB > 2,000 (docstring)
_M_MMAP_THRESHOLD = -3   # glibc malloc.h

log = logging.getLogger("together_train_server")
_libc: Any = None


def _load_libc() -> Any:
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        except OSError:
            _libc = False
    return _libc


def set_mmap_threshold(nbytes: int | None = None, env: Mapping[str, str] | None = None) -> int:
    """glibc ``mallopt(M_MMAP_THRESHOLD, nbytes)`` (fixed threshold: blocks >= nbytes are mmapped).

    Args:
        nbytes: the threshold in bytes; None: ``TOGETHER_TRAIN_MMAP_THRESHOLD`` from ``env`` (default
            ``DEFAULT_MMAP_THRESHOLD``). 0 leaves glibc's dynamic threshold. A set
            ``MALLOC_MMAP_THRESHOLD_`` (glibc's own variable) wins: nothing is changed.

    Returns:
        The threshold set, or 0 when nothing was set (0 asked, glibc's variable set, no glibc, or the
        process runs on tcmalloc: `allocator`).
    """
    env = os.environ if env is None else env
    if "MALLOC_MMAP_THRESHOLD_" in env or allocator.tcmalloc_active():   # glibc's malloc is not the one in use
        return 0
    if nbytes is None:
        nbytes = int(env.get(MMAP_ENV_VAR, DEFAULT_MMAP_THRESHOLD))
    fn = getattr(_load_libc() or None, "mallopt", None)
    if nbytes <= 0 or fn is None:
        return 0
    if fn(_M_MMAP_THRESHOLD, int(nbytes)) != 1:
        return 0
    short_steps.start(int(nbytes), fn)
    return int(nbytes)


def trim_allocator() -> bool:
    """``gc.collect()`` then glibc ``malloc_trim(0)`` (tcmalloc: ``allocator.release_free_memory``).

    Returns:
        True when glibc's ``malloc_trim`` (or tcmalloc's release) ran, whether or
        not it released memory; False where the C library has none (musl, macOS).
    """
    gc.collect()
    if allocator.release_free_memory():
        return True
    libc = _load_libc()
    fn = getattr(libc, "malloc_trim", None) if libc else None
    if fn is None:
        return False
    fn(0)
    return True


class TrimAllocator:
    """`EngineHook`: `trim_allocator()` after each call of the named engine methods (also a failing one)."""

    def __init__(self, methods: Sequence[str]) -> None:
        self.methods = frozenset(methods)

    def around(self, method: str, call: Callable[[], T]) -> T:
        if method not in self.methods:
            return call()
        try:
            return call()
        finally:
            trim_allocator()


def install_trim(engine: TrainerEngine, methods: list[str]) -> WrappedTrainerEngine:
    """``engine`` wrapped so the allocator is trimmed after each call of ``methods`` (`TrimAllocator`).

    Returns:
        One `WrappedTrainerEngine` (``engine``'s hooks, if it is one, plus this).

    Raises:
        ValueError: the engine has no such method.
    """
    check_method_names(methods, engine, ENV_VAR)
    log.info("%s: the allocator is trimmed after %s", ENV_VAR, methods)
    return wrap(engine, TrimAllocator(methods))


def install_trim_from_env(engine: TrainerEngine, env: Mapping[str, str] | None = None) -> TrainerEngine:
    """``install_trim(engine, <comma-separated names in env[ENV_VAR]>)`` when set; else ``engine`` untouched."""
    spec = (os.environ if env is None else env).get(ENV_VAR, "")
    names = [p.strip() for p in spec.split(",") if p.strip()]
    return install_trim(engine, names) if names else engine
