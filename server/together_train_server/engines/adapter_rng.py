"""Each adapter's own torch CPU random stream (LoRA dropout) and its seeded initialisation.

A training-mode forward (dropout > 0) swaps the adapter's stream in and back out, so one
session's dropout draws never shift another's and a training checkpoint restores the stream
exactly. (On CUDA, dropout draws from the device generator, not per session.)
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from .trainer_adapters import TrainerAdapter

__all__ = ["new_stream", "own_stream", "seeded"]


def new_stream(seed: int) -> torch.Tensor:
    """A fresh CPU generator state (uint8) seeded with ``seed``."""
    return torch.Generator().manual_seed(int(seed)).get_state()


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the body under ``torch.manual_seed(seed)`` and restore the global CPU RNG state after.

    Adapter creation: A's Kaiming-uniform init is reproducible and the outer stream is untouched.
    """
    outer = torch.random.get_rng_state()
    torch.manual_seed(int(seed))
    try:
        yield
    finally:
        torch.random.set_rng_state(outer)


@contextmanager
def own_stream(st: TrainerAdapter, active: bool) -> Iterator[None]:
    """Run the body on ``st``'s own RNG stream when ``active`` (a training-mode forward); keep its
    advanced state in ``st.rng_state`` and restore the outer stream after (also on an error)."""
    if not active or st.rng_state is None:
        yield
        return
    outer = torch.random.get_rng_state()
    torch.random.set_rng_state(st.rng_state)
    try:
        yield
    finally:
        st.rng_state = torch.random.get_rng_state()
        torch.random.set_rng_state(outer)
