"""Helpers for tests: tiny random models and random training samples.

Used by the engine tests and by other layers' tests (service, SDK end to
end) so everyone trains the same tiny models. Never imported by the server.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .model_loading import build_tiny_model
from .types import TrainSample

__all__ = ["tiny_model", "random_samples"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def tiny_model(out_dir: str | os.PathLike, arch: str = "llama", seed: int = 0) -> Path:
    """Build (or reuse) a tiny random model in ``out_dir`` (see ``build_tiny_model``)."""
    out = Path(out_dir)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    return build_tiny_model(out, arch=arch, seed=seed)


def random_samples(lengths, vocab_size: int, seed: int = 0, weights: str = "random") -> list[TrainSample]:
    """Cross-entropy samples with random tokens, one per entry of ``lengths``.

    Args:
        lengths: ``model_input`` lengths.
        vocab_size: token ids are drawn from ``[0, vocab_size)``.
        seed: numpy seed.
        weights: ``"random"`` (uniform in [-0.5, 1.5), negative values included),
            ``"ones"``.
    """
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        full = rng.integers(0, vocab_size, n + 1).astype(np.int64)
        w = (rng.random(n) * 2 - 0.5) if weights == "random" else np.ones(n)
        out.append(TrainSample(full[:-1].copy(), {
            "target_tokens": full[1:].copy(), "weights": w.astype(np.float32)}))
    return out
