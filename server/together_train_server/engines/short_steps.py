"""Short micro-batches on a thread and glibc arena of their own, with a high mmap threshold.

serve sets glibc's mmap threshold to 1 MiB at start (``memory`` has why),
so every activation of every step is a fresh mmap and page-faults in: the
trainer of ``train_overhead --quick`` took 188,601 minor faults and 0.48 s of
system time per step against glibc's own 52,295 and 0.22 s.
``run_sized`` (the trainer calls it around each micro-batch and clock-cycle
pass; ``memory.set_mmap_threshold`` calls `start`) takes short steps off that
tax without giving long ones a heap: a micro-batch of at most ``SHORT_MICRO_BATCH_TOKENS`` padded tokens runs with the
threshold at ``SHORT_MMAP_THRESHOLD`` (32 MiB, glibc's dynamic ceiling: blocks
come from the heap and are reused) on one dedicated thread, ``short-steps``,
whose glibc arena (one per thread) thus holds every block short steps free; a
long one runs on the caller's thread at the threshold set at start. A long
micro-batch never draws from the short steps' free blocks (what sank the
earlier per-micro-batch threshold, 715418f: a long operation after short ones
re-touched their freed heap blocks and peaked 505 MB against a 340 MB
estimate). The heap costs memory: SmolLM2, one forward_backward after a
short one, peak above the RSS before it (in-process, 2026-12-03): 512 tokens
1,225 MB in the heap vs 834 MB at 1 MiB (estimate 1,452); 1,024 tokens 2,172-2,484
vs 1,440-1,495 (estimate 2,589: 4 % margin), hence the 512-token bound.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from . import allocator

__all__ = ["SHORT_MMAP_THRESHOLD", "SHORT_MICRO_BATCH_TOKENS", "SHORT_STEPS_THREAD", "start", "run_sized"]

T = TypeVar("T")

SHORT_MMAP_THRESHOLD = 32 << 20   # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
SHORT_MICRO_BATCH_TOKENS = 512   # at most this many padded tokens: a short micro-batch (heap reuse; docstring)
SHORT_STEPS_THREAD = "short-steps"
_M_MMAP_THRESHOLD = -3   # glibc malloc.h


class _Sized:
    """`run_sized`'s state once `start`ed: the long threshold, the one in force, the short-steps thread.
    Calls come from the one trainer worker (under the engine lock)."""

    long_threshold = 0
    current = 0
    mallopt: Callable[[int, int], int] | None = None
    pool: ThreadPoolExecutor | None = None
    thread: threading.Thread | None = None

    @classmethod
    def use(cls, nbytes: int) -> None:
        if nbytes != cls.current and cls.mallopt is not None and cls.mallopt(_M_MMAP_THRESHOLD, nbytes) == 1:
            cls.current = nbytes


def start(nbytes: int, mallopt: Callable[[int, int], int]) -> None:
    """Turn `run_sized` on: ``nbytes`` is the threshold just set with glibc's ``mallopt`` (long micro-batches').

    The short-steps thread starts (once) and takes its glibc arena now, before the server's threads
    (glibc gives a thread an arena of its own while fewer than 8 x cores exist).
    """
    _Sized.long_threshold = _Sized.current = int(nbytes)
    _Sized.mallopt = mallopt
    if _Sized.pool is None:
        _Sized.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=SHORT_STEPS_THREAD)
        _Sized.thread = _Sized.pool.submit(_attach_arena).result()


def _attach_arena() -> threading.Thread:
    bytearray(4096)   # above pymalloc's 512 bytes: a C malloc, which attaches the thread's arena
    return threading.current_thread()


def run_sized(padded_tokens: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` (a micro-batch's forward/backward of ``padded_tokens`` = rows x longest) where its freed
    blocks belong (module docstring).

    Before `start` (``memory.set_mmap_threshold`` set no threshold): ``fn()`` here; on tcmalloc
    (``allocator``) a micro-batch above ``SHORT_MICRO_BATCH_TOKENS`` is followed by
    ``allocator.release_free_memory()``, so its activations do not stay resident.
    Above ``SHORT_MICRO_BATCH_TOKENS``: the threshold set at start, ``fn()`` on this thread. Else:
    ``max(that, SHORT_MMAP_THRESHOLD)``, ``fn()`` on the ``short-steps`` thread (this one waits; what
    ``fn`` raises is raised here). ``fn`` must not depend on thread-local torch state set by the caller
    (grad mode: set it inside). Results are those of ``fn()`` alone: only where memory comes from changes.
    """
    pool = _Sized.pool
    if pool is None or _Sized.long_threshold <= 0:
        if int(padded_tokens) > SHORT_MICRO_BATCH_TOKENS and allocator.tcmalloc_active():
            try:
                return fn(*args)
            finally:   # tcmalloc keeps freed spans resident: a long micro-batch's go back to the OS now
                allocator.release_free_memory()
        return fn(*args)
    if int(padded_tokens) > SHORT_MICRO_BATCH_TOKENS:
        _Sized.use(_Sized.long_threshold)
        return fn(*args)
    _Sized.use(max(_Sized.long_threshold, SHORT_MMAP_THRESHOLD))
    if threading.current_thread() is _Sized.thread:
        return fn(*args)
    return pool.submit(fn, *args).result()
