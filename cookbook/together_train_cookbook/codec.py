"""Codecs: a conversation <-> token ids, with the model's own chat template.

`get_codec(tokenizer)` wraps a Hugging Face tokenizer that has a chat template.
`Codec.render(messages)` returns the exact tokens that
`tokenizer.apply_chat_template(messages, tokenize=True)` produces, plus a
per-token train mask: 1.0 on the tokens the model must produce in assistant
turns (the assistant content and its end-of-turn token), 0.0 on everything
else (system/user/tool turns, role headers such as ``<|im_start|>assistant\\n``,
and template whitespace after the end-of-turn token).

How the mask is found, without knowing the template: for every assistant
message ``k`` the codec renders ``messages[:k]`` with the generation prompt
and ``messages[:k+1]`` without it. Both must be token prefixes of the full
rendering ("prefix-stable" template); the tokens between the two prefixes are
what the model generates for that turn. Within that span the mask ends at the
last end-of-turn token (`Codec.stop_token_ids`), so trailing newlines the
template adds after it stay 0.0. Templates that rewrite earlier turns (for
example reasoning models, such as Qwen3, whose templates strip ``<think>`` blocks
from earlier assistant turns) are not prefix-stable; `render` raises
`TemplateNotPrefixStableError` for them.

`render_turns(messages)` handles both kinds: for a prefix-stable conversation it
returns the single `render` sequence (every assistant turn trained in one
sequence); otherwise it splits the conversation into one sequence per assistant
turn k: ``apply_chat_template(messages[:k+1])``, whose history ``messages[:k]`` is
rendered exactly as the model sees it at inference (earlier reasoning stripped by
the template) and whose train mask covers turn k only (its reasoning and content,
through the end-of-turn token). Each turn is then trained against the context it
will actually be generated from.

Only a tokenizer is needed: no model, no server, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Message = Mapping[str, Any]

# End-of-turn markers of common chat templates; whichever exist in the
# tokenizer's vocabulary (as single tokens) become stop tokens.
_KNOWN_END_OF_TURN = (
    "<|im_end|>",  # ChatML: SmolLM, Qwen
    "<|eot_id|>",  # Llama 3
    "<|end|>",  # Phi-3
    "<end_of_turn>",  # Gemma
    "<|endoftext|>",
    "</s>",
)


class TemplateNotPrefixStableError(ValueError):
    """The chat template renders a conversation prefix into tokens that are not a
    prefix of the full conversation's tokens, so per-turn masks can't be cut
    from one rendering."""


@dataclass(frozen=True)
class RenderedConversation:
    """A rendered conversation.

    Attributes:
        tokens: token ids, length n, exactly `apply_chat_template(messages, tokenize=True)`.
        train_mask: n floats, 1.0 on assistant-generated tokens (content + end-of-turn
            token), 0.0 elsewhere. One value per *token*; `build_cross_entropy_sample`
            does the shift to per-position weights.
    """

    tokens: list[int]
    train_mask: list[float]

    def __len__(self) -> int:
        return len(self.tokens)


def _as_ids(result: Any) -> list[int]:
    """`apply_chat_template(tokenize=True)` returns a list in transformers 4 and a
    BatchEncoding (mapping with "input_ids") in 5; normalise to a flat list."""
    if isinstance(result, Mapping) or hasattr(result, "keys"):
        result = result["input_ids"]
    if hasattr(result, "tolist"):
        result = result.tolist()
    ids = list(result)
    if ids and isinstance(ids[0], (list, tuple)):
        if len(ids) != 1:
            raise ValueError(f"expected one rendered sequence, got {len(ids)}")
        ids = list(ids[0])
    return [int(t) for t in ids]


class Codec:
    """Chat-template codec for one tokenizer. Build it with `get_codec`.

    Attributes:
        tokenizer: the wrapped Hugging Face tokenizer.
        stop_token_ids: end-of-turn / end-of-sequence token ids (sorted); sampling should
            stop on any of them.
        stop_strings: their text forms, e.g. ("<|im_end|>",), for stop-string sampling.
    """

    def __init__(self, tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"tokenizer {type(tokenizer).__name__} has no chat template; "
                "a codec renders conversations with the tokenizer's own template"
            )
        self.tokenizer = tokenizer
        self._kwargs = dict(chat_template_kwargs or {})
        self.stop_token_ids, self.stop_strings = self._find_stop_tokens()

    # -- stop tokens -----------------------------------------------------------------

    def _find_stop_tokens(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        tok = self.tokenizer
        vocab = tok.get_vocab()
        names: list[str] = []
        for name in _KNOWN_END_OF_TURN:
            if name in vocab and self._in_template(name):
                names.append(name)
        eos = getattr(tok, "eos_token", None)
        if eos and eos in vocab and eos not in names:
            names.append(eos)
        ids = sorted({int(vocab[n]) for n in names})
        return tuple(ids), tuple(names)

    def _in_template(self, marker: str) -> bool:
        template = self.tokenizer.chat_template
        if isinstance(template, Mapping):  # named templates
            template = " ".join(str(v) for v in template.values())
        return marker in str(template)

    # -- rendering --------------------------------------------------------------------

    def _apply(self, messages: Sequence[Message], add_generation_prompt: bool) -> list[int]:
        return _as_ids(
            self.tokenizer.apply_chat_template(
                [dict(m) for m in messages],
                tokenize=True,
                add_generation_prompt=add_generation_prompt,
                **self._kwargs,
            )
        )

    def render(self, messages: Sequence[Message]) -> RenderedConversation:
        """Render `messages` (dicts with "role" and "content") to tokens + train mask.

        Returns:
            RenderedConversation with `tokens` equal to
            `apply_chat_template(messages, tokenize=True)` and `train_mask` (same length)
            1.0 exactly on the tokens of each assistant turn from the first content token
            through its end-of-turn token.

        Raises:
            ValueError: empty conversation, a message without "role".
            TemplateNotPrefixStableError: the template renders a prefix of the conversation
                differently from the start of the full rendering (see module docstring).
        """
        if not messages:
            raise ValueError("cannot render an empty conversation")
        for i, m in enumerate(messages):
            if "role" not in m:
                raise ValueError(f"message {i} has no 'role': {dict(m)!r}")
        full = self._apply(messages, add_generation_prompt=False)
        mask = [0.0] * len(full)
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            if k == 0:
                raise ValueError(
                    "the first message is an assistant turn; a codec needs a prompt before it"
                )
            start = len(self._checked_prefix(full, messages[:k], True, k))
            end = len(self._checked_prefix(full, messages[: k + 1], False, k + 1))
            if end < start:
                raise TemplateNotPrefixStableError(
                    f"assistant message {k} renders to a span that ends ({end}) before it "
                    f"starts ({start}); the template is not prefix-stable"
                )
            # The model generates up to and including the end-of-turn token; what the
            # template appends after it (e.g. "\n") is not generated.
            stop_at = end
            for i in range(end - 1, start - 1, -1):
                if full[i] in self.stop_token_ids:
                    stop_at = i + 1
                    break
            for i in range(start, stop_at):
                mask[i] = 1.0
        return RenderedConversation(tokens=full, train_mask=mask)

    def render_turns(self, messages: Sequence[Message]) -> list[RenderedConversation]:
        """Render `messages` into the sequences to train on: ``[render(messages)]`` when the
        template is prefix-stable for them, else one sequence per assistant turn.

        Returns:
            A list of `RenderedConversation`. Split case, for assistant message k:
            ``tokens = apply_chat_template(messages[:k+1], tokenize=True)``; its first
            ``len(apply_chat_template(messages[:k], add_generation_prompt=True))`` tokens are the
            inference-time prompt (mask 0), then turn k's tokens (mask 1 through the last
            end-of-turn token; template text after it 0).

        Raises:
            ValueError: as `render`.
            TemplateNotPrefixStableError: even the generation prompt of ``messages[:k]`` is not a
                prefix of the rendering of ``messages[:k+1]`` (the template rewrites the turn
                being generated; nothing sensible to train on).
        """
        try:
            return [self.render(messages)]
        except TemplateNotPrefixStableError:
            pass
        out = []
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            if k == 0:
                raise ValueError("the first message is an assistant turn; a codec needs a prompt before it")
            full = self._apply(messages[: k + 1], add_generation_prompt=False)
            start = len(self._checked_prefix(full, messages[:k], True, k))
            stop_at = len(full)
            for i in range(len(full) - 1, start - 1, -1):
                if full[i] in self.stop_token_ids:
                    stop_at = i + 1
                    break
            mask = [0.0] * len(full)
            for i in range(start, stop_at):
                mask[i] = 1.0
            out.append(RenderedConversation(tokens=full, train_mask=mask))
        return out

    def _checked_prefix(
        self, full: list[int], prefix_msgs: Sequence[Message], gen: bool, k: int
    ) -> list[int]:
        prefix = self._apply(prefix_msgs, add_generation_prompt=gen)
        if full[: len(prefix)] != prefix:
            n = next(
                (i for i, (a, b) in enumerate(zip(prefix, full)) if a != b),
                min(len(prefix), len(full)),
            )
            what = "with the generation prompt" if gen else "without the generation prompt"
            raise TemplateNotPrefixStableError(
                f"the chat template is not prefix-stable: rendering the first {k} message(s) "
                f"{what} gives {len(prefix)} tokens that differ from the full conversation's "
                f"rendering at token {n} "
                f"({self._show(prefix[n:n + 8])!r} vs {self._show(full[n:n + 8])!r}). "
                "Templates that rewrite earlier turns (e.g. strip reasoning) need one "
                "sequence per turn: use render_turns (conversation_to_samples)."
            )
        return prefix

    def _show(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def build_generation_prompt(self, messages: Sequence[Message]) -> list[int]:
        """Tokens of `messages` followed by the template's assistant header
        (`apply_chat_template(..., add_generation_prompt=True)`), ready for `sample`."""
        if not messages:
            raise ValueError("cannot build a prompt from an empty conversation")
        return self._apply(messages, add_generation_prompt=True)

    def parse_response(self, tokens: Sequence[int]) -> str:
        """Decode sampled tokens into the assistant's text: cut at the first stop token
        (or stop string), drop special tokens, strip surrounding whitespace."""
        ids = [int(t) for t in tokens]
        for i, t in enumerate(ids):
            if t in self.stop_token_ids:
                ids = ids[:i]
                break
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        for s in self.stop_strings:
            cut = text.find(s)
            if cut >= 0:
                text = text[:cut]
        return text.strip()


def get_codec(tokenizer: Any, **chat_template_kwargs: Any) -> Codec:
    """Codec for a Hugging Face tokenizer with a chat template.

    Extra keyword arguments are passed to every `apply_chat_template` call (for
    example `enable_thinking=False`).

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    return Codec(tokenizer, chat_template_kwargs)
