"""`schema_closing.closed_schema` / `strict_schema`, checked with ``jsonschema`` (the independent reference):
a closed schema refuses an unlisted key where the original admitted it, admits every instance it listed,
and leaves open what the schema opened or combined (``additionalProperties``, ``allOf``, ``$ref``)."""

from __future__ import annotations

import pytest

from together_train_server.service.sampling.schema_closing import closed_schema, strict_schema

jsonschema = pytest.importorskip("jsonschema")

POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
# A property named "properties" / "type", nested objects in items, anyOf and $defs, a free dict, an allOf.
SCHEMA = {
    "type": "object",
    "properties": {
        "properties": {"type": "string"},
        "type": {"enum": [{"properties": {}}]},
        "points": {"type": "array", "items": POINT},
        "either": {"anyOf": [{"$ref": "#/$defs/p"}, {"type": "null"}]},
        "free": {"type": "object", "additionalProperties": {"type": "integer"}},
        "bare": {"type": "object"},
        "merged": {"allOf": [POINT, {"properties": {"y": {"type": "integer"}}}]},
    },
    "$defs": {"p": POINT},
}


def _valid(schema, instance) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


@pytest.mark.parametrize("instance, open_ok, closed_ok", [
    ({"properties": "a", "type": {"properties": {}}}, True, True),
    ({"zzz": 1}, True, False),                                       # top level
    ({"points": [{"x": 1}]}, True, True),
    ({"points": [{"x": 1, "zzz": 2}]}, True, False),                 # items
    ({"either": {"x": 1, "zzz": 2}}, True, False),                   # anyOf -> $ref -> $defs
    ({"free": {"a": 1, "b": 2}}, True, True),                        # additionalProperties given: kept
    ({"bare": {"a": 1}}, True, True),                                # no properties listed: open
    ({"merged": {"x": 1, "y": 2}}, True, True),                      # allOf members are not closed
])
def test_closed_schema_refuses_only_unlisted_keys(instance, open_ok, closed_ok):
    closed = closed_schema(SCHEMA)
    assert _valid(SCHEMA, instance) is open_ok and _valid(closed, instance) is closed_ok, (instance, closed)
    assert closed["properties"]["type"] == SCHEMA["properties"]["type"]  # an enum value is data, not a schema
    assert "additionalProperties" not in SCHEMA  # the input is not modified


def test_strict_schema_also_closes_bare_objects():
    assert _valid(closed_schema(SCHEMA), {"bare": {"a": 1}})
    assert not _valid(strict_schema(SCHEMA), {"bare": {"a": 1}})
    assert _valid(strict_schema(SCHEMA), {"bare": {}, "free": {"a": 1}})
