"""Session paging: a resident set of sessions sized by a memory budget; idle ones written out, read back on use.

A session's trainer state (LoRA weights, accumulated gradients, AdamW moments, RNG stream,
step) costs ~16 bytes per trainable parameter in the trainer (float32 weights, gradients and
two moments). `SessionPager` keeps the sessions' states within ``budget_bytes``: when a
session is created or paged in past the budget, the least recently used *idle* session
(nothing queued or running) is written to ``<storage>/pages/<session>.page`` through the
engine's `PageableTrainer.save_session` (crash-safe, checksummed:
engines/session_pages.py) and dropped from the trainer. Any engine call that names a
paged-out session pages it back in first, bit-exactly: the pager is the trainer runtime's one
paging hook (service/core/runtime.py calls `ensure` before every call naming a session), so
operations, weights pushes, checkpoints and snapshots all get it.

What stays resident per paged-out session: its `SessionRecord` (queue, versions; a few KB)
and the pager's entry; the trainer holds nothing of it. When nothing idle can go, the
resident set grows past the budget (work is never refused for memory here; the
per-operation admission, training/memory_admission.py, still applies).

Failures: a page-out that fails to write (disk full, I/O error) keeps the session resident
and logs an error naming the session, the file and the cause (retried after
``retry_after_s``); a page that fails to read back (checksum, truncated) fails the call with
DATA_LOSS naming the session, and the session is never silently given a fresh adapter.

Thread safety: every method runs on the trainer runtime's thread (the only caller of the engine);
`stats` may be read from any thread.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from together_train_server.engines.types import LoraConfig

if TYPE_CHECKING:
    from together_train_server.engines.types import ForwardOutput
    from together_train_server.engines.cross_session import ForwardItem

__all__ = ["SessionPager", "PageIO", "BYTES_PER_PARAM", "default_budget_bytes", "make_pager"]

log = logging.getLogger(__name__)

BYTES_PER_PARAM = 16     # float32 weight + gradient + AdamW exp_avg + exp_avg_sq
PAGE_SUFFIX = ".page"


def default_budget_bytes(available: int | None = None) -> int:
    """The default session-memory budget: a quarter of the memory available at start, within [256 MiB, 2 GiB].

    ``available``: bytes (default: ``MemAvailable`` from /proc/meminfo, else 4 GiB). On a 24 GB machine
    with ~17 GB available that is 2 GiB: ~27 resident trained rank-16 sessions of SmolLM2-135M (78 MB
    each). Capped at 2 GiB because the resource also keeps each published session's latest adapter for
    the replicas (~10 MB per rank-16 session in bf16, 2.5 GB for 256): both stay within 6 GiB.
    """
    if available is None:
        available = 4 << 30
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
        except OSError:
            pass
    return int(min(max(available // 4, 256 << 20), 2 << 30))


@dataclass
class _Entry:
    spec: LoraConfig
    nbytes: int                  # resident cost estimate (BYTES_PER_PARAM x trainable parameters)
    resident: bool = True
    page: Path | None = None     # its last page (kept after a page-in until overwritten or the session stops)
    retry_at: float = 0.0        # after a failed page-out: not tried again before this time


class PageIO(Protocol):
    """The engine calls a `SessionPager` pages with, which the runtime runs (service/core/runtime.py): write a
    session out (`PageableTrainer.save_session`), read it back (``load_session``), free it (``drop_adapter``)."""

    def save_session(self, adapter_id: str, path: str | os.PathLike) -> int: ...

    def load_session(self, adapter_id: str, spec: LoraConfig, path: str | os.PathLike) -> int: ...

    def drop_adapter(self, adapter_id: str) -> None: ...


class SessionPager:
    """Which sessions are in the trainer, and moving them out and in (see the module docstring).

    Args:
        io: the runtime's page I/O over the trainer (`PageIO`).
        pages_dir: where pages are written (created; leftover temporary files removed).
        budget_bytes: resident sessions' estimated bytes kept at or under this when possible.
        is_idle: session id -> True when nothing of it is queued or running.
        retry_after_s: a failed page-out is not retried for this long.
    """

    def __init__(self, io: PageIO, pages_dir: Path, budget_bytes: int,
                 is_idle: Callable[[str], bool], retry_after_s: float = 60.0) -> None:
        self.io = io
        self.pages_dir = Path(pages_dir)
        self.pages_dir.mkdir(parents=True, exist_ok=True)
        for tmp in self.pages_dir.glob(f"*{PAGE_SUFFIX}.tmp-*"):   # a crash mid-write leaves these
            tmp.unlink(missing_ok=True)
        self.budget_bytes = int(budget_bytes)
        self.is_idle = is_idle
        self.retry_after_s = float(retry_after_s)
        self._entries: dict[str, _Entry] = {}
        self._mu = threading.Lock()   # guards the two tables' mutation against `stats` from other threads
        self._lru: collections.OrderedDict[str, None] = collections.OrderedDict()  # resident, oldest first
        self.counters = {"page_outs": 0, "page_ins": 0, "page_out_errors": 0, "page_in_errors": 0}
        self.last_ms = {"page_out": 0.0, "page_in": 0.0}

    # ----- bookkeeping
    def page_path(self, session_id: str) -> Path:
        return self.pages_dir / f"{session_id}{PAGE_SUFFIX}"

    def resident_bytes(self) -> int:
        return sum(self._entries[s].nbytes for s in self._lru)

    def is_resident(self, session_id: str) -> bool:
        e = self._entries.get(session_id)
        return e is None or e.resident

    def stats(self) -> dict[str, Any]:
        """Counts and sizes for capabilities, /metrics and the benchmark (plain values)."""
        with self._mu:
            lru, entries = list(self._lru), dict(self._entries)
        return {"budget_bytes": self.budget_bytes, "resident": len(lru),
                "paged_out": len(entries) - len(lru),
                "resident_bytes": sum(entries[s].nbytes for s in lru if s in entries),
                **self.counters, "last_page_out_ms": self.last_ms["page_out"],
                "last_page_in_ms": self.last_ms["page_in"]}

    # ----- the runtime's hook (on its thread)
    def created(self, session_id: str, spec: LoraConfig, num_params: int) -> None:
        """A session's adapter was just created in the trainer: count it, then keep within the budget."""
        with self._mu:
            self._entries[session_id] = _Entry(spec, BYTES_PER_PARAM * int(num_params))
            self._lru[session_id] = None
        self.make_room(keep=session_id)

    def ensure(self, session_id: str) -> None:
        """Page ``session_id`` in if it is out (after making room), and mark it most recently used.

        Unknown ids pass through (the engine raises its own KeyError).

        Raises:
            PageCorrupt (status DATA_LOSS): its page cannot be read back; it stays paged out.
        """
        e = self._entries.get(session_id)
        if e is None:
            return
        if not e.resident:
            self.make_room(keep=session_id, extra=e.nbytes)
            t0 = time.perf_counter()
            try:
                assert e.page is not None  # a session paged out has its page
                self.io.load_session(session_id, e.spec, e.page)
            except Exception:
                self.counters["page_in_errors"] += 1
                log.error("could not page in session %s from %s", session_id, e.page, exc_info=True)
                raise
            self.last_ms["page_in"] = (time.perf_counter() - t0) * 1000
            self.counters["page_ins"] += 1
            e.resident = True
            log.info("paged in session %s (%.0f ms)", session_id, self.last_ms["page_in"])
        with self._mu:
            self._lru[session_id] = None
            self._lru.move_to_end(session_id)

    def dropped(self, session_id: str) -> bool:
        """The session stops: forget it and delete its page. Returns True when it was resident (drop it too)."""
        with self._mu:
            e = self._entries.pop(session_id, None)
            self._lru.pop(session_id, None)
        if e is None:
            return True
        if e.page is not None:
            e.page.unlink(missing_ok=True)
        return e.resident

    def make_room(self, keep: str | None = None, extra: int = 0) -> None:
        """Page out least recently used idle sessions (never ``keep``) until ``extra`` more bytes fit."""
        while self.resident_bytes() + extra > self.budget_bytes:
            now = time.monotonic()
            victim = next((s for s in self._lru if s != keep and self._entries[s].retry_at <= now
                           and self.is_idle(s)), None)
            if victim is None:
                return
            self.page_out(victim)   # a failure sets its retry time: the next candidate is tried

    def page_out(self, session_id: str) -> bool:
        """Write ``session_id``'s state out and free it from the trainer; False (kept resident) on failure."""
        e = self._entries.get(session_id)
        if e is None or not e.resident:
            return False
        path = self.page_path(session_id)
        t0 = time.perf_counter()
        try:
            nbytes = self.io.save_session(session_id, path)
        except Exception as err:
            self.counters["page_out_errors"] += 1
            e.retry_at = time.monotonic() + self.retry_after_s
            log.error("could not page out session %s to %s (%s: %s); it stays resident, paging it out is "
                      "retried in %.0f s: check the free space of %s", session_id, path, type(err).__name__, err,
                      self.retry_after_s, self.pages_dir)
            return False
        self.io.drop_adapter(session_id)
        self.last_ms["page_out"] = (time.perf_counter() - t0) * 1000
        self.counters["page_outs"] += 1
        e.resident, e.page = False, path
        with self._mu:
            self._lru.pop(session_id, None)
        log.info("paged out session %s (%d bytes, %.0f ms)", session_id, nbytes, self.last_ms["page_out"])
        return True

    def has_idle(self, idle_for: Callable[[str], float], after_s: float) -> bool:
        """Whether a resident session went unused for ``after_s`` seconds (any thread: a look before
        `page_out_idle` is queued on the runtime, so an idle resource queues nothing)."""
        with self._mu:
            lru = list(self._lru)
        return any(idle_for(s) >= after_s for s in lru)

    def page_out_idle(self, idle_for: Callable[[str], float], after_s: float) -> int:
        """Page out every idle resident session unused for ``after_s`` seconds; returns how many."""
        n = 0
        for s in list(self._lru):
            if idle_for(s) >= after_s and self._entries[s].retry_at <= time.monotonic() and self.is_idle(s):
                n += self.page_out(s)
        return n

    def run_cycle(self, items: Sequence[ForwardItem],
                  many: Callable[[Sequence[ForwardItem]], list[ForwardOutput | BaseException]],
                  one: Callable[..., ForwardOutput]) -> list[ForwardOutput | BaseException]:
        """A clock cycle (service/training/cycle.py) once every item's session is in: ``many(items)``.

        When paging one in pushed another of the cycle out (the budget holds fewer), the items run one by
        one through ``one`` (the runtime's ``forward``, which pages each in); an item whose session cannot be
        paged in gets that error as its result.
        """
        out: dict[int, ForwardOutput | BaseException] = {}
        for i, it in enumerate(items):
            try:
                self.ensure(it.adapter_id)
            except Exception as e:   # that session's own failure (PageCorrupt)
                out[i] = e
        rest = [i for i in range(len(items)) if i not in out]
        if all(self.is_resident(items[i].adapter_id) for i in rest):
            out.update(zip(rest, many([items[i] for i in rest])))
        else:
            for i in rest:
                it = items[i]
                try:
                    out[i] = one(it.adapter_id, it.samples, it.loss_fn, it.loss_params, backward=it.backward,
                                 return_logprobs=it.return_logprobs, return_elementwise=it.return_elementwise)
                except Exception as e:   # that op's own error
                    out[i] = e
        return [out[i] for i in range(len(items))]


def pages_dir(storage_dir: str | os.PathLike) -> Path:
    return Path(storage_dir) / "pages"


@dataclass(frozen=True)
class PagingConfig:
    """Serve's paging settings (``--session-memory-mb``, ``--page-out-idle``: `ServeConfig.paging`).

    Attributes:
        budget_bytes: resident sessions' memory budget (None: `default_budget_bytes`; 0: paging off,
            every session stays resident).
        page_idle_s: a session idle this long is paged out even within the budget (0: only for room).
    """

    budget_bytes: int | None = None
    page_idle_s: float = 600.0


def make_pager(storage_dir: str | os.PathLike, config: PagingConfig | None,
               is_idle: Callable[[str], bool]) -> Callable[[PageIO], SessionPager | None]:
    """What `TrainerRuntime.use_pager` builds the pager with: a `SessionPager` over the engine's page I/O, or
    None when paging is off (``budget_bytes`` 0). The runtime asks only when its engine declares ``paging``
    and trains LoRA."""
    config = config or PagingConfig()

    def make(io: PageIO) -> SessionPager | None:
        if config.budget_bytes == 0:
            return None
        budget = config.budget_bytes if config.budget_bytes is not None else default_budget_bytes()
        pager = SessionPager(io, pages_dir(storage_dir), budget, is_idle)
        log.info("session paging: %.0f MiB of resident sessions (%s), pages in %s", budget / (1 << 20),
                 "--session-memory-mb" if config.budget_bytes is not None else "default: 1/4 of available memory",
                 pager.pages_dir)
        return pager

    return make


def paging_summary(pager: SessionPager | None) -> str:
    """One line for serve's start message: the resident budget, or why every session stays resident."""
    if pager is None:
        return "session paging off: every session stays resident"
    return f"resident sessions within {pager.budget_bytes / (1 << 20):.0f} MiB, paged out to {pager.pages_dir}"


def paging_families(pager: SessionPager | None) -> list[Any]:
    """Prometheus families of one scrape (resource-wide, no session ids): resident / paged-out sessions,
    the resident bytes and budget, page-outs / page-ins and their failures. Empty with paging off."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    if pager is None:
        return []
    st = pager.stats()
    sessions = GaugeMetricFamily("together_train_sessions_paging", "Sessions by residency in the trainer",
                                 labels=["state"])
    sessions.add_metric(["resident"], st["resident"])
    sessions.add_metric(["paged_out"], st["paged_out"])
    return [
        sessions,
        GaugeMetricFamily("together_train_session_memory_bytes", "Estimated bytes of the resident sessions",
                          value=st["resident_bytes"]),
        GaugeMetricFamily("together_train_session_memory_budget_bytes", "--session-memory-mb in bytes",
                          value=st["budget_bytes"]),
        CounterMetricFamily("together_train_page_outs", "Sessions paged out", value=st["page_outs"]),
        CounterMetricFamily("together_train_page_ins", "Sessions paged in", value=st["page_ins"]),
        CounterMetricFamily("together_train_page_errors", "Failed page-outs (kept resident) and page-ins "
                            "(DATA_LOSS)", value=st["page_out_errors"] + st["page_in_errors"]),
    ]
