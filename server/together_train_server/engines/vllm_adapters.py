"""The vLLM replica's adapter versions: which LoRA id serves each key, who still uses the old ones,
and the PEFT directories vLLM loads them from.

Every ``load_adapter`` is a new vLLM LoRA id with its own directory on tmpfs (``/dev/shm`` when
present); the key's previous id is retired and removed once no request in flight holds it, so
a request never mixes versions. The directory stays while its id is live because vLLM reloads
from it if its LRU cache evicted the adapter. Thread-safe (one lock); the vLLM calls themselves
(add/remove a LoRA) are the engine's, on its engine thread.
"""

from __future__ import annotations

import atexit
import copy
import itertools
import json
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from .lora import make_lora_config, quiet_peft
from .types import LoraConfig

__all__ = ["AdapterVersions", "LoraHold", "LoraShapes", "VllmAdapter"]


@dataclass
class VllmAdapter:
    """A key's adapter version in vLLM."""

    lora_id: int
    name: str
    path: Path
    version: int | None          # the caller's tag (policy version), reported per request


@dataclass(frozen=True)
class LoraHold:
    """What a request names its adapter version by (all None: the base model)."""

    lora_id: int | None = None
    name: str | None = None
    path: str | None = None
    version: int | None = None


class LoraShapes:
    """The PEFT state-dict keys and shapes an adapter for this model must have, from a meta-device peft
    model (no memory), so pushed tensors are checked exactly like the torch engine checks them.

    Args:
        hf_config: the model's ``transformers`` config.
        model_dir: recorded as the LoRA config's base model.

    Attributes:
        target_modules: the default (and allowed) LoRA target module names.
    """

    def __init__(self, hf_config: Any, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        from .lora import default_target_modules

        with torch.device("meta"):
            self._meta_base = AutoModelForCausalLM.from_config(hf_config)
        self.model_dir = model_dir
        self.target_modules: list[str] = default_target_modules(self._meta_base)
        self._cache: dict[tuple, dict[str, tuple[int, ...]]] = {}

    def config(self, spec: LoraConfig) -> Any:
        """The ``peft.LoraConfig`` of ``spec`` on this model."""
        return make_lora_config(spec, self.target_modules, str(self.model_dir))

    def expected(self, spec: LoraConfig) -> dict[str, tuple[int, ...]]:
        """PEFT state-dict keys and shapes for ``spec`` (cached by rank and targets)."""
        from peft import get_peft_model, get_peft_model_state_dict

        key = (int(spec.rank), tuple(sorted(spec.target_modules or self.target_modules)))
        if key not in self._cache:
            with quiet_peft():
                peft_model = get_peft_model(copy.deepcopy(self._meta_base), self.config(spec))
                sd = get_peft_model_state_dict(peft_model, save_embedding_layers=False)
            self._cache[key] = {k: tuple(v.shape) for k, v in sd.items()}
        return self._cache[key]


class AdapterVersions:
    """Keys -> live `VllmAdapter`, retired versions awaiting their last request, and holds per LoRA id.

    Args:
        adapter_dir: where versions are written (default a fresh directory under ``/dev/shm`` or the
            temp dir; removed at exit).
    """

    def __init__(self, adapter_dir: str | os.PathLike | None = None) -> None:
        root = adapter_dir or tempfile.mkdtemp(prefix="tt-vllm-adapters-",
                                              dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        # tmpfs is memory: a replica that exits without close() must not leave its adapters there.
        atexit.register(shutil.rmtree, self.root, True)
        self._live: dict[str, VllmAdapter] = {}
        self._retired: dict[int, VllmAdapter] = {}   # replaced versions awaiting their last request
        self._refs: dict[int, int] = {}              # lora id -> requests in flight
        self._next_id = itertools.count(1)
        self._lock = threading.RLock()

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._live)

    def current(self, key: str) -> VllmAdapter:
        """The version serving ``key`` now. Raises KeyError if unknown."""
        with self._lock:
            return self._live[key]

    def hold(self, key: str | None, holds: int) -> LoraHold:
        """The version serving ``key`` (None: the base model), taking ``holds`` references on it.

        The references pin that version: a push meanwhile retires it only after these requests
        finish. Raises KeyError ``unknown adapter 'key'``.
        """
        if key is None:
            return LoraHold()
        with self._lock:
            try:
                ad = self._live[key]
            except KeyError:
                raise KeyError(f"unknown adapter {key!r}") from None
            self._refs[ad.lora_id] = self._refs.get(ad.lora_id, 0) + holds
            return LoraHold(ad.lora_id, ad.name, str(ad.path), ad.version)

    def release(self, lora_id: int | None) -> VllmAdapter | None:
        """Drop one hold on ``lora_id``; returns the retired version to remove when that was its last."""
        if lora_id is None:
            return None
        with self._lock:
            n = self._refs.get(lora_id, 0) - 1
            if n > 0:
                self._refs[lora_id] = n
                return None
            self._refs.pop(lora_id, None)
            return self._retired.pop(lora_id, None)

    def stage(self, key: str, config: Any, tensors: Mapping[str, torch.Tensor], version: int | None) -> VllmAdapter:
        """Write a new version's PEFT directory (``adapter_model.safetensors``, ``adapter_config.json`` of the
        ``peft.LoraConfig`` ``config``) under a fresh id, tagged ``version``; not serving until `install`.
        Raises OSError (the directory is removed)."""
        from safetensors.torch import save_file

        lora_id = next(self._next_id)
        path = self.root / f"lora-{lora_id}"
        path.mkdir(parents=True, exist_ok=True)
        try:
            save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
                      str(path / "adapter_model.safetensors"))
            (path / "adapter_config.json").write_text(json.dumps(config.to_dict(), default=list))
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        return VllmAdapter(lora_id, f"{key}@{lora_id}", path, None if version is None else int(version))

    def install(self, key: str, ad: VllmAdapter) -> VllmAdapter | None:
        """``ad`` serves ``key`` from now on; returns the replaced version when nothing holds it (remove it
        now), else retires it until its last request."""
        with self._lock:
            old = self._live.get(key)
            self._live[key] = ad
            if old is None or self._refs.get(old.lora_id, 0) == 0:
                return old
            self._retired[old.lora_id] = old
            return None

    def pop(self, key: str) -> VllmAdapter | None:
        """Stop serving ``key``; returns its version when nothing holds it (remove it now), else retires it.
        Raises KeyError ``unknown adapter 'key'``."""
        with self._lock:
            try:
                ad = self._live.pop(key)
            except KeyError:
                raise KeyError(f"unknown adapter {key!r}") from None
            if self._refs.get(ad.lora_id, 0) > 0:
                self._retired[ad.lora_id] = ad
                return None
            return ad

    def discard(self, ad: VllmAdapter) -> None:
        """Delete a version's directory (after vLLM removed it, or a failed load)."""
        shutil.rmtree(ad.path, ignore_errors=True)

    def close(self) -> None:
        """Delete every version directory."""
        shutil.rmtree(self.root, ignore_errors=True)
