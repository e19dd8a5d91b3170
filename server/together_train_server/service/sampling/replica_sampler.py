"""Sampling on the generator replicas in plain types: the one path every sampling API takes.

`ReplicaSampler` validates a request against the resource's limits
(`validation.check_sampling`), routes it to the least-loaded replica
(`ReplicaPool.route`: a replica that is down is retried elsewhere, a lost
adapter re-pushed), turns a replica's refusal (`ReplicaError`) into a
`ServiceError` with its status code, and records telemetry. The Tinker,
Together and OpenAI HTTP APIs (through `Resource.sample` / `sample_stream` /
`InferenceService`) and ``together-train deploy`` sample through it; only
their own parsing and response shapes stay in their routes. The requests and
answers are plain dataclasses (`SampleRequest`, `SampleOutput`,
`TokenBatch`); the gRPC client (wire/replica_client.py) translates them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Protocol, Sequence

from together_train_server.engines.types import GenSequence, SamplingParams
from together_train_server.service import validation
from together_train_server.service.sampling.cancellation import CallerGone
from together_train_server.service.errors import ServiceError
from together_train_server.service.replicas.client import ReplicaConnection
from together_train_server.service.replicas.errors import ReplicaError
from together_train_server.service.replicas.pool import ReplicaPool
from together_train_server.service.telemetry import Telemetry

__all__ = ["LogprobsOutput", "ReplicaClient", "ReplicaSampler", "SampleOutput", "SampleRequest", "TokenBatch"]


@dataclass(frozen=True)
class SampleRequest:
    """One sampling call to a replica.

    Attributes:
        key: the replicas' adapter key ("" = the base model; a session id, ``snap:<id>``, ``ckpt:<uri>``).
        prompt: token ids.
        params: sampling parameters (validated: `ReplicaSampler.request`).
        num_samples: completions (streams) of the prompt.
        prompt_logprobs: also the untempered logprobs of the prompt tokens.
        top_k_prompt_logprobs: also the k most likely tokens per prompt position.
        gone: set when the caller went away (`cancellation.CallerGone`): the replica call in
            flight is cancelled and raises `cancellation.SampleCancelled` (None = never).
    """

    key: str
    prompt: tuple[int, ...]
    params: SamplingParams
    num_samples: int = 1
    prompt_logprobs: bool = False
    top_k_prompt_logprobs: int = 0
    gone: CallerGone | None = field(default=None, compare=False, repr=False)

    @property
    def tokens(self) -> int:
        """Tokens the call processes at most: the prompt and every stream's max_tokens (deadline sizing)."""
        return len(self.prompt) + max(1, self.num_samples) * int(self.params.max_tokens)


@dataclass
class SampleOutput:
    """A replica's answer.

    Attributes:
        sequences: one per sample: tokens, their float32 logprobs (nats), stop_reason "stop" | "length".
        prompt_logprobs: ``len(prompt) - 1`` untempered logprobs of prompt[i+1] ([] when not asked).
        top_k_prompt_logprobs: per prompt position i+1, (token ids, logprobs) of the k most likely
            tokens ([] when not asked).
        policy_version: the adapter version that served every token (-1 = the base model).
        replica_id: the replica that answered.
        prompt_cache_hit_tokens: prompt tokens whose keys/values the replica's prefix cache served.
    """

    sequences: list[GenSequence]
    prompt_logprobs: list[float] = field(default_factory=list)
    top_k_prompt_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)
    policy_version: int = -1
    replica_id: str = ""
    prompt_cache_hit_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens generated, all sequences."""
        return sum(len(s.tokens) for s in self.sequences)


@dataclass
class LogprobsOutput:
    """A replica's scores of token sequences.

    Attributes:
        logprobs: per sequence ``len - 1`` untempered float32 logprobs of tokens[i+1] (nats).
        policy_version: the adapter version that scored them (-1 = the base model).
        replica_id: the replica that answered.
    """

    logprobs: list[list[float]]
    policy_version: int = -1
    replica_id: str = ""


@dataclass
class TokenBatch:
    """Tokens a replica sampled since its previous batch (streamed sampling).

    Attributes:
        tokens: (sequence index, token id) pairs in the order sampled.
        sampled_at: Unix seconds (the replica's clock) when the last of them was sampled.
    """

    tokens: list[tuple[int, int]]
    sampled_at: float = 0.0


class ReplicaClient(ReplicaConnection, Protocol):
    """One replica for the sampling path: sample, stream, score, and what the pool needs (`ReplicaConnection`:
    push, drop, probe, cancel, close); wire/replica_client.GrpcReplicaClient is the gRPC one. Errors as
    `ReplicaConnection`'s, and ReplicaLacksWeights when the replica holds no adapter under the request's key."""

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


class ReplicaSampler:
    """Validate, route, translate errors, record telemetry: sampling on a `ReplicaPool`.

    Args:
        pool: the replicas (`ReplicaPool` of `ReplicaClient`s).
        limits: the request limits prompts and parameters are checked against.
        telemetry: the resource's `Telemetry` (None: nothing recorded, ``together-train deploy``).
    """

    def __init__(self, pool: ReplicaPool[ReplicaClient], limits: validation.Limits,
                 telemetry: Telemetry | None = None) -> None:
        self.pool = pool
        self.limits = limits
        self.telemetry = telemetry

    def request(self, key: str, prompt: Sequence[int], params: SamplingParams, *, num_samples: int = 1,
                prompt_logprobs: bool = False, top_k_prompt_logprobs: int = 0,
                sample_index: int | None = None, gone: CallerGone | None = None) -> SampleRequest:
        """A checked `SampleRequest`.

        Args:
            key: the adapter key ("" = base model).
            prompt: token ids.
            params: as an API's parser built them (checked here: `validation.check_sampling`).
            sample_index: the prompt's index in a batch, named by the error.
            gone: see `SampleRequest.gone`.

        Raises:
            ServiceError: INVALID_ARGUMENT naming the field (and ``sample_index``).
        """
        try:
            checked = validation.check_sampling(prompt, params, num_samples=num_samples,
                                                top_k_prompt_logprobs=top_k_prompt_logprobs, limits=self.limits)
        except ServiceError as err:
            if sample_index is None:
                raise
            raise ServiceError(err.code, err.message, sample_index=sample_index, key=err.key) from None
        return SampleRequest(key, tuple(int(t) for t in prompt), checked, int(num_samples), bool(prompt_logprobs),
                             int(top_k_prompt_logprobs), gone)

    def sample(self, req: SampleRequest, *, scope: str = "", record: str | None = None) -> SampleOutput:
        """Sample `req` on the least-loaded live replica.

        Args:
            scope: the session the tokens count for in telemetry ("" = none).
            record: ``"call"``: the call is counted as a ``sample`` operation (`Telemetry.sample_ended`,
                failures too); ``"tokens"``: only the tokens sampled (`Telemetry.count_sampled`; the
                caller's operation is counted elsewhere); None: neither (OpenAI inference). The prompt's
                tokens and cache hits are counted in every case (`Telemetry.count_prompt`).

        Raises:
            ServiceError: a replica's refusal with its status code ("sampling failed on a replica: ...");
                UNAVAILABLE / FAILED_PRECONDITION from the pool (no replica, a lost adapter).
        """
        t0 = time.perf_counter()
        try:
            out = self.pool.route(lambda c: c.sample(req), key=req.key, hedge=True)
        except ReplicaError as e:
            self._failed(scope, record, e.code, t0)
            raise ServiceError(e.code, f"sampling failed on a replica: {e.details}") from None
        except ServiceError as e:
            self._failed(scope, record, e.code, t0)
            raise
        self._succeeded(scope, record, req, out, t0)
        return out

    def sample_stream(self, req: SampleRequest, *, scope: str = "",
                      record: str | None = None) -> Iterator[TokenBatch | SampleOutput]:
        """`sample`, yielding a `TokenBatch` as the replica samples tokens, then the `SampleOutput`.

        A replica that fails before its first tokens is retried elsewhere (`ReplicaPool.route_stream`);
        errors (raised while iterating) as `sample`'s.
        """
        t0 = time.perf_counter()
        try:
            for item in self.pool.route_stream(lambda c: c.sample_stream(req), key=req.key):
                if isinstance(item, SampleOutput):
                    self._succeeded(scope, record, req, item, t0)
                yield item
        except ReplicaError as e:
            self._failed(scope, record, e.code, t0)
            raise ServiceError(e.code, f"sampling failed on a replica: {e.details}") from None
        except ServiceError as e:
            self._failed(scope, record, e.code, t0)
            raise

    def score(self, key: str, sequences: Sequence[Sequence[int]], *, scope: str = "") -> LogprobsOutput:
        """Untempered logprobs of `sequences` (token id lists) under adapter `key` ("" = the base model),
        on the least-loaded live replica (``compute_logprobs``; checks are the caller's). `scope`: the
        session the scored tokens count for in usage (prefill tokens, sampler seconds; "" = none).

        Raises:
            ServiceError: a replica's refusal with its code ("scoring failed on a replica: ...");
                UNAVAILABLE / FAILED_PRECONDITION from the pool.
        """
        t0 = time.perf_counter()
        try:
            out = self.pool.route(lambda c: c.compute_logprobs(key, sequences), key=key, hedge=True)
        except ReplicaError as e:
            raise ServiceError(e.code, f"scoring failed on a replica: {e.details}") from None
        sink = getattr(self.telemetry, "usage_sink", None)
        if sink is not None and scope:
            sink(scope, prefill_tokens=sum(len(s) for s in sequences), sampler_seconds=time.perf_counter() - t0)
        return out

    def _succeeded(self, scope: str, record: str | None, req: SampleRequest, out: SampleOutput, t0: float) -> None:
        if self.telemetry is None:
            return
        tokens = out.num_tokens
        self.telemetry.count_prompt(len(req.prompt), out.prompt_cache_hit_tokens, scope)
        if record is None:
            return
        if record == "call":
            self.telemetry.sample_ended(scope, tokens=tokens, seconds=time.perf_counter() - t0, status="SUCCEEDED")
        else:
            self.telemetry.count_sampled(scope, tokens, time.perf_counter() - t0)

    def _failed(self, scope: str, record: str | None, code: str, t0: float) -> None:
        if self.telemetry is not None and record == "call":
            self.telemetry.sample_ended(scope, tokens=0, seconds=time.perf_counter() - t0,
                                        status="CANCELLED" if code == "CANCELLED" else "FAILED", error_code=code)
