"""Closing JSON schemas for constrained decoding: no object key beyond those a schema lists.

JSON Schema admits any extra key in an object that does not say ``additionalProperties``; a
grammar built from such a schema lets an untrained or small model open a key of its own and
write it until ``max_tokens`` (the answer then never parses). The frameworks send exactly such
schemas by default (langchain's ``bind_tools`` and ``ProviderStrategy``, smolagents' tools,
pydantic-ai's non-strict tools). xgrammar and outlines, vLLM's usual backends, never generate
unlisted keys, and vLLM's guidance backend has ``disable_additional_properties`` to match them;
this module does the same for every engine, by filling ``additionalProperties: false`` into the
schema the grammar is built from. What the grammar admits is a subset of what the schema
admits, so every answer still validates against the schema as the client sent it.

An object is closed when it lists ``properties`` and says nothing of its other keys
(``additionalProperties``, ``unevaluatedProperties``, ``patternProperties``), and when it is not
combined with other schemas that list keys of their own (``allOf`` members and ``$ref``
siblings: closing one part would refuse the keys of another). OpenAI's ``strict: true`` also
closes a bare ``{"type": "object"}`` (`strict_schema`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["closed_schema", "strict_schema"]

_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
_ONE = ("items", "additionalProperties", "unevaluatedProperties", "not", "if", "then", "else", "contains",
        "propertyNames", "additionalItems")
_LISTS = ("anyOf", "oneOf", "prefixItems")
_OPEN = ("additionalProperties", "unevaluatedProperties", "patternProperties", "allOf", "$ref")


def closed_schema(schema: Any, bare_objects: bool = False, _closable: bool = True) -> Any:
    """A copy of `schema` whose object schemas admit no unlisted key (see the module docstring).

    Args:
        schema: a JSON Schema (a dict; booleans and lists of schemas pass through the walk).
        bare_objects: also close ``{"type": "object"}`` without ``properties`` (OpenAI strict mode).

    Only schema positions are walked (``properties`` values, ``items``, ``anyOf`` members, ...), never
    ``enum``/``const``/``default`` values, so a property named ``properties`` or ``type`` is left alone.
    """
    if isinstance(schema, list):
        return [closed_schema(s, bare_objects) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: closed_schema(s, bare_objects) for name, s in out[k].items()}
    for k in _ONE:
        if k in out:
            out[k] = closed_schema(out[k], bare_objects)
    for k in _LISTS:
        if isinstance(out.get(k), list):
            out[k] = [closed_schema(s, bare_objects) for s in out[k]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed_schema(s, bare_objects, _closable=False) for s in out["allOf"]]
    lists_keys = "properties" in out or (bare_objects and out.get("type") == "object")
    if _closable and lists_keys and not any(k in out for k in _OPEN):
        out["additionalProperties"] = False
    return out


def strict_schema(schema: Any) -> Any:
    """OpenAI's strict mode: `closed_schema` that also closes bare ``{"type": "object"}`` schemas."""
    return closed_schema(schema, bare_objects=True)
