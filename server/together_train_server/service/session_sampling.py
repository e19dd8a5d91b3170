"""Sampling as an operation in a session's order (the Together RL API's ``sample`` operation).

Our gRPC ``Sample`` is a direct call: it samples from whatever version the
session's replica adapter holds at that moment. Together's REST API has no
seq_id and makes ``sample`` an operation like ``forward_backward``: operations
of a session run in arrival order, so a ``sample`` sent after a
``weights_sync`` must see the synced version. `submit_sample` gives that: the
request is validated at submission (a bad prompt is a FAILED operation
naming the prompt index and the field, nothing queued), takes its place in
the session queue, and when its turn comes it waits for the session's earlier
weight pushes (`Resource._publish_async` chains them) and then samples every
prompt on the replicas, off the trainer worker (other sessions keep
training while it decodes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from together_train._proto import common_pb2, generator_pb2
from together_train_server.service import validation
from together_train_server.service.errors import ServiceError


@dataclass
class PromptSamples:
    """What one prompt of a `submit_sample` produced.

    Attributes:
        response: the replica's ``generator_pb2.SampleResponse`` (sequences with
            tokens, float32 logprobs, stop reasons; prompt logprobs when asked).
        policy_version: the session's version that served it: 0 = the base model
            (a session before its first weights_sync), else the synced step.
    """

    response: Any
    policy_version: int


def _params_pb(kw: Mapping[str, Any]) -> Any:
    p = common_pb2.SamplingParams(stop=list(kw.get("stop") or ()), stop_token_ids=list(kw.get("stop_token_ids") or ()),
                                  ignore_eos=bool(kw.get("ignore_eos", False)))
    for name in ("max_tokens", "temperature", "top_k", "top_p", "seed"):
        if kw.get(name) is not None:
            setattr(p, name, kw[name])
    return p


def submit_sample(
    resource: Any,
    session_id: str,
    seq_id: int,
    idempotency_key: str,
    *,
    prompts: Sequence[Sequence[int]],
    params: Mapping[str, Any],
    num_samples: int,
    prompt_logprobs: bool = False,
    top_k_prompt_logprobs: int = 0,
    owner: str = "",
) -> Any:
    """Queue a sample of `prompts` (token id lists) in the session's operation order.

    Args:
        resource: the `Resource`.
        session_id, seq_id, idempotency_key, owner: as for every ``Resource.submit_*``.
        prompts: one or more prompts, each a list of int token ids.
        params: keyword arguments of `validation.validate_sampling` (max_tokens,
            temperature, top_k, top_p, seed, stop, stop_token_ids, ignore_eos).
        num_samples: completions per prompt.
        prompt_logprobs / top_k_prompt_logprobs: also score the prompt tokens.

    Returns:
        The `OperationRecord`; its result is a list of `PromptSamples`, one per prompt.

    Errors (a FAILED operation): INVALID_ARGUMENT naming the prompt (sample_index)
    and the field; FAILED_PRECONDITION without replicas; a replica's own error
    status (e.g. UNAVAILABLE) when sampling fails.
    """
    r = resource
    s = r.get_session(session_id, owner)

    def prepare() -> Callable[[], Any]:
        if len(r.pool) == 0:
            raise ServiceError("FAILED_PRECONDITION",
                               "this resource has no generator replicas to sample with (--generators N)")
        if not prompts:
            raise ServiceError("INVALID_ARGUMENT", "model_inputs is empty: give at least one prompt",
                               key="model_inputs")
        for i, prompt in enumerate(prompts):
            try:
                validation.validate_sampling(prompt, num_samples=num_samples,
                                             top_k_prompt_logprobs=top_k_prompt_logprobs, limits=r.limits,
                                             **{k: params.get(k) for k in ("max_tokens", "temperature", "top_k",
                                                                           "top_p", "seed")},
                                             stop=list(params.get("stop") or ()),
                                             stop_token_ids=list(params.get("stop_token_ids") or ()),
                                             ignore_eos=bool(params.get("ignore_eos", False)))
            except ServiceError as err:
                raise ServiceError(err.code, err.message, sample_index=i, key=err.key) from None
        sp = _params_pb(params)

        def body() -> list[PromptSamples]:
            # Runs after the session's earlier pushes: s.synced_version is the version they left.
            import grpc

            version = s.synced_version
            key = session_id if version > 0 else ""  # version 0: B = 0, the base model
            out = []
            for prompt in prompts:
                req = generator_pb2.SampleRequest(session_id=key, prompt=list(prompt), params=sp,
                                                  num_samples=num_samples, prompt_logprobs=prompt_logprobs,
                                                  top_k_prompt_logprobs=top_k_prompt_logprobs)
                t0 = time.perf_counter()
                try:
                    resp = r.pool.route(lambda c, req=req: c.sample(req), key=key)
                except grpc.RpcError as e:
                    r.telemetry.sample_ended(session_id, tokens=0, seconds=time.perf_counter() - t0,
                                             status="FAILED", error_code=e.code().name)
                    raise ServiceError(e.code().name, e.details() or "generator replica error") from None
                r.telemetry.sample_ended(session_id, tokens=sum(len(q.tokens) for q in resp.sequences),
                                         seconds=time.perf_counter() - t0, status="SUCCEEDED")
                out.append(PromptSamples(resp, max(version, 0)))
            return out

        # On the trainer worker only the hand-off: decoding runs on the publish chain's thread.
        return lambda: r._publish_async(s, body)

    return r._submit(session_id, owner, seq_id, idempotency_key, "sample", prepare)
