"""``POST /v1/completions``: text completion of a prompt (string, strings, or token ids)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Iterator

from fastapi import Request

from together_train_server.wire.http.openai.params import openai_params
from together_train_server.wire.http.openai.rendering import legacy_logprobs, top_dict, usage
from together_train_server.wire.http.openai.routing import handled, json_body, rollout_id, router, service
from together_train_server.wire.http.openai.streaming import log_completion, stream_response
from together_train_server.wire.http.openai.vllm_extras import read_extras


@router.post("/v1/completions")
@router.post("/v1/rollouts/{rollout_id}/completions")
@handled
async def completions(request: Request) -> Any:
    """Text completion of a prompt (string, strings, or token ids); choice index = prompt index * n + i.

    Under ``/v1/rollouts/{rollout_id}`` the call is also recorded (`service.rollouts`)."""
    svc, owner = service(request)
    rollout = rollout_id(request, svc, owner)
    body = await json_body(request)
    key = await asyncio.to_thread(svc.model_key, body.get("model"), owner)  # the model before the payload
    params = openai_params(body, chat=False, limits=svc.limits)
    extras = read_extras(body, chat=False)  # vLLM's return_token_ids, return_tokens_as_token_ids
    prompts = await asyncio.to_thread(svc.text_prompts, body.get("prompt"))
    model = body.get("model")
    rid, created, t0 = f"cmpl-{uuid.uuid4().hex}", int(time.time()), time.perf_counter()
    head = {"id": rid, "object": "text_completion", "created": created, "model": model}
    if not params.stream:
        done = await asyncio.to_thread(svc.complete, model, prompts, params, owner, key)
        if rollout is not None:
            svc.record(rollout, owner, model, prompts, done.choices, params.n)
        log_completion(rid, model, done.prompt_tokens, done.completion_tokens, t0, stream=False)
        return extras.add_ids({**head, "choices": [{"index": ch.index, "text": ch.text, "logprobs": legacy_logprobs(ch),
                                                    "finish_reason": ch.finish_reason}
                                                   for ch in extras.shown_choices(done.choices)],
                               "usage": usage(done)}, prompts, done.choices, params.n, chat=False)
    stream = await asyncio.to_thread(svc.stream, model, prompts, params, owner, key)

    def chunks() -> Iterator[dict[str, Any]]:
        offset: dict[int, int] = {}  # text sent so far per choice (logprobs' text_offset)
        for ev in stream:
            lps = None
            if ev.logprob is not None:
                lp = extras.shown(ev.logprob)
                lps = {"tokens": [lp.token], "token_logprobs": [lp.logprob],
                       "top_logprobs": [top_dict(lp)], "text_offset": [offset.get(ev.index, 0)]}
            offset[ev.index] = offset.get(ev.index, 0) + len(ev.delta)
            yield {**head, "choices": [{"index": ev.index, "text": ev.delta, "logprobs": lps,
                                        "finish_reason": ev.finish_reason}]}
        if params.include_usage:
            yield {**head, "choices": [], "usage": usage(stream)}

    on_done = None if rollout is None else (
        lambda: svc.record(rollout, owner, model, prompts, stream.choices, params.n))
    return await stream_response(stream, extras.stream_ids(chunks(), prompts, params.n, False, lambda: stream.choices),
                                 rid, model, t0, on_done)
