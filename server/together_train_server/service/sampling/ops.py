"""The resource's sampling entry: `Sampling`, the one road every sampling API takes.

Every API (the gRPC ``Sample`` / ``SampleStream``, Tinker's ``asample``, Together's ``sample``
operation, OpenAI's completions and chat completions, rollouts) parses its own wire format into
one `SamplingParams` (in its ``wire/`` package) and then samples through this object:

1. `request`: check the prompt and the parameters against the resource's limits
   (`validation.check_sampling`) and the prompt logprobs against the memory budget;
2. `sample` / `sample_stream`: route to the least-loaded replica, translate its errors,
   record telemetry (`ReplicaSampler`);
3. the caller shapes the plain `SampleOutput` back into its wire format.

`inference` is the OpenAI-style `InferenceService` (completions, and the chat use case of the
OpenAI and Anthropic APIs: service/sampling/chat.py) sampling through this object, so its requests
take step 1's checks, memory admission included, as the gRPC, Tinker and Together ones do.
`Resource` holds one `Sampling`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from together_train_server.engines.types import SamplingParams
from together_train_server.service import validation
from together_train_server.service.sampling.cancellation import CallerGone
from together_train_server.service.sampling.inference import InferenceService
from together_train_server.service.sampling.model_catalog import ModelCatalog
from together_train_server.service.replicas.pool import ReplicaPool
from together_train_server.service.telemetry import Telemetry
from together_train_server.service.sampling.replica_sampler import (LogprobsOutput, ReplicaClient, ReplicaSampler,
                                                                    SampleOutput, SampleRequest, TokenBatch)
from together_train_server.service.sampling.rollouts import RolloutStore
from together_train_server.service.training.memory_admission import MemoryAdmission

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Sampling:
    """Sampling on a resource's replicas (see the module docstring).

    Args:
        pool: the replicas (`ReplicaPool`).
        limits: the request limits prompts and parameters are checked against.
        telemetry: the resource's `Telemetry` (None: nothing recorded).
        admission: the memory budget prompt logprobs are checked against.
        catalog: the models the OpenAI API serves (built on first use of `inference`).
        tokenizer: returns the base model's tokenizer (called on first use of `inference`).
        rollouts: where calls under ``/v1/rollouts/{id}`` are recorded.
    """

    def __init__(self, pool: ReplicaPool[ReplicaClient], limits: validation.Limits, telemetry: Telemetry | None,
                 admission: MemoryAdmission,
                 catalog: Callable[[], ModelCatalog], tokenizer: Callable[[], PreTrainedTokenizerBase], rollouts: RolloutStore) -> None:
        self.sampler = ReplicaSampler(pool, limits, telemetry)
        self.limits = limits
        self._admission = admission
        self._catalog = catalog
        self._tokenizer = tokenizer
        self._rollouts = rollouts

    @functools.cached_property
    def inference(self) -> InferenceService:
        """The OpenAI-style inference service: the base model and the callers' inference checkpoints."""
        return InferenceService(self._catalog(), self._tokenizer(), self.limits, self, self._rollouts)

    def request(self, key: str, prompt: Sequence[int], params: SamplingParams, *, num_samples: int = 1,
                prompt_logprobs: bool = False, top_k_prompt_logprobs: int = 0,
                sample_index: int | None = None, gone: CallerGone | None = None) -> SampleRequest:
        """A checked `SampleRequest` (step 1; see `ReplicaSampler.request`).

        Raises:
            ServiceError: INVALID_ARGUMENT naming the field (and ``sample_index``); RESOURCE_EXHAUSTED when
                the prompt logprobs asked for exceed the memory budget (`MemoryAdmission.check_scoring`).
        """
        req = self.sampler.request(key, prompt, params, num_samples=num_samples, prompt_logprobs=prompt_logprobs,
                                   top_k_prompt_logprobs=top_k_prompt_logprobs, sample_index=sample_index, gone=gone)
        if req.prompt_logprobs or req.top_k_prompt_logprobs:
            self._admission.check_scoring([len(req.prompt)], "prompt logprobs", num_samples=req.num_samples,
                                          max_tokens=req.params.max_tokens, sample_index=sample_index or 0)
        return req

    def sample(self, request: SampleRequest, *, scope: str = "", record: str | None = None) -> SampleOutput:
        """Sample on the least-loaded replica (step 2; see `ReplicaSampler.sample`).

        Raises:
            ServiceError: a replica's refusal with its code; UNAVAILABLE / FAILED_PRECONDITION without replicas.
        """
        return self.sampler.sample(request, scope=scope, record=record)

    def sample_stream(self, request: SampleRequest, *, scope: str = "",
                      record: str | None = None) -> Iterator[TokenBatch | SampleOutput]:
        """`sample`, yielding token batches as they are sampled, then the `SampleOutput`."""
        return self.sampler.sample_stream(request, scope=scope, record=record)

    def score(self, key: str, sequences: Sequence[Sequence[int]], *, scope: str = "") -> LogprobsOutput:
        """Untempered logprobs of `sequences` under adapter `key` (see `ReplicaSampler.score`; `scope`: the
        session metered for it)."""
        return self.sampler.score(key, sequences, scope=scope)
