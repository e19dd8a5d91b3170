"""`SampleResult`: result of sample."""

from __future__ import annotations

from dataclasses import dataclass

from together_train._proto import generator_pb2
from together_train.types.sampled_sequence import SampledSequence

__all__ = ["SampleResult"]


@dataclass
class SampleResult:
    """Result of `sample`.

    Attributes:
        sequences: `num_samples` completions, in order.
        prompt_logprobs: when requested, len(prompt) - 1 floats: logprob of
            ``prompt[i+1]`` given ``prompt[:i+1]``; else None.
        top_k_prompt_logprobs: when requested, len(prompt) - 1 entries
            ``(token_ids, logprobs)`` of the k most likely tokens; else None.
        policy_version: the version that served the request (-1 = base model).
        replica_id: which generator replica served it.
        prompt_cache_hit_tokens: prompt tokens served from the replica's
            prefix cache (not prefilled again); the torch engine's hits are
            whole blocks of 16 tokens (``--prefix-cache-mb``), 0 without a hit.
    """

    sequences: list[SampledSequence]
    prompt_logprobs: list[float] | None = None
    top_k_prompt_logprobs: list[tuple[list[int], list[float]]] | None = None
    policy_version: int = -1
    replica_id: str = ""
    prompt_cache_hit_tokens: int = 0

    @classmethod
    def from_proto(
        cls, msg: generator_pb2.SampleResponse, *, prompt_logprobs: bool = True, top_k: bool = True
    ) -> "SampleResult":
        return cls(
            sequences=[SampledSequence.from_proto(s) for s in msg.sequences],
            prompt_logprobs=list(msg.prompt_logprobs) if prompt_logprobs and len(msg.prompt_logprobs) else None,
            top_k_prompt_logprobs=(
                [(list(t.token_ids), list(t.logprobs)) for t in msg.top_k_prompt_logprobs]
                if top_k and len(msg.top_k_prompt_logprobs)
                else None
            ),
            policy_version=int(msg.policy_version),
            replica_id=msg.replica_id,
            prompt_cache_hit_tokens=int(msg.prompt_cache_hit_tokens),
        )
