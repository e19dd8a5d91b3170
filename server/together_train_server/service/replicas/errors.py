"""What a `ReplicaClient` raises, apart from the pool that handles it (`replicas.ReplicaPool`) and the
sampler that reports it (`replica_sampling.ReplicaSampler`), so both import it one way."""

from __future__ import annotations


class ReplicaUnavailable(Exception):
    """Raised by a ReplicaClient when its replica cannot be reached, missed a deadline, or was
    taken out of routing while the call was in flight (retry elsewhere)."""


class ReplicaLacksWeights(Exception):
    """Raised by a ReplicaClient when the replica holds no adapter under `key` (it was restarted,
    the adapter dropped, or a push lost): the pool re-pushes the latest version and retries."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


class ReplicaError(Exception):
    """Raised by a ReplicaClient when the replica answered a call with an error status (it refused
    the request): not retried elsewhere. `ReplicaSampler` reports it as a ServiceError of that code.

    Attributes:
        code: the status code's name ("INVALID_ARGUMENT", "INTERNAL", ...).
        details: the replica's message.
    """

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details
