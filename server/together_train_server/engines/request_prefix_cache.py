"""The prefix cache as the torch generator's scheduler uses it, request by request.

`PrefixCache` (prefix_cache.py) stores blocks of keys/values by token prefix; this object decides, for
the requests of one admission round and the rows leaving the batch, what is looked up and what is stored:
the blocks a prompt reuses, the prompt blocks a prefill adds, the prompt + completion blocks of a finished
stream, and which requests of a group should wait for a leader that prefills their shared prefix.
Scheduler thread only.
"""

from __future__ import annotations

from typing import Any

import torch

from .decode_requests import DecodeRequest, DecodeRow
from .prefix_cache import PrefixCache, cache_block, cache_columns, common_blocks

__all__ = ["RequestPrefixCache"]


class RequestPrefixCache:
    """Request-level lookups and stores over `store`; ``stats`` (the engine's counters) gets
    ``cached_sequences`` counted."""

    def __init__(self, store: PrefixCache, stats: dict[str, int]) -> None:
        self.store = store
        self._stats = stats

    @property
    def block_size(self) -> int:
        return self.store.block_size

    def split_shared(self, group: list[DecodeRequest]) -> list[list[DecodeRequest]]:
        """``[group]``, or ``[leaders, followers]`` when requests of ``group`` share uncached prompt blocks.

        Requests admitted together (e.g. rollouts of one system prompt) would
        each prefill the shared prefix: a follower, whose prompt shares more
        whole blocks with an earlier request (same weights) than the cache
        holds, is prefilled right after the leaders and reuses their blocks.
        """
        pc = self.store
        if len(group) < 2:
            return [group]
        leaders: list[int] = []
        followers: list[DecodeRequest] = []
        for i, r in enumerate(group):
            limit = len(r.prompt) - 1
            shared = max((common_blocks(r.prompt, group[j].prompt, limit, pc.block_size)
                          for j in leaders if group[j].ns == r.ns), default=0)
            if shared > 0 and shared > pc.match(r.ns, r.prompt, limit):
                followers.append(r)
            else:
                leaders.append(i)
        return [[group[i] for i in leaders], followers] if followers else [group]

    def lookup(self, r: DecodeRequest) -> list[torch.Tensor]:
        """The cached blocks ``r``'s prompt reuses (at most ``len(prompt) - 1`` tokens)."""
        return self.store.lookup(r.ns, r.prompt, len(r.prompt) - 1)

    def store_prompts(self, group: list[DecodeRequest], cache: Any, width: int) -> None:
        """Store the whole prompt blocks of ``group`` not cached yet (row i's prompt ends at column ``width``
        of the prefill's KV ``cache``)."""
        pc, bs = self.store, self.store.block_size
        for i, r in enumerate(group):
            if r.weights_replaced:
                continue                         # never looked up again
            start = width - len(r.prompt)        # column of prompt position 0 (< 0 when a cached part precedes)

            def block(j: int, _i: int = i, _s: int = start) -> torch.Tensor:
                return cache_block(cache, _i, _s + j * bs, bs)

            pc.insert(r.ns, r.prompt, r.hit // bs, block)

    def store_finished(self, rows: list[DecodeRow], keep: list[int], cache: Any, mask: torch.Tensor) -> None:
        """Store the whole blocks of prompt + completion of the rows leaving the batch (those not in ``keep``).

        A finished stream's cache row holds its prompt and every sampled token
        but the last (never fed forward), in the columns where its ``mask`` row is 1:
        the next turn of its conversation reuses them. Called before the rows
        are dropped; blocks cached already (its prompt's) are only marked used.
        """
        pc = self.store
        kept, bs = set(keep), pc.block_size
        for i, row in enumerate(rows):
            req = row.req
            if i in kept or req.weights_replaced:
                continue                         # still decoding, or weights already replaced
            seq = req.prompt + req.tokens[row.stream][:-1]
            if len(seq) < bs:
                continue
            cols = mask[i].nonzero().squeeze(-1)    # this row's real columns, in order
            if len(cols) != len(seq):            # never expected: keep the cache exact rather than guess
                continue

            def block(j: int, _i: int = i, _c: torch.Tensor = cols) -> torch.Tensor:
                return cache_columns(cache, _i, _c[j * bs:(j + 1) * bs])

            pc.insert(req.ns, seq, 0, block)
            self._stats["cached_sequences"] += 1
