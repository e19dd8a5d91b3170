"""``POST /v1/responses`` (OpenAI's Responses API), ``GET`` / ``DELETE /v1/responses/{id}``.

One road with chat completions: the request becomes chat messages (`responses_items`), is
rendered with the model's chat template (tools included), sampled by `Chats.chat` (one
`ChatCall`, service/sampling/chat.py) with the same constraint (``text.format`` as ``response_format``, a forced ``tool_choice``:
`structured.chat_constraint`) and parsed by the same tool-call parser; only the shapes differ.
Under ``/v1/rollouts/{rollout_id}/responses`` the call is recorded token for token exactly as a
chat call (`InferenceService.record`). ``store`` (default true) keeps the response for
``previous_response_id`` and ``GET`` (`service.sampling.responses`).

Fields: ``model``, ``input``, ``instructions``, ``tools`` (function tools), ``tool_choice``,
``parallel_tool_calls``, ``text.format``, ``max_output_tokens``, ``temperature``, ``top_p``,
``previous_response_id``, ``store``, ``metadata``, ``stream``, and ``seed`` (as vLLM's); others (``reasoning``,
``include``, ``truncation``, ``user``, ...) are ignored, as OpenAI's server ignores what a
model does not use. Streaming sends Responses events (``response.created``,
``response.output_text.delta``, ``response.function_call_arguments.delta``,
``response.completed``, ...); text without tools streams as it is sampled, a reply with tools
once it is parsed.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

from fastapi import Request

from together_train_server.service.errors import ServiceError, invalid
from together_train_server.service.interfaces import (
    ChatCall, ChatResult, CompletionStream, InferenceService, ResolvedModel, ResponseStore)
from together_train_server.wire.http.openai import responses_items as items
from together_train_server.wire.http.openai.params import openai_params
from together_train_server.wire.http.deps import chats_of
from together_train_server.wire.http.openai.routing import handled, json_body, rollout_id, router, service
from together_train_server.wire.http.openai.streaming import log_completion, stream_response


@dataclass
class _Call:
    """A parsed Responses request: the chat call, and what the response object repeats."""

    chat: ChatCall
    conversation: list[dict[str, Any]]  # stored for previous_response_id (no instructions)
    store: bool
    echo: dict[str, Any]                # request fields the response object repeats


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(f"{name} must be a boolean, got {v!r}", key=name)
    return v


def _parse(svc: InferenceService, owner: str, model: ResolvedModel, rollout: str | None,
           body: dict[str, Any]) -> _Call:
    """Read a Responses body (see the module docstring) into a `ChatCall`. Raises ServiceError naming the field."""
    mot = body.get("max_output_tokens")
    if mot is not None and (isinstance(mot, bool) or not isinstance(mot, int) or mot < 1):
        raise invalid(f"max_output_tokens must be an integer >= 1, got {mot!r}", key="max_output_tokens")
    chat_body = {"max_completion_tokens": mot, "temperature": body.get("temperature"), "top_p": body.get("top_p"),
                 "stream": body.get("stream"), "seed": body.get("seed")}  # seed: vLLM's extension
    params = openai_params(chat_body, chat=True, limits=svc.limits)
    history = None
    if body.get("previous_response_id") is not None:
        history = _store(svc).get(owner, body["previous_response_id"], key="previous_response_id").messages
    messages, conv = items.input_messages(body.get("input"), body.get("instructions"), history)
    text = body.get("text") or {}
    if not isinstance(text, dict):
        raise invalid("text must be an object {format}", key="text")
    chat = ChatCall(model, owner, messages, params, items.chat_tools(body.get("tools")),
                    items.chat_tool_choice(body.get("tool_choice")), body.get("parallel_tool_calls"),
                    text.get("format"), format_key="text.format", rollout=rollout)
    echo = {"instructions": body.get("instructions"), "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice") or "auto", "parallel_tool_calls": body.get("parallel_tool_calls",
                                                                                                True),
            "text": {"format": text.get("format") or {"type": "text"}}, "max_output_tokens": mot,
            "temperature": params.sampling.temperature, "top_p": params.sampling.top_p,
            "previous_response_id": body.get("previous_response_id"), "metadata": body.get("metadata") or {}}
    return _Call(chat, conv, _bool(body, "store", True), echo)


def _store(svc: InferenceService) -> ResponseStore:
    store = getattr(svc, "responses", None)
    if store is None:
        raise ServiceError("NOT_FOUND", "this server stores no responses", key="previous_response_id")
    return store


def _response(rid: str, created: int, call: _Call, output: list[dict[str, Any]], usage: dict[str, Any] | None,
              finish: str | None) -> dict[str, Any]:
    """The response object (``status`` in_progress while `finish` is None)."""
    status = "in_progress" if finish is None else "incomplete" if finish == "length" else "completed"
    return {"id": rid, "object": "response", "created_at": created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": call.chat.model.name, "output": output, "usage": usage, "store": call.store, **call.echo}


@router.post("/v1/responses")
@router.post("/v1/rollouts/{rollout_id}/responses")
@handled
async def create_response(request: Request) -> Any:
    """A model response to ``input`` (see the module docstring): one `ChatCall` run by
    `Chats.chat` / `chat_stream`; recorded under a rollout URL."""
    svc, owner = service(request)
    chats = chats_of(request)
    rollout = rollout_id(request, svc, owner)
    body = await json_body(request)
    model = await asyncio.to_thread(chats.resolve, body.get("model"), owner)  # the model before the payload
    call = await asyncio.to_thread(_parse, svc, owner, model, rollout, body)
    rid, created, t0 = f"resp_{uuid.uuid4().hex}", int(time.time()), time.perf_counter()

    def finish(done: ChatResult, msg_id: str | None = None) -> dict[str, Any]:
        """Store: the final response object."""
        out = items.output_items(done.replies[0], msg_id)
        resp = _response(rid, created, call, out, items.usage_json(done), done.choices[0].finish_reason)
        if call.store and getattr(svc, "responses", None) is not None:
            svc.responses.put(owner, rid, resp, call.conversation + items.assistant_messages(out))
        return resp

    if not call.chat.params.stream:
        done = await asyncio.to_thread(chats.chat, call.chat)
        log_completion(rid, model.name, done.prompt_tokens, done.completion_tokens, t0, stream=False)
        return finish(done)
    run = await asyncio.to_thread(chats.chat_stream, call.chat)
    if run.result is None:  # text without tools: sent as it is sampled
        assert run.events is not None
        events = _live_events(run.events, _response(rid, created, call, [], None, None),
                              lambda msg_id: finish(run.finish(), msg_id))
        return await stream_response(run.events, _numbered(events), rid, model.name, t0)
    done = run.result
    log_completion(rid, model.name, done.prompt_tokens, done.completion_tokens, t0, stream=False)
    events = _parsed_events(_response(rid, created, call, [], None, None), finish(done))
    return await stream_response(CompletionStream(iter(()), done.prompt_tokens), _numbered(events), rid,
                                 model.name, t0)


@router.get("/v1/responses/{response_id}")
@handled
async def get_response(response_id: str, request: Request) -> Any:
    """A stored response object."""
    svc, owner = service(request)
    return _store(svc).get(owner, response_id).body


@router.delete("/v1/responses/{response_id}")
@handled
async def delete_response(response_id: str, request: Request) -> Any:
    """Forget a stored response."""
    svc, owner = service(request)
    _store(svc).delete(owner, response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


# ----- streaming events --------------------------------------------------------------------------------
def _numbered(events: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for i, ev in enumerate(events):
        yield {**ev, "sequence_number": i}


def _item_events(k: int, item: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A finished output item as it would stream: added, its text or arguments as one delta, done."""
    if item["type"] == "message":
        text = item["content"][0]["text"]
        yield from _message_open(k, item)
        if text:
            yield {"type": "response.output_text.delta", "item_id": item["id"], "output_index": k,
                   "content_index": 0, "delta": text, "logprobs": []}
        yield from _message_close(k, item)
        return
    yield {"type": "response.output_item.added", "output_index": k,
           "item": {**item, "arguments": "", "status": "in_progress"}}
    yield {"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": k,
           "delta": item["arguments"]}
    yield {"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": k,
           "name": item["name"], "arguments": item["arguments"]}
    yield {"type": "response.output_item.done", "output_index": k, "item": item}


def _message_open(k: int, item: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield {"type": "response.output_item.added", "output_index": k,
           "item": {**item, "status": "in_progress", "content": []}}
    yield {"type": "response.content_part.added", "item_id": item["id"], "output_index": k, "content_index": 0,
           "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}


def _message_close(k: int, item: dict[str, Any]) -> Iterator[dict[str, Any]]:
    part = item["content"][0]
    yield {"type": "response.output_text.done", "item_id": item["id"], "output_index": k, "content_index": 0,
           "text": part["text"], "logprobs": []}
    yield {"type": "response.content_part.done", "item_id": item["id"], "output_index": k, "content_index": 0,
           "part": part}
    yield {"type": "response.output_item.done", "output_index": k, "item": item}


def _parsed_events(opening: dict[str, Any], final: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The events of a finished response (a reply with tools: sent once parsed)."""
    yield {"type": "response.created", "response": opening}
    yield {"type": "response.in_progress", "response": opening}
    for k, item in enumerate(final["output"]):
        yield from _item_events(k, item)
    yield {"type": f"response.{final['status']}", "response": final}


def _live_events(stream: CompletionStream, opening: dict[str, Any], finish: Any) -> Iterator[dict[str, Any]]:
    """Text sampled as it comes: one message item whose deltas are the stream's, then the final response."""
    yield {"type": "response.created", "response": opening}
    yield {"type": "response.in_progress", "response": opening}
    item = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
    yield from _message_open(0, item)
    for ev in stream:
        if ev.delta:
            yield {"type": "response.output_text.delta", "item_id": item["id"], "output_index": 0,
                   "content_index": 0, "delta": ev.delta, "logprobs": []}
    final = finish(item["id"])
    yield from _message_close(0, final["output"][0])
    yield {"type": f"response.{final['status']}", "response": final}
