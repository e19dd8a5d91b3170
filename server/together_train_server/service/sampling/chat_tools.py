"""Tool calls on /v1/chat/completions: OpenAI's ``tools`` in through the chat template, ``tool_calls`` out.

In: the request's ``tools`` (OpenAI's ``{"type": "function", "function": {"name",
"description", "parameters"}}``) are passed to ``tokenizer.apply_chat_template(...,
tools=...)``, so the model sees them exactly as its template lays them out; a
template that never reads ``tools`` cannot show them, and the request is refused
(400) rather than silently answered without tools. Earlier assistant messages'
``tool_calls`` (arguments as JSON strings) become the template's form (arguments as
objects), and ``tool`` messages keep their ``tool_call_id`` / ``name``.

Out: the completion is parsed as the template's format defines: with the
tokenizer's declarative ``response_template`` (transformers' ``parse_response``,
read from ``tokenizer_config.json``) when it has one, else the Hermes / Qwen
``<tool_call>{"name", "arguments"}</tool_call>`` blocks when the chat template
writes those. Calls found come back as OpenAI ``tool_calls`` (arguments as a
JSON string) with ``finish_reason`` ``tool_calls``; the text outside them is the
message's content.

``tool_choice``: ``"auto"`` (default) and ``"none"`` (tools not rendered, nothing
parsed); ``"required"`` and a named function ``{"type": "function", "function":
{"name"}}`` are forced by constrained decoding (`structured.chat_constraint`): the
answer is a valid call of an allowed tool in the Hermes format, which is parsed
as any other.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from together_train_server.service.errors import invalid

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class ParsedReply:
    """An assistant reply split into content and OpenAI ``tool_calls`` (empty when it called nothing)."""

    content: str | None
    tool_calls: list[dict[str, Any]]


def supports_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's chat template reads the ``tools`` variable."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one, or any
        template = template.get("tool_use") or template.get("default") or ""
    return bool(template) and re.search(r"\btools\b", str(template)) is not None


def check_tools(tokenizer: PreTrainedTokenizerBase, tools: Any, tool_choice: Any) -> list[dict[str, Any]] | None:
    """The tools to render (None = none) for a request's ``tools`` / ``tool_choice``.

    Raises:
        ServiceError: INVALID_ARGUMENT naming ``tools[i]`` / ``tool_choice`` for a wrong shape, an
            unsupported choice, or a model whose chat template does not support tools.
    """
    if tool_choice is not None and tool_choice not in ("auto", "none", "required") and not isinstance(tool_choice, dict):
        raise invalid(f"tool_choice must be 'auto', 'none', 'required' or {{type: 'function', function: {{name}}}}, "
                      f"got {tool_choice!r}", key="tool_choice")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise invalid(f"tools must be a list of {{type: 'function', function: {{name, ...}}}}, got {tools!r}",
                      key="tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise invalid(f"tools[{i}] must be {{type: 'function', function: {{name, description, parameters}}}}",
                          key=f"tools[{i}]")
    if not supports_tools(tokenizer):
        raise invalid("tools are not supported by this model: its chat template does not render tools", key="tools")
    return None if tool_choice == "none" else tools


def template_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's OpenAI ``tool_calls`` in the chat template's form (arguments as objects).

    Raises:
        ServiceError: INVALID_ARGUMENT naming ``messages[i].tool_calls[j]`` for a wrong shape.
    """
    if not isinstance(calls, list):
        raise invalid(f"{where} must be a list of tool calls", key=where)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid(f"{where}[{j}] must be {{id, type: 'function', function: {{name, arguments}}}}",
                          key=f"{where}[{j}]")
        args = fn.get("arguments") or {}
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise invalid(f"{where}[{j}].function.arguments is not JSON: {args!r}", key=f"{where}[{j}]") from None
        out.append({"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def _openai_call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments if arguments is not None else {})
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def parse_reply(tokenizer: PreTrainedTokenizerBase, prompt: list[int], tokens: list[int], text: str,
                tools: list[dict[str, Any]] | None) -> ParsedReply:
    """Split a completion into content and tool calls, in the template's format (see the module docstring).

    Args:
        prompt: the rendered prompt's token ids (``parse_response`` reads the assistant's opening).
        tokens: the completion's token ids. text: its shown text (stop strings cut).
        tools: the rendered tools (None: nothing is parsed, the text is the content).
    """
    if not tools:
        return ParsedReply(text, [])
    if getattr(tokenizer, "response_template", None):
        try:
            rendered: list[dict[Any, Any] | Callable[..., Any]] = list(tools)
            msg = tokenizer.parse_response(tokens, prefix=prompt, tools=rendered)
        except (ValueError, KeyError, TypeError):  # output the template cannot parse: plain content
            return ParsedReply(text, [])
        calls = []
        for c in msg.get("tool_calls") or []:
            fn = c.get("function", c) if isinstance(c, dict) else {}
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                calls.append(_openai_call(fn["name"], fn.get("arguments")))
        content = msg.get("content")
        return ParsedReply(content if content or not calls else None, calls)
    if "<tool_call>" not in str(getattr(tokenizer, "chat_template", "") or ""):
        return ParsedReply(text, [])  # no format this server knows how to read: the text is the content
    calls, spans = [], []
    for m in HERMES_BLOCK.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue  # not a well-formed call: left in the content
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            calls.append(_openai_call(obj["name"], obj.get("arguments", obj.get("parameters"))))
            spans.append(m.span())
    if not calls:
        return ParsedReply(text, [])
    rest, at = [], 0
    for a, b in spans:
        rest.append(text[at:a])
        at = b
    content = ("".join(rest) + text[at:]).strip()
    return ParsedReply(content or None, calls)
