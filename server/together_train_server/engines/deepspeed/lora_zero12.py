"""`LoraZero12Worker`: LoRA sessions under ZeRO-1/2 (``--zero-stage 1|2``).

One frozen base copy per rank and one DeepSpeed engine per adapter over the
shared peft model, with the adapter's plain ``torch.optim.AdamW``, which ZeRO
partitions (optimizer state at stage 1, also gradients at 2). DeepSpeed
averages gradients over ranks: the loss is multiplied by the world size before
``engine.backward`` so the reduced gradient is the gradient of the request's
sum loss, as on one device. Every ``forward(backward=True)`` marks its
backward as not an accumulation boundary; ``optim_step`` marks it
(`DeepSpeedWorker._zero_optim_step`). ``zero_grad`` also drops the buffers
ZeRO-1/2 reduce non-boundary gradients into.

Checkpoints: ``save_state`` gathers the full (unpartitioned) AdamW moments
with ``deepspeed.utils.safe_get_full_optimizer_state`` (a collective on every
rank) and rank 0 writes exactly the single-device format, so a checkpoint
resumes on either backend; ``load_state`` runs on every rank and reads the
directory, which must be reachable from every rank.
"""

from __future__ import annotations

from typing import Any

import torch

from ..trainer_adapters import TrainerAdapter
from ..types import AdamParams, LoraConfig, OptimOutput
from .worker import DeepSpeedWorker

__all__ = ["LoraZero12Worker"]


class LoraZero12Worker(DeepSpeedWorker):
    """LoRA adapters, each with its own DeepSpeed ZeRO-1/2 engine (see the module docstring)."""

    def __init__(self, model_dir: Any, **kwargs: Any) -> None:
        self._ds: dict[str, Any] = {}        # adapter_id -> DeepSpeedEngine
        super().__init__(model_dir, **kwargs)

    def _forward_engine(self, adapter_id: str) -> Any:
        return self._ds[adapter_id]

    # ------------------------------------------------------------------ sessions
    def create_adapter(self, adapter_id: str, spec: LoraConfig) -> int:
        """As TorchTrainerEngine, plus a DeepSpeed engine over the adapter's AdamW. Collective."""
        import deepspeed

        n = super().create_adapter(adapter_id, spec)
        st = self._get(adapter_id)
        self._activate(st)
        try:
            eng, _, _, _ = deepspeed.initialize(model=self.table.peft, optimizer=st.optimizer, config=self._ds_config())
        except Exception:
            super().drop_adapter(adapter_id)
            raise
        self._ds[adapter_id] = eng
        return n

    def drop_adapter(self, adapter_id: str) -> None:
        """As TorchTrainerEngine; the adapter's DeepSpeed engine is released. Collective."""
        super().drop_adapter(adapter_id)
        eng = self._ds.pop(adapter_id, None)
        if eng is not None:
            try:
                eng.optimizer.zero_grad(set_to_none=True)
            except Exception:
                pass
            eng.destroy() if hasattr(eng, "destroy") else None

    def optim_step(self, adapter_id: str, cfg: AdamParams) -> OptimOutput:
        """ZeRO's AdamW step (`DeepSpeedWorker._zero_optim_step`). Collective."""
        return self._zero_optim_step(adapter_id, cfg)

    # ------------------------------------------------------------------ checkpoints
    def load_state(self, adapter_id: str, state_dir: str, with_optimizer: bool) -> int:
        """As TorchTrainerEngine.load_state on every rank, after dropping ZeRO's accumulated gradients."""
        eng = self._ds.get(adapter_id)
        if eng is not None:
            self._drop_zero_grads(eng.optimizer)
        return super().load_state(adapter_id, state_dir, with_optimizer)

    def _optimizer_state_dict(self, st: TrainerAdapter) -> dict[str, Any]:
        """Full AdamW state per parameter, gathered from the ZeRO partitions. Collective."""
        from deepspeed.utils import safe_get_full_optimizer_state

        eng = self._ds[st.adapter_id]
        inner = eng.optimizer.optimizer
        if inner.state:   # (re)link the per-parameter fragments to the live AdamW state
            eng.optimizer._hp_optimizer_states_linked = False
            eng.optimizer._lazy_init_hp_params_optimizer_state()
        steps = []
        for g in inner.param_groups:
            s = inner.state.get(g["params"][0], {}) if g["params"] else {}
            steps.append(s.get("step"))
        state: dict[int, dict[str, torch.Tensor]] = {}
        for idx, (p, gi) in enumerate(zip(st.params, self._group_of(st))):
            if steps[gi] is None:
                continue
            entry = {"step": torch.as_tensor(steps[gi]).detach().clone().float().reshape(())}
            for key in ("exp_avg", "exp_avg_sq"):
                entry[key] = safe_get_full_optimizer_state(p, key).detach().to("cpu").clone()
            state[idx] = entry
        groups = [{k: v for k, v in g.items() if k != "params"} for g in eng.optimizer.param_groups]
        return {"state": state, "param_groups": groups}

    def _load_optimizer_state_dict(self, st: TrainerAdapter, sd: dict[str, Any]) -> None:
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        eng = self._ds[st.adapter_id]
        inner = eng.optimizer.optimizer
        for p in st.params:
            safe_set_full_fp32_param(p, p.detach())
        # Fresh AdamW state tensors on the flat fp32 partitions, linked to the
        # per-parameter fragments, then filled from the full tensors.
        inner.state.clear()
        for g in inner.param_groups:
            for fp in g["params"]:
                inner.state[fp] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(fp),
                                   "exp_avg_sq": torch.zeros_like(fp)}
        eng.optimizer._hp_optimizer_states_linked = False
        eng.optimizer._lazy_init_hp_params_optimizer_state()
        groups = self._group_of(st)
        steps: dict[int, torch.Tensor] = {}
        for idx, p in enumerate(st.params):
            entry = sd["state"].get(idx)
            if not entry:
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                safe_set_full_optimizer_state(p, entry[key].to(p.device, torch.float32), key)
            steps[groups[idx]] = entry["step"]
        for gi, g in enumerate(inner.param_groups):
            if gi in steps:
                for fp in g["params"]:
                    inner.state[fp]["step"] = steps[gi].clone()
            g.update({k: v for k, v in sd["param_groups"][gi].items() if k in ("lr", "betas", "eps", "weight_decay")})

    def _reset_optimizer(self, st: TrainerAdapter) -> None:
        from deepspeed.utils import safe_set_full_fp32_param

        eng = self._ds[st.adapter_id]
        for p in st.params:
            safe_set_full_fp32_param(p, p.detach())
        eng.optimizer.optimizer.state.clear()
        eng.optimizer._hp_optimizer_states_linked = False   # relinked at the next step
