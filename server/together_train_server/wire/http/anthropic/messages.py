"""``POST /v1/messages``: Anthropic's Messages API as chat completions underneath (see the package docstring).

In: ``model``, ``max_tokens`` (required), ``system`` (a string or text blocks), ``messages``
(``user`` / ``assistant``; content a string or blocks: ``text``, ``tool_use`` on the assistant's
side, ``tool_result`` on the user's), ``tools`` (``{name, description, input_schema}``),
``tool_choice`` (``auto``, ``any`` = required, ``tool`` = that one, ``none``;
``disable_parallel_tool_use``), ``temperature``, ``top_p``, ``top_k``, ``stop_sequences``,
``stream``; other fields are ignored. Out: a ``message`` with ``text`` and ``tool_use`` blocks,
``stop_reason`` (``end_turn``, ``max_tokens``, ``stop_sequence``, ``tool_use``) and ``usage``
(``cache_read_input_tokens``: prompt tokens the prefix cache served). ``stream: true`` sends
Anthropic's events (``message_start``, ``content_block_start``, ``content_block_delta`` with
``text_delta`` / ``input_json_delta``, ``content_block_stop``, ``message_delta``,
``message_stop``) once the reply is parsed.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import replace
from typing import Any, Iterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from together_train_server.service.errors import invalid
from together_train_server.service.interfaces import ChatCall, Choice, InferenceService, ParsedReply, ResolvedModel
from together_train_server.wire.http.anthropic.routing import handled, router
from together_train_server.wire.http.openai.params import openai_params
from together_train_server.wire.http.deps import chats_of
from together_train_server.wire.http.openai.routing import json_body, rollout_id, service
from together_train_server.wire.http.openai.streaming import log_completion

_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in content):
        return "".join(str(b.get("text", "")) for b in content)
    raise invalid(f"{where} must be a string or a list of text blocks", key=where)


def _message(i: int, m: Any) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages (tool results first, as tool messages)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise invalid(f"{where}.role must be 'user' or 'assistant'", key=f"{where}.role")
    content = m.get("content")
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(blocks, list):
        raise invalid(f"{where}.content must be a string or a list of blocks", key=f"{where}.content")
    texts, calls, results = [], [], []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            texts.append(str(b.get("text", "")))
        elif kind == "tool_use" and m["role"] == "assistant" and isinstance(b.get("name"), str):
            calls.append({"id": b.get("id"), "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {})}})
        elif kind == "tool_result" and m["role"] == "user":
            results.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                            "content": _text(b.get("content", ""), f"{where}.content[{j}].content")})
        elif kind not in ("thinking", "redacted_thinking"):
            raise invalid(f"{where}.content[{j}]: block type {kind!r} is not served (text, tool_use, tool_result)",
                          key=f"{where}.content[{j}]")
    msg: dict[str, Any] = {"role": m["role"], "content": "".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    return results + ([msg] if texts or calls or not results else [])


def _tools(tools: Any, choice: Any) -> tuple[list[dict[str, Any]] | None, Any, bool]:
    """(chat tools, chat tool_choice, parallel) of Anthropic's ``tools`` / ``tool_choice``."""
    out = None
    if tools:
        if not isinstance(tools, list):
            raise invalid("tools must be a list of {name, description, input_schema}", key="tools")
        out = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str) or t.get("type") not in (None, "custom"):
                raise invalid(f"tools[{i}] must be a custom tool {{name, description, input_schema}}", key=f"tools[{i}]")
            out.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                         "parameters": t.get("input_schema") or {"type": "object"}}})
    if choice is None:
        return out, None, True
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise invalid(f"tool_choice must be {{type: 'auto' | 'any' | 'tool' | 'none'}}, got {choice!r}", key="tool_choice")
    chat = {"type": "function", "function": {"name": choice.get("name")}} if choice["type"] == "tool" \
        else _CHOICES[choice["type"]]
    return out, chat, not choice.get("disable_parallel_tool_use", False)


def _request(svc: InferenceService, owner: str, model: ResolvedModel, rollout: str | None,
             body: dict[str, Any]) -> ChatCall:
    """The `ChatCall` of a Messages body. Raises ServiceError naming the field."""
    mt = body.get("max_tokens")
    if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
        raise invalid(f"max_tokens is required: an integer >= 1, got {mt!r}", key="max_tokens")
    params = openai_params({"max_completion_tokens": mt, "temperature": body.get("temperature"),
                            "top_p": body.get("top_p"), "stop": body.get("stop_sequences")}, chat=True,
                           limits=svc.limits)
    top_k = body.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise invalid(f"top_k must be an integer >= 0, got {top_k!r}", key="top_k")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise invalid("messages must be a non-empty list", key="messages")
    system = [{"role": "system", "content": _text(body["system"], "system")}] if body.get("system") else []
    chat = system + [c for i, m in enumerate(msgs) for c in _message(i, m)]
    tools, choice, parallel = _tools(body.get("tools"), body.get("tool_choice"))
    params = replace(params, sampling=replace(params.sampling, top_k=top_k or 0))
    return ChatCall(model, owner, chat, params, tools, choice, parallel, rollout=rollout)


def _stop(ch: Choice, rep: ParsedReply, hit: str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a choice (`hit`: the stop string that ended it)."""
    if rep.tool_calls:
        return "tool_use", None
    if ch.finish_reason == "length":
        return "max_tokens", None
    return ("stop_sequence", hit) if hit else ("end_turn", None)


def _blocks(rep: ParsedReply) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"type": "text", "text": rep.content}] if rep.content or not rep.tool_calls else []
    for c in rep.tool_calls:
        out.append({"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": c["function"]["name"],
                    "input": json.loads(c["function"]["arguments"] or "{}")})
    return out


@router.post("/v1/messages")
@router.post("/v1/rollouts/{rollout_id}/messages")
@router.post("/v1/rollouts/{rollout_id}/v1/messages")  # the anthropic client's base_url has no /v1: it adds one
@handled
async def create_message(request: Request) -> Any:
    """A message (see the module docstring); recorded under a rollout URL."""
    svc, owner = service(request)
    chats = chats_of(request)
    rollout = rollout_id(request, svc, owner)
    body = await json_body(request)
    model = await asyncio.to_thread(chats.resolve, body.get("model"), owner)  # a known model: a non-empty string
    call = await asyncio.to_thread(_request, svc, owner, model, rollout, body)
    rid, t0 = f"msg_{uuid.uuid4().hex}", time.perf_counter()
    done = await asyncio.to_thread(chats.chat, call)
    log_completion(rid, model.name, done.prompt_tokens, done.completion_tokens, t0, stream=False)
    ch, rep = done.choices[0], done.replies[0]
    reason, seq = _stop(ch, rep, done.stop_sequences[0])
    msg = {"id": rid, "type": "message", "role": "assistant", "model": model.name, "content": _blocks(rep),
           "stop_reason": reason, "stop_sequence": seq,
           "usage": {"input_tokens": done.prompt_tokens, "output_tokens": done.completion_tokens,
                     "cache_read_input_tokens": done.cached_tokens, "cache_creation_input_tokens": 0}}
    if body.get("stream") is True:
        return StreamingResponse(_events(msg), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return msg


def _events(msg: dict[str, Any]) -> Iterator[str]:
    """A finished message as Anthropic's server-sent events (``event:`` name and JSON ``data:``)."""
    def ev(kind: str, **data: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

    start = {**msg, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {**msg["usage"], "output_tokens": 0}}
    yield ev("message_start", message=start)
    for k, b in enumerate(msg["content"]):
        if b["type"] == "text":
            yield ev("content_block_start", index=k, content_block={"type": "text", "text": ""})
            yield ev("content_block_delta", index=k, delta={"type": "text_delta", "text": b["text"]})
        else:
            yield ev("content_block_start", index=k, content_block={**b, "input": {}})
            yield ev("content_block_delta", index=k, delta={"type": "input_json_delta",
                                                            "partial_json": json.dumps(b["input"])})
        yield ev("content_block_stop", index=k)
    yield ev("message_delta", delta={"stop_reason": msg["stop_reason"], "stop_sequence": msg["stop_sequence"]},
             usage={"output_tokens": msg["usage"]["output_tokens"]})
    yield ev("message_stop")
