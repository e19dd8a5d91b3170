"""Chat data for SFT: rows of ``{"messages": [{"role": ..., "content": ...}, ...]}`` from any
source `together_train_cookbook.data` reads (JSONL, JSON, Parquet, a ``save_to_disk`` dir),
rendered with the model's chat template into ``cross_entropy`` samples that train on the
assistant tokens only.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import together_train as tt

from together_train_cookbook.codec import Codec
from together_train_cookbook.data import iter_rows
from together_train_cookbook.jsonl import DataError
from together_train_cookbook.samples import conversation_to_samples
from together_train_cookbook.supervised.dataset import ShuffledDataset

__all__ = ["Chat", "chat_dataset", "load_chats"]

#: One conversation: messages ``{"role": "system" | "user" | "assistant", "content": str}``.
Chat = list[dict[str, Any]]


def load_chats(path: str | os.PathLike, split: str | None = None) -> list[Chat]:
    """The ``messages`` column of a local dataset (see `data.load_rows` for the sources).

    Raises:
        ValueError: a row has no non-empty "messages" list or no assistant turn (the message
            names the row: ``chats.jsonl:7``), the source has no rows, or as `data.load_rows`.
    """
    chats = []
    for where, row in iter_rows(path, split):
        msgs = row.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f'{where}: expected {{"messages": [...]}}')
        if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in msgs):
            raise DataError(f"{where}: no assistant message to train on")
        chats.append(msgs)
    if not chats:
        raise DataError(f"{path}: no chats")
    return chats


def chat_dataset(codec: Codec, chats: Sequence[Chat], batch_size: int, seed: int,
                 max_length: int | None = None) -> ShuffledDataset[tt.Sample]:
    """Render every chat (one sample per chat, or one per assistant turn for templates that
    strip earlier reasoning; `samples.conversation_to_samples`, truncated to `max_length`
    tokens) and batch the samples in seeded per-epoch permutations (`ShuffledDataset`).

    Raises:
        ValueError: a chat has no trained token within max_length, or as `ShuffledDataset`.
    """
    samples = [s for msgs in chats for s in conversation_to_samples(codec, msgs, max_length=max_length)]
    return ShuffledDataset(samples, batch_size, seed)
