"""Preference pairs for DPO: a prompt with a preferred (chosen) and a dispreferred (rejected)
reply, from any source `together_train_cookbook.data` reads, rendered into ``cross_entropy``-
layout samples ``[chosen_0, rejected_0, chosen_1, ...]`` whose weights mark the reply tokens.

Row formats (the columns of common preference datasets):

- ``{"prompt": str | [messages], "chosen": str, "rejected": str}``;
- ``{"chosen": [messages], "rejected": [messages]}`` (whole conversations, e.g. UltraFeedback
  binarized): the reply is the last message, the prompt the messages before it (``prompt``
  may be given too).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import together_train as tt

from together_train_cookbook.codec import Codec
from together_train_cookbook.data import iter_rows
from together_train_cookbook.jsonl import DataError, prompt_messages
from together_train_cookbook.samples import conversation_to_sample

__all__ = ["PreferencePair", "load_pairs", "pair_samples"]


@dataclass
class PreferencePair:
    """A prompt (messages up to the assistant turn) with a preferred and a dispreferred reply.

    `example`: the task example the pair came from, when a checker can grade new replies
    (online DPO samples rejected replies from the policy); None for pairs read from files."""

    prompt: list[dict[str, Any]]
    chosen: str
    rejected: str
    example: Any = None


def _reply(value: Any, where: str, key: str) -> tuple[str, list[dict[str, Any]] | None]:
    """(reply text, the conversation before it or None) of a "chosen"/"rejected" cell."""
    if isinstance(value, str):
        return value, None
    if isinstance(value, list) and value and isinstance(value[-1], dict) and value[-1].get("role") == "assistant":
        return str(value[-1].get("content", "")), list(value[:-1])
    raise DataError(f"{where}: {key!r} must be a string or a message list ending with an assistant message")


def load_pairs(path: str | os.PathLike, split: str | None = None) -> list[PreferencePair]:
    """Preference pairs of a local dataset (see the module doc for the row formats and
    `data.load_rows` for the sources).

    Raises:
        ValueError: a row without "chosen"/"rejected", without a prompt, or with a malformed
            reply (naming the row: ``pairs.jsonl:3``), no rows, or as `data.load_rows`.
    """
    out = []
    for where, row in iter_rows(path, split):
        if not {"chosen", "rejected"} <= set(row):
            raise DataError(f'{where}: expected {{"prompt", "chosen", "rejected"}}')
        chosen, before = _reply(row["chosen"], where, "chosen")
        rejected, _ = _reply(row["rejected"], where, "rejected")
        if row.get("prompt") is not None:
            prompt = prompt_messages(row["prompt"])
        elif before:
            prompt = before
        else:
            raise DataError(f'{where}: expected {{"prompt", "chosen", "rejected"}}')
        out.append(PreferencePair(prompt, chosen, rejected))
    if not out:
        raise DataError(f"{path}: no pairs")
    return out


def pair_samples(codec: Codec, pairs: Sequence[PreferencePair], max_length: int | None = None) -> list[tt.Sample]:
    """``[chosen_0, rejected_0, chosen_1, ...]`` samples, each the prompt plus the reply as an
    assistant turn, weights = the reply's tokens (truncated to `max_length` tokens)."""
    out = []
    for p in pairs:
        for reply in (p.chosen, p.rejected):
            out.append(conversation_to_sample(codec, p.prompt + [{"role": "assistant", "content": reply}], max_length))
    return out
