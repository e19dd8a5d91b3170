"""``POST /v1/chat/completions``: messages rendered with the model's chat template, the reply as the assistant's."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Iterator

from fastapi import Request

from together_train_server.service.inference import openai_params
from together_train_server.wire.http.openai.rendering import chat_logprobs, usage
from together_train_server.wire.http.openai.routing import handled, json_body, router, service
from together_train_server.wire.http.openai.streaming import log_completion, stream_response


@router.post("/v1/chat/completions")
@handled
async def chat_completions(request: Request) -> Any:
    """A chat completion: messages rendered with the model's chat template, the reply as the assistant's."""
    svc, owner = service(request)
    body = await json_body(request)
    await asyncio.to_thread(svc.model_key, body.get("model"), owner)  # the model before the payload
    params = openai_params(body, chat=True, limits=svc.limits)
    prompt = await asyncio.to_thread(svc.chat_prompt, body.get("messages"))
    model = body.get("model")
    rid, created, t0 = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), time.perf_counter()
    if not params.stream:
        done = await asyncio.to_thread(svc.complete, model, [prompt], params, owner)
        log_completion(rid, model, done.prompt_tokens, done.completion_tokens, t0, stream=False)
        head = {"id": rid, "object": "chat.completion", "created": created, "model": model}
        return {**head, "choices": [
            {"index": ch.index, "message": {"role": "assistant", "content": ch.text},
             "logprobs": chat_logprobs(ch.logprobs) if ch.logprobs is not None else None,
             "finish_reason": ch.finish_reason} for ch in done.choices], "usage": usage(done)}
    stream = await asyncio.to_thread(svc.stream, model, [prompt], params, owner)
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}

    def chunks() -> Iterator[dict[str, Any]]:
        started: set[int] = set()
        for ev in stream:
            if ev.index not in started:  # each choice opens with the assistant's role (as OpenAI streams)
                started.add(ev.index)
                yield {**head, "choices": [{"index": ev.index, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]}
            delta = {"content": ev.delta} if ev.finish_reason is None else {}
            yield {**head, "choices": [{"index": ev.index, "delta": delta,
                                        "logprobs": chat_logprobs([ev.logprob]) if ev.logprob is not None else None,
                                        "finish_reason": ev.finish_reason}]}
        if params.include_usage:
            yield {**head, "choices": [], "usage": usage(stream)}

    return await stream_response(stream, chunks(), rid, model, t0)
