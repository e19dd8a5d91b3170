"""Which C allocator a trainer or replica process runs on: tcmalloc when installed, else glibc's malloc.

On CPU torch allocates every tensor with ``malloc``. glibc's malloc gives a
long forward_backward a bad choice (``memory`` has the figures): with its
dynamic mmap threshold freed activations stay in the heap (a 2K-token step on
SmolLM2 peaked 2,241 MB against an 858 MB estimate), and with the 1 MiB
threshold ``serve`` sets each activation is a fresh ``mmap`` whose pages fault
in (the same step: 29.3 s, 12.6 s of it system time; the plain torch loop
takes 17.5 s). gperftools' tcmalloc (Debian's ``libtcmalloc-minimal4``)
keeps freed spans in its page heap for reuse and returns them in the
background: the same step took 21.0 s at a 379 MB peak; 4K 56.6 s (plain
51.8 s) at 725 MB; 8K 140 s at 1,499 MB (2 idle cores, 2026-12-03).

A process cannot switch allocator once running, so ``serve`` and
``generator`` re-execute themselves once with tcmalloc in ``LD_PRELOAD``
(`reexec_with_tcmalloc`; ``--allocator``). Children they spawn (replicas)
inherit it. Without the library everything works on glibc as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from typing import Mapping

__all__ = ["ALLOCATORS", "TCMALLOC", "tcmalloc_library", "tcmalloc_active", "release_free_memory",
           "reexec_with_tcmalloc"]

ALLOCATORS = ("auto", "tcmalloc", "glibc")
TCMALLOC = "tcmalloc_minimal"   # gperftools' tcmalloc without the heap profiler (smaller, same allocator)
_REEXEC_MARK = "TOGETHER_TRAIN_ALLOCATOR_REEXEC"   # set across the one re-exec: never loop


def tcmalloc_library() -> str | None:
    """The tcmalloc shared library's name as the dynamic loader finds it (``libtcmalloc_minimal.so.4``), or
    None when it is not installed (``apt-get install libtcmalloc-minimal4`` on Debian/Ubuntu)."""
    return ctypes.util.find_library(TCMALLOC) or ctypes.util.find_library("tcmalloc")


@functools.cache
def tcmalloc_active() -> bool:
    """Whether this process's ``malloc`` is tcmalloc's (preloaded: its extension symbols are global)."""
    try:
        return hasattr(ctypes.CDLL(None), "MallocExtension_ReleaseFreeMemory")
    except OSError:  # pragma: no cover - no dynamic loader
        return False


def release_free_memory() -> bool:
    """tcmalloc: return every free page to the OS now (``MallocExtension_ReleaseFreeMemory``).

    Returns:
        True when it ran; False when this process does not run on tcmalloc.
    """
    if not tcmalloc_active():
        return False
    ctypes.CDLL(None).MallocExtension_ReleaseFreeMemory()
    return True


def reexec_with_tcmalloc(choice: str, env: Mapping[str, str] | None = None) -> str:
    """Make this process run on tcmalloc per ``choice`` (``--allocator``); re-executes it when needed.

    ``auto``: tcmalloc when the library is installed, else glibc. ``tcmalloc``: required. ``glibc``:
    nothing changes. The re-exec (``os.execve`` of ``sys.orig_argv`` with the library prepended to
    ``LD_PRELOAD``) happens at most once, before any model is loaded; it does not return.

    Args:
        choice: one of ``ALLOCATORS``.
        env: the environment (default ``os.environ``).

    Returns:
        ``"tcmalloc"`` or ``"glibc"``: the allocator this process runs on when no re-exec happened.

    Raises:
        ValueError: an unknown choice, or ``tcmalloc`` asked and not installed (naming the package).
    """
    if choice not in ALLOCATORS:
        raise ValueError(f"--allocator must be one of {', '.join(ALLOCATORS)}, got {choice!r}")
    if tcmalloc_active():
        return "tcmalloc"
    env = dict(os.environ if env is None else env)
    if choice == "glibc" or env.get(_REEXEC_MARK):   # asked for glibc, or the preload did not take
        return "glibc"
    lib = tcmalloc_library()
    if lib is None:
        if choice == "tcmalloc":
            raise ValueError("--allocator tcmalloc: libtcmalloc_minimal is not installed "
                             "(Debian/Ubuntu: apt-get install libtcmalloc-minimal4)")
        return "glibc"
    env["LD_PRELOAD"] = " ".join(filter(None, [lib, env.get("LD_PRELOAD", "")]))
    env[_REEXEC_MARK] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(sys.orig_argv), env)
    raise AssertionError("unreachable")   # pragma: no cover - execve does not return
