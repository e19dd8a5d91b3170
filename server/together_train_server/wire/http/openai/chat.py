"""``POST /v1/chat/completions``: messages (and tools) rendered with the model's chat template, the reply as the
assistant's (tool calls parsed, `service.chat_tools`)."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace
from typing import Any, Iterator

from fastapi import Request

from together_train_server.service.sampling import structured
from together_train_server.service.sampling.inference import Completion, CompletionStream
from together_train_server.wire.http.openai.params import openai_params
from together_train_server.wire.http.openai.rendering import chat_logprobs, chat_message, usage
from together_train_server.wire.http.openai.routing import handled, json_body, rollout_id, router, service
from together_train_server.wire.http.openai.streaming import log_completion, stream_response
from together_train_server.wire.http.openai.vllm_extras import read_extras


@router.post("/v1/chat/completions")
@router.post("/v1/rollouts/{rollout_id}/chat/completions")
@handled
async def chat_completions(request: Request) -> Any:
    """A chat completion: messages (and ``tools``) rendered with the model's chat template, the reply
    as the assistant's (tool calls parsed in the template's format, `service.chat_tools`).

    Under ``/v1/rollouts/{rollout_id}`` the call is also recorded (`service.rollouts`)."""
    svc, owner = service(request)
    rollout = rollout_id(request, svc, owner)
    body = await json_body(request)
    key = await asyncio.to_thread(svc.model_key, body.get("model"), owner)  # the model before the payload
    params = openai_params(body, chat=True, limits=svc.limits)
    tools = svc.tools(body.get("tools"), body.get("tool_choice"))
    constraint = structured.chat_constraint(  # response_format, forced tool calls
        body.get("response_format"), tools, body.get("tool_choice"), body.get("parallel_tool_calls"))
    params = replace(params, sampling=replace(params.sampling, constraint=constraint))
    one_call = body.get("parallel_tool_calls") is False
    messages = body.get("messages")
    extras = read_extras(body, chat=True)  # vLLM's return_token_ids, chat_template_kwargs, ...
    prompt = await asyncio.to_thread(svc.chat_prompt, messages, tools, extras.template)
    model = body.get("model")
    rid, created, t0 = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), time.perf_counter()

    def record(choices: list[Any]) -> None:
        if rollout is not None:
            svc.record(rollout, owner, model, [prompt], choices, params.n, messages)

    if not params.stream or tools:  # with tools a stream is sent once the reply is parsed
        done = await asyncio.to_thread(svc.complete, model, [prompt], params, owner, key)
        record(done.choices)
        log_completion(rid, model, done.prompt_tokens, done.completion_tokens, t0, stream=False)
        replies = [svc.reply(prompt, ch, tools, one_call) for ch in done.choices]
        if params.stream:
            head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
            chunks = _parsed_chunks(done, replies, params.include_usage, head)
            return await stream_response(CompletionStream(iter(()), done.prompt_tokens),
                                         extras.stream_ids(chunks, [prompt], params.n, True, lambda: done.choices),
                                         rid, model, t0)
        head = {"id": rid, "object": "chat.completion", "created": created, "model": model}
        return extras.add_ids({**head, "choices": [
            {"index": ch.index, "message": chat_message(rep),
             "logprobs": chat_logprobs(ch.logprobs) if ch.logprobs is not None else None,
             "finish_reason": "tool_calls" if rep.tool_calls else ch.finish_reason}
            for ch, rep in zip(extras.shown_choices(done.choices), replies)], "usage": usage(done)},
            [prompt], done.choices, params.n, chat=True)
    stream = await asyncio.to_thread(svc.stream, model, [prompt], params, owner, key)
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
                                        "logprobs": chat_logprobs([extras.shown(ev.logprob)])
                                        if ev.logprob is not None else None,
                                        "finish_reason": ev.finish_reason}]}
        if params.include_usage:
            yield {**head, "choices": [], "usage": usage(stream)}

    return await stream_response(stream, extras.stream_ids(chunks(), [prompt], params.n, True, lambda: stream.choices),
                                 rid, model, t0, lambda: record(stream.choices))


def _parsed_chunks(done: Completion, replies: list[Any], include_usage: bool,
                   head: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Parsed chat replies as OpenAI streams them: role and content, each tool call (with its index), finish."""
    for ch, rep in zip(done.choices, replies):
        one = {"index": ch.index, "logprobs": None, "finish_reason": None}
        yield {**head, "choices": [{**one, "delta": {"role": "assistant", "content": rep.content or ""}}]}
        for k, call in enumerate(rep.tool_calls):
            yield {**head, "choices": [{**one, "delta": {"tool_calls": [{"index": k, **call}]}}]}
        yield {**head, "choices": [{**one, "delta": {}, "finish_reason": "tool_calls" if rep.tool_calls
                                    else ch.finish_reason}]}
    if include_usage:
        yield {**head, "choices": [], "usage": usage(done)}
