"""What the sampling path needs from one replica: `ReplicaClient` (plain types).

It extends the pool's `ReplicaConnection` (service/replicas/client.py: push, drop, probe, cancel,
close) with the calls `ReplicaPool.route` runs on it; wire/replica_client.GrpcReplicaClient is the
gRPC one. Errors as `ReplicaConnection`, and ReplicaLacksWeights when the replica holds no adapter
under the request's key.
"""

from __future__ import annotations

from typing import Iterator, Protocol, Sequence

from together_train_server.service.replicas.client import ReplicaConnection
from together_train_server.service.sampling.replica_sampler import LogprobsOutput, SampleOutput, SampleRequest, TokenBatch


class ReplicaClient(ReplicaConnection, Protocol):
    """One replica for the sampling path: sample, stream, score, and what the pool needs."""

    def sample(self, request: SampleRequest) -> SampleOutput:
        """Sample on this replica (deadline: ``deadlines.for_tokens(request.tokens + tokens in flight)``)."""
        ...

    def sample_stream(self, request: SampleRequest) -> Iterator[TokenBatch | SampleOutput]:
        """`sample`, yielding a TokenBatch per batch of new tokens, then the SampleOutput; closing the
        iterator early cancels the call."""
        ...

    def compute_logprobs(self, key: str, sequences: Sequence[Sequence[int]]) -> LogprobsOutput:
        """Score `sequences` with the adapter `key` ("" = base model) on this replica."""
        ...
