"""The ``sample`` operation kind: prompts through the session's current weights, in queue order.

`prepare_sample` parses the body (as `training`'s prepare functions); `output_sample` renders one
SampleResult per prompt.
"""

from __future__ import annotations

from typing import Any

from together_train_server.engines.types import SamplingParams
from together_train_server.service.errors import invalid
from together_train_server.service.interfaces import ResourceApi
from together_train_server.wire.http.together.ids import OpEntry, Prepared
from together_train_server.wire.http.together.parsing import int64, number, tokens
from together_train_server.wire.http.together.rendering import sample_result
from together_train_server.wire.sampling_params import default_max_tokens, ranged_from_body


def prepare_sample(resource: ResourceApi, body: dict[str, Any], session_id: str, key: str, owner: str) -> Prepared:
    """``sample``: ``num_samples`` completions of each of ``model_inputs`` (with prompt logprobs if asked)."""
    if body.get("return_routed_experts"):
        raise invalid("return_routed_experts: this model is not a mixture of experts", key="return_routed_experts")
    inputs = body.get("model_inputs")
    if not isinstance(inputs, list):
        raise invalid("model_inputs must be a list of ModelInput", key="model_inputs")
    prompts = [tokens(m, i, "model_inputs") for i, m in enumerate(inputs)]
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise invalid("sampling_params must be an object", key="sampling_params")
    stop = sp.get("stop") or []
    if isinstance(stop, str) or not all(isinstance(x, str) for x in stop):
        raise invalid("sampling_params.stop must be a list of strings", key="stop")
    # Unset max_tokens: DEFAULT_MAX_TOKENS bounded by the context the longest prompt leaves (as on the Tinker API).
    top_k = int64(sp["top_k"], "top_k") if "top_k" in sp else 0
    params = SamplingParams(
        max_tokens=int64(sp["max_tokens"], "max_tokens") if sp.get("max_tokens") is not None
        else default_max_tokens(resource.limits, max(map(len, prompts), default=0)),
        temperature=number(sp["temperature"], "temperature") if "temperature" in sp else 1.0,
        top_k=max(top_k, 0),  # -1 = off, as in vLLM
        top_p=number(sp["top_p"], "top_p") if "top_p" in sp else 1.0,
        seed=int64(sp["seed"], "seed") if sp.get("seed") is not None else None,
        stop=tuple(stop), **ranged_from_body(sp, "sampling_params."))
    n = int64(body.get("num_samples", 1), "num_samples")
    plp = bool(body.get("prompt_logprobs", False))
    topk = int64(body.get("topk_prompt_logprobs", 0), "topk_prompt_logprobs")
    extra = {"prompt_lens": [len(p) for p in prompts], "prompt_logprobs": plp, "topk": topk}
    return (lambda seq: [resource.submit_sample(session_id, seq, key, prompts=prompts, params=params,
                                                num_samples=n, prompt_logprobs=plp or topk > 0,
                                                top_k_prompt_logprobs=topk, owner=owner)]), extra


def output_sample(entry: OpEntry, recs: list[Any]) -> dict[str, Any]:
    """One SampleResult per prompt (its sequences, and prompt logprobs when asked)."""
    return {"results": [sample_result(ps, n, entry.extra["prompt_logprobs"], entry.extra["topk"])
                        for ps, n in zip(recs[0].result, entry.extra["prompt_lens"])]}
