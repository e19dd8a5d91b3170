"""Rollouts as OpenAI base URLs, and tool calls, through a real resource with the official ``openai`` client.

A real resource (``launch_local(http_port=0)``, two API keys) on a tiny Llama over printable
characters whose tokenizer is given here a chat template that renders ``tools`` (Hermes-style ``<tool_call>`` JSON)
and a declarative ``response_template`` (transformers' ``parse_response``). References: the
tokenizer's own ``apply_chat_template`` (the recorded prompt), ``compute_logprobs`` of the same
session version (the recorded sampler logprobs, within the sampler/trainer parity bound 1e-4 of
tests/server/test_e2e_versions.py: fp32, temperature 1), the session's step (the recorded versions).
"""

from __future__ import annotations

import json
import string

import httpx
import numpy as np
import pytest

import together_train as tt

openai = pytest.importorskip("openai")

KEY_A, KEY_B = "sk-rollout-a", "sk-rollout-b"
LOGPROB_ATOL = 1e-4  # sampler vs compute_logprobs on one version (tests/server/test_e2e_versions.py)
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\ntools: {% for t in tools %}{{ t.function.name }} {% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.tool_calls %}{% for c in message.tool_calls %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "{%- else %}{{ message.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
RESPONSE_TEMPLATE = {"defaults": {"role": "assistant"}, "start_anchor": "<|im_start|>assistant\n", "fields": {
    "tool_calls": {"open_pattern": r"\s*<tool_call>", "close": "</tool_call>", "repeats": True, "content": "json",
                   "transform": {"type": "function", "function": "{content}"}},
    "content": {"close_pattern": r"\s*<\|im_end\|>", "content": "text"}}}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "add two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
QUESTION = [{"role": "user", "content": "What is 2+3?"}]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory):
    """A tiny random Llama over printable characters (so LoRA learns a tool call in a few steps;
    `_models.build_char_model`) with the tool-rendering template and its response_template."""
    from _models import build_char_model

    chars = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")
    return build_char_model(tmp_path_factory.mktemp("tools-char"), chars, TOOL_TEMPLATE,
                            tokenizer_config={"response_template": RESPONSE_TEMPLATE})


@pytest.fixture(scope="module")
def tok(tools_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tools_model)


@pytest.fixture(scope="module")
def served(tools_model, tmp_path_factory):
    """(client of key A, client of key B, http url) of a resource with two API keys."""
    tmp = tmp_path_factory.mktemp("rollout-keys")
    (tmp / "keys").write_text(f"{KEY_A}\n{KEY_B}\n")
    (tmp / "keys").chmod(0o600)
    with tt.launch_local(model=str(tools_model), generators=1, storage_dir=tmp / "storage", api_key=KEY_A,
                         http_port=0, extra_args=["--trainer-threads", "1", "--generator-threads", "1",
                                                  "--api-key-file", str(tmp / "keys")]) as a:
        with tt.ResourceClient(a.local_resource.address, api_key=KEY_B) as b:
            yield a, b, a.local_resource.http_url


def _oai(url: str, rollout: str | None, key: str = KEY_A):
    base = f"{url}/v1" if rollout is None else f"{url}/v1/rollouts/{rollout}"
    return openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=120)


def _sft(session, tok, messages, reply: str, steps: int, tools=None, lr: float = 3e-2) -> None:
    """Train `session` to answer `messages` with `reply` (+ <|im_end|>), then publish (weights_sync)."""
    prompt = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                     return_dict=True)["input_ids"]
    target = tok(reply + "<|im_end|>", add_special_tokens=False)["input_ids"]
    full = np.asarray(prompt + target)
    w = np.r_[np.zeros(len(prompt) - 1), np.ones(len(target))].astype(np.float32)
    sample = tt.Sample(model_input=full[:-1], loss_fn_inputs={"target_tokens": full[1:], "weights": w})
    for _ in range(steps):
        session.forward_backward([sample], "cross_entropy")
        session.optim_step(tt.AdamParams(learning_rate=lr))
    session.weights_sync().result(timeout=300)


@pytest.fixture(scope="module")
def trained(served, tok):
    """A session of key A trained (3 steps) to start answering QUESTION, synced: version 3."""
    s = served[0].create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
    _sft(s, tok, QUESTION, " five", 3)
    yield s
    s.stop()


def test_rollout_records_the_sampled_tokens_logprobs_and_versions(served, trained, tok):
    client, _, url = served
    oai = _oai(url, "agent-run_1")
    chat = oai.chat.completions.create(model=trained.session_id, messages=QUESTION, max_tokens=8, temperature=1.0,
                                       n=2, seed=7)
    prompt2 = tok("Once upon a time", add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in prompt2
    streamed = "".join(c.choices[0].text for c in oai.completions.create(
        model=trained.session_id, prompt=prompt2, max_tokens=6, temperature=1.0, seed=3, stream=True) if c.choices)
    r = client.get_rollout("agent-run_1")
    assert r.rollout_id == "agent-run_1" and len(r.calls) == 2
    c1, c2 = r.calls
    want_prompt = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"]
    assert c1.prompt_tokens == want_prompt and c1.messages == QUESTION and c1.model == trained.session_id
    assert [ch.text for ch in c1.choices] == [ch.message.content for ch in chat.choices]
    assert sum(len(ch.tokens) for ch in c1.choices) == chat.usage.completion_tokens
    assert c2.prompt_tokens == prompt2 and c2.messages is None and c2.choices[0].text == streamed
    for call in (c1, c2):
        seqs = [call.prompt_tokens + ch.tokens for ch in call.choices]
        scored = trained.compute_logprobs(seqs).result(timeout=120)
        assert scored.policy_version == 3
        for ch, lp in zip(call.choices, scored.logprobs):
            assert ch.policy_versions == [3] * len(ch.tokens)
            assert tok.decode(ch.tokens, skip_special_tokens=True).startswith(ch.text)
            assert ch.finish_reason in ("stop", "length") and len(ch.logprobs) == len(ch.tokens)
            got, want = np.asarray(ch.logprobs), np.asarray(lp[len(call.prompt_tokens) - 1:])
            assert np.max(np.abs(got - want)) <= LOGPROB_ATOL, (got, want)
    # the same record over HTTP, in OpenAI-style JSON
    body = httpx.get(f"{url}/v1/rollouts/agent-run_1", headers={"Authorization": f"Bearer {KEY_A}"}).json()
    assert [c["prompt_tokens"] for c in body["calls"]] == [c1.prompt_tokens, c2.prompt_tokens]
    assert body["calls"][0]["choices"][1]["tokens"] == c1.choices[1].tokens
    client.delete_rollout("agent-run_1")
    with pytest.raises(tt.NotFoundError):
        client.get_rollout("agent-run_1")


def test_base_model_and_checkpoint_versions(served, tok):
    client, _, url = served
    base = _oai(url, None).models.list().data[0].id
    _oai(url, "base-run").completions.create(model=base, prompt="Hello", max_tokens=3, temperature=1.0, seed=1)
    (call,) = client.get_rollout("base-run").calls
    assert call.choices[0].policy_versions == [-1] * len(call.choices[0].tokens)  # the base model
    s = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))  # step 0: the base, its version 0
    try:
        _oai(url, "fresh-session").completions.create(model=s.session_id, prompt="Hello", max_tokens=3, seed=1)
        ch = client.get_rollout("fresh-session").calls[0].choices[0]
        assert ch.policy_versions == [0] * len(ch.tokens) and ch.tokens == call.choices[0].tokens
    finally:
        s.stop()


def test_other_key_sees_nothing_and_bad_ids_are_400(served, trained):
    a, b, url = served
    _oai(url, "mine").completions.create(model=trained.session_id, prompt="Hi", max_tokens=2)
    with pytest.raises(tt.NotFoundError):
        b.get_rollout("mine")
    with pytest.raises(tt.NotFoundError):
        b.delete_rollout("mine")
    r = httpx.get(f"{url}/v1/rollouts/mine", headers={"Authorization": f"Bearer {KEY_B}"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "rollout_id"
    with pytest.raises(openai.NotFoundError):  # key B cannot write into key A's rollout either
        _oai(url, "mine", KEY_B).completions.create(model="base", prompt="Hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError):  # nor sample key A's session
        _oai(url, "theirs", KEY_B).completions.create(model=trained.session_id, prompt="Hi", max_tokens=2)
    assert len(a.get_rollout("mine").calls) == 1
    # the dashboard lists each key's own rollouts
    for key, seen in ((KEY_A, True), (KEY_B, False)):
        st = httpx.get(f"{url}/api/dashboard/state", headers={"X-API-Key": key}).json()
        assert ("mine" in [x["rollout_id"] for x in st["rollouts"]]) is seen and st["rollout_store"]["rollouts"] >= 1
    for bad in ("has space", "semi;colon", "x" * 129, "dot.dot"):
        r = httpx.post(f"{url}/v1/rollouts/{bad}/chat/completions", headers={"Authorization": f"Bearer {KEY_A}"},
                       json={"model": "base", "messages": QUESTION, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "rollout_id", (bad, r.text)
        assert "letters, digits" in r.json()["error"]["message"]
    with pytest.raises(tt.InvalidArgumentError):
        a.get_rollout("has space")
    r = httpx.get(f"{url}/v1/rollouts/mine", headers={"Authorization": "Bearer sk-wrong"})
    assert r.status_code == 401


def test_tool_call_rendered_by_the_template_and_parsed_from_the_reply(served, tok):
    client, _, url = served
    s = client.create_session(lora=tt.LoraConfig(rank=16, alpha=32.0, seed=0))
    try:
        # measured with plain peft on this model: teacher-forced accuracy 1.0 after 60 steps at lr 1e-2
        _sft(s, tok, QUESTION, CALL, 80, tools=TOOLS, lr=1e-2)
        oai = _oai(url, "tools-run")
        r = oai.chat.completions.create(model=s.session_id, messages=QUESTION, tools=TOOLS, max_tokens=70,
                                        temperature=0, logprobs=True)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        (call,) = ch.message.tool_calls
        assert call.type == "function" and call.function.name == "add"
        assert json.loads(call.function.arguments) == {"a": 2, "b": 3} and call.id.startswith("call_")
        rec = client.get_rollout("tools-run").calls[0]
        want = tok.apply_chat_template(QUESTION, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"]
        assert rec.prompt_tokens == want  # the tools as the template renders them
        assert rec.choices[0].tokens == tok(CALL + "<|im_end|>", add_special_tokens=False)["input_ids"]
        # one logprob per generated token, the stop token included (usage counts it)
        assert len(ch.logprobs.content) == r.usage.completion_tokens == len(rec.choices[0].tokens)
        # the tool's answer goes back as a tool message; the call is re-rendered from OpenAI's form
        turn2 = QUESTION + [ch.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id,
                                                                       "content": "5"}]
        r2 = oai.chat.completions.create(model=s.session_id, messages=turn2, tools=TOOLS, max_tokens=3, temperature=0)
        rec2 = client.get_rollout("tools-run").calls[1]
        assert rec2.prompt_tokens[:len(rec.prompt_tokens) + len(rec.choices[0].tokens)] == \
            rec.prompt_tokens + rec.choices[0].tokens  # the history re-renders token for token
        assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
        # streamed: the same call, as OpenAI streams tool calls
        chunks = list(oai.chat.completions.create(model=s.session_id, messages=QUESTION, tools=TOOLS, max_tokens=70,
                                                  temperature=0, stream=True))
        deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert [d.function.name for d in deltas] == ["add"] and chunks[-1].choices[0].finish_reason == "tool_calls"
        # tool_choice "required" (constrained decoding, tests/conformance/test_openai_structured.py): a call of a listed tool
        strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]  # keys a and b only
        r3 = oai.chat.completions.create(model=s.session_id, messages=QUESTION, tools=strict, tool_choice="required",
                                         max_tokens=150, temperature=0)
        assert r3.choices[0].finish_reason == "tool_calls", r3.choices[0]
        assert [c.function.name for c in r3.choices[0].message.tool_calls] == ["add"]
    finally:
        s.stop()
