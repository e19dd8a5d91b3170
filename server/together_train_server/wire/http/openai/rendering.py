"""Service values -> OpenAI response objects: models, usage, logprobs (legacy and chat)."""

from __future__ import annotations

from typing import Any

from together_train_server.service.interfaces import (
    ChatResult, Choice, Completion, CompletionStream, ModelEntry, ParsedReply, TokenLogprob)


def model_json(m: ModelEntry) -> dict[str, Any]:
    """An OpenAI Model object (``parent``/``root``: the base model of a checkpoint)."""
    out = {"id": m.id, "object": "model", "created": m.created, "owned_by": "together-train"}
    if m.parent:
        out["parent"] = out["root"] = m.parent
    else:
        out["root"] = m.id
    return out


def usage(c: Completion | CompletionStream | ChatResult) -> dict[str, Any]:
    """OpenAI's usage object of a completion or a finished stream: token counts, and the prompt
    tokens served from the replicas' prefix cache as ``prompt_tokens_details.cached_tokens``."""
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": int(getattr(c, "cached_tokens", 0))}}


def legacy_logprobs(ch: Choice) -> dict[str, Any] | None:
    """/v1/completions' logprobs object: tokens, token_logprobs, top_logprobs, text_offset (an echoed
    prompt's first token: logprob and alternatives null)."""
    if ch.logprobs is None:
        return None
    starts = [0] + ch.token_ends[:-1]
    return {"tokens": [t.token for t in ch.logprobs], "token_logprobs": [t.logprob for t in ch.logprobs],
            "top_logprobs": [top_dict(t) for t in ch.logprobs],
            "text_offset": starts[: len(ch.logprobs)]}


def top_dict(t: TokenLogprob) -> dict[str, float] | None:
    """A token's alternatives as /v1/completions writes them (null where it has no logprob)."""
    return None if t.logprob is None else {s: lp for _, s, lp in t.top}


def chat_message(reply: ParsedReply) -> dict[str, Any]:
    """The assistant message of a parsed reply (`chat_tools.ParsedReply`): content, and tool_calls when any."""
    msg: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        msg["tool_calls"] = reply.tool_calls
    return msg


def chat_logprobs(items: list[Any]) -> dict[str, Any]:
    """/v1/chat/completions' logprobs object: ``content`` with token, logprob, bytes and top_logprobs each."""

    def tok(s: str, lp: float) -> dict[str, Any]:
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**tok(t.token, t.logprob), "top_logprobs": [tok(s, lp) for _, s, lp in t.top]}
                        for t in items]}
