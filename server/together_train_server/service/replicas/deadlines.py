"""Deadlines of the resource's calls to its generator replicas, and the health-probe policy (README "Failures")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Deadlines:
    """Deadlines of resource-to-replica calls, sized from the work, and the health-probe policy.

    - ``sample``: ``base_s + per_token_s * (prompt tokens + num_samples * max_tokens + W)``
    - ``compute_logprobs``: ``base_s + per_token_s * (sum of the sequences' tokens + W)``
      (W = the tokens of the sample / logprob calls already in flight on that
      replica: they share its decode steps)
    - ``push`` (PushWeights): ``base_s + bytes / push_bytes_per_s`` (bytes pushed, in the replica's dtype)
    - ``sync``: ``sync_base_s + bytes / sync_bytes_per_s``: how long a weights push waits for a
      replica once another took the version; a replica slower than that leaves routing for that
      adapter key until its push ends (1 s + 0.2 s for the ~20 MB of a rank-32 LoRA of a 135M model)
    - ``drop``: ``base_s``; Health probe: ``probe_timeout_s``; a probe unanswered after
      ``suspect_after_s`` makes the replica suspect (requests go elsewhere, hedged calls in
      flight there are re-issued: service/replicas/supervision.py) until a probe answers

    The work deadlines are generous backstops; a hung replica is found by the
    probes: within ``probe_misses * (probe_period_s + probe_timeout_s) + probe_period_s``
    seconds (`detection_bound_s`). A request waits at most
    ``wait_for_replica_s`` for a replica to come back when none is routable.
    All times in seconds.
    """

    base_s: float = 30.0
    per_token_s: float = 0.1
    push_bytes_per_s: float = 10e6
    probe_period_s: float = 2.0
    probe_timeout_s: float = 5.0
    probe_misses: int = 2
    wait_for_replica_s: float = 60.0
    sync_base_s: float = 1.0
    sync_bytes_per_s: float = 100e6
    suspect_after_s: float = 0.5

    def __post_init__(self) -> None:
        for name in ("base_s", "per_token_s", "push_bytes_per_s", "probe_period_s", "probe_timeout_s",
                     "sync_base_s", "sync_bytes_per_s", "suspect_after_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"replica deadline {name} must be > 0, got {getattr(self, name)}")
        if self.probe_misses < 1:
            raise ValueError(f"probe_misses must be >= 1, got {self.probe_misses}")

    def for_tokens(self, tokens: int) -> float:
        """Deadline (s) of a sample / compute_logprobs call that processes `tokens` tokens."""
        return self.base_s + self.per_token_s * max(0, int(tokens))

    def for_bytes(self, num_bytes: int) -> float:
        """Deadline (s) of a PushWeights stream of `num_bytes` bytes."""
        return self.base_s + max(0, int(num_bytes)) / self.push_bytes_per_s

    def for_sync(self, num_bytes: int) -> float:
        """Seconds a weights push of `num_bytes` bytes waits for each replica (from its start) before a
        replica that has not acknowledged it leaves routing for that key (see `ReplicaPool.publish`)."""
        return self.sync_base_s + max(0, int(num_bytes)) / self.sync_bytes_per_s

    @property
    def detection_bound_s(self) -> float:
        """Longest time (s) from a replica hanging to it being marked down by the probes."""
        return self.probe_misses * (self.probe_period_s + self.probe_timeout_s) + self.probe_period_s


class ReplicaFlags(Protocol):
    """The ``serve --replica-*`` flags `deadlines_from_args` reads (``config.ServeConfig`` has them)."""

    @property
    def replica_timeout_s(self) -> float: ...
    @property
    def replica_timeout_per_token_s(self) -> float: ...
    @property
    def replica_push_mb_s(self) -> float: ...
    @property
    def replica_probe_period_s(self) -> float: ...
    @property
    def replica_probe_timeout_s(self) -> float: ...
    @property
    def replica_probe_misses(self) -> int: ...
    @property
    def replica_wait_s(self) -> float: ...


def deadlines_from_args(args: ReplicaFlags) -> Deadlines:
    """`Deadlines` from the ``serve --replica-*`` flags (see together_train_server/cli.py).

    Raises:
        ValueError: a flag is <= 0 (naming it).
    """
    for flag in ("replica_timeout_s", "replica_timeout_per_token_s", "replica_push_mb_s", "replica_probe_period_s",
                 "replica_probe_timeout_s", "replica_probe_misses", "replica_wait_s"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    return Deadlines(
        base_s=args.replica_timeout_s,
        per_token_s=args.replica_timeout_per_token_s,
        push_bytes_per_s=args.replica_push_mb_s * 1e6,
        probe_period_s=args.replica_probe_period_s,
        probe_timeout_s=args.replica_probe_timeout_s,
        probe_misses=args.replica_probe_misses,
        wait_for_replica_s=args.replica_wait_s,
        sync_base_s=getattr(args, "replica_sync_s", 1.0),
        suspect_after_s=getattr(args, "replica_suspect_s", 0.5),
    )
