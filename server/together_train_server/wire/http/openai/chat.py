"""``POST /v1/chat/completions``: messages (and tools) rendered with the model's chat template, the reply as the
assistant's (tool calls parsed, `service.chat_tools`)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Iterator

from fastapi import Request

from together_train_server.service.interfaces import ChatCall, ChatResult, CompletionStream
from together_train_server.wire.http.openai.params import openai_params
from together_train_server.wire.http.openai.rendering import chat_logprobs, chat_message, usage
from together_train_server.wire.http.deps import chats_of
from together_train_server.wire.http.openai.routing import handled, json_body, rollout_id, router, service
from together_train_server.wire.http.openai.streaming import log_completion, stream_response
from together_train_server.wire.http.openai.vllm_extras import read_extras


@router.post("/v1/chat/completions")
@router.post("/v1/rollouts/{rollout_id}/chat/completions")
@handled
async def chat_completions(request: Request) -> Any:
    """A chat completion: messages (and ``tools``) rendered with the model's chat template, the reply
    as the assistant's (tool calls parsed in the template's format, `service.chat_tools`).

    The body becomes one `ChatCall` run by `Chats.chat` / `chat_stream` (service/sampling/chat.py);
    under ``/v1/rollouts/{rollout_id}`` the call is also recorded (`service.rollouts`)."""
    svc, owner = service(request)
    chats = chats_of(request)
    rollout = rollout_id(request, svc, owner)
    body = await json_body(request)
    model = await asyncio.to_thread(chats.resolve, body.get("model"), owner)  # the model before the payload
    params = openai_params(body, chat=True, limits=svc.limits)
    extras = read_extras(body, chat=True)  # vLLM's return_token_ids, chat_template_kwargs, ...
    call = ChatCall(model, owner, body.get("messages"), params, body.get("tools"), body.get("tool_choice"),
                    body.get("parallel_tool_calls"), body.get("response_format"),
                    template_options=extras.template, rollout=rollout)
    rid, created, t0 = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), time.perf_counter()
    if not params.stream:
        done = await asyncio.to_thread(chats.chat, call)
        log_completion(rid, model.name, done.prompt_tokens, done.completion_tokens, t0, stream=False)
        head = {"id": rid, "object": "chat.completion", "created": created, "model": model.name}
        return extras.add_ids({**head, "choices": [
            {"index": ch.index, "message": chat_message(rep),
             "logprobs": chat_logprobs(ch.logprobs) if ch.logprobs is not None else None,
             "finish_reason": "tool_calls" if rep.tool_calls else ch.finish_reason}
            for ch, rep in zip(extras.shown_choices(done.choices), done.replies)], "usage": usage(done)},
            [done.prompt], done.choices, params.n, chat=True)
    run = await asyncio.to_thread(chats.chat_stream, call)
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model.name}
    if run.result is not None:  # with tools a stream is sent once the reply is parsed
        res = run.result
        log_completion(rid, model.name, res.prompt_tokens, res.completion_tokens, t0, stream=False)
        return await stream_response(CompletionStream(iter(()), res.prompt_tokens),
                                     extras.stream_ids(_parsed_chunks(res, params.include_usage, head), [run.prompt],
                                                       params.n, True, lambda: res.choices),
                                     rid, model.name, t0)
    stream = run.events
    assert stream is not None

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

    return await stream_response(stream, extras.stream_ids(chunks(), [run.prompt], params.n, True,
                                                            lambda: stream.choices),
                                 rid, model.name, t0, run.finish)


def _parsed_chunks(done: ChatResult, include_usage: bool, head: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Parsed chat replies as OpenAI streams them: role and content, each tool call (with its index), finish."""
    for ch, rep in zip(done.choices, done.replies):
        one = {"index": ch.index, "logprobs": None, "finish_reason": None}
        yield {**head, "choices": [{**one, "delta": {"role": "assistant", "content": rep.content or ""}}]}
        for k, call in enumerate(rep.tool_calls):
            yield {**head, "choices": [{**one, "delta": {"tool_calls": [{"index": k, **call}]}}]}
        yield {**head, "choices": [{**one, "delta": {}, "finish_reason": "tool_calls" if rep.tool_calls
                                    else ch.finish_reason}]}
    if include_usage:
        yield {**head, "choices": [], "usage": usage(done)}
