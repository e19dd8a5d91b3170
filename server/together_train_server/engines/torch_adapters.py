"""The torch generator's adapter table: peft adapters per key, versions, pins, spares, mixed batches.

`PeftAdapters` is a mixin of `TorchGeneratorEngine` (it shares the engine's
``_state`` lock and scheduler thread, ``_run_task``). A key maps to one peft
adapter (`_Adapter`); a request pins the adapter current when it is
submitted. A ``load_adapter`` for a key whose adapter is pinned loads into a
*new* peft adapter (reusing an idle spare of the same shape when there is
one) and retires the old one, which is freed (or kept as a spare) when its
last request finishes: weights never change inside a sequence. Rows of one
batch that use different adapters run in one forward through peft's
mixed-adapter inference (`_mixed_forward`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from .generator_base import check_adapter_tensors, contiguous_run, flat_in_order
from .lora import make_lora_config, one_thread, quiet_peft
from .types import LoraConfig

__all__ = ["BASE", "PeftAdapters"]

BASE = "__base__"           # peft's adapter name for "no adapter" in mixed batches
_MAX_SPARES = 2             # idle peft adapters kept for reuse (per engine)


def _lora_shape_key(spec: LoraConfig, targets: Sequence[str]) -> tuple:
    # same key => same parameter shapes and the same scale (alpha / rank, a float peft keeps per
    # layer from the config the adapter was created with) => tensors can be overwritten in place
    return (int(spec.rank), float(spec.alpha), tuple(sorted(spec.target_modules or targets)),
            bool(spec.train_unembed))


@dataclass(eq=False)
class _Adapter:
    """One peft adapter: what a key currently maps to, or a retired/spare one."""

    name: str                   # peft adapter name
    shape_key: tuple
    spec: LoraConfig
    version: int | None = None
    refs: int = 0               # queued or decoding requests pinned to it
    key: str | None = None      # None once retired (replaced or dropped)
    ns: int = 0                 # prefix-cache namespace: a new number for every load (0 = base model)


class PeftAdapters:
    """Adapter keys -> peft adapters of the engine's base model (mixin of `TorchGeneratorEngine`).

    The engine provides ``_base`` (the transformers model), ``model_dir``,
    ``lora_target_modules``, ``_state`` (an RLock guarding the table and the
    pins) and ``_run_task`` (runs a function on the scheduler thread, which
    alone touches the model).
    """

    _base: Any
    _state: threading.RLock
    _run_task: Callable[[Callable[[], Any]], Any]

    def _init_adapters(self) -> None:
        self._peft = None
        self._adapters: dict[str, _Adapter] = {}     # key -> current adapter
        self._retired: list[_Adapter] = []           # replaced/dropped, still pinned
        self._spares: list[_Adapter] = []            # idle, reusable for the same shape
        self._pending_delete: list[str] = []         # peft cannot delete its last adapter
        self._views: dict[str, dict[str, torch.Tensor]] = {}  # peft name -> its state-dict tensors (_adapter_views)
        self._flat: dict[str, torch.Tensor | None] = {}   # peft name -> contiguous_run of those views (or None)
        self._counter = 0

    @property
    def adapter_keys(self) -> list[str]:
        """Keys of the loaded adapters."""
        with self._state:
            return list(self._adapters)

    def adapter_version(self, key: str) -> int | None:
        """Version tag of the adapter ``key`` now (None if untagged). Raises KeyError if unknown."""
        with self._state:
            try:
                return self._adapters[key].version
            except KeyError:
                raise KeyError(f"unknown adapter {key!r}") from None

    def load_adapter(self, key: str, spec: LoraConfig, tensors: Mapping[str, torch.Tensor],
                     version: int | None = None) -> None:
        """Load (or replace) the adapter ``key`` from PEFT state-dict tensors.

        ``tensors`` uses the keys of ``peft.get_peft_model_state_dict`` (as
        produced by ``TorchTrainerEngine.adapter_tensors``), any float dtype,
        on CPU. When ``key`` exists with the same LoRA shape (rank, targets,
        train_unembed) and no queued or running request uses it, the tensors
        are copied in place; when requests use it, they finish on the old
        weights and the new ones go to another peft adapter. Requests
        submitted after this returns use the new weights. ``version`` tags
        the adapter (reported as ``GenOutput.adapter_version``). The tensors
        are checked (exact key set, shapes, finite values) before anything
        changes.

        Raises:
            ValueError: invalid spec, missing/unexpected keys, shape mismatch,
                non-finite values. The previous adapter under ``key`` is kept.
        """
        config = make_lora_config(spec, self.lora_target_modules, str(self.model_dir))  # validates spec
        shape_key = _lora_shape_key(spec, self.lora_target_modules)
        self._run_task(lambda: self._load(key, spec, shape_key, config, tensors, version))

    def _load(self, key, spec, shape_key, config, tensors, version) -> None:
        from peft import get_peft_model

        with self._state, torch.no_grad(), one_thread():
            old = self._adapters.get(key)
            if old is not None and old.shape_key == shape_key and old.refs == 0:
                self._check_views(old.name, tensors)
                self._copy_tensors(old.name, tensors)
                self._drop_cached(old)
                old.version, old.spec, old.ns = version, spec, self._new_ns()
                return
            spare = next((a for a in self._spares if a.shape_key == shape_key), None)
            if spare is not None:
                self._check_views(spare.name, tensors)
                self._copy_tensors(spare.name, tensors)
                self._spares.remove(spare)
                new = _Adapter(spare.name, shape_key, spec, version, key=key, ns=self._new_ns())
            else:
                self._counter += 1
                name = f"gen{self._counter}"
                with quiet_peft():
                    if self._peft is None:
                        self._peft = get_peft_model(self._base, config, adapter_name=name)
                        self._peft.eval()
                    else:
                        self._peft.add_adapter(name, config)
                self._flatten(name)
                try:
                    self._check_views(name, tensors)
                    self._copy_tensors(name, tensors)
                except Exception:
                    self._pending_delete.append(name)
                    self._flush_pending_deletes()
                    raise
                new = _Adapter(name, shape_key, spec, version, key=key, ns=self._new_ns())
            self._adapters[key] = new
            if old is not None:
                self._retire(old)
            self._flush_pending_deletes()

    def _new_ns(self) -> int:
        self._counter += 1
        return self._counter

    def _drop_cached(self, a: _Adapter) -> None:
        """Free the prefix-cache blocks computed by ``a``'s current weights (never looked up again)."""
        if getattr(self, "prefix_cache", None) is not None:
            self.prefix_cache.drop_namespace(a.ns)

    def _retire(self, a: _Adapter) -> None:
        """``a`` no longer serves its key: free it now, or when its last request ends."""
        a.key = None
        self._drop_cached(a)
        if a.refs > 0:
            self._retired.append(a)
            return
        if a in self._retired:
            self._retired.remove(a)
        if len(self._spares) < _MAX_SPARES:
            self._spares.append(a)
        else:
            self._pending_delete.append(a.name)

    def _unpin(self, a: _Adapter | None) -> None:
        if a is None:
            return
        with self._state:
            a.refs -= 1
            if a.refs == 0 and a.key is None:
                self._retire(a)
                self._flush_pending_deletes()

    def _check_views(self, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        check_adapter_tensors({k: tuple(v.shape) for k, v in self._adapter_views(name).items()}, tensors)

    def _adapter_views(self, name: str) -> dict[str, torch.Tensor]:
        """The peft state-dict tensors of adapter ``name``: views of its parameters, found once.

        peft's ``get_peft_model_state_dict`` / ``set_peft_model_state_dict`` walk
        every module of the model per call (~0.1 s a push for SmolLM2-135M with
        a rank-32 adapter, 90 % of an in-place load); the copy itself is ~1 ms.
        The views stay valid while the adapter exists (peft never replaces its
        parameters; dropped with it in `_flush_pending_deletes`).
        """
        from peft import get_peft_model_state_dict

        views = self._views.get(name)
        if views is None:
            views = get_peft_model_state_dict(self._peft, adapter_name=name, save_embedding_layers=False)
            params = {p.data_ptr() for p in self._peft.parameters()}
            if any(v.data_ptr() not in params for v in views.values()):
                raise RuntimeError(f"peft state dict of {name} is not views of its parameters")
            self._views[name] = views
        return views

    def _copy_tensors(self, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy checked tensors (same keys and shapes, any float dtype) into adapter ``name``.

        One ``copy_`` when both sides are one flat buffer in the same order (the adapter's
        parameters are laid out so, `_flatten`; a push arrives so), else one ``_foreach_copy_``.
        """
        views = self._adapter_views(name)
        if name not in self._flat:   # 420 tensors to walk: once per adapter layout, not per push
            self._flat[name] = contiguous_run(list(views.values()))
        dst = self._flat[name]
        src = flat_in_order(tensors, list(views)) if dst is not None else None
        if src is not None:
            dst.copy_(src)
        else:
            torch._foreach_copy_(list(views.values()), [tensors[k] for k in views])

    def _flatten(self, name: str) -> None:
        """Lay adapter ``name``'s parameters out back to back in one buffer, in state-dict order.

        A push then lands with one copy (`_copy_tensors`) instead of one per tensor
        (420 for a rank-32 all-linear adapter of SmolLM2-135M). The parameters stay the
        same objects (only their ``.data`` moves), so peft's modules and `_adapter_views` see it.
        """
        from peft import get_peft_model_state_dict

        views = get_peft_model_state_dict(self._peft, adapter_name=name, save_embedding_layers=False)
        params = {p.data_ptr(): p for p in self._peft.parameters()}
        ps = [params.get(v.data_ptr()) for v in views.values()]
        if any(p is None or p.shape != v.shape for p, v in zip(ps, views.values())) or len(set(map(id, ps))) != len(ps):
            return  # not plain views of distinct parameters: keep peft's layout
        dtypes = {p.dtype for p in ps}
        if len(dtypes) != 1:
            return
        flat = torch.empty(sum(p.numel() for p in ps), dtype=ps[0].dtype, device=ps[0].device)
        off = 0
        for p in ps:
            n = p.numel()
            flat[off: off + n].copy_(p.data.reshape(-1))
            p.data = flat[off: off + n].view(p.shape)
            off += n
        self._views.pop(name, None)   # rebuilt over the new storage
        self._flat.pop(name, None)

    def drop_adapter(self, key: str) -> None:
        """Remove the adapter ``key`` (requests already using it finish). Raises KeyError if unknown."""
        def drop() -> None:
            with self._state:
                try:
                    a = self._adapters.pop(key)
                except KeyError:
                    raise KeyError(f"unknown adapter {key!r}") from None
                self._retire(a)
                self._flush_pending_deletes()

        self._run_task(drop)

    def _flush_pending_deletes(self) -> None:
        live = ([a.name for a in self._adapters.values()] + [a.name for a in self._retired]
                + [a.name for a in self._spares])
        for name in list(self._pending_delete):
            if not live:
                break  # peft needs one adapter; deleted after the next load
            if name in self._peft.active_adapters:
                self._peft.set_adapter(live[0])
            self._peft.delete_adapter(name)
            self._views.pop(name, None)
            self._flat.pop(name, None)
            self._pending_delete.remove(name)

    def _resolve(self, adapter: str | None) -> _Adapter | None:
        if adapter is None:
            return None
        try:
            return self._adapters[adapter]
        except KeyError:
            raise KeyError(f"unknown adapter {adapter!r}") from None

    def _forward(self, names: list[str], **kw: Any):
        """Model forward where row i uses peft adapter ``names[i]`` (``BASE`` = base model)."""
        if self._peft is None:
            return self._base(**kw)
        uniq = set(names)
        if len(uniq) == 1:
            (name,) = uniq
            if name == BASE:
                with self._peft.disable_adapter():
                    return self._peft(**kw)
            if self._peft.active_adapters != [name]:
                self._peft.set_adapter(name)
            return self._peft(**kw)
        return self._mixed_forward(list(names), **kw)

    def _mixed_forward(self, names: list[str], **kw: Any):
        """peft mixed-adapter inference with per-module adapter names, hooks always removed.

        Same mechanism as ``PeftModel.forward(adapter_names=...)`` (a forward
        pre-hook hands ``adapter_names`` to every LoRA layer), with two fixes
        for peft 0.21: the hooks are removed when the forward raises (peft
        leaks them), and the ``lm_head`` copy of ``train_unembed`` adapters
        (a ``ModulesToSaveWrapper``) sees ``"__base__"`` for adapters that
        have no copy (peft raises KeyError there). That wrapper only mixes
        when its active adapter is one of its own, so one such adapter in
        the batch is made active.
        """
        from peft.tuners.lora import LoraLayer
        from peft.utils.other import AuxiliaryTrainingWrapper

        def hook(module, args, kwargs, adapter_names):
            kwargs["adapter_names"] = adapter_names
            return args, kwargs

        handles = []
        try:
            for m in self._peft.modules():
                if isinstance(m, LoraLayer):
                    per = names
                elif isinstance(m, AuxiliaryTrainingWrapper):
                    own = set(getattr(m, "modules_to_save", {}).keys())
                    per = [n if n in own else BASE for n in names]
                    mine = sorted(set(per) - {BASE})
                    if mine and self._peft.active_adapters != [mine[0]]:
                        self._peft.set_adapter(mine[0])
                else:
                    continue
                handles.append(m.register_forward_pre_hook(
                    lambda mod, a, k, _n=per: hook(mod, a, k, _n), with_kwargs=True))
            return self._peft(**kw)
        finally:
            for h in handles:
                h.remove()
