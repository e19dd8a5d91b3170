"""vLLM's token-exact extras of ``/v1/chat/completions`` and ``/v1/completions`` (RL trainers read them).

- ``return_token_ids`` (bool): chat answers carry the prompt's ids as ``prompt_token_ids`` and each
  choice its sampled ids as ``token_ids`` (the stop token included, as `usage` counts them);
  completions put both on each choice. Streamed: ``prompt_token_ids`` on the first chunk, a
  choice's ``token_ids`` on its finishing chunk.
- ``return_tokens_as_token_ids`` (bool): logprobs name tokens ``"token_id:<id>"`` instead of their text.
- chat only: ``chat_template_kwargs`` (an object passed to the chat template, e.g.
  ``{"enable_thinking": false}``), ``add_generation_prompt`` (default true) and
  ``continue_final_message`` (default false: true continues the last, assistant, message).

A wrong type is a 400 naming the field; fields this server does not know are ignored, as OpenAI's
server ignores them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

from together_train_server.service.errors import invalid
from together_train_server.service.interfaces import Choice, TokenLogprob

__all__ = ["Extras", "read_extras"]

# apply_chat_template arguments a request may not set through chat_template_kwargs.
_RESERVED = {"conversation", "messages", "tools", "tokenize", "return_dict", "add_generation_prompt",
             "continue_final_message", "chat_template", "documents", "padding", "truncation", "max_length"}


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(f"{name} must be a boolean, got {v!r}", key=name)
    return v


@dataclass(frozen=True)
class Extras:
    """A request's vLLM extras (see the module docstring).

    Attributes:
        token_ids: ``return_token_ids``. ids_as_tokens: ``return_tokens_as_token_ids``.
        template: keyword arguments for ``apply_chat_template`` (chat only): the
            ``chat_template_kwargs``, ``add_generation_prompt``, ``continue_final_message``.
    """

    token_ids: bool = False
    ids_as_tokens: bool = False
    template: dict[str, Any] = field(default_factory=dict)

    def shown(self, lp: TokenLogprob | None) -> TokenLogprob | None:
        """A `TokenLogprob` as the answer names it (``token_id:<id>`` with ``return_tokens_as_token_ids``)."""
        if lp is None or not self.ids_as_tokens:
            return lp
        return replace(lp, token=f"token_id:{lp.token_id}", top=[(a, f"token_id:{a}", b) for a, _, b in lp.top])

    def shown_choices(self, choices: list[Choice]) -> list[Choice]:
        """Choices whose logprobs are named as `shown` names them."""
        if not self.ids_as_tokens:
            return choices
        return [replace(c, logprobs=[self.shown(t) for t in c.logprobs]) if c.logprobs is not None else c
                for c in choices]

    def add_ids(self, resp: dict[str, Any], prompts: list[list[int]], choices: list[Choice], n: int,
                chat: bool) -> dict[str, Any]:
        """`resp` (an answer object) with the token ids, when asked."""
        if not self.token_ids:
            return resp
        by_index = {c.index: c for c in choices}
        for ch in resp["choices"]:
            ch["token_ids"] = list(by_index[ch["index"]].tokens)
            if not chat:
                ch["prompt_token_ids"] = list(prompts[ch["index"] // n])
        if chat:
            resp["prompt_token_ids"] = list(prompts[0])
        return resp

    def stream_ids(self, chunks: Iterator[dict[str, Any]], prompts: list[list[int]], n: int, chat: bool,
                   choices: Callable[[], list[Any]]) -> Iterator[dict[str, Any]]:
        """Streamed chunks with the token ids, when asked: the prompt's on the first chunk (each choice's
        first, for completions), a choice's sampled ids on its finishing chunk (`choices`: those finished)."""
        if not self.token_ids:
            yield from chunks
            return
        first = True
        seen: set[int] = set()
        for c in chunks:
            if chat and first and c.get("choices"):
                c, first = {**c, "prompt_token_ids": list(prompts[0])}, False
            for ch in c.get("choices", ()):
                if not chat and ch["index"] not in seen:
                    seen.add(ch["index"])
                    ch["prompt_token_ids"] = list(prompts[ch["index"] // n])
                if ch.get("finish_reason") is not None:
                    done = {x.index: x for x in choices()}
                    ch["token_ids"] = list(done[ch["index"]].tokens) if ch["index"] in done else []
            yield c


def read_extras(body: dict[str, Any], chat: bool) -> Extras:
    """Read a request's vLLM extras.

    Raises:
        ServiceError: INVALID_ARGUMENT naming the field for a wrong type, ``chat_template_kwargs``
            setting a reserved argument, or both ``add_generation_prompt`` and ``continue_final_message``.
    """
    token_ids = _flag(body, "return_token_ids", False)
    as_ids = _flag(body, "return_tokens_as_token_ids", False)
    if not chat:
        return Extras(token_ids, as_ids)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise invalid(f"chat_template_kwargs must be an object, got {kwargs!r}", key="chat_template_kwargs")
    bad = sorted(set(kwargs) & _RESERVED)
    if bad:
        raise invalid(f"chat_template_kwargs may not set {bad} (request fields do)", key="chat_template_kwargs")
    cont = _flag(body, "continue_final_message", False)
    gen = _flag(body, "add_generation_prompt", not cont)
    if gen and cont:
        raise invalid("continue_final_message and add_generation_prompt cannot both be true",
                      key="continue_final_message")
    return Extras(token_ids, as_ids, {**kwargs, "add_generation_prompt": gen, "continue_final_message": cont})
