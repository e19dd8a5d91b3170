"""The data of a supervised run as batches, one per optimizer step.

`SupervisedDataset` is the interface the loop (`supervised.train`) reads: ``get_batch(step)``
for every step, ``len()`` = items per epoch (for ``--epochs``). Unlike tinker-cookbook's
``set_epoch`` (the loop tells the dataset a new epoch starts), the batch of a step is a pure
function of (how the dataset was built, step): a run resumed at step k asks for step k and gets
what an uninterrupted run got, with no state to restore.

`ShuffledDataset` is the usual implementation: a list of items in a fresh seeded permutation per
epoch, the epochs read as one stream (a batch that straddles two epochs takes the end of one and
the start of the next: no item is dropped, none repeats within an epoch).
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Generic, TypeVar

import together_train as tt

__all__ = ["Item", "SupervisedDataset", "ShuffledDataset"]

#: What a batch holds: `together_train.Sample` for a built-in loss; a loss of its own may take
#: richer items (DPO: preference pairs, rendered into samples by the loss).
Item = TypeVar("Item")


class SupervisedDataset(ABC, Generic[Item]):
    """Batches of training items, one batch per optimizer step.

    Contract: ``get_batch(step)`` depends only on how the dataset was built (its data, batch
    size and seed) and on `step`, never on which batches were asked for before, so a resumed
    run trains on the same batches as an uninterrupted one.
    """

    batch_size: int

    @abstractmethod
    def __len__(self) -> int:
        """Items in one epoch (one pass over the data)."""

    @abstractmethod
    def get_batch(self, step: int) -> list[Item]:
        """The batch of 0-based optimizer step `step` (any step >= 0: the data repeats in
        further epochs)."""

    def steps_for_epochs(self, epochs: float) -> int:
        """Optimizer steps that make `epochs` passes over the data (>= 1)."""
        return max(1, math.ceil(epochs * len(self) / self.batch_size))

    def max_tokens(self) -> int | None:
        """The longest item in tokens (checked against the resource's context before training),
        or None when the items are not samples."""
        return None


class ShuffledDataset(SupervisedDataset[Item]):
    """`items` in batches of `batch_size`, each epoch a fresh permutation from ``Random(seed)``.

    Item j of the stream is ``items[perm_e[j % n]]`` with e = j // n and ``perm_e`` the e-th
    ``Random(seed).shuffle`` of ``range(n)``; step k's batch is stream items
    ``[k * batch_size, (k + 1) * batch_size)``.

    Raises:
        ValueError: no items, or batch_size < 1.
    """

    def __init__(self, items: Sequence[Item], batch_size: int, seed: int = 0) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not items:
            raise ValueError("no items to train on")
        self.items = list(items)
        self.batch_size = batch_size
        self._rng = random.Random(seed)
        self._perms: list[list[int]] = []

    def __len__(self) -> int:
        return len(self.items)

    def _perm(self, epoch: int) -> list[int]:
        while len(self._perms) <= epoch:  # the permutations are drawn in order, once each
            perm = list(range(len(self.items)))
            self._rng.shuffle(perm)
            self._perms.append(perm)
        return self._perms[epoch]

    def get_batch(self, step: int) -> list[Item]:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        n = len(self.items)
        return [self.items[self._perm(j // n)[j % n]]
                for j in range(step * self.batch_size, (step + 1) * self.batch_size)]

    def max_tokens(self) -> int | None:
        if not all(isinstance(s, tt.Sample) for s in self.items):
            return None
        return max(s.length + 1 for s in self.items)  # type: ignore[attr-defined]
