"""Rank 0's guard over the follower ranks of a multi-rank trainer (``--trainer deepspeed``).

A follower that dies must become a clear error naming it, at once, and the
launcher's teardown must not turn that error into a refused connection:

- Every rank publishes ``(host, pid, process start time)`` once at startup
  (`exchange_peers`, a collective). Rank 0 sees a same-host follower die
  from ``/proc`` at once (a reused pid is told apart by its start time); a
  follower on another host by the engine's heartbeat (``engine.failed``,
  after its ``heartbeat_timeout_s``).
- `RankGuard` is an `EngineHook` around the engine's collective methods
  (``wrap(engine, guard)``, engines/wrapped.py): once a rank
  is known dead they fail at once with ``ServiceError("UNAVAILABLE")`` naming
  it and saying how to resume; when the engine itself raises ``RankFailure``
  (a collective broke) the guard waits up to ``name_wait_s`` for the dead
  rank to be named. ``drop_adapter`` on a broken trainer is a local no-op,
  so stopping a session neither fails nor blocks.
- torchrun stops every worker as soon as one dies (SIGTERM to rank 0, SIGKILL
  30 s later); the CLI then keeps rank 0 answering with this error for a
  drain window (``--failure-drain-s``) before exiting (see ``cli.cmd_serve``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

from together_train_server.service.errors import ServiceError

if TYPE_CHECKING:  # pragma: no cover
    from together_train_server.engines.deepspeed import DeepSpeedTrainerEngine

__all__ = ["RankGuard", "exchange_peers", "process_alive"]

log = logging.getLogger(__name__)
T = TypeVar("T")

# TrainerEngine methods that run a collective on every rank (DeepSpeedTrainerEngine).
COLLECTIVE_METHODS = ("create_adapter", "drop_adapter", "forward", "optim_step", "save_state", "load_state",
                      "save_merged")

Peer = tuple[str, int, "int | None"]


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) from /proc/<pid>/stat; None when the pid is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # the command name may hold spaces
    return fields[0], int(fields[19])


def process_alive(pid: int, start_time: int | None) -> bool:
    """True while ``pid`` runs and is the process that had ``start_time`` (zombies count as dead).

    Without /proc (not Linux) or a start time, nothing can be told: True.
    """
    if start_time is None or not Path("/proc/self/stat").exists():
        return True
    st = _proc_stat(pid)
    return st is not None and st[0] not in ("Z", "X", "x") and st[1] == start_time


def exchange_peers() -> list[Peer]:
    """Every rank's ``(host, pid, start time)``, indexed by rank. Collective: every rank calls it."""
    import torch.distributed as dist

    st = _proc_stat(os.getpid())
    me: Peer = (socket.gethostname(), os.getpid(), st[1] if st else None)
    peers: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(peers, me)
    return [tuple(p) for p in peers]


class RankGuard:
    """Names dead follower ranks and makes rank 0's engine fail fast and clearly once one is dead.

    Args:
        engine: rank 0's DeepSpeedTrainerEngine (its ``failed``: why the ranks broke, or None).
        peers: `exchange_peers()` of this launch.
        name_wait_s: after a collective broke, how long to wait for the dead
            rank to be named (a remote follower is named by its heartbeat:
            the engine's ``heartbeat_timeout_s``, 10 s, plus its 1 s period).
    """

    def __init__(self, engine: DeepSpeedTrainerEngine, peers: Sequence[Peer], *, name_wait_s: float = 12.0) -> None:
        self.engine = engine
        self.peers = list(peers)
        self.name_wait_s = float(name_wait_s)
        self._host = socket.gethostname()
        self._dead: set[int] = set()
        self._lock = threading.Lock()

    def dead_ranks(self) -> list[int]:
        """Follower ranks known dead (sticky): same-host pids gone now, or named by the heartbeat."""
        with self._lock:
            for rank, (host, pid, start) in enumerate(self.peers):
                if rank and rank not in self._dead and host == self._host and not process_alive(pid, start):
                    self._dead.add(rank)
            return sorted(self._dead)

    def failure(self) -> str | None:
        """Why the trainer is unavailable (None while every rank is alive and no collective broke)."""
        dead = self.dead_ranks()
        if dead:
            who = ", ".join(f"rank {r} (pid {self.peers[r][1]} on {self.peers[r][0]})" for r in dead)
            return f"{who} died"
        return self.engine.failed

    def error(self, why: str) -> ServiceError:
        """The UNAVAILABLE error every operation gets once the trainer is broken."""
        return ServiceError(
            "UNAVAILABLE",
            f"the DeepSpeed trainer lost a rank: {why}. This resource cannot train any more: restart every "
            "rank (the whole launch) and resume each session from its last training checkpoint with "
            "create_session(checkpoint_uri=<its save_state uri>, with_optimizer=True)",
        )

    def _named(self, err: BaseException) -> str:
        """After a broken collective: wait (bounded) until a dead rank is named."""
        deadline = time.monotonic() + self.name_wait_s
        while True:
            dead = self.dead_ranks()
            failed = self.engine.failed
            if dead or (failed and "heartbeat" in failed) or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        return self.failure() or f"a collective failed ({err})"

    def around(self, method: str, call: Callable[[], T]) -> T:
        """`EngineHook` (engines/wrapped.py): a collective method fails fast once a rank is dead.

        Non-collective methods run as they are. ``drop_adapter`` on a broken trainer returns
        None (nothing to free on ranks that are gone); every other collective raises
        `error`, also when the engine's own collective breaks (``grpc_code`` UNAVAILABLE).
        """
        if method not in COLLECTIVE_METHODS:
            return call()
        why = self.failure()
        if why is not None:
            if method == "drop_adapter":  # nothing to free on ranks that are gone
                return None  # type: ignore[return-value]
            raise self.error(why)
        try:
            return call()
        except Exception as err:
            if getattr(err, "grpc_code", None) != "UNAVAILABLE":
                raise
            why = self._named(err)
            log.error("DeepSpeed trainer: %s", why)
            if method == "drop_adapter":
                return None  # type: ignore[return-value]
            raise self.error(why) from None
