"""Structured output and forced tool calls by constrained decoding, through the official ``openai`` client.

A real resource (`_served.launch_with_http`) on a tiny random Llama (1024 positions, conftest's
`tiny_model_dir_1k`) with SmolLM2's tokenizer: its chat template is the embedded model's, which the server
serves with Hermes-style tool rendering
(service/sampling/chat_templates.py). A random model writes anything, so whatever it answers under a
constraint is the grammar's doing. Independent references: ``jsonschema`` (every answer validates
against its schema), ``json.loads``, and plain transformers for the recorded logprobs (a masked
distribution never gives a sampled token less probability than the model's own, and a token the
grammar forces has logprob 0).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from _served import launch_with_http

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

KEY = "sk-structured"
SEEDS = range(5)  # x N choices (each its own random stream): 20 answers per test
N = 4
ASK = [{"role": "user", "content": "Describe a city as JSON."}]
CITY = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "population": {"type": "integer", "minimum": 0, "maximum": 999},
    "capital": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["old", "new", "big"]}, "maxItems": 2}},
    "required": ["name", "population", "capital", "tags"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the weather in a city", "parameters": {
              "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {
                  "type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"],
              "additionalProperties": False}}},
         {"type": "function", "function": {"name": "add", "description": "add two numbers", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                              "b": {"type": "integer", "minimum": 0, "maximum": 99}},
             "required": ["a", "b"], "additionalProperties": False}}}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def served(tiny_model_dir_1k, tmp_path_factory):
    with launch_with_http(tiny_model_dir_1k, tmp_path_factory.mktemp("structured"), KEY) as client:
        yield client, client.http_url


@pytest.fixture(scope="module")
def oai(served):
    return openai.OpenAI(base_url=f"{served[1]}/v1", api_key=KEY, max_retries=0, timeout=300)


def _error(exc_info) -> dict:
    return exc_info.value.response.json()["error"]


def _chat(oai, tiny_model_dir_1k, seed: int, n: int = 1, **kw):
    return oai.chat.completions.create(model=tiny_model_dir_1k.name, messages=ASK, seed=seed, temperature=1.0,
                                       max_tokens=120, n=n, **kw)


def _answers(oai, tiny_model_dir_1k, **kw):
    """(seed, choice) of N choices for each of SEEDS."""
    return [(seed, ch) for seed in SEEDS for ch in _chat(oai, tiny_model_dir_1k, seed, N, **kw).choices]


def test_json_schema_answers_validate_over_seeds(oai, tiny_model_dir_1k):
    """strict: every one of 20 answers (5 seeds x 4 choices) is JSON valid against the schema, with no key beyond its own."""
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    strict = {**CITY, "additionalProperties": False}
    for seed, ch in _answers(oai, tiny_model_dir_1k, response_format=fmt):
        assert ch.finish_reason == "stop", (seed, ch)
        jsonschema.validate(json.loads(ch.message.content), strict)


def test_non_strict_schemas_get_no_unlisted_key(oai, tiny_model_dir_1k):
    """Without strict (the frameworks' default: langchain's bind_tools, smolagents' tools) an object that lists
    its properties still gets no other key, as xgrammar decodes: all 20 answers end (a random model that opens a
    key of its own writes it until max_tokens) and validate against the schema closed by hand."""
    weather = {**PARAMS["weather"]}
    del weather["additionalProperties"]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": weather}}]
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    for seed, ch in _answers(oai, tiny_model_dir_1k, response_format=fmt):
        assert ch.finish_reason == "stop", (seed, ch)
        jsonschema.validate(json.loads(ch.message.content), {**CITY, "additionalProperties": False})
    for seed, ch in _answers(oai, tiny_model_dir_1k, tools=tools, tool_choice="required", parallel_tool_calls=False):
        assert ch.finish_reason == "tool_calls", (seed, ch)
        jsonschema.validate(json.loads(ch.message.tool_calls[0].function.arguments), PARAMS["weather"])


def test_tool_choice_required_is_a_valid_call_of_a_tool(oai, tiny_model_dir_1k):
    """required: one or more calls, each of a listed tool with arguments valid against its parameters."""
    names = set()
    for seed, ch in _answers(oai, tiny_model_dir_1k, tools=TOOLS, tool_choice="required"):
        assert ch.finish_reason == "tool_calls" and ch.message.tool_calls, (seed, ch)
        for call in ch.message.tool_calls:
            names.add(call.function.name)
            jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    assert names == {"weather", "add"}  # the grammar leaves the choice of tool to the model


def test_named_tool_choice_and_parallel_false(oai, tiny_model_dir_1k):
    """A named function: exactly that one; parallel_tool_calls false: exactly one call."""
    choice = {"type": "function", "function": {"name": "add"}}
    for seed, ch in _answers(oai, tiny_model_dir_1k, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False):
        (call,) = ch.message.tool_calls
        assert ch.finish_reason == "tool_calls" and call.function.name == "add", (seed, ch)
        jsonschema.validate(json.loads(call.function.arguments), PARAMS["add"])


def test_recorded_logprobs_are_of_the_masked_distribution(oai, served, tiny_model_dir_1k, tokenizer_1k):
    """At temperature 1 a rollout records log p_masked(token) >= log p_model(token) (plain transformers
    on the same model), with equality to 0 where the grammar allows one token only."""
    import torch
    from transformers import AutoModelForCausalLM

    client, url = served
    roll = openai.OpenAI(base_url=f"{url}/v1/rollouts/structured-lp", api_key=KEY, max_retries=0, timeout=300)
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    r = roll.chat.completions.create(model=tiny_model_dir_1k.name, messages=ASK, seed=3, max_tokens=120,
                                     response_format=fmt)
    jsonschema.validate(json.loads(r.choices[0].message.content), CITY)
    rec = client.get_rollout("structured-lp").calls[0]
    prompt, seq = list(rec.prompt_tokens), rec.choices[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir_1k, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + list(seq.tokens)])).logits[0].float()
    plain = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(-1, torch.tensor(seq.tokens)[:, None])[:, 0]
    got = np.asarray(seq.logprobs, np.float64)
    assert np.all(got >= plain.numpy() - 1e-4), np.c_[got, plain.numpy()]
    assert np.all(got <= 1e-6), got
    forced = np.abs(got) < 1e-6
    assert forced.any() and np.all(plain.numpy()[forced] < -1.0), np.c_[got, plain.numpy()]


def test_tools_render_with_the_served_template(oai, served, tiny_model_dir_1k, tokenizer_1k):
    """The tiny model's template (the embedded model's) is served with tool rendering: the recorded
    prompt is the packaged template's rendering of the tools."""
    from together_train_server.service.sampling.chat_templates import TOOLS_TEMPLATE

    client, url = served
    roll = openai.OpenAI(base_url=f"{url}/v1/rollouts/structured-tools", api_key=KEY, max_retries=0, timeout=300)
    roll.chat.completions.create(model=tiny_model_dir_1k.name, messages=ASK, tools=TOOLS, max_tokens=2)
    want = tokenizer_1k.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                         return_dict=True, chat_template=TOOLS_TEMPLATE.read_text())["input_ids"]
    rec = client.get_rollout("structured-tools").calls[0]
    assert list(rec.prompt_tokens) == list(want)
    assert "<tools>" in tokenizer_1k.decode(rec.prompt_tokens) and '"name": "weather"' in tokenizer_1k.decode(want)


@pytest.mark.parametrize("kw, param, words", [
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "cannot be used for constrained decoding"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": CITY, "strict": "yes"}}},
     "response_format", "strict must be a boolean"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "must name one of the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls", "must be a boolean"),
])
def test_bad_constraints_are_400_naming_the_field(oai, tiny_model_dir_1k, kw, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(oai, tiny_model_dir_1k, 0, **kw)
    err = _error(e)
    assert err["param"] == param and words in err["message"], err
