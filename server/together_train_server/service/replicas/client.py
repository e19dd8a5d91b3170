"""What the replica pool needs from one replica: `ReplicaConnection` (plain types).

The full client the sampling path uses (`service/sampling/replica_sampler.py` `ReplicaClient`) adds
sample / sample_stream / compute_logprobs; the gRPC one is `wire/replica_client.GrpcReplicaClient`.
The pool and its supervisor only push, drop, probe, cancel and close, so this room does not depend on
the sampling room's request and answer types.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Protocol

from together_train_server.service.replicas.deadlines import Deadlines

if TYPE_CHECKING:
    import torch

    from together_train_server.engines.types import LoraConfig


class ReplicaConnection(Protocol):
    """One replica as the pool sees it.

    `deadlines` is set by the pool when it adopts the client. Every call raises
    ReplicaUnavailable (service/replicas/errors.py) when the replica is gone or misses its
    deadline and ReplicaError when it refused the request; `cancel_inflight` makes the calls
    in flight raise ReplicaUnavailable now.
    """

    replica_id: str
    deadlines: Deadlines

    def push(self, session_id: str, version: int, lora: LoraConfig, tensors: Mapping[str, torch.Tensor]) -> int:
        """Load `tensors` (adapter or full weights, by parameter name) as `session_id`'s `version`;
        returns the bytes sent. A replica never replaces a version by an older one."""
        ...

    def drop(self, session_id: str) -> None:
        """Forget the adapter key `session_id`."""
        ...

    def probe(self) -> dict[str, int]:
        """Health: the adapter versions the replica holds ({key: version})."""
        ...

    def cancel_inflight(self) -> None:
        """Make the calls in flight raise ReplicaUnavailable now."""
        ...

    def close(self) -> None:
        """Release the connection."""
        ...
