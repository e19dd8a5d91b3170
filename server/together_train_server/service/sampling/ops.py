"""The resource's sampling entry points: what the HTTP sampling routes call (`SamplingOpsMixin`).

`Resource.sample` / `sample_stream` run a checked `SampleRequest` on the
replicas through the resource's `ReplicaSampler` (route, error
translation, telemetry); `sample_request` checks a prompt and its sampling
parameters against the resource's limits; `inference` is the OpenAI-style
`InferenceService` over the same sampler. A route parses its own wire
format into these plain values and shapes the `SampleOutput` back.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator, Mapping, Sequence

from together_train_server.service.sampling.inference import InferenceService
from together_train_server.service.sampling.model_catalog import ResourceCatalog
from together_train_server.service.sampling.replica_sampler import ReplicaSampler, SampleOutput, SampleRequest, TokenBatch
from together_train_server.service.resource_state import ResourceState
from together_train_server.service.sampling.session_ops import submit_sample


class SamplingOpsMixin(ResourceState):
    """Sampling on the resource's replicas (part of `Resource`)."""

    @functools.cached_property
    def sampler(self) -> ReplicaSampler:
        """The resource's `ReplicaSampler` (its pool, limits and telemetry)."""
        return ReplicaSampler(self.pool, self.limits, self.telemetry)

    @functools.cached_property
    def inference(self) -> InferenceService:
        """The OpenAI-style inference service: the base model and the callers' inference checkpoints."""
        return InferenceService(ResourceCatalog(self), self.engine.tokenizer, self.limits, self.sampler)

    def sample_request(self, key: str, prompt: Sequence[int], params: Mapping[str, Any], *, num_samples: int = 1,
                       prompt_logprobs: bool = False, top_k_prompt_logprobs: int = 0,
                       sample_index: int | None = None) -> SampleRequest:
        """A checked `SampleRequest` (see `ReplicaSampler.request`).

        Raises:
            ServiceError: INVALID_ARGUMENT naming the field (and ``sample_index``); RESOURCE_EXHAUSTED when
                the prompt logprobs asked for exceed the memory budget (`MemoryAdmission.check_scoring`).
        """
        req = self.sampler.request(key, prompt, params, num_samples=num_samples, prompt_logprobs=prompt_logprobs,
                                   top_k_prompt_logprobs=top_k_prompt_logprobs, sample_index=sample_index)
        if req.prompt_logprobs or req.top_k_prompt_logprobs:
            self.admission.check_scoring([len(req.prompt)], "prompt logprobs", num_samples=req.num_samples,
                                         max_tokens=req.params.max_tokens, sample_index=sample_index or 0)
        return req

    def sample(self, request: SampleRequest, *, scope: str = "", record: str | None = None) -> SampleOutput:
        """Sample on the least-loaded replica (see `ReplicaSampler.sample`).

        Raises:
            ServiceError: a replica's refusal with its code; UNAVAILABLE / FAILED_PRECONDITION without replicas.
        """
        return self.sampler.sample(request, scope=scope, record=record)

    def sample_stream(self, request: SampleRequest, *, scope: str = "",
                      record: str | None = None) -> Iterator[TokenBatch | SampleOutput]:
        """`sample`, yielding token batches as they are sampled, then the `SampleOutput`."""
        return self.sampler.sample_stream(request, scope=scope, record=record)

    def submit_sample(self, session_id: str, seq_id: int, idempotency_key: str, *, prompts: Sequence[Sequence[int]],
                      params: Mapping[str, Any], num_samples: int, prompt_logprobs: bool = False,
                      top_k_prompt_logprobs: int = 0, owner: str = "") -> Any:
        """Queue a sample in the session's operation order (the Together API's ``sample``;
        see `session_sampling.submit_sample`). Returns the `OperationRecord`."""
        return submit_sample(self, session_id, seq_id, idempotency_key, prompts=prompts, params=params,
                             num_samples=num_samples, prompt_logprobs=prompt_logprobs,
                             top_k_prompt_logprobs=top_k_prompt_logprobs, owner=owner)
