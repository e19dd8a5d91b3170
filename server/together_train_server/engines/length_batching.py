"""Micro-batches grouped by length, so right padding stays a small share of the tokens processed.

A micro-batch of samples of lengths ``n_1..n_B`` is one ``[B, max n]`` forward:
it processes ``B * max n`` positions of which ``B * max n - sum n`` are padding.
Taking the request's samples in order (the old way) puts a 4K sample beside
100-token ones and pads them all to 4K. ``group_by_length`` instead visits the
samples longest first and closes a group when the next sample would push the
group's padded size over the token budget or its padding over
``MAX_PADDING_FRACTION`` of the group's padded size; a group of one sample has
no padding, so every group, and hence the whole request, pads at most that
fraction. Sorting is stable (equal lengths keep request order). The engine
returns per-sample results in the request's order (``restore_order``); sums
over the request change only by float summation order.
"""

from __future__ import annotations

from typing import Sequence, TypeVar

__all__ = ["MAX_PADDING_FRACTION", "group_by_length", "restore_order", "padding_fraction"]

MAX_PADDING_FRACTION = 0.10
T = TypeVar("T")


def group_by_length(lens: Sequence[int], max_tokens: int,
                    max_padding: float = MAX_PADDING_FRACTION) -> list[list[int]]:
    """Groups of indices into ``lens``: each ``len(g) * max(lens[g]) <= max_tokens`` (a longer
    single sample runs alone) and padding ``<= max_padding`` of ``len(g) * max(lens[g])``.

    Args:
        lens: sample lengths (tokens, >= 1).
        max_tokens: padded-token budget of one micro-batch.
        max_padding: largest padding share of a group, in [0, 1).

    Returns:
        Groups (lists of indices, longest sample first); together they hold every index once.
    """
    order = sorted(range(len(lens)), key=lambda i: -int(lens[i]))   # stable: ties keep request order
    groups: list[list[int]] = []
    cur: list[int] = []
    longest = real = 0
    for i in order:
        n = int(lens[i])
        if cur:
            padded = (len(cur) + 1) * longest      # longest first: n <= longest
            if padded > max_tokens or padded - (real + n) > max_padding * padded:
                groups.append(cur)
                cur, real = [], 0
        if not cur:
            longest = n
        cur.append(i)
        real += n
    if cur:
        groups.append(cur)
    return groups


def restore_order(items: Sequence[T], order: Sequence[int]) -> list[T]:
    """``items[k]`` belongs to index ``order[k]``; returns them by index (``order`` a permutation
    of ``range(len(items))``). An empty ``items`` (results not asked for) stays empty."""
    if not items:
        return list(items)
    out: list[T] = [None] * len(order)  # type: ignore[list-item]
    for k, i in enumerate(order):
        out[i] = items[k]
    return out


def padding_fraction(lens: Sequence[int], groups: Sequence[Sequence[int]]) -> float:
    """Padding positions / positions processed over all ``groups`` (0 for an empty request)."""
    processed = sum(len(g) * max(int(lens[i]) for i in g) for g in groups if g)
    return 1.0 - sum(int(n) for n in lens) / processed if processed else 0.0
