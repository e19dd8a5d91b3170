"""Released agent frameworks, unchanged, against a rollout URL on a real resource.

langchain-openai / langgraph (chat completions and, with ``use_responses_api``, the Responses API),
pydantic-ai's default ``openai:`` model (the Responses API), smolagents (``ToolCallingAgent``, which
sends ``tool_choice: "required"``, and ``CodeAgent``) and dspy (``Predict``) talk to
``http://HOST:PORT/v1/rollouts/{id}`` exactly as they would to OpenAI. The model is the tiny random
Llama (4096 positions: smolagents' system prompts are ~2k tokens) with SmolLM2's tokenizer, so the
embedded model's template with Hermes tool rendering: its text is garbage, so the tests assert structure
and recording, never content. Tools and typed outputs are forced (``tool_choice``, ``response_format`` /
``text.format``) so that constrained decoding makes even a random model's answer valid; tool arguments
are bounded (enums) so that a forced call ends well within ``max_tokens``.

Independent references: the Hermes ``<tool_call>\\n{json}\\n</tool_call>`` format parsed here with ``re``
and ``json``, pydantic's own validation of the typed outputs, and what each framework handed to the
tools and returned: it must equal what the recorded sampled tokens decode to.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

import pytest
from pydantic import BaseModel, Field
from _served import launch_with_http

openai = pytest.importorskip("openai")

KEY = "sk-frameworks"
CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)


class Report(BaseModel):
    """A typed answer every framework is asked for (bounded: a random model ends it)."""

    sky: Literal["sunny", "rainy"]
    days: int = Field(ge=1, le=7)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from _models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-4k"), arch="llama", seed=0, max_positions=4096)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    with launch_with_http(tiny_model_dir, tmp_path_factory.mktemp("frameworks"), KEY) as client:
        yield client, client.local_resource.http_url


def _url(served, rollout: str) -> str:
    return f"{served[1]}/v1/rollouts/{rollout}"


def _texts(served, tok, rollout: str) -> list[str]:
    """Each recorded call's sampled tokens, decoded (special tokens such as ``<|im_end|>`` dropped)."""
    return [tok.decode(c.choices[0].tokens, skip_special_tokens=True) for c in served[0].get_rollout(rollout).calls]


def _tool_calls(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(name, arguments) of each complete Hermes tool call in `text`."""
    return [(c["name"], c["arguments"]) for c in map(json.loads, CALL.findall(text))]


# ----- langchain-openai / langgraph --------------------------------------------------------------------
def _chat_openai(served, tiny_model_dir, rollout: str, **kw):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=tiny_model_dir.name, base_url=_url(served, rollout), api_key=KEY, max_retries=0,
                      timeout=300, extra_body={"seed": 0}, **kw)


def _lc_weather(seen: list, **tool_kw):
    from langchain_core.tools import tool

    @tool(**tool_kw)
    def weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        seen.append({"city": city})
        return "sunny"

    return weather


@pytest.mark.parametrize("responses_api", [False, True], ids=["chat", "responses"])
def test_langchain_openai_text_tools_and_structured_output(served, tiny_model_dir, tok, responses_api):
    """ChatOpenAI: plain text (streamed), a forced tool call (streamed too) and ``with_structured_output``
    (its default json_schema method, strict), on chat completions and on the Responses API."""
    rollout = f"lc-{int(responses_api)}"
    llm = _chat_openai(served, tiny_model_dir, rollout, max_tokens=60, use_responses_api=responses_api)
    weather = _lc_weather([])
    text = llm.invoke("Hello").text
    streamed = "".join(c.text for c in llm.stream("Hello again"))
    forced = llm.bind_tools([weather], tool_choice="weather", parallel_tool_calls=False)
    called = forced.invoke("Weather in Rome?").tool_calls
    acc = None
    for chunk in forced.stream("Weather in Paris?"):
        acc = chunk if acc is None else acc + chunk
    report = llm.with_structured_output(Report).invoke("Report the weather.")
    rec = _texts(served, tok, rollout)
    assert len(rec) == 5, rec
    assert [text, streamed] == rec[:2]
    for got, want in ((called, rec[2]), (acc.tool_calls, rec[3])):
        assert [(c["name"], c["args"]) for c in got] == _tool_calls(want) and len(got) == 1, (got, want)
    assert isinstance(report, Report) and report == Report.model_validate_json(rec[4])


@pytest.mark.filterwarnings("ignore:create_react_agent has been moved")  # to the `langchain` package; still langgraph 1.x's
def test_langgraph_react_agent_with_a_tool_and_response_format(served, tiny_model_dir, tok):
    """langgraph's prebuilt ReAct agent: a forced tool call that returns directly, then an agent with a
    ``response_format`` (a free-text turn, then langgraph's structured-output call)."""
    from langgraph.prebuilt import create_react_agent

    seen: list = []
    weather = _lc_weather(seen, return_direct=True)
    llm = _chat_openai(served, tiny_model_dir, "lg", max_tokens=60)
    tool_agent = create_react_agent(llm.bind_tools([weather], tool_choice="required",
                                                   parallel_tool_calls=False), [weather])
    out = tool_agent.invoke({"messages": [("user", "Weather in Rome?")]})
    assert out["messages"][-1].content == "sunny" and len(seen) == 1
    typed = create_react_agent(llm, [], response_format=Report)
    out = typed.invoke({"messages": [("user", "Report the weather.")]})
    rec = _texts(served, tok, "lg")
    assert len(rec) == 3, rec
    assert _tool_calls(rec[0]) == [("weather", seen[0])]
    assert out["messages"][-1].text == rec[1]
    assert out["structured_response"] == Report.model_validate_json(rec[2])


# ----- pydantic-ai ---------------------------------------------------------------------------------------
@pytest.fixture()
def openai_env(served, monkeypatch):
    """pydantic-ai's ``openai:`` provider reads OPENAI_BASE_URL / OPENAI_API_KEY, as a user would set them."""

    def point(rollout: str) -> None:
        monkeypatch.setenv("OPENAI_BASE_URL", _url(served, rollout))
        monkeypatch.setenv("OPENAI_API_KEY", KEY)

    return point


def test_pydantic_ai_default_model_tools_and_output_type(served, tiny_model_dir, tok, openai_env):
    """``Agent("openai:<model>")`` (the Responses API) with a tool and a typed ``output_type``: pydantic-ai
    asks for tool_choice "required" (its output is a ``final_result`` tool), so every turn is a forced call;
    what each tool got, and the output, are the recorded tokens decoded."""
    pydantic_ai = pytest.importorskip("pydantic_ai")
    openai_env("pa-tools")
    seen: list = []
    settings = pydantic_ai.ModelSettings(max_tokens=80, parallel_tool_calls=False, extra_body={"seed": 0})
    agent = pydantic_ai.Agent(f"openai:{tiny_model_dir.name}", output_type=Report, model_settings=settings)

    @agent.tool_plain
    def weather(city: Literal["Paris", "Rome"], days: Annotated[int, Field(ge=1, le=7)]) -> str:
        """The weather in a city for some days."""
        seen.append({"city": city, "days": days})
        return "sunny"

    result = agent.run_sync("Weather in Rome?", usage_limits=pydantic_ai.UsageLimits(request_limit=20))
    calls = [c for t in _texts(served, tok, "pa-tools") for c in _tool_calls(t)]
    assert len(calls) == len(_texts(served, tok, "pa-tools"))  # one complete call per recorded turn
    assert [args for name, args in calls if name == "weather"] == seen
    assert calls[-1] == ("final_result", result.output.model_dump())


def test_pydantic_ai_native_output_and_streaming(served, tiny_model_dir, tok, openai_env):
    """``NativeOutput`` (``text.format`` json_schema) run and streamed on the default model."""
    pydantic_ai = pytest.importorskip("pydantic_ai")
    import asyncio

    openai_env("pa-native")
    agent = pydantic_ai.Agent(f"openai:{tiny_model_dir.name}", output_type=pydantic_ai.NativeOutput(Report),
                              model_settings=pydantic_ai.ModelSettings(max_tokens=60))

    async def both() -> tuple[Report, Report]:
        ran = (await agent.run("Report the weather.")).output
        async with agent.run_stream("Report it again.") as streamed:
            return ran, await streamed.get_output()

    outputs = asyncio.run(both())
    rec = _texts(served, tok, "pa-native")
    assert list(outputs) == [Report.model_validate_json(t) for t in rec]


# ----- smolagents ----------------------------------------------------------------------------------------
def _smol_tools(seen: list) -> list:
    from smolagents import tool

    @tool
    def weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city.

        Args:
            city: the city
        """
        seen.append(("weather", {"city": city}))
        return "sunny"

    @tool
    def final_answer(answer: Literal["sunny", "rainy"]) -> str:
        """The final answer (replaces smolagents' own, whose free-text argument a random model never ends).

        Args:
            answer: the weather
        """
        seen.append(("final_answer", {"answer": answer}))
        return answer

    return [weather, final_answer]


def _smol_model(served, tiny_model_dir, rollout: str):
    from smolagents import OpenAIServerModel

    return OpenAIServerModel(tiny_model_dir.name, api_base=_url(served, rollout), api_key=KEY, max_tokens=100,
                             seed=0, parallel_tool_calls=False)  # the extra kwargs go into each request


def test_smolagents_tool_calling_agent(served, tiny_model_dir, tok):
    """``ToolCallingAgent`` sends tool_choice "required": every step is a valid call of its tools."""
    smolagents = pytest.importorskip("smolagents")
    seen: list = []
    agent = smolagents.ToolCallingAgent(tools=_smol_tools(seen), model=_smol_model(served, tiny_model_dir, "sa-tools"),
                                        max_steps=3, verbosity_level=0)
    answer = agent.run("Weather in Rome?")
    rec = _texts(served, tok, "sa-tools")
    steps = [s for s in agent.memory.steps if isinstance(s, smolagents.ActionStep)]
    calls = [c for t in rec for c in _tool_calls(t)]
    assert calls and calls == seen[:len(calls)], (calls, seen)
    for step, text in zip(steps, rec):
        assert [(c.name, c.arguments) for c in step.tool_calls] == _tool_calls(text)
    if seen[-1][0] == "final_answer":  # else max_steps ended it: a last free-text call is the answer
        assert answer == seen[-1][1]["answer"] and len(rec) == len(steps)
    else:
        assert answer == rec[-1] and len(rec) == len(steps) + 1


def test_smolagents_code_agent(served, tiny_model_dir, tok):
    """``CodeAgent``: a random model writes no code block, so its one step fails to parse and smolagents
    asks for a final answer in free text; both calls are recorded as the agent saw them."""
    smolagents = pytest.importorskip("smolagents")
    agent = smolagents.CodeAgent(tools=_smol_tools([])[:1], model=_smol_model(served, tiny_model_dir, "sa-code"),
                                 max_steps=1, verbosity_level=0)
    answer = agent.run("Weather in Rome?")
    rec = _texts(served, tok, "sa-code")
    step = next(s for s in agent.memory.steps if isinstance(s, smolagents.ActionStep))
    # "</code>" is one of its stop strings, so smolagents appends it to a reply that lacks it
    assert len(rec) == 2 and step.model_output_message.content.removesuffix("</code>") == rec[0] and answer == rec[1]


# ----- dspy ------------------------------------------------------------------------------------------------
def _dspy_signature():
    """A dspy signature with a bounded output field (built here: dspy is imported only by its test)."""
    import dspy

    class Weather(dspy.Signature):
        """Report the weather in a city."""

        city: str = dspy.InputField()
        sky: Literal["sunny", "rainy"] = dspy.OutputField()

    return Weather


def _dspy_outputs(lm) -> list[str]:
    """The text of each call dspy made, as dspy received it (its LM history)."""
    return [out if isinstance(out, str) else out["text"] for h in lm.history for out in h["outputs"]]


def test_dspy_predict(served, tiny_model_dir, tok, monkeypatch):
    """``dspy.Predict`` (dspy 3.4's native OpenAI-chat engine; litellm is not imported). As
    ``openai/<model>`` dspy knows nothing of the model, so it sends no ``response_format``: ChatAdapter's
    call and JSONAdapter's fallback are random text and dspy raises, each call recorded as dspy got it.
    Declared with dspy's ``register_provider`` as supporting response schemas, JSONAdapter sends a
    json_schema and the constrained answer parses."""
    dspy = pytest.importorskip("dspy")
    from dspy.lm15 import AccessPolicy, ModelSupport, OpenAIChatCompat, ProviderDefinition, register_provider
    from dspy.lm15 import unregister_provider
    from dspy.utils.exceptions import AdapterParseError

    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # dspy's metadata refresh fetches from GitHub otherwise
    weather = _dspy_signature()
    kw = {"api_key": KEY, "cache": False, "max_tokens": 60, "num_retries": 0, "seed": 0}
    plain = dspy.LM(f"openai/{tiny_model_dir.name}", api_base=_url(served, "dspy-0"), **kw)
    with dspy.context(lm=plain), pytest.raises(AdapterParseError):
        dspy.Predict(weather)(city="Rome")
    assert _dspy_outputs(plain) == _texts(served, tok, "dspy-0") and len(plain.history) == 2
    access = AccessPolicy(provider="together-train", base_url=_url(served, "dspy-1"))
    register_provider(ProviderDefinition.chat(access, compat=OpenAIChatCompat.preset("vllm")),
                      supports=ModelSupport(response_schema=True))
    try:
        typed = dspy.LM(f"together-train/{tiny_model_dir.name}", **kw)
    finally:
        unregister_provider("together-train")
    with dspy.context(lm=typed, adapter=dspy.JSONAdapter()):
        answer = dspy.Predict(weather)(city="Rome")
    rec = _texts(served, tok, "dspy-1")
    assert _dspy_outputs(typed) == rec and len(rec) == 1, (_dspy_outputs(typed), rec)
    assert answer.sky == json.loads(rec[0])["sky"], (answer, rec)
    assert list(typed.history[0]["kwargs"]["response_format"].model_fields) == ["sky"]  # its json_schema's model
