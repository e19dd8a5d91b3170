"""Structured output and forced tool calls as grammars (`engines.types.Constraint`) for constrained decoding.

What a request asks for, turned into the one constraint its samples follow:

- ``response_format`` (chat completions; the Responses API's ``text.format`` reads the same
  way): ``{"type": "text"}`` nothing; ``{"type": "json_object"}`` any JSON object;
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` JSON valid against
  ``schema``. An object schema that lists ``properties`` and says nothing of other keys gets no
  other key (`schema_closing`: as xgrammar and outlines decode, so a small model cannot wander
  into a key of its own until ``max_tokens``; the answer still validates against the schema as
  sent); ``strict: true`` (OpenAI's strict mode) also closes a bare ``{"type": "object"}``.
- ``tool_choice`` ``"required"`` or ``{"type": "function", "function": {"name"}}``: the answer
  is one or more tool calls (exactly one with ``parallel_tool_calls: false``) in the
  Hermes / Qwen format `chat_tools` parses, ``<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>``, whose arguments are valid against the chosen tool's
  ``parameters`` (closed the same way; ``strict`` per function). ``"auto"`` with a
  ``response_format``: either tool calls or the JSON answer.

JSON is written compactly (``", "`` and ``": "`` separators, no other whitespace:
`engines.grammar.COMPACT_JSON`). Every grammar is compile-checked here, so a schema the
grammar library cannot read is a 400 naming the field before anything is sampled.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from together_train_server.engines.grammar import COMPACT_JSON, check_constraint
from together_train_server.engines.types import Constraint
from together_train_server.service.errors import invalid
from together_train_server.service.sampling.schema_closing import closed_schema, strict_schema

__all__ = ["chat_constraint", "forced_tools", "response_format_schema", "strict_schema"]

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def response_format_schema(fmt: Any, key: str = "response_format") -> dict[str, Any] | None:
    """The JSON schema a ``response_format`` asks for (None = free text).

    Raises:
        ServiceError: INVALID_ARGUMENT naming `key` for a wrong shape or an unknown type.
    """
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise invalid(f"{key} must be an object {{type: 'text' | 'json_object' | 'json_schema', ...}}, got {fmt!r}",
                      key=key)
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return dict(ANY_OBJECT)
    if kind != "json_schema":
        raise invalid(f"{key}.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", key=key)
    spec = fmt.get("json_schema", fmt)  # chat nests it under json_schema; Responses' text.format is flat
    if not isinstance(spec, dict):
        raise invalid(f"{key}.json_schema must be an object {{name, schema, strict}}", key=key)
    schema = spec.get("schema", ANY_OBJECT)
    if not isinstance(schema, dict):
        raise invalid(f"{key}: schema must be a JSON Schema object, got {schema!r}", key=key)
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid(f"{key}: strict must be a boolean, got {strict!r}", key=key)
    return strict_schema(schema) if strict else closed_schema(copy.deepcopy(schema))


def forced_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> list[dict[str, Any]] | None:
    """The tools a ``tool_choice`` forces a call of (None = no call is forced).

    Raises:
        ServiceError: INVALID_ARGUMENT (key ``tool_choice``) for a forced choice without tools
            or naming a function that is not among them.
    """
    if tool_choice == "required" or isinstance(tool_choice, dict):
        if not tools:
            raise invalid(f"tool_choice {tool_choice!r} needs tools", key="tool_choice")
        if tool_choice == "required":
            return tools
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else tool_choice.get("name")
        chosen = [t for t in tools if t["function"]["name"] == name]
        if tool_choice.get("type") != "function" or not isinstance(name, str) or not chosen:
            raise invalid(f"tool_choice must name one of the tools {[t['function']['name'] for t in tools]} as "
                          f"{{type: 'function', function: {{name}}}}, got {tool_choice!r}", key="tool_choice")
        return chosen[:1]
    return None


def _call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON schema of one Hermes call object ``{"name", "arguments"}`` of any of `tools`."""
    variants = []
    for t in tools:
        fn = t["function"]
        params = fn.get("parameters") or ANY_OBJECT
        params = strict_schema(params) if fn.get("strict") else closed_schema(params)
        variants.append({"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
                         "required": ["name", "arguments"], "additionalProperties": False})
    return {"anyOf": variants, "x-guidance": COMPACT_JSON}


def _json_rule(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": COMPACT_JSON})


def tool_call_grammar(tools: list[dict[str, Any]], parallel: bool, answer: dict[str, Any] | None = None,
                      optional: bool = False) -> str:
    """A Lark grammar (llguidance syntax) of Hermes tool calls of `tools`.

    Args:
        parallel: one call, or one or more separated by newlines.
        answer: with `optional`, the JSON schema of the answer given instead of calls.
        optional: calls or the `answer` (tool_choice "auto" with a response_format).
    """
    calls = 'calls: call ("\\n" call)*' if parallel else "calls: call"
    rules = [calls, 'call: "<tool_call>\\n" body "\\n</tool_call>"', "body: " + _json_rule(_call_schema(tools))]
    if optional and answer is not None:
        return "\n".join(["start: calls | answer", "answer: " + _json_rule(answer), *rules])
    return "\n".join(["start: calls", *rules])


def chat_constraint(response_format: Any, tools: list[dict[str, Any]] | None, tool_choice: Any,
                    parallel_tool_calls: Any = None, format_key: str = "response_format") -> Constraint | None:
    """The constraint of a chat request (see the module docstring); None = unconstrained.

    Args:
        tools: the rendered tools (`chat_tools.check_tools`: checked, None under "none").
        parallel_tool_calls: OpenAI's field (None = true).

    Raises:
        ServiceError: INVALID_ARGUMENT naming `format_key`, ``tool_choice`` or
            ``parallel_tool_calls`` for a wrong shape or a schema that does not compile.
    """
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise invalid(f"parallel_tool_calls must be a boolean, got {parallel_tool_calls!r}", key="parallel_tool_calls")
    parallel = parallel_tool_calls is not False
    schema = response_format_schema(response_format, format_key)
    forced = forced_tools(tools, tool_choice)
    if forced:
        c, key = Constraint("lark", tool_call_grammar(forced, parallel)), "tool_choice"
    elif tools and schema is not None:
        c, key = Constraint("lark", tool_call_grammar(tools, parallel, schema, optional=True)), format_key
    elif schema is not None:
        c, key = Constraint("json_schema", json.dumps(schema)), format_key
    else:
        return None
    try:
        check_constraint(c)
    except ValueError as e:
        raise invalid(f"{key}: the schema cannot be used for constrained decoding: {e}", key=key) from None
    return c
