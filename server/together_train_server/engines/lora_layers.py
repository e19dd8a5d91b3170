"""Add, activate and delete one peft LoRA adapter without walking the other adapters (O(1) in their number).

peft 0.21's ``PeftModel.add_adapter`` / ``set_adapter`` / ``delete_adapter`` walk
``named_modules()`` of the whole model, and every LoRA layer's ``set_adapter``
touches every adapter it holds: each call costs time proportional to the number
of adapters already there (measured on SmolLM2-135M, rank 16, CPU, 2 busy cores:
create 0.56 s with none, 3.3 s at 48, 7.1 s with the profiler on; stop 0.16 s
at 48). With many sessions that is O(n) a create and O(n^2) in all.

`LoraLayerIndex` lists the model's LoRA layers once (in ``named_modules`` order) and
then does per layer what peft does per layer: ``update_layer`` (peft's own code,
so initialisation draws the same random numbers in the same order: an adapter
made here is bit-identical to one ``add_adapter`` makes with the same seed),
``delete_adapter``, and ``_active_adapter``. Only the per-layer re-activation of
every adapter inside ``update_layer`` is skipped; instead the adapter being
trained gets ``requires_grad`` (`activate`): the others are outside the graph,
so they never get gradients either way.

The index applies to plain LoRA on layers peft has already wrapped. An adapter
with ``train_unembed`` (peft's ``modules_to_save`` wrapper) or targeting a layer
not wrapped yet goes through peft (`fits` is False); once a ``modules_to_save``
wrapper exists the index is off for good (`usable`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["LoraLayerIndex"]


def _noop(*_a: Any, **_k: Any) -> None:
    return None


def _move_to_base(layer: Any, name: str) -> None:
    """Move adapter ``name`` of ``layer`` to its base layer's device and float dtype.

    peft's ``_move_adapter_to_device_of_base_layer`` for plain LoRA, minus its check of every
    adapter's parameters for the meta device (a fresh adapter is never on meta).
    """
    base = layer.get_base_layer()
    device, dtype = layer._get_base_layer_device_and_dtype(base)
    if device is None:
        return
    if dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
        dtype = None
    for attr in ("lora_A", "lora_B", "lora_dropout"):
        d = getattr(layer, attr)
        if name in d:
            d[name] = d[name].to(device, dtype=dtype) if dtype is not None else d[name].to(device)


class LoraLayerIndex:
    """The LoRA layers of one ``PeftModel``, found once; per-adapter add/activate/delete over them.

    Args:
        peft_model: a ``peft.PeftModel`` with at least one LoRA adapter.

    Not thread-safe (the trainer engine runs one operation at a time).
    """

    def __init__(self, peft_model: Any) -> None:
        from peft.tuners.lora import LoraLayer
        from peft.utils.other import AuxiliaryTrainingWrapper

        self._peft = peft_model
        self.layers: list[tuple[str, Any]] = []
        self.usable = True
        for key, mod in peft_model.base_model.model.named_modules():
            if isinstance(mod, AuxiliaryTrainingWrapper):
                self.usable = False
            elif isinstance(mod, LoraLayer):
                self.layers.append((key, mod))
        self._leaves = {key.rsplit(".", 1)[-1] for key, _ in self.layers}

    def fits(self, config: Any) -> bool:
        """True when ``config`` (a peft ``LoraConfig``) can be added here without peft's model walk."""
        targets = config.target_modules
        return (self.usable and not config.modules_to_save and not config.rank_pattern
                and not config.alpha_pattern and isinstance(targets, (set, list, tuple))
                and set(targets) <= self._leaves)

    def add(self, name: str, config: Any) -> None:
        """Add adapter ``name`` to every indexed layer ``config`` targets, as peft's ``inject_adapter`` would.

        Same layers in the same order and the same ``update_layer`` call as peft, so the same RNG
        draws. The new adapter's parameters are left inactive (``requires_grad`` False).
        Raises: ValueError when `fits` is False (callers check first).
        """
        if not self.fits(config):
            raise ValueError(f"adapter {name!r} cannot be added through the layer index")
        targets = set(config.target_modules)
        self._peft.peft_config[name] = config
        for key, layer in self.layers:
            if key.rsplit(".", 1)[-1] not in targets:
                continue
            # skip the two per-layer walks over every adapter (re-activation, device check); the new
            # adapter alone is moved below, as peft's move does it
            layer.set_adapter = _noop
            layer._move_adapter_to_device_of_base_layer = _noop
            try:
                layer.update_layer(name, config.r, lora_alpha=config.lora_alpha, target_name=key, config=config)
            finally:
                del layer.set_adapter
                del layer._move_adapter_to_device_of_base_layer
            _move_to_base(layer, name)
            for d in (layer.lora_A, layer.lora_B):
                d[name].requires_grad_(False)

    def activate(self, name: str, params: list[Any]) -> None:
        """Make ``name`` the active adapter of every layer; ``params`` (its parameters) require grad."""
        for _, layer in self.layers:
            layer._active_adapter = name
        self._peft.base_model.active_adapter = name
        self._peft.active_adapter = name
        for p in params:
            p.requires_grad_(True)

    def delete(self, name: str, fallback: str) -> None:
        """Remove adapter ``name`` from every layer; ``fallback`` (another live adapter) becomes active."""
        for _, layer in self.layers:
            if name in layer.lora_A:
                layer._active_adapter = fallback
                layer.delete_adapter(name)
        self._peft.peft_config.pop(name, None)
        if self._peft.base_model.active_adapter == name:
            self._peft.base_model.active_adapter = fallback
        if self._peft.active_adapter == name:
            self._peft.active_adapter = fallback

    def adapter_parameters(self, name: str) -> list[tuple[str, Any]]:
        """``(peft parameter name, parameter)`` of adapter ``name``, in ``named_parameters`` order."""
        out = []
        prefix = "base_model.model."
        for key, layer in self.layers:
            for attr in ("lora_A", "lora_B"):
                d = getattr(layer, attr)
                if name in d:
                    for pn, p in d[name].named_parameters():
                        out.append((f"{prefix}{key}.{attr}.{name}.{pn}", p))
        return out
