"""The `InferenceService`'s sample functions over the generator replicas (a `ReplicaPool` or a `Resource`'s).

A sample request goes to the least-loaded replica as a generator ``SampleRequest`` (or
``SampleStream``); the pool re-pushes an adapter a replica lost and retries on another replica
when one is down; a replica's gRPC error becomes a ServiceError with its status code.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from together_train_server.service.errors import ServiceError
from together_train_server.service.inference import (
    InferenceService,
    ResourceCatalog,
    SampledSequence,
    SampleFn,
    SampleResult,
    StreamFn,
    TokenBatch,
)
from together_train_server.service.resource import Resource

# ``route(call, key=...)``: run `call(replica client)` on a replica (ReplicaPool.route / Resource.route_to_replica).
Route = Callable[..., Any]


def _sample_request(key: str, prompt: list[int], kw: dict[str, Any], n: int, prompt_lp: bool = False,
                    top_k: int = 0) -> Any:
    from together_train._proto import common_pb2, generator_pb2

    sp = common_pb2.SamplingParams(max_tokens=kw["max_tokens"], temperature=kw["temperature"], top_k=kw["top_k"],
                                   top_p=kw["top_p"], stop=kw["stop"], stop_token_ids=kw["stop_token_ids"],
                                   ignore_eos=kw["ignore_eos"])
    if kw["seed"] is not None:
        sp.seed = kw["seed"]
    return generator_pb2.SampleRequest(session_id=key, prompt=prompt, params=sp, num_samples=n,
                                       prompt_logprobs=prompt_lp, top_k_prompt_logprobs=top_k)


def _sample_result(resp: Any) -> SampleResult:
    from together_train._proto import generator_pb2

    def versions(s: Any) -> list[int]:  # per token: its span's version, else the response's
        out = [int(resp.policy_version)] * len(s.tokens)
        for span in s.version_spans:
            out[span.start:span.end] = [int(span.policy_version)] * (span.end - span.start)
        return out

    return SampleResult(
        [SampledSequence(list(s.tokens), "length" if s.stop_reason == generator_pb2.LENGTH else "stop",
                         list(s.logprobs), versions(s)) for s in resp.sequences],
        list(resp.prompt_logprobs),
        [(list(t.token_ids), list(t.logprobs)) for t in resp.top_k_prompt_logprobs],
    )


def _replica_error(e: Exception) -> ServiceError:
    """A replica's gRPC status as a ServiceError with its code."""
    code = getattr(e, "code", None)
    name = code().name if callable(code) else "INTERNAL"
    details = e.details() if callable(getattr(e, "details", None)) else str(e)
    return ServiceError(name, f"sampling failed on a replica: {details}")


def replica_sampler(route: Route) -> SampleFn:
    """A `SampleFn` that sends a generator ``SampleRequest`` to the least-loaded replica through `route`.

    `route` is ``ReplicaPool.route`` or ``Resource.route_to_replica``: it re-pushes an adapter a
    replica lost (``key``) and retries on another replica when one is down; a replica's gRPC
    error becomes a ServiceError with its status code.
    """

    def sample(key: str, prompt: list[int], kw: dict[str, Any], n: int, prompt_lp: bool, top_k: int) -> SampleResult:
        req = _sample_request(key, prompt, kw, n, prompt_lp, top_k)
        try:
            return _sample_result(route(lambda c: c.sample(req), key=key))
        except ServiceError:
            raise
        except Exception as e:  # a replica's gRPC status
            raise _replica_error(e) from None

    return sample


def replica_stream_sampler(route_stream: Route) -> StreamFn:
    """A `StreamFn`: a generator ``SampleStream`` on the least-loaded replica through `route_stream`
    (``ReplicaPool.route_stream`` or ``Resource.route_stream_to_replica``).

    Yields a `TokenBatch` per message of new tokens, then the `SampleResult`.
    Failures before the first tokens are retried as `replica_sampler`'s; a
    replica's gRPC error becomes a ServiceError with its status code.
    """

    def stream(key: str, prompt: list[int], kw: dict[str, Any], n: int) -> Iterator[TokenBatch | SampleResult]:
        req = _sample_request(key, prompt, kw, n)
        try:
            for chunk in route_stream(lambda c: c.sample_stream(req), key=key):
                if chunk.HasField("done"):
                    yield _sample_result(chunk.done)
                    return
                t = chunk.tokens
                yield TokenBatch(list(zip(t.sequence, t.token_ids)), t.sampled_at)
        except ServiceError:
            raise
        except Exception as e:  # a replica's gRPC status
            raise _replica_error(e) from None

    return stream


def inference_for_resource(resource: Resource) -> InferenceService:
    """The `InferenceService` of a running resource: its base model, checkpoints, tokenizer, limits, replicas."""
    return InferenceService(ResourceCatalog(resource), resource.tokenizer(), resource.limits,
                            replica_sampler(resource.route_to_replica),
                            replica_stream_sampler(resource.route_stream_to_replica))
