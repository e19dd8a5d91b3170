"""`ComputeLogprobsResult`: result of compute_logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from together_train._proto import generator_pb2

__all__ = ["ComputeLogprobsResult"]


@dataclass
class ComputeLogprobsResult:
    """Result of `compute_logprobs`.

    Attributes:
        logprobs: one float32 [len(tokens) - 1] array per sequence: logprob of
            ``tokens[i+1]`` given ``tokens[:i+1]`` (untempered).
        policy_version: the version scored with (-1 = base model).
        replica_id: which generator replica served it.
    """

    logprobs: list[np.ndarray]
    policy_version: int = -1
    replica_id: str = ""

    @classmethod
    def from_proto(cls, msg: generator_pb2.ComputeLogprobsResponse) -> "ComputeLogprobsResult":
        return cls(
            logprobs=[np.asarray(list(s.logprobs), dtype=np.float32) for s in msg.sequences],
            policy_version=int(msg.policy_version),
            replica_id=msg.replica_id,
        )
