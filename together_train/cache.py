"""Where together-train keeps files on this machine: one root for converted models, the resource's
storage and the SDK's tokenizer cache.

The root is ``$TOGETHER_TRAIN_CACHE`` when set (``~`` expanded), else ``~/.cache/together-train``:
``<root>/models/`` (the embedded model, converted once), ``<root>/storage/`` (``serve``'s default
``--storage``: checkpoints, pages, the model registry) and ``<root>/tokenizers/`` (`ResourceClient.get_tokenizer`).
"""

from __future__ import annotations

import os
import pathlib

__all__ = ["cache_root", "default_storage_dir"]


def cache_root() -> pathlib.Path:
    """``$TOGETHER_TRAIN_CACHE`` if set (``~`` expanded), else ``~/.cache/together-train``."""
    env = os.environ.get("TOGETHER_TRAIN_CACHE")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "together-train"


def default_storage_dir() -> pathlib.Path:
    """``serve``'s storage directory when ``--storage`` is not given: ``<cache_root>/storage``."""
    return cache_root() / "storage"
