"""Sampling as an operation in a session's order (the Together RL API's ``sample`` operation).

Our gRPC ``Sample`` is a direct call: it samples from whatever version the
session's replica adapter holds at that moment. Together's REST API has no
seq_id and makes ``sample`` an operation like ``forward_backward``: operations
of a session run in arrival order, so a ``sample`` sent after a
``weights_sync`` must see the synced version. `submit_sample` gives that: the
request is validated at submission (a bad prompt is a FAILED operation
naming the prompt index and the field, nothing queued), takes its place in
the session queue, and when its turn comes it waits for the session's earlier
weight pushes (`WeightsPublisher.publish_async` chains them) and then samples every
prompt on the replicas, off the trainer worker (other sessions keep
training while it decodes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from together_train_server.engines.types import SamplingParams
from together_train_server.service.errors import ServiceError
from together_train_server.service.sampling.replica_sampler import SampleOutput

if TYPE_CHECKING:
    from together_train_server.service.core.operations import OperationRecord
    from together_train_server.service.sampling.ops import Sampling
    from together_train_server.service.training.submissions import Submissions
    from together_train_server.service.weights.publishing import WeightsPublisher


class SessionSampler(Protocol):
    """What `submit_sample` needs of the `Resource`: its parts (public attributes)."""

    submissions: Submissions
    publisher: WeightsPublisher
    sampling: Sampling


@dataclass
class PromptSamples:
    """What one prompt of a `submit_sample` produced.

    Attributes:
        response: the replica's `SampleOutput` (sequences with tokens, float32 logprobs, stop
            reasons; prompt logprobs when asked).
        policy_version: the session's synced version that served it (its step when published; 0 also
            for a fresh session before its first weights_sync, which the base model serves).
    """

    response: SampleOutput
    policy_version: int


def submit_sample(
    resource: SessionSampler,
    session_id: str,
    seq_id: int,
    idempotency_key: str,
    *,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    num_samples: int,
    prompt_logprobs: bool = False,
    top_k_prompt_logprobs: int = 0,
    owner: str = "",
) -> OperationRecord:
    """Queue a sample of `prompts` (token id lists) in the session's operation order.

    Args:
        resource: the `Resource`.
        session_id, seq_id, idempotency_key, owner: as for every ``Resource.submit_*``.
        prompts: one or more prompts, each a list of int token ids.
        params: as the API's parser built them (checked here for each prompt: `Sampling.request`).
        num_samples: completions per prompt.
        prompt_logprobs / top_k_prompt_logprobs: also score the prompt tokens.

    Returns:
        The `OperationRecord`; its result is a list of `PromptSamples`, one per prompt.

    Errors (a FAILED operation): INVALID_ARGUMENT naming the prompt (sample_index)
    and the field; FAILED_PRECONDITION without replicas; a replica's own error
    status (e.g. UNAVAILABLE) when sampling fails.
    """
    r = resource
    s = r.submissions.sessions.get_session(session_id, owner)

    def prepare() -> Callable[[], Any]:
        if len(r.publisher.pool) == 0:
            raise ServiceError("FAILED_PRECONDITION",
                               "this resource has no generator replicas to sample with (--generators N)")
        if not prompts:
            raise ServiceError("INVALID_ARGUMENT", "model_inputs is empty: give at least one prompt",
                               key="model_inputs")
        reqs = [r.sampling.request("", prompt, params, num_samples=num_samples, prompt_logprobs=prompt_logprobs,
                                 top_k_prompt_logprobs=top_k_prompt_logprobs, sample_index=i)
                for i, prompt in enumerate(prompts)]

        def body() -> list[PromptSamples]:
            # Runs after the session's earlier pushes: s.synced_version is the version they left.
            key, version = s.serving()
            return [PromptSamples(r.sampling.sample(dataclasses.replace(req, key=key), scope=session_id, record="call"),
                                  max(version, 0)) for req in reqs]

        # On the trainer worker only the hand-off: decoding runs on the publish chain's thread.
        return lambda: r.publisher.publish_async(s, body)

    return r.submissions.submit(session_id, owner, seq_id, idempotency_key, "sample", prepare)
