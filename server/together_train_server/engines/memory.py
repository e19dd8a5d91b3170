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
import functools
import gc
import logging
import os
from typing import Any, Mapping

__all__ = ["ENV_VAR", "trim_allocator", "install_trim", "install_trim_from_env"]

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


def _trimmed(original: Any) -> Any:
    @functools.wraps(original)
    def trimmed(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        finally:
            trim_allocator()

    return trimmed


def install_trim(engine: Any, methods: list[str]) -> Any:
    """Wrap ``engine``'s ``methods`` (on the instance) so the allocator is trimmed after each call.

    Returns:
        ``engine`` itself.

    Raises:
        ValueError: the engine has no such method.
    """
    for name in methods:
        original = getattr(engine, name, None)
        if not callable(original):
            raise ValueError(f"{ENV_VAR}: engine {type(engine).__name__} has no method {name!r}")

        setattr(engine, name, _trimmed(original))
    log.info("%s: the allocator is trimmed after %s", ENV_VAR, methods)
    return engine


def install_trim_from_env(engine: Any, env: Mapping[str, str] | None = None) -> Any:
    """``install_trim(engine, <comma-separated names in env[ENV_VAR]>)`` when set; else ``engine`` untouched."""
    spec = (os.environ if env is None else env).get(ENV_VAR, "")
    names = [p.strip() for p in spec.split(",") if p.strip()]
    return install_trim(engine, names) if names else engine
