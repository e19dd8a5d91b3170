"""``POST /v1/messages`` (Anthropic's Messages API) through the official ``anthropic`` client, on a real resource.

The tiny random Llama (1024 positions, the embedded model's template with tool rendering).
References: the tokenizer's ``apply_chat_template`` (the recorded prompt), ``jsonschema`` (a forced
tool_use's input), and the rollout record: what the client received is the recorded tokens decoded.
"""

from __future__ import annotations

import pytest
from _served import WEATHER, launch_with_http

anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

KEY = "sk-anthropic"
TOOLS = [{"name": "weather", "description": "the weather in a city", "input_schema": WEATHER}]


@pytest.fixture(scope="module")
def served(tiny_model_dir_1k, tmp_path_factory):
    with launch_with_http(tiny_model_dir_1k, tmp_path_factory.mktemp("anthropic"), KEY) as client:
        yield client, client.http_url


def _client(served, rollout: str):
    return anthropic.Anthropic(base_url=f"{served[1]}/v1/rollouts/{rollout}", api_key=KEY, max_retries=0,
                               timeout=300)


def test_text_message_is_the_recorded_tokens(served, tiny_model_dir_1k, tokenizer_1k):
    m = _client(served, "ant-text").messages.create(model=tiny_model_dir_1k.name, max_tokens=8, system="Be brief.",
                                                    messages=[{"role": "user", "content": "Hello"}])
    (call,) = served[0].get_rollout("ant-text").calls
    want = tokenizer_1k.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
                                   add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert list(call.prompt_tokens) == list(want)
    assert m.content[0].text == tokenizer_1k.decode(call.choices[0].tokens, skip_special_tokens=True)
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.input_tokens == len(want)
    assert m.usage.output_tokens == len(call.choices[0].tokens)


def test_forced_tool_use_then_tool_result(served, tiny_model_dir_1k, tokenizer_1k):
    client = _client(served, "ant-tools")
    ask = [{"role": "user", "content": "Weather in Rome?"}]
    m = client.messages.create(model=tiny_model_dir_1k.name, max_tokens=80, messages=ask, tools=TOOLS,
                               tool_choice={"type": "any", "disable_parallel_tool_use": True})
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and use.name == "weather"
    jsonschema.validate(use.input, WEATHER)
    turn2 = ask + [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
    m2 = client.messages.create(model=tiny_model_dir_1k.name, max_tokens=4, messages=turn2, tools=TOOLS)
    c1, c2 = served[0].get_rollout("ant-tools").calls
    assert tokenizer_1k.decode(c2.prompt_tokens).startswith(tokenizer_1k.decode(list(c1.prompt_tokens) + list(c1.choices[0].tokens)))
    assert "<tool_response>\nsunny\n</tool_response>" in tokenizer_1k.decode(c2.prompt_tokens)
    assert m2.content[0].text == tokenizer_1k.decode(c2.choices[0].tokens, skip_special_tokens=True)


def test_streamed_events(served, tiny_model_dir_1k):
    client = _client(served, "ant-stream")
    with client.messages.stream(model=tiny_model_dir_1k.name, max_tokens=200, tools=TOOLS,
                                messages=[{"role": "user", "content": "Paris?"}],
                                tool_choice={"type": "tool", "name": "weather"}) as s:
        final = s.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    assert uses and final.stop_reason == "tool_use" and {u.name for u in uses} == {"weather"}
    for use in uses:  # parallel calls allowed: each valid
        jsonschema.validate(use.input, WEATHER)
    with client.messages.stream(model=tiny_model_dir_1k.name, max_tokens=6,
                                messages=[{"role": "user", "content": "Hi"}]) as s:
        text = "".join(s.text_stream)
    assert text == s.get_final_message().content[0].text


@pytest.mark.parametrize("kw, words", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 4, "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
])
def test_bad_requests_are_400_naming_the_field(served, tiny_model_dir_1k, kw, words):
    args = {"model": tiny_model_dir_1k.name, "messages": [{"role": "user", "content": "x"}], **kw}
    with pytest.raises(anthropic.BadRequestError) as e:
        _client(served, "ant-bad").messages.create(**args)
    assert words in e.value.response.json()["error"]["message"]
