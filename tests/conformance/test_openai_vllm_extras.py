"""vLLM's token-exact extras on chat and completions, through the official ``openai`` client (``extra_body``).

A real resource (`_served.launch_with_http`) on the tiny model. References: the tokenizer itself
(``apply_chat_template`` and plain tokenization: the prompt ids), and the rollout record (the
sampled ids the replica returned).
"""

from __future__ import annotations

import pytest
from _served import launch_with_http

openai = pytest.importorskip("openai")

KEY = "sk-extras"
ASK = [{"role": "user", "content": "Say something"}]


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    with launch_with_http(tiny_model_dir, tmp_path_factory.mktemp("extras"), KEY) as client:
        yield client, client.local_resource.http_url


def _oai(served, rollout: str | None = None):
    base = f"{served[1]}/v1" + (f"/rollouts/{rollout}" if rollout else "")
    return openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=120)


def _template_ids(tok, messages, **kw) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)["input_ids"])


def test_chat_return_token_ids_are_the_recorded_tokens(served, tiny_model_dir, tokenizer):
    client = served[0]
    r = _oai(served, "ids-chat").chat.completions.create(
        model=tiny_model_dir.name, messages=ASK, max_completion_tokens=6, n=2, seed=0, logprobs=True,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True, "some_future_field": 1})
    body = r.model_dump()
    assert body["prompt_token_ids"] == _template_ids(tokenizer, ASK, add_generation_prompt=True)
    rec = client.get_rollout("ids-chat").calls[0]
    for ch, got in zip(body["choices"], rec.choices):
        assert ch["token_ids"] == list(got.tokens) and len(ch["token_ids"]) <= 6
        assert ch["message"]["content"] == tokenizer.decode(ch["token_ids"], skip_special_tokens=True)
        assert [t["token"] for t in ch["logprobs"]["content"]] == [f"token_id:{t}" for t in ch["token_ids"]]
    assert r.usage.completion_tokens == sum(len(c["token_ids"]) for c in body["choices"])


def test_completions_return_token_ids_per_choice(served, tiny_model_dir, tokenizer):
    r = _oai(served).completions.create(model=tiny_model_dir.name, prompt=["The fox", "A dog"], max_tokens=4, n=2,
                                        seed=1, logprobs=1, extra_body={"return_token_ids": True,
                                                                        "return_tokens_as_token_ids": True})
    for ch in r.model_dump()["choices"]:
        prompt = ["The fox", "A dog"][ch["index"] // 2]
        assert ch["prompt_token_ids"] == tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert ch["text"] == tokenizer.decode(ch["token_ids"], skip_special_tokens=True)
        assert ch["logprobs"]["tokens"] == [f"token_id:{t}" for t in ch["token_ids"]]


def test_streamed_token_ids_and_usage(served, tiny_model_dir, tokenizer):
    chunks = list(_oai(served).chat.completions.create(
        model=tiny_model_dir.name, messages=ASK, max_completion_tokens=5, stream=True, seed=2,
        stream_options={"include_usage": True}, extra_body={"return_token_ids": True}))
    dumps = [c.model_dump() for c in chunks]
    assert dumps[0]["prompt_token_ids"] == _template_ids(tokenizer, ASK, add_generation_prompt=True)
    (last,) = [c["choices"][0] for c in dumps if c["choices"] and c["choices"][0]["finish_reason"]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in dumps if c["choices"])
    assert text == tokenizer.decode(last["token_ids"], skip_special_tokens=True)
    assert dumps[-1]["usage"]["completion_tokens"] == len(last["token_ids"])


def test_template_options(served, tiny_model_dir, tokenizer):
    client, oai = served[0], _oai(served, "ids-template")
    partial = ASK + [{"role": "assistant", "content": "Well, I think"}]
    oai.chat.completions.create(model=tiny_model_dir.name, messages=partial, max_tokens=2,
                                extra_body={"continue_final_message": True, "chat_template_kwargs": {"x": 1}})
    oai.chat.completions.create(model=tiny_model_dir.name, messages=ASK, max_tokens=2,
                                extra_body={"add_generation_prompt": False})
    cont, plain = client.get_rollout("ids-template").calls
    assert list(cont.prompt_tokens) == _template_ids(tokenizer, partial, continue_final_message=True)
    assert tokenizer.decode(cont.prompt_tokens).endswith("Well, I think")
    assert list(plain.prompt_tokens) == _template_ids(tokenizer, ASK, add_generation_prompt=False)


@pytest.mark.parametrize("extra, param", [
    ({"return_token_ids": "yes"}, "return_token_ids"),
    ({"return_tokens_as_token_ids": 1}, "return_tokens_as_token_ids"),
    ({"chat_template_kwargs": "thinking"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"continue_final_message": True}, "messages"),  # the last message is the user's
    ({"add_generation_prompt": "no"}, "add_generation_prompt"),
])
def test_wrong_types_are_400_naming_the_field(served, tiny_model_dir, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        _oai(served).chat.completions.create(model=tiny_model_dir.name, messages=ASK, max_tokens=2, extra_body=extra)
    assert e.value.response.json()["error"]["param"] == param
