"""Rank plumbing of the DeepSpeed engines: rank 0 broadcasts each operation, every rank runs it.

`RankExecutor` is the executor half (as vLLM splits executor from worker):
rank 0's ``call(op, ...)`` sends ``(op, args, kwargs)`` to the other ranks
(``torch.distributed.broadcast_object_list``; samples travel as numpy arrays
inside it) and then runs ``getattr(worker, op)`` itself; ranks 1..k-1 sit in
``follow()`` running the same calls. Results come from rank 0.

Liveness: collectives carry a timeout (``init_distributed(timeout_s)``) and
every follower writes a heartbeat into the c10d store; when a collective
fails or a heartbeat is older than ``heartbeat_timeout_s`` the executor turns
*broken*: every later call raises `RankFailure` naming the ranks that stopped.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["RankFailure", "RankExecutor", "init_distributed"]

log = logging.getLogger(__name__)


class RankFailure(RuntimeError):
    """A rank died or a collective timed out; the resource must be restarted.

    ``grpc_code`` tells the service layer which status to report (engines do
    not import gRPC).
    """

    grpc_code = "UNAVAILABLE"
    retryable = False


def init_distributed(backend: str | None = None, timeout_s: float = 300.0) -> tuple[int, int]:
    """Initialise torch.distributed through DeepSpeed from the launcher's env; returns (rank, world).

    ``backend`` defaults to ``"nccl"`` when CUDA is available, else ``"gloo"``.
    The shared-memory CPU collective op (a 25-40 s JIT C++ build) is disabled:
    gloo is used as is.

    Raises:
        ImportError: deepspeed missing. ValueError: env not set (``RANK`` etc.).
    """
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        if key not in os.environ:
            raise ValueError(f"{key} is not set: launch with `deepspeed` or `torchrun` (see README)")
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=timeout_s), verbose=False)
    return dist.get_rank(), dist.get_world_size()


class RankExecutor:
    """Runs operations of ``worker`` on every rank, rank 0 leading; watches the followers' heartbeats.

    Args:
        rank, world_size: of this process (`init_distributed`).
        heartbeat_s / heartbeat_timeout_s: follower heartbeat period and the age after
            which rank 0 declares a follower dead.

    Attributes:
        worker: the object whose methods ``call`` runs (set before the first call).
    """

    def __init__(self, rank: int, world_size: int, *, heartbeat_s: float = 1.0,
                 heartbeat_timeout_s: float = 10.0) -> None:
        self.rank, self.world_size = rank, world_size
        self.worker: Any = None
        self._failed: str | None = None
        self._hb_s, self._hb_timeout = float(heartbeat_s), float(heartbeat_timeout_s)
        self._store = dist.distributed_c10d._get_default_store()
        self._stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._beat()
        if world_size > 1:
            target = self._heartbeat_loop if rank else self._monitor_loop
            self._hb_thread = threading.Thread(target=target, name="ds-heartbeat", daemon=True)
            self._hb_thread.start()

    # ----- liveness
    def _beat(self) -> None:
        self._store.set(f"together_train/hb/{self.rank}", repr(time.time()))

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self._hb_s):
            try:
                self._beat()
            except Exception:  # rank 0 (the store's host) is gone
                log.error("rank %d: lost the rendezvous store (rank 0 gone?); exiting", self.rank)
                os._exit(3)

    def dead_ranks(self) -> list[int]:
        """Followers whose heartbeat is older than ``heartbeat_timeout_s`` (rank 0 view)."""
        now, dead = time.time(), []
        for r in range(1, self.world_size):
            try:
                ts = float(self._store.get(f"together_train/hb/{r}").decode())
            except Exception:
                ts = 0.0
            if now - ts > self._hb_timeout:
                dead.append(r)
        return dead

    def _monitor_loop(self) -> None:
        while not self._stop.wait(self._hb_s) and self._failed is None:
            dead = self.dead_ranks()
            if dead:
                self._failed = f"rank(s) {dead} stopped sending heartbeats"
                log.error("DeepSpeed trainer: %s", self._failed)

    def _broken(self, err: BaseException | None = None) -> RankFailure:
        if self._failed is None:
            dead = self.dead_ranks() if self.rank == 0 else []
            who = f"rank(s) {dead} died" if dead else "a collective failed or timed out"
            self._failed = f"{who}: {type(err).__name__}: {err}" if err else who
        return RankFailure(
            f"the DeepSpeed trainer is unavailable ({self._failed}); restart every rank and resume the "
            "session from its last training checkpoint"
        )

    @property
    def failed(self) -> str | None:
        """Why the ranks are broken (None while every rank is alive)."""
        return self._failed

    # ----- operations
    def call(self, op: str, *args: Any, **kwargs: Any) -> Any:
        """Rank 0: broadcast ``(op, args, kwargs)`` then run ``worker.op`` here too; the result is this rank's."""
        if self._failed is not None:
            raise self._broken()
        if self.world_size > 1:
            try:
                dist.broadcast_object_list([(op, args, kwargs)], src=0)
            except Exception as err:
                raise self._broken(err) from None
        return self._run(op, args, kwargs)

    def _run(self, op: str, args: tuple, kwargs: dict) -> Any:
        if op == "shutdown":
            return None
        try:
            return getattr(self.worker, op)(*args, **kwargs)
        except (RuntimeError, dist.DistBackendError) as err:
            if isinstance(err, RankFailure) or "gloo" in str(err).lower() or "nccl" in str(err).lower() \
                    or isinstance(err, dist.DistBackendError) or "timed out" in str(err).lower():
                raise self._broken(err) from None
            raise

    def follow(self) -> None:
        """Ranks 1..k-1: execute rank 0's operations until ``close()`` (or rank 0 dies).

        Errors raised by an operation are logged and swallowed (rank 0 raises
        the same error and reports it); a failed broadcast ends the loop.
        """
        if self.rank == 0:
            raise RuntimeError("follow() runs on ranks 1..k-1 only")
        while True:
            box: list[Any] = [None]
            try:
                dist.broadcast_object_list(box, src=0)
            except Exception as err:
                log.error("rank %d: lost rank 0 (%s); exiting follower loop", self.rank, err)
                return
            op, args, kwargs = box[0]
            if op == "shutdown":
                self._stop.set()
                self._join_heartbeat()
                return
            try:
                self._run(op, args, kwargs)
            except RankFailure as err:
                log.error("rank %d: %s", self.rank, err)
                return
            except Exception as err:  # the same error is raised on rank 0
                log.info("rank %d: %s failed: %s", self.rank, op, err)

    def close(self) -> None:
        """Rank 0: release the followers (they return from ``follow``)."""
        if self.rank == 0 and self.world_size > 1 and self._failed is None:
            try:
                self.call("shutdown")
            except Exception:
                pass
        self._stop.set()
        self._join_heartbeat()

    def _join_heartbeat(self) -> None:
        t = self._hb_thread
        if t is not None and t.is_alive():
            t.join(timeout=5)
