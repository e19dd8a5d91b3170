"""The Responses API's shapes <-> chat completions' (parse and build only; `responses` serves them).

In: ``instructions`` and ``input`` (a string, or items: messages with text content,
``function_call``, ``function_call_output``; ``reasoning`` items are skipped) become chat
messages; function ``tools`` (flat: ``{"type": "function", "name", "description",
"parameters", "strict"}``) and ``tool_choice`` (``{"type": "function", "name"}``) take chat's
nested form. Out: a parsed reply (`chat_tools.ParsedReply`) becomes output items (a
``message`` with ``output_text``, then one ``function_call`` per call) and the assistant
messages that continue the conversation.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Protocol

from together_train_server.service.errors import invalid
from together_train_server.service.interfaces import ParsedReply

__all__ = ["assistant_messages", "chat_tool_choice", "chat_tools", "input_messages", "output_items", "usage_json"]

_TEXT_PARTS = ("input_text", "output_text", "text")


def _text(content: Any, where: str) -> str:
    """A message's content: a string or a list of text parts (``input_text`` / ``output_text``)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") not in _TEXT_PARTS or not isinstance(p.get("text"), str):
                raise invalid(f"{where}.content[{j}] must be a text part {{type: 'input_text', text}} "
                              "(this server serves text models)", key=f"{where}.content")
            out.append(p["text"])
        return "".join(out)
    raise invalid(f"{where}.content must be a string or a list of text parts", key=f"{where}.content")


def _call(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``function_call`` item as a chat tool call."""
    name, args, call_id = item.get("name"), item.get("arguments", "{}"), item.get("call_id")
    if not isinstance(name, str) or not isinstance(args, str) or not isinstance(call_id, str):
        raise invalid(f"{where} must be {{type: 'function_call', call_id, name, arguments (a JSON string)}}",
                      key=where)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def input_messages(inp: Any, instructions: Any = None, history: list[dict[str, Any]] | None = None
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(messages to render, the conversation to store) of a request's ``input``.

    The rendered messages are the ``instructions`` (a system message), the stored `history`
    (``previous_response_id``) and the input; the stored conversation leaves the instructions out.

    Raises:
        ServiceError: INVALID_ARGUMENT naming ``input[i]`` (or ``input``, ``instructions``) for a wrong shape.
    """
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions must be a string", key="instructions")
    items = [{"role": "user", "content": inp}] if isinstance(inp, str) else inp
    if not isinstance(items, list):
        raise invalid("input must be a string or a list of items", key="input")
    conv = list(history or [])
    names: dict[str, str] = {}
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and isinstance(item.get("role"), str):
            conv.append({"role": item["role"], "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = _call(item, where)
            names[call["id"]] = call["function"]["name"]
            if conv and conv[-1]["role"] == "assistant":
                conv[-1].setdefault("tool_calls", []).append(call)
            else:
                conv.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out, call_id = item.get("output"), item.get("call_id")
            if not isinstance(call_id, str):
                raise invalid(f"{where}.call_id must be a string", key=where)
            text = out if isinstance(out, str) else _text(out, where) if isinstance(out, list) else json.dumps(out)
            msg = {"role": "tool", "tool_call_id": call_id, "content": text}
            if call_id in names:
                msg["name"] = names[call_id]
            conv.append(msg)
        elif kind != "reasoning":  # reasoning items carry nothing a text model can render
            raise invalid(f"{where} must be a message {{role, content}}, a function_call or a function_call_output "
                          f"item, got type {kind!r}", key=where)
    system = [{"role": "system", "content": instructions}] if instructions else []
    return system + conv, conv


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Responses function tools in chat's form.

    Raises:
        ServiceError: INVALID_ARGUMENT naming ``tools[i]`` for a tool that is not a function tool.
    """
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise invalid("tools must be a list of function tools", key="tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            raise invalid(f"tools[{i}] must be a function tool {{type: 'function', name, parameters}} (hosted tools "
                          "are not served)", key=f"tools[{i}]")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                                      if t.get(k) is not None}})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """A Responses ``tool_choice`` in chat's form (``{"type": "function", "name"}`` nests the name)."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def output_items(reply: ParsedReply, msg_id: str | None = None) -> list[dict[str, Any]]:
    """A parsed reply's output items: a ``message`` (when it has text; id `msg_id` or a new one), then a
    ``function_call`` per call."""
    items: list[dict[str, Any]] = []
    if reply.content or not reply.tool_calls:
        items.append({"type": "message", "id": msg_id or f"msg_{uuid.uuid4().hex}", "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": reply.content or "", "annotations": [],
                                   "logprobs": []}]})
    for c in reply.tool_calls:
        items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": c["id"],
                      "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": "completed"})
    return items


def assistant_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of output items (the turn a later ``previous_response_id`` continues)."""
    text = "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = calls
    return [msg]


class Counts(Protocol):
    """Token counts of an answer (`inference.Completion`, a finished `CompletionStream`; ``cached_tokens``
    read when present)."""

    @property
    def prompt_tokens(self) -> int: ...
    @property
    def completion_tokens(self) -> int: ...


def usage_json(done: Counts) -> dict[str, Any]:
    """The Responses usage object of a completion (cached: prompt tokens the prefix cache served)."""
    return {"input_tokens": done.prompt_tokens,
            "input_tokens_details": {"cached_tokens": int(getattr(done, "cached_tokens", 0))},
            "output_tokens": done.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": done.prompt_tokens + done.completion_tokens}
