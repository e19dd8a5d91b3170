"""``POST /v1/responses`` through the official ``openai`` client (``client.responses``) and openai-agents'
default model, on a real resource.

The tiny random Llama (1024 positions, SmolLM2's tokenizer and so the embedded model's template
with tool rendering). References: the tokenizer's own ``apply_chat_template`` (the recorded
prompt), ``jsonschema`` (forced calls and text.format answers), and the rollout record: what the
client received is exactly the recorded sampled tokens decoded.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, Field
from _served import WEATHER, launch_with_http

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

KEY = "sk-responses"
TOOLS = [{"type": "function", "name": "weather", "description": "the weather in a city", "parameters": WEATHER}]


@pytest.fixture(scope="module")
def served(tiny_model_dir_1k, tmp_path_factory):
    with launch_with_http(tiny_model_dir_1k, tmp_path_factory.mktemp("responses"), KEY) as client:
        yield client, client.http_url


class Report(BaseModel):
    """openai-agents' output_type in the agent test (bounded: a random model ends it)."""

    sky: Literal["sunny", "rainy"]
    days: int = Field(ge=1, le=7)


def _oai(served, rollout: str | None = None):
    base = f"{served[1]}/v1" + (f"/rollouts/{rollout}" if rollout else "")
    return openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=300)


def _decoded(tokenizer_1k, choice) -> str:
    return tokenizer_1k.decode(choice.tokens, skip_special_tokens=True)


def test_text_response_is_the_recorded_tokens(served, tiny_model_dir_1k, tokenizer_1k):
    client = served[0]
    r = _oai(served, "resp-text").responses.create(model=tiny_model_dir_1k.name, input="Hello there",
                                                   instructions="Answer briefly.", max_output_tokens=8, temperature=0)
    assert r.object == "response" and r.status in ("completed", "incomplete")
    (call,) = client.get_rollout("resp-text").calls
    want = tokenizer_1k.apply_chat_template([{"role": "system", "content": "Answer briefly."},
                                    {"role": "user", "content": "Hello there"}], add_generation_prompt=True,
                                   tokenize=True, return_dict=True)["input_ids"]
    assert list(call.prompt_tokens) == list(want)
    assert r.output_text == call.choices[0].text == _decoded(tokenizer_1k, call.choices[0])
    assert r.usage.input_tokens == len(want) and r.usage.output_tokens == len(call.choices[0].tokens)
    assert r.usage.input_tokens_details.cached_tokens >= 0
    assert _oai(served).responses.retrieve(r.id).output_text == r.output_text  # store defaults to true


def test_forced_tool_call_then_its_output_chains_by_previous_response_id(served, tiny_model_dir_1k, tokenizer_1k):
    client, oai = served[0], _oai(served, "resp-tools")
    r1 = oai.responses.create(model=tiny_model_dir_1k.name, input="Weather in Paris?", tools=TOOLS, tool_choice="required",
                              parallel_tool_calls=False, max_output_tokens=80, extra_body={"seed": 1})
    (fc,) = [o for o in r1.output if o.type == "function_call"]
    assert fc.name == "weather" and fc.call_id
    jsonschema.validate(json.loads(fc.arguments), WEATHER)
    r2 = oai.responses.create(model=tiny_model_dir_1k.name, previous_response_id=r1.id, tools=TOOLS, max_output_tokens=5,
                              input=[{"type": "function_call_output", "call_id": fc.call_id, "output": "sunny"}])
    c1, c2 = client.get_rollout("resp-tools").calls
    first = tokenizer_1k.decode(list(c1.prompt_tokens) + list(c1.choices[0].tokens))
    second = tokenizer_1k.decode(c2.prompt_tokens)
    assert second.startswith(first), (first, second)  # the stored turn, re-rendered
    assert "<tool_response>\nsunny\n</tool_response>" in second
    assert r2.output_text == _decoded(tokenizer_1k, c2.choices[0])


def test_text_format_json_schema(served, tiny_model_dir_1k):
    fmt = {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}
    for seed in range(3):
        r = _oai(served).responses.create(model=tiny_model_dir_1k.name, input="JSON please", text={"format": fmt},
                                          max_output_tokens=60, extra_body={"seed": seed})
        assert r.status == "completed", r
        jsonschema.validate(json.loads(r.output_text), WEATHER)


def test_streamed_text_and_tool_call_events(served, tiny_model_dir_1k, tokenizer_1k):
    client, oai = served[0], _oai(served, "resp-stream")
    events = list(oai.responses.create(model=tiny_model_dir_1k.name, input="Hi", max_output_tokens=10, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in (
        "response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    rec = client.get_rollout("resp-stream").calls[0].choices[0]
    assert text == events[-1].response.output_text == _decoded(tokenizer_1k, rec)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    events = list(oai.responses.create(model=tiny_model_dir_1k.name, input="Rome?", tools=TOOLS, tool_choice="required",
                                       max_output_tokens=80, stream=True, parallel_tool_calls=False))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    jsonschema.validate(json.loads(args), WEATHER)
    assert "response.output_item.added" in [e.type for e in events]


@pytest.mark.parametrize("kw, code, param", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0]"),
    ({"input": [{"type": "image", "url": "x"}]}, 400, "input[0]"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, 400, "text.format"),
    ({"input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
])
def test_bad_requests_name_the_field(served, tiny_model_dir_1k, kw, code, param):
    with pytest.raises(openai.APIStatusError) as e:
        _oai(served).responses.create(model=tiny_model_dir_1k.name, **kw)
    err = e.value.response.json()["error"]
    assert e.value.status_code == code and err["param"] == param, err


def test_store_false_is_not_kept(served, tiny_model_dir_1k):
    r = _oai(served).responses.create(model=tiny_model_dir_1k.name, input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        _oai(served).responses.retrieve(r.id)


def test_openai_agents_default_model_with_a_tool_and_output_type(served, tiny_model_dir_1k, tokenizer_1k):
    """openai-agents' default model (the Responses API) runs, unchanged, an agent whose tool call is forced
    (tool_choice "required"; the run stops at the tool) and an agent with a typed output (text.format:
    constrained). Every call is recorded; what the agent received is the recorded tokens decoded."""
    agents = pytest.importorskip("agents")
    seen = []

    @agents.function_tool  # bounded arguments: a random model fills a free string until max_tokens
    def weather(city: Literal["Paris", "Rome"], days: Annotated[int, Field(ge=1, le=7)]) -> str:
        """The weather in a city for some days."""
        seen.append((city, days))
        return "sunny"

    client = served[0]
    agents.set_tracing_disabled(True)
    model = agents.OpenAIResponsesModel(tiny_model_dir_1k.name, openai.AsyncOpenAI(
        base_url=f"{served[1]}/v1/rollouts/resp-agent", api_key=KEY, max_retries=0, timeout=300))
    settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=80)
    tool_agent = agents.Agent(name="w", instructions="Use the tool.", tools=[weather], model=model,
                              model_settings=settings, tool_use_behavior="stop_on_first_tool")
    result = agents.Runner.run_sync(tool_agent, "Weather in Rome?", max_turns=2)
    (call,) = client.get_rollout("resp-agent").calls
    assert result.final_output == "sunny" and len(seen) >= 1
    text = _decoded(tokenizer_1k, call.choices[0])
    assert text.startswith("<tool_call>\n") and f'"city": "{seen[0][0]}", "days": {seen[0][1]}' in text
    typed = agents.Agent(name="r", instructions="Report.", model=model, output_type=Report,
                         model_settings=agents.ModelSettings(max_tokens=60))
    result = agents.Runner.run_sync(typed, "Weather in Rome?", max_turns=1)
    last = client.get_rollout("resp-agent").calls[-1]
    assert isinstance(result.final_output, Report)
    assert Report.model_validate_json(_decoded(tokenizer_1k, last.choices[0])) == result.final_output


def test_cookbook_agents_sdk_example_runs_and_chains(served, tiny_model_dir_1k, tokenizer_1k):
    """cookbook/examples/agents_sdk_agent.py (what agent_rl runs) against a rollout URL: two recorded
    Responses calls, the second's prompt continuing the first's turn (previous_response_id)."""
    pytest.importorskip("agents")
    from together_train_cookbook.examples.agents_sdk_agent import agent

    score = agent(f"{served[1]}/v1/rollouts/resp-cookbook", KEY, tiny_model_dir_1k.name,
                  {"a": 2, "b": 3, "c": 4})
    assert 0.0 <= score <= 2.0
    c1, c2 = served[0].get_rollout("resp-cookbook").calls
    assert tokenizer_1k.decode(c2.prompt_tokens).startswith(tokenizer_1k.decode(c1.prompt_tokens))
    assert "Add 4 to your answer." in tokenizer_1k.decode(c2.prompt_tokens)
