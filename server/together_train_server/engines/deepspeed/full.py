"""`FullWorker`: one full-weight session (``--mode full``, ZeRO-1/2/3).

One DeepSpeed engine over the whole model with one ``torch.optim.AdamW`` group
over every parameter (lr, betas, eps, weight decay on all of them;
``lora_plus_ratio`` is ignored); ZeRO partitions optimizer state (1),
gradients (2) and parameters (3). One session at a time; a session created
after a dropped one starts again from the base weights (re-read from
``model_dir``). The forward goes through the DeepSpeed engine, always in eval
mode. Checkpoints are DeepSpeed's own sharded format (``save_checkpoint``:
every rank writes its optimizer shard) plus ``trainer_state.json``; they
resume exactly on the same world size and stage. ``save_merged`` gathers the
full weights (``safe_get_full_fp32_param``, one tensor at a time) and writes
the same Hugging Face directory as the single-device merged export;
``adapter_tensors`` / ``save_adapter`` raise `FullModeError`. Dtypes: the
model dtype (float32, or bfloat16 with DeepSpeed's bf16 mode: fp32 master
weights and moments in the ZeRO partitions).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

from .. import trainer_state
from ..merged_export import write_model_dir
from ..trainer_adapters import TrainerAdapter
from ..types import AdamParams, LoraConfig, OptimOutput
from .errors import FullModeError
from .loading import reload_full_weights
from .lora_zero3 import check_partitioned
from .worker import DeepSpeedWorker

__all__ = ["FullWorker"]

FULL_TAG = "zero"   # DeepSpeed checkpoint tag (subdirectory) of a full-mode training checkpoint


class FullWorker(DeepSpeedWorker):
    """Every parameter of the model trained by one session through one DeepSpeed ZeRO engine."""

    mode = "full"
    dropout_allowed = False

    def __init__(self, model_dir: Any, **kwargs: Any) -> None:
        import deepspeed

        super().__init__(model_dir, **kwargs)
        self._full_dirty = False              # weights changed since loaded from model_dir
        params = list(self._base.parameters())      # tied weights appear once
        for p in params:
            p.requires_grad_(True)
        if self.zero_stage == 3:
            check_partitioned(self._base)
        opt = torch.optim.AdamW([{"params": params, "name": "A"}], lr=0.0, foreach=False)
        self._base_eng, _, _, _ = deepspeed.initialize(model=self._base, optimizer=opt, config=self._ds_config())
        self._base_eng.eval()

    def _forward_engine(self, adapter_id: str) -> Any:
        return self._base_eng

    def _activate(self, st: TrainerAdapter) -> None:
        pass  # full mode has no peft model

    def _set_train(self, flag: bool) -> None:
        self._base_eng.eval()   # deterministic: full mode never enables dropout

    # ------------------------------------------------------------------ sessions
    def create_adapter(self, adapter_id: str, spec: LoraConfig) -> int:
        """The session trains every parameter; returns the model's parameter count. Collective.

        Raises:
            ValueError: the id exists. FullModeError: a second live session, or a LoRA config
                other than ``LoraConfig()``'s defaults (``seed`` aside).
        """
        if adapter_id in self.table:
            raise ValueError(f"adapter {adapter_id!r} already exists")
        if dataclasses.replace(spec, seed=0) != LoraConfig():
            raise FullModeError("this resource runs --mode full (every parameter trains): create the session "
                                "without a LoRA config")
        if len(self.table):
            raise FullModeError(f"this --mode full resource trains one session at a time "
                                f"({next(iter(self.table))!r} is live); stop it first")
        if self._full_dirty:
            reload_full_weights(self._base, self.model_dir, self.device, self.rank)
            self._reset_full_optimizer()
            self._full_dirty = False
        eng = self._base_eng
        params = list(self._base.parameters())
        names = [n for n, _ in self._base.named_parameters()]
        st = TrainerAdapter(adapter_id, "full", spec, params, [], eng.optimizer.optimizer, 0, names)
        self.table.put(st)
        self._full_dirty = True
        return int(sum(getattr(p, "ds_numel", p.numel()) for p in params))

    def drop_adapter(self, adapter_id: str) -> None:
        """End the session: its optimizer state is cleared; the next session starts from the base weights."""
        self.table.remove(adapter_id, layers=False)
        self._drop_zero_grads(self._base_eng.optimizer)
        self._reset_full_optimizer()

    def optim_step(self, adapter_id: str, cfg: AdamParams) -> OptimOutput:
        """ZeRO's AdamW step over every parameter (`DeepSpeedWorker._zero_optim_step`). Collective."""
        return self._zero_optim_step(adapter_id, cfg)

    def _reset_full_optimizer(self) -> None:
        """Fresh AdamW moments (the fp32 master weights are kept)."""
        zopt = self._base_eng.optimizer
        zopt.optimizer.state.clear()
        if hasattr(zopt, "_hp_optimizer_states_linked"):
            zopt._hp_optimizer_states_linked = False   # relinked at the next step

    # ------------------------------------------------------------------ weights out
    def adapter_tensors(self, adapter_id: str, dtype: str = "float32") -> Mapping[str, torch.Tensor]:
        """Raises FullModeError (after KeyError for an unknown session): a full session has no adapter."""
        self._get(adapter_id)
        raise FullModeError(
            "a --mode full session has no adapter: weights_sync and unmerged save_weights are LoRA "
            "operations; save_weights(merged=True) writes the full Hugging Face model directory"
        )

    def save_adapter(self, adapter_id: str, out_dir: Any) -> Any:
        """Raises FullModeError, as `adapter_tensors`."""
        return self.adapter_tensors(adapter_id)

    def full_weights(self, adapter_id: str) -> dict[str, torch.Tensor] | None:
        """Every parameter by name (model dtype, CPU) on rank 0, None elsewhere; one gathered at a time. Collective."""
        from deepspeed.utils import safe_get_full_fp32_param

        self._get(adapter_id)
        td = next(p.dtype for p in self._base.parameters())
        out: dict[str, torch.Tensor] | None = {} if self.rank == 0 else None
        for name, p in self._base.named_parameters():   # one gathered tensor at a time
            t = safe_get_full_fp32_param(p)
            if out is not None:
                out[name] = t.detach().to("cpu", td).clone()
        return out

    def full_adam_state(self, adapter_id: str) -> dict[str, tuple[torch.Tensor, ...]] | None:
        """Every parameter's fp32 master weight and AdamW moments, gathered one at a time. Collective.

        Returns ``{name: (weight, exp_avg, exp_avg_sq)}`` (float32 CPU, the parameter's shape) on
        rank 0, None elsewhere; moments are zeros before the first step. For checks and debugging:
        a full session's moments are partitioned across the ranks, so no rank holds them whole.
        """
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        self._get(adapter_id)
        out: dict[str, tuple[torch.Tensor, ...]] | None = {} if self.rank == 0 else None
        for name, p in self._base.named_parameters():
            w = safe_get_full_fp32_param(p)
            m = safe_get_full_optimizer_state(p, "exp_avg")
            v = safe_get_full_optimizer_state(p, "exp_avg_sq")
            if out is not None:
                out[name] = tuple(torch.zeros_like(w) if t is None else t.detach().float().cpu().clone()
                                  for t in (w, m, v))
        return out

    def save_merged(self, adapter_id: str, out_dir: Any) -> Path | None:
        """The single-device merged format from the gathered weights; rank 0 writes. Collective."""
        sd = self.full_weights(adapter_id)
        if self.rank != 0:
            return None
        return write_model_dir(self._base, self.tokenizer, Path(out_dir), state_dict=sd)

    # ------------------------------------------------------------------ checkpoints
    def save_state(self, adapter_id: str, out_dir: str) -> Path:
        """DeepSpeed's checkpoint (``zero/``: every rank writes its shard) plus ``trainer_state.json``.

        The metadata adds ``mode: "full"``, ``zero_stage`` and ``world_size``. Collective.
        """
        st = self._get(adapter_id)
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        # DeepSpeed's own sharded format: every rank writes its optimizer partition; bit-exact resume.
        self._base_eng.save_checkpoint(str(out), tag=FULL_TAG, save_latest=False)
        if self.rank == 0:
            meta = {"format": trainer_state.STATE_FORMAT, "format_version": trainer_state.STATE_FORMAT_VERSION,
                    "mode": "full", "step": int(st.step), "lora": trainer_state.spec_meta(st.spec),
                    "base": self.base_fingerprint(), "zero_stage": self.zero_stage, "world_size": self.world_size,
                    "param_groups": trainer_state.param_groups_meta(self._base_eng.optimizer.param_groups),
                    "params": list(st.param_names)}
            (out / trainer_state.STATE_META).write_text(json.dumps(meta, indent=1))
        dist.barrier()
        return out

    def load_state(self, adapter_id: str, state_dir: str, with_optimizer: bool) -> int:
        """A full-mode checkpoint of the same model, world size and stage; returns its step. Collective.

        Without ``with_optimizer`` the AdamW state starts fresh (the fp32 master weights are
        always loaded: under ZeRO they live in the optimizer state).

        Raises:
            ValueError: naming what differs, or no DeepSpeed checkpoint in ``state_dir``.
        """
        st = self._get(adapter_id)
        d = Path(state_dir)
        meta = self.read_state_meta(d)
        diffs = self.state_differences(meta, st.spec)
        if diffs:
            raise ValueError("checkpoint does not fit this session: " + "; ".join(diffs))
        if not (d / FULL_TAG).is_dir():
            raise ValueError(f"{state_dir} has no DeepSpeed checkpoint ({FULL_TAG}/)")
        eng = self._base_eng
        self._drop_zero_grads(eng.optimizer)
        path, _ = eng.load_checkpoint(str(d), tag=FULL_TAG, load_optimizer_states=True,
                                      load_lr_scheduler_states=False)
        if path is None:
            raise ValueError(f"DeepSpeed could not load the checkpoint in {state_dir}")
        if not with_optimizer:
            self._reset_full_optimizer()
        self._full_dirty = True
        st.step = int(meta["step"])
        return st.step
