"""``serve --chat-template FILE``: the operator's template replaces the model's for chat completions.

A real resource on the tiny model (whose own template is the embedded model's) served with a plain
ChatML template of its own system prompt and no tool rendering, through the official ``openai``
client. References: the tokenizer's ``apply_chat_template`` with FILE (the recorded prompt).
"""

from __future__ import annotations

import pytest
from _served import launch_with_http

openai = pytest.importorskip("openai")

KEY = "sk-template"
PLAIN = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\nOperator says: {% endif %}")
ASK = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chat-template")
    (tmp / "plain.jinja").write_text(PLAIN)
    with launch_with_http(tiny_model_dir, tmp / "storage", KEY, "--chat-template", str(tmp / "plain.jinja")) as c:
        yield c, c.local_resource.http_url


def test_the_operators_template_renders_chats(served, tiny_model_dir, tokenizer):
    client, url = served
    roll = openai.OpenAI(base_url=f"{url}/v1/rollouts/tpl", api_key=KEY, max_retries=0, timeout=120)
    roll.chat.completions.create(model=tiny_model_dir.name, messages=ASK, max_tokens=2)
    want = tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True, return_dict=True,
                                         chat_template=PLAIN)["input_ids"]
    assert list(client.get_rollout("tpl").calls[0].prompt_tokens) == list(want)


def test_tools_on_a_template_without_tools_are_refused(served, tiny_model_dir):
    oai = openai.OpenAI(base_url=f"{served[1]}/v1", api_key=KEY, max_retries=0, timeout=120)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=tiny_model_dir.name, messages=[{"role": "user", "content": "x"}],
                                    tools=tools)
    err = e.value.response.json()["error"]
    assert err["param"] == "tools" and "chat template does not render tools" in err["message"]


def test_the_embedded_models_template_is_served_with_tools():
    """--model embedded: its GGUF template (plain ChatML, no tools) is served as the packaged tools template,
    which renders tool-free chats exactly as the GGUF's did and tools in the Hermes format `chat_tools` parses."""
    from transformers import AutoTokenizer

    from together_train_server.engines.model_loading import embedded_tokenizer_dir
    from together_train_server.service.sampling import chat_templates, chat_tools

    tok = AutoTokenizer.from_pretrained(embedded_tokenizer_dir())
    own = tok.chat_template
    assert not chat_tools.supports_tools(tok)
    chat_templates.install(tok)
    assert tok.chat_template == chat_templates.TOOLS_TEMPLATE.read_text() and chat_tools.supports_tools(tok)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "x"}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == tok.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True, chat_template=own)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    assert "<tool_call>" in tok.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=True)
