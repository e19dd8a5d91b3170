"""The trainer's adapter table: each session's adapter record and the peft model holding their layers.

`AdapterTable` owns the live `TrainerAdapter` records (one per session), the peft model
created with the first adapter, the internal peft names and the deletions peft must defer
(it cannot delete its last adapter). Layers are added, activated and deleted through
`lora_layers.LoraLayerIndex` (O(1) in the number of adapters) when it applies, else through
peft's own walks. Not thread-safe (the engine runs one call at a time).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from .lora import FlatSource, is_lora_b, quiet_peft
from .lora_layers import LoraLayerIndex
from .types import LoraConfig

__all__ = ["AdapterTable", "TrainerAdapter"]


@dataclass
class TrainerAdapter:
    """One session's adapter: its parameters, optimizer, step counter and RNG stream."""

    adapter_id: str
    name: str                      # internal peft adapter name
    spec: LoraConfig
    params_a: list[torch.nn.Parameter]   # lora_A and full modules (lr)
    params_b: list[torch.nn.Parameter]   # lora_B (lr * lora_plus_ratio)
    optimizer: torch.optim.Optimizer
    step: int = 0
    param_names: list[str] = field(default_factory=list)
    # Per-adapter torch CPU RNG state (uint8), swapped in around training-mode
    # forwards so each session has its own LoRA-dropout stream (isolation,
    # exact resume); seeded from spec.seed (adapter_rng.py).
    rng_state: torch.Tensor | None = None
    # The parameters by peft state-dict key, found once by adapter_tensors (its snapshots' source).
    snapshot_source: FlatSource | None = None
    # peft parameter name -> parameter (model order), found at creation.
    named: dict[str, torch.nn.Parameter] = field(default_factory=dict)

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return self.params_a + self.params_b

    @property
    def numel(self) -> int:
        """Trainable parameter count."""
        return int(sum(p.numel() for p in self.params))


def split_lora_parameters(named: Sequence[tuple[str, torch.nn.Parameter]]
                          ) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """``(A, B)``: lora_B parameters apart from the rest (lora_A, full modules such as an lm_head copy).

    LoRA+ (Hayou et al. 2024) gives only B ``lr * ratio`` (peft's create_loraplus_optimizer).
    """
    a: list[torch.nn.Parameter] = []
    b: list[torch.nn.Parameter] = []
    for pname, p in named:
        (b if is_lora_b(pname) else a).append(p)
    return a, b


class AdapterTable:
    """The live adapters over one frozen base model (``base``), by session id.

    Args:
        base: the frozen base model peft wraps with the first adapter.
        fast: add/activate/delete layers through `LoraLayerIndex` when it applies (the DeepSpeed
            workers keep peft's own walks).

    Attributes:
        peft: the ``peft.PeftModel`` (None until the first adapter).
        layer_index: the `LoraLayerIndex` over ``peft`` (None until the first adapter).
    """

    def __init__(self, base: torch.nn.Module, *, fast: bool = True) -> None:
        self.base = base
        self.fast = fast
        self.peft: Any = None
        self.layer_index: LoraLayerIndex | None = None
        self._records: dict[str, TrainerAdapter] = {}
        self._counter = 0
        self._pending_delete: list[str] = []

    # ----- records
    def __contains__(self, adapter_id: object) -> bool:
        return adapter_id in self._records

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._records))

    def get(self, adapter_id: str) -> TrainerAdapter:
        """The adapter's record. Raises KeyError ``unknown adapter 'id'``."""
        try:
            return self._records[adapter_id]
        except KeyError:
            raise KeyError(f"unknown adapter {adapter_id!r}") from None

    def find(self, adapter_id: str | None) -> TrainerAdapter | None:
        """The adapter's record, or None."""
        return self._records.get(adapter_id or "")

    def put(self, st: TrainerAdapter) -> None:
        """Record ``st`` under its id. Raises ValueError when the id is taken."""
        if st.adapter_id in self._records:
            raise ValueError(f"adapter {st.adapter_id!r} already exists")
        self._records[st.adapter_id] = st

    def remove(self, adapter_id: str, *, layers: bool = True) -> TrainerAdapter:
        """Forget the adapter; with ``layers`` its peft layers go too (deferred while it is the last one).

        Raises KeyError for an unknown id.
        """
        st = self.get(adapter_id)
        del self._records[adapter_id]
        if layers:
            self._pending_delete.append(st.name)
            self.flush_deletes()
        return st

    # ----- peft layers
    def new_name(self) -> str:
        """A fresh internal peft adapter name (no dots, not a substring of "lora_")."""
        self._counter += 1
        return f"ad{self._counter}"

    def _index(self) -> LoraLayerIndex | None:
        return self.layer_index if self.fast else None

    def add_layers(self, name: str, config: Any) -> list[tuple[str, torch.nn.Parameter]]:
        """Add peft adapter ``name`` (a ``peft.LoraConfig``); returns its ``(parameter name, parameter)`` pairs
        in model order.

        Through `LoraLayerIndex` when it applies (O(1) in the number of adapters; bit-identical
        weights), else through peft's ``add_adapter`` (walks every module and adapter).
        """
        from peft import get_peft_model

        index = self._index()
        if index is not None and index.fits(config):
            index.add(name, config)
            return index.adapter_parameters(name)
        with quiet_peft():
            if self.peft is None:
                self.peft = get_peft_model(self.base, config, adapter_name=name)
            else:
                self.peft.add_adapter(name, config)
        self.layer_index = LoraLayerIndex(self.peft)
        return [(n, p) for n, p in self.peft.named_parameters() if f".{name}." in n]

    def flush_deletes(self) -> None:
        """Delete the peft layers of dropped adapters, keeping at least one adapter inside peft."""
        live = {a.name for a in self._records.values()}
        index = self._index()
        for name in list(self._pending_delete):
            if not live:
                break  # keep one adapter inside peft; it is deleted after the next create
            if index is not None and index.usable:
                index.delete(name, next(iter(live)))
            else:
                if name in self.peft.active_adapters:
                    self.peft.set_adapter(next(iter(live)))
                self.peft.delete_adapter(name)
            self._pending_delete.remove(name)

    def activate(self, st: TrainerAdapter) -> None:
        """Make ``st`` the adapter the peft model runs and trains."""
        # set_adapter flips requires_grad (only the active adapter trains);
        # it leaves .grad alone, so other adapters' accumulated gradients survive.
        index = self._index()
        if index is not None and index.usable:
            index.activate(st.name, st.params)
        elif self.peft.active_adapters != [st.name]:
            self.peft.set_adapter(st.name)

    def head_model(self) -> torch.nn.Module:
        """The model whose output embedding the head applies (peft's; the base without peft)."""
        return self.peft if self.peft is not None else self.base

    def parameters_by_name(self, st: TrainerAdapter) -> dict[str, torch.nn.Parameter]:
        """The adapter's live parameters by peft parameter name."""
        if st.named:
            return dict(st.named)
        named = dict(self.peft.named_parameters())
        return {n: named[n] for n in st.param_names}

    def state_names(self, st: TrainerAdapter) -> list[str]:
        """Adapter parameter names without the internal adapter name, aligned with ``st.params``."""
        by_id = {id(p): n for n, p in self.parameters_by_name(st).items()}
        return [by_id[id(p)].replace(f".{st.name}.", ".") for p in st.params]
