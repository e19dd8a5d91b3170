"""Codec.render_turns against the templates' own apply_chat_template: a Qwen3-style template that
strips <think> from earlier assistant turns (one sequence per turn) and one that keeps it (one
sequence). Small local Jinja templates on the tiny model's tokenizer; no hub."""

from __future__ import annotations

import copy

import pytest

from together_train_cookbook.codec import TemplateNotPrefixStableError, get_codec
from together_train_cookbook.samples import conversation_to_samples

_HEAD = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}{%- endfor -%}"
)
# Qwen3-style: an assistant turn before the last user message loses its reasoning.
STRIPPING = _HEAD + (
    "{%- for m in messages -%}{%- set c = m['content'] -%}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_query and '</think>' in c -%}"
    "{%- set c = c.split('</think>')[-1].lstrip('\n') -%}{%- endif -%}"
    "{{ '<|im_start|>' + m['role'] + '\n' + c + '<|im_end|>\n' }}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)
KEEPING = (
    "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)

CHAT = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n5"},
    {"role": "user", "content": "And 4 + 4?"},
    {"role": "assistant", "content": "<think>\ndouble four\n</think>\n\n8"},
]


def _ids(tok, msgs, **kw):
    out = tok.apply_chat_template(msgs, tokenize=True, **kw)
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def _with_template(tokenizer, template):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok


def _trained_text(tok, r):
    return tok.decode([t for t, m in zip(r.tokens, r.train_mask) if m], skip_special_tokens=False)


def test_stripping_template_splits_into_one_sequence_per_turn(tokenizer):
    tok = _with_template(tokenizer, STRIPPING)
    codec = get_codec(tok)
    with pytest.raises(TemplateNotPrefixStableError):
        codec.render(CHAT)  # one sequence is impossible: turn 1 renders differently in the history
    turns = codec.render_turns(CHAT)
    assert len(turns) == 2
    for k, r in zip((1, 3), turns):
        assert r.tokens == _ids(tok, CHAT[: k + 1])  # the template's own rendering
        prompt = _ids(tok, CHAT[:k], add_generation_prompt=True)  # what the model sees at inference
        assert r.tokens[: len(prompt)] == prompt and not any(r.train_mask[: len(prompt)])
        assert _trained_text(tok, r) == CHAT[k]["content"] + "<|im_end|>"
    history = tok.decode(turns[1].tokens)
    assert "add them" not in history and "double four" in history  # turn 1's reasoning stripped
    samples = conversation_to_samples(codec, CHAT)
    assert len(samples) == 2 and list(samples[1].model_input) == turns[1].tokens[:-1]


def test_keeping_template_trains_as_one_sequence(tokenizer):
    tok = _with_template(tokenizer, KEEPING)
    codec = get_codec(tok)
    turns = codec.render_turns(CHAT)
    assert len(turns) == 1
    r = turns[0]
    assert r.tokens == _ids(tok, CHAT)
    assert "add them" in tok.decode(r.tokens)
    assert _trained_text(tok, r) == CHAT[1]["content"] + "<|im_end|>" + CHAT[3]["content"] + "<|im_end|>"
    assert r == codec.render(CHAT)
    assert len(conversation_to_samples(codec, CHAT)) == 1


def test_stripping_template_single_turn_is_one_sequence(tokenizer):
    tok = _with_template(tokenizer, STRIPPING)
    turns = get_codec(tok).render_turns(CHAT[:2])
    assert len(turns) == 1 and turns[0].tokens == _ids(tok, CHAT[:2])
