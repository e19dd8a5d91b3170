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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
from typing import Any, Callable, Mapping, Sequence, TypeVar

from .interfaces import TrainerEngine
from .wrapped import WrappedTrainerEngine, check_method_names, wrap

__all__ = ["ENV_VAR", "trim_allocator", "TrimAllocator", "install_trim", "install_trim_from_env"]

T = TypeVar("T")

ENV_VAR = "TOGETHER_TRAIN_TRIM_AFTER"

log = logging.getLogger("together_train_server")
_libc: Any = None


def trim_allocator() -> bool:
    """``gc.collect()`` then glibc ``malloc_trim(0)``.

    Returns:
        True when glibc's ``malloc_trim`` ran (whether or not it released
        memory); False where the C library has none (musl, macOS).
    """
    global _libc
    gc.collect()
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        except OSError:
            _libc = False
    fn = getattr(_libc, "malloc_trim", None) if _libc else None
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
