"""`DeepSpeedTrainerEngine`: the `TrainerEngine` rank 0's service calls (the executor facade).

It builds this rank's worker for the layout (`LoraZero12Worker`,
`LoraZero3Worker` or `FullWorker`) and a `RankExecutor`; each collective
operation goes through ``RankExecutor.call`` (broadcast to the other ranks,
then run by every rank's worker), the rest is asked of rank 0's worker alone.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ..interfaces import TrainerCapabilities
from ..types import AdamParams, ForwardOutput, LoraConfig, OptimOutput, Sample
from .config import check_overrides
from .errors import FullModeError
from .full import FullWorker
from .lora_zero3 import LoraZero3Worker
from .lora_zero12 import LoraZero12Worker
from .ranks import RankExecutor, init_distributed
from .worker import DeepSpeedWorker

__all__ = ["DeepSpeedTrainerEngine"]


def worker_class(mode: str, zero_stage: int) -> type[DeepSpeedWorker]:
    """The worker of a layout: full mode (any stage), LoRA on ZeRO-3, LoRA on ZeRO-1/2."""
    if mode == "full":
        return FullWorker
    return LoraZero3Worker if zero_stage == 3 else LoraZero12Worker


class DeepSpeedTrainerEngine:
    """Trainer over DeepSpeed ZeRO across ranks (the `TrainerEngine` interface, as TorchTrainerEngine).

    Launch one process per rank (``deepspeed`` launcher or ``torchrun``; env ``MASTER_ADDR``,
    ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``); every rank builds one.
    Rank 0 is the one the service calls; ranks 1..k-1 sit in ``follow()`` (no gRPC).
    How each layout trains: docs/multi_gpu.md and the worker modules.

    Args:
        model_dir, dtype, micro_batch_tokens, activation_checkpointing: as ``TorchTrainerEngine``.
        zero_stage: 1, 2 (optimizer-state / gradient partitioning) or 3 (also
            parameters: the frozen base in LoRA mode, every weight in full mode).
        mode: ``"lora"`` (sessions are LoRA adapters on the frozen base) or
            ``"full"`` (one session training every parameter; ``dtype``
            float32 or bfloat16).
        device: ``"cpu"`` or ``"cuda"`` (each rank uses ``cuda:LOCAL_RANK``).
        collective_timeout_s: timeout of every collective (process group).
        heartbeat_s / heartbeat_timeout_s: follower heartbeat period and the
            age after which rank 0 declares a follower dead.
        deepspeed_config: entries merged (recursively) over the engine's own
            DeepSpeed config, e.g. ``{"zero_optimization":
            {"stage3_max_live_parameters": 0}}``. DeepSpeed's stage-3 defaults
            keep up to 1e9 gathered parameters live and prefetch 5e7, so a
            model below ~1B parameters keeps every gathered layer for the whole
            step; lower them to trade speed for memory. Batch-size and
            clipping keys are the engine's own and cannot be overridden.

    Attributes:
        mode, zero_stage, rank, world_size: as given / from the launcher.
        worker: this rank's `DeepSpeedWorker`.

    Raises:
        ValueError: bad stage or mode, float16 in full mode, launcher env
        missing. ImportError: no deepspeed.
    """

    backend_name = "DeepSpeedTrainerEngine"
    # LoRA or every weight (--mode full), long sequences (layer recomputation); no paging and no clock
    # cycle yet: every session stays resident and runs its forwards alone.
    capabilities = TrainerCapabilities(full_weight=True, long_context=True)

    def __init__(self, model_dir: Any, *, zero_stage: int = 2, mode: str = "lora", dtype: str = "float32",
                 device: str = "cpu", micro_batch_tokens: int = 8192, collective_timeout_s: float = 300.0,
                 heartbeat_s: float = 1.0, heartbeat_timeout_s: float = 10.0,
                 deepspeed_config: Mapping[str, Any] | None = None, activation_checkpointing: str = "auto") -> None:
        if zero_stage not in (1, 2, 3):
            raise ValueError(f"zero_stage must be 1, 2 or 3, got {zero_stage}")
        if mode not in ("lora", "full"):
            raise ValueError(f"mode must be 'lora' or 'full', got {mode!r}")
        if mode == "full" and dtype in ("float16", "fp16"):
            raise ValueError("--mode full trains in float32 or bfloat16 (float16 would need loss scaling)")
        overrides = check_overrides(deepspeed_config)
        rank, world_size = init_distributed(timeout_s=collective_timeout_s)
        if device.startswith("cuda"):
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            torch.cuda.set_device(torch.device(device))
        self._ranks = RankExecutor(rank, world_size, heartbeat_s=heartbeat_s,
                                   heartbeat_timeout_s=heartbeat_timeout_s)
        self.worker: DeepSpeedWorker = worker_class(mode, int(zero_stage))(
            model_dir, zero_stage=zero_stage, dtype=dtype, device=device, micro_batch_tokens=micro_batch_tokens,
            rank=rank, world_size=world_size, ds_overrides=overrides,
            activation_checkpointing=activation_checkpointing)
        self._ranks.worker = self.worker

    # ------------------------------------------------------------------ attributes (this rank's worker)
    @property
    def model_id(self) -> str:
        return self.worker.model_id

    @property
    def model_dir(self) -> Path:
        return self.worker.model_dir

    @property
    def tokenizer(self) -> Any:
        return self.worker.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.worker.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.worker.max_seq_len

    @property
    def dtype(self) -> str:
        return self.worker.dtype

    @property
    def mode(self) -> str:
        return self.worker.mode

    @property
    def lora_target_modules(self) -> Sequence[str]:
        return self.worker.lora_target_modules

    @property
    def micro_batch_tokens(self) -> int:
        return self.worker.micro_batch_tokens

    @property
    def zero_stage(self) -> int:
        return self.worker.zero_stage

    @property
    def rank(self) -> int:
        return self._ranks.rank

    @property
    def world_size(self) -> int:
        return self._ranks.world_size

    # ------------------------------------------------------------------ ranks
    @property
    def failed(self) -> str | None:
        """Why the engine is broken (None while every rank is alive)."""
        return self._ranks.failed

    def dead_ranks(self) -> list[int]:
        """Followers whose heartbeat is older than ``heartbeat_timeout_s`` (rank 0 view)."""
        return self._ranks.dead_ranks()

    def follow(self) -> None:
        """Ranks 1..k-1: execute rank 0's operations until ``close()`` (or rank 0 dies)."""
        self._ranks.follow()

    def close(self) -> None:
        """Rank 0: release the followers (they return from ``follow``)."""
        self._ranks.close()

    # ------------------------------------------------------------------ collective operations
    def create_adapter(self, adapter_id: str, spec: LoraConfig) -> int:
        """Create a session; returns its trainable parameter count. Collective.

        LoRA: as TorchTrainerEngine (ZeRO-1/2: plus a DeepSpeed engine over the
        adapter's AdamW). Full mode: the session trains every parameter
        (count = the model's parameters); ``spec`` must be ``LoraConfig()``'s
        defaults apart from ``seed``.

        Raises:
            ValueError: as TorchTrainerEngine; ``FullModeError`` (a ValueError)
            for a second full-mode session, LoRA fields in full mode, or
            ``train_unembed`` under ZeRO-3.
        """
        return self._ranks.call("create_adapter", adapter_id, spec)

    def drop_adapter(self, adapter_id: str) -> None:
        """As TorchTrainerEngine (ZeRO-1/2: its DeepSpeed engine is released; full: the optimizer
        state is cleared and the next session starts from the base weights). Collective."""
        return self._ranks.call("drop_adapter", adapter_id)

    def forward(self, adapter_id: str, samples: Sequence[Sample], loss_fn: str,
                loss_params: Mapping[str, Any] | None = None, *, backward: bool = False,
                return_logprobs: bool = False, return_elementwise: bool = False) -> ForwardOutput:
        """As TorchTrainerEngine.forward, the batch split across ranks. Collective.

        Differences: on a non-finite loss the error is raised before that
        micro-batch's backward on every rank, but gradients of *earlier*
        micro-batches of the same request (requests above
        ``micro_batch_tokens``) stay accumulated. LoRA dropout draws differ
        from the single-device backend (each rank has its own stream). Full
        mode always runs the model in eval mode.
        """
        samples = [Sample(np.asarray(s.model_input), {k: np.asarray(v) for k, v in s.inputs.items()})
                   for s in samples]
        return self._ranks.call("forward", adapter_id, samples, loss_fn, dict(loss_params or {}), backward=backward,
                                return_logprobs=return_logprobs, return_elementwise=return_elementwise)

    def optim_step(self, adapter_id: str, cfg: AdamParams) -> OptimOutput:
        """As TorchTrainerEngine.optim_step. Collective.

        ZeRO-1/2 LoRA and full mode: ZeRO-partitioned AdamW; without any accumulated
        gradient the step still runs (zero gradients: Adam moments decay and
        weight decay applies), unlike the torch backend which skips parameters
        without a gradient. Full mode: one group, ``lora_plus_ratio`` unused.
        ZeRO-3 LoRA: gradients are all-reduced (sum), then the torch backend's step.
        """
        return self._ranks.call("optim_step", adapter_id, cfg)

    def zero_grad(self, adapter_id: str) -> None:
        """Drop the adapter's accumulated gradients on every rank. Collective."""
        return self._ranks.call("zero_grad", adapter_id)

    def save_state(self, adapter_id: str, out_dir: str | os.PathLike) -> Any:
        """Training checkpoint. Collective; ``out_dir`` must be reachable by every rank.

        LoRA: the single-device format (rank 0 writes; it resumes on either
        backend). Full mode: DeepSpeed's checkpoint (``zero/``: model states
        and one optimizer shard per rank, written by each rank) plus
        ``trainer_state.json`` (``mode: "full"``, step, ``zero_stage``,
        ``world_size``, base fingerprint).
        """
        return self._ranks.call("save_state", adapter_id, str(out_dir))

    def load_state(self, adapter_id: str, state_dir: str | os.PathLike, with_optimizer: bool) -> int:
        """As TorchTrainerEngine.load_state on every rank (``state_dir`` readable by all). Collective.

        Full mode: a full-mode checkpoint of the same model, world size and
        ZeRO stage (else ValueError naming the difference); without
        ``with_optimizer`` the AdamW state starts fresh.
        """
        return self._ranks.call("load_state", adapter_id, str(state_dir), bool(with_optimizer))

    def save_merged(self, adapter_id: str, out_dir: str | os.PathLike) -> Any:
        """Hugging Face model directory of the session's weights (the single-device merged format).

        LoRA: as TorchTrainerEngine (rank 0 only, nothing partitioned is
        read). Full mode: collective; the full weights are gathered one tensor
        at a time and rank 0 writes ``config.json``, ``model.safetensors``,
        tokenizer files (and ``chat_template.jinja``).
        """
        if self.mode != "full":
            return self.worker.save_merged(adapter_id, out_dir)
        return self._ranks.call("save_merged", adapter_id, str(out_dir))

    def full_weights(self, adapter_id: str) -> dict[str, torch.Tensor] | None:
        """Full mode: every parameter by name (model dtype, CPU) on rank 0, None elsewhere. Collective.

        Raises:
            FullModeError: not a full-mode resource. KeyError: unknown session.
        """
        if self.mode != "full":
            raise FullModeError("full_weights is for --mode full; LoRA sessions have adapter_tensors")
        return self._ranks.call("full_weights", adapter_id)

    def full_adam_state(self, adapter_id: str) -> dict[str, tuple[torch.Tensor, ...]] | None:
        """Full mode: ``{name: (fp32 weight, exp_avg, exp_avg_sq)}`` (float32 CPU) on rank 0, None
        elsewhere; gathered from the ZeRO partitions one parameter at a time. Collective.

        Raises:
            FullModeError: not a full-mode resource. KeyError: unknown session.
        """
        if self.mode != "full":
            raise FullModeError("full_adam_state is for --mode full")
        return self._ranks.call("full_adam_state", adapter_id)

    # ------------------------------------------------------------------ rank 0 only
    def memory_estimate(self, lens: Sequence[int], backward: bool, adapter_id: str | None = None) -> Any:
        """As TorchTrainerEngine.memory_estimate, for rank 0's worker (an upper bound: every sample on one rank)."""
        return self.worker.memory_estimate(lens, backward, adapter_id)

    def model_dims(self) -> Any:
        """The base model's sizes (``memory_estimate.ModelDims``), as TorchTrainerEngine.model_dims."""
        return self.worker.model_dims()

    def step(self, adapter_id: str) -> int:
        """Optimizer steps taken by the session. Raises KeyError if unknown."""
        return self.worker.step(adapter_id)

    def adapter_tensors(self, adapter_id: str, dtype: str = "float32") -> Mapping[str, torch.Tensor]:
        """As TorchTrainerEngine.adapter_tensors (LoRA). Raises FullModeError in full mode."""
        return self.worker.adapter_tensors(adapter_id, dtype)

    def save_adapter(self, adapter_id: str, out_dir: str | os.PathLike) -> Any:
        """As TorchTrainerEngine.save_adapter (LoRA). Raises FullModeError in full mode."""
        return self.worker.save_adapter(adapter_id, out_dir)

    def read_state_meta(self, state_dir: str | os.PathLike) -> dict[str, Any]:
        """A training checkpoint's metadata (engines/trainer_state.py)."""
        return self.worker.read_state_meta(state_dir)

    def spec_from_meta(self, meta: Mapping[str, Any]) -> LoraConfig:
        """The LoraConfig recorded in a training checkpoint's metadata."""
        return self.worker.spec_from_meta(meta)

    def state_differences(self, meta: Mapping[str, Any], spec: LoraConfig | None = None) -> list[str]:
        """As TorchTrainerEngine.state_differences, plus mode (and, full mode, world size and stage)."""
        return self.worker.state_differences(meta, spec)

    def grad_norm(self, adapter_id: str) -> float:
        """Not available (gradients are partitioned until ``optim_step``). Raises NotImplementedError."""
        return self.worker.grad_norm(adapter_id)
