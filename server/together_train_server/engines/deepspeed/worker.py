"""`DeepSpeedWorker`: what every rank runs, common to the three layouts (the worker half).

A worker is a `TorchTrainerEngine` whose methods run on every rank at once
(``RankExecutor`` calls the same method on each): the methods that differ
per layout are overridden in `LoraZero12Worker`, `LoraZero3Worker` and
`FullWorker`, the rest is inherited (``super()``).

Data parallel (every layout): the samples of a request are split into
contiguous chunks, one per rank (``numpy.array_split`` order); each rank runs
its chunk in micro-batches (``micro_batch_tokens``) and every rank runs the
same number of forwards (a rank with fewer pads with zero-loss one-token
forwards), so collectives line up. Loss sums, metric sums, per-sample
logprobs and elementwise losses are gathered (``all_gather_object``) and
returned in request order.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from .. import losses as _losses
from ..adamw import check_adam, set_hyperparameters
from ..adapter_rng import own_stream
from ..length_batching import restore_order
from ..torch_trainer import TorchTrainerEngine
from ..trainer_adapters import TrainerAdapter
from ..trainer_forward import ScoreSheet
from ..trainer_batching import check_forward, micro_batches, model_target_logprobs
from ..types import AdamParams, ForwardOutput, LoraConfig, OptimOutput, Sample
from .config import base_config, merge_config
from .loading import load_partitioned_lm

__all__ = ["DeepSpeedWorker"]


class DeepSpeedWorker(TorchTrainerEngine):
    """The trainer on one rank of a DeepSpeed launch (see the module docstring).

    Args:
        model_dir, dtype, device, micro_batch_tokens: as ``TorchTrainerEngine`` (``device``
            already this rank's, e.g. ``cuda:LOCAL_RANK``).
        zero_stage: 1, 2 or 3. rank, world_size: of this process.
        ds_overrides: the user's DeepSpeed config entries (already checked).
    """

    mode = "lora"
    cache_state_keys = False
    fast_adapter_table = False   # ZeRO partitions parameters: keep peft's own add/delete
    # LoRA dropout may run in training-mode forwards (full mode: always eval, deterministic).
    dropout_allowed = True

    def __init__(self, model_dir: Any, *, zero_stage: int, dtype: str, device: str, micro_batch_tokens: int,
                 rank: int, world_size: int, ds_overrides: Mapping[str, Any],
                 activation_checkpointing: str = "auto") -> None:
        self.zero_stage = int(zero_stage)
        self.rank, self.world_size = rank, world_size
        self._ds_overrides = dict(ds_overrides)
        self.dtype = dtype
        self._cur = None          # DeepSpeed engine of the running operation (None: plain peft forward)
        self._base_eng = None     # ZeRO-3 LoRA: the engine that partitions the base; full: the model's
        # ZeRO-3: _load_model builds and loads the model already partitioned.
        super().__init__(model_dir, dtype=dtype, device=device, micro_batch_tokens=micro_batch_tokens,
                         activation_checkpointing=activation_checkpointing)
        if self.zero_stage == 3 and self.mode == "full":
            # ZeRO-3 gathers a layer's weights in a collective each time the layer runs: a head applied
            # per chunk, or a layer recomputed, as often as this rank's lengths say would leave the ranks
            # waiting on different collectives (measured: the 2-rank run hung). Full mode trains the
            # partitioned head, so it is not gathered once outside ZeRO (LoraZero3Worker does that):
            # one head call per forward, no checkpointing.
            self.chunked_head = False
            self.checkpointing.mode = "off"
            self.logprob_chunk_rows = 1 << 62   # (the memory estimate then counts whole [tokens, vocab] logits)

    def _load_model(self, path: Path, dtype: str, device: str):
        """The base model and tokenizer; under ZeRO-3 loaded already partitioned (deepspeed/loading.py)."""
        if self.zero_stage != 3:
            return super()._load_model(path, dtype, device)
        return load_partitioned_lm(path, dtype, device, self.rank, self._ds_config())

    def _ds_config(self) -> dict[str, Any]:
        bf16 = self.mode == "full" and self.dtype in ("bfloat16", "bf16")
        return merge_config(base_config(self.world_size, self.zero_stage, bf16), self._ds_overrides)

    def _forward_engine(self, adapter_id: str) -> Any:
        """The DeepSpeed engine a forward of this adapter runs through (None: the plain peft forward)."""
        return None

    def _set_train(self, flag: bool) -> None:
        self.table.peft.train(flag)

    # ------------------------------------------------------------------ forward / backward
    def forward(self, adapter_id: str, samples: Sequence[Sample], loss_fn: str,
                loss_params: Mapping[str, Any] | None = None, *, backward: bool = False,
                return_logprobs: bool = False, return_elementwise: bool = False) -> ForwardOutput:
        """This rank's share of the request (see the module docstring); the gathered result. Collective.

        On a non-finite loss the error is raised before that micro-batch's backward on every
        rank, but gradients of earlier micro-batches of the same request stay accumulated.
        """
        st = self._get(adapter_id)
        params, lens = check_forward(samples, loss_fn, loss_params, self.max_seq_len)
        self._activate(st)
        self._cur = self._forward_engine(adapter_id)
        batch = _losses.batch_stats([s.inputs for s in samples])
        mine = [int(i) for i in np.array_split(np.arange(len(samples)), self.world_size)[self.rank]]
        groups = micro_batches([lens[i] for i in mine], self.micro_batch_tokens, self.max_padding_fraction)
        n_groups = torch.tensor([len(groups)], dtype=torch.long)
        dist.all_reduce(n_groups, op=dist.ReduceOp.MAX)
        train_mode = backward and st.spec.dropout > 0 and self.dropout_allowed
        self._set_train(train_mode)
        sheet = ScoreSheet(return_logprobs, return_elementwise)
        try:
            with own_stream(st, train_mode):
                for g in range(int(n_groups.item())):
                    idx = [mine[j] for j in groups[g]] if g < len(groups) else []
                    with self._agreed_checkpointing(len(idx) * max([lens[i] for i in idx], default=1), backward):
                        if idx:
                            self._forward_group([samples[i] for i in idx], [lens[i] for i in idx], loss_fn, params,
                                                batch, backward, sheet)
                        else:
                            self._pad_forward(backward)
        finally:
            self._set_train(False)
        order = [j for g in groups for j in g]   # groups are by length; results go back in request order
        lp_out, el_out = restore_order(sheet.logprobs, order), restore_order(sheet.elementwise, order)
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, (sheet.total, sheet.acc, lp_out, el_out))
        total, acc, lp_out, el_out = 0.0, {}, [], []
        for t, a, lp, el in parts:
            total += t
            for k, v in a.items():
                acc[k] = acc.get(k, 0.0) + v
            lp_out += lp
            el_out += el
        if not math.isfinite(total):
            raise FloatingPointError(f"the {loss_fn} loss of this batch is not finite ({total})")
        metrics = _losses.finalize_metrics(acc)
        metrics["loss:sum"] = total
        return ForwardOutput(loss=total, logprobs=lp_out if return_logprobs else None,
                             elementwise_loss=el_out if return_elementwise else None, metrics=metrics)

    def _model_logits(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self._cur is None:   # ZeRO-3 LoRA: ZeRO-3's hooks on the base modules gather each layer's weights
            return self.table.peft(input_ids=ids, attention_mask=mask, use_cache=False).logits
        return self._cur(input_ids=ids, attention_mask=mask, use_cache=False).logits

    def _backward_group(self, total: torch.Tensor, value: float) -> None:
        ok = torch.tensor([1.0 if math.isfinite(value) else 0.0])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item() < 1.0:
            raise FloatingPointError(
                "the loss of this batch is not finite on at least one rank; this micro-batch was not "
                "accumulated (check advantages and sampler logprobs: r = exp(p - q) may overflow)"
            )
        if self._cur is None:
            total.backward()    # ZeRO-3 LoRA: summed over ranks at optim_step
            return
        self._cur.set_gradient_accumulation_boundary(False)
        # DeepSpeed averages over ranks; x world gives the gradient of the request's sum loss.
        self._cur.backward(total * float(self.world_size))

    @contextlib.contextmanager
    def _agreed_checkpointing(self, padded_tokens: int, backward: bool) -> Iterator[None]:
        """ZeRO-3: every rank checkpoints this micro-batch if one would (``auto`` decides on the padded
        size, which differs per rank): a recomputed layer gathers its weights again in backward, so the
        ranks must recompute the same layers. Other stages: each rank's own decision."""
        if self.zero_stage != 3 or not self.checkpointing.layers:
            yield
            return
        want = torch.tensor([1 if self.checkpointing.wanted(padded_tokens, backward) else 0], dtype=torch.long)
        dist.all_reduce(want, op=dist.ReduceOp.MAX)
        mode = self.checkpointing.mode
        self.checkpointing.mode = "on" if want.item() else "off"
        try:
            yield
        finally:
            self.checkpointing.mode = mode

    def _pad_forward(self, backward: bool) -> None:
        """A zero-loss one-token forward (and backward), so every rank runs as many as the others, through
        the same path as a real micro-batch (chunked head, checkpointing): the same collectives under ZeRO-3."""
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        mask = torch.ones_like(ids)
        self.checkpointing.enabled = self.checkpointing.wanted(1, backward)
        with torch.set_grad_enabled(backward):
            if self.chunked_head:
                lp = model_target_logprobs(self.table.head_model(), lambda: self._model_logits(ids, mask), mask, ids,
                                           self.logprob_chunk_rows, self.head_for)
            else:
                lp = self._model_logits(ids, mask)
            total = lp.float().sum() * 0.0
            if backward:
                self._backward_group(total, 0.0)

    def zero_grad(self, adapter_id: str) -> None:
        """Drop the adapter's accumulated gradients (also those inside its ZeRO optimizer)."""
        st = self._get(adapter_id)
        eng = self._forward_engine(adapter_id)
        if eng is not None:
            self._drop_zero_grads(eng.optimizer)
        for p in st.params:
            p.grad = None

    def _drop_zero_grads(self, zopt: Any) -> None:
        """Discard the gradients a DeepSpeed ZeRO optimizer accumulated since its last step."""
        zopt.zero_grad(set_to_none=True)
        if self.zero_stage < 3:
            # ZeRO-1/2 keep gradients reduced by earlier (non-boundary) backwards in buffers that
            # zero_grad leaves alone (measured: they came back at the next step); drop them as
            # DeepSpeed's own overflow path does.
            if hasattr(zopt, "_release_preflattened_grad_buffers"):
                zopt._release_preflattened_grad_buffers()
            for attr in ("averaged_gradients", "all_grad_tensors"):
                held = getattr(zopt, attr, None) or {}
                for k in list(held):
                    held[k] = None

    def grad_norm(self, adapter_id: str) -> float:  # pragma: no cover - not meaningful under ZeRO
        """Not available: gradients are partitioned (ZeRO) or per rank (ZeRO-3 LoRA) until ``optim_step``.

        Raises:
            NotImplementedError: always; ``optim_step`` returns the pre-clip norm.
        """
        raise NotImplementedError("grad_norm before optim_step is not available on the DeepSpeed backend")

    # ------------------------------------------------------------------ optimizer
    def _zero_optim_step(self, adapter_id: str, cfg: AdamParams) -> OptimOutput:
        """ZeRO's AdamW step (ZeRO-1/2 LoRA, full mode).

        Marks the accumulation boundary with a zero-loss backward (ZeRO then reduces the
        accumulated gradients, docs/design.md §9), sets the hyper-parameters on the ZeRO
        param groups (A: lr, B: lr * lora_plus_ratio, betas, eps, weight_decay) and ZeRO's
        own clipping (``optimizer.clip_grad``; as ``clip_grad_norm_``: scale by
        ``max / (norm + 1e-6)`` when above), then ``engine.step()``; ``grad_norm`` is ZeRO's
        pre-clip global L2 norm. Without an accumulated gradient the step still runs (Adam
        moments decay, weight decay applies), unlike the torch backend.
        """
        st = self._get(adapter_id)
        lr = check_adam(cfg)
        eng = self._cur = self._forward_engine(adapter_id)
        self._activate(st)
        self._set_train(False)
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        zero = self._model_logits(ids, torch.ones_like(ids)).float().sum() * 0.0
        eng.set_gradient_accumulation_boundary(True)
        eng.backward(zero)
        set_hyperparameters(eng.optimizer.param_groups, cfg, lr)
        eng.optimizer.clip_grad = float(cfg.grad_clip_norm)
        eng.step()
        norm = eng.get_global_grad_norm()
        norm = float(norm) if norm is not None else 0.0
        if not math.isfinite(norm):
            raise FloatingPointError(f"non-finite gradient norm ({norm}); step skipped, gradients dropped")
        st.step += 1
        return OptimOutput(step=st.step, grad_norm=norm, learning_rate=lr)

    # ------------------------------------------------------------------ checkpoints (LoRA; full mode overrides)
    def save_state(self, adapter_id: str, out_dir: str) -> Any:
        """The single-device format, written by rank 0 (it resumes on either backend). Collective.

        The other ranks take part in gathering the optimizer state (ZeRO-1/2).
        """
        if self.rank == 0:
            return super().save_state(adapter_id, out_dir)
        self._optimizer_state_dict(self._get(adapter_id))
        return None

    def state_differences(self, meta: Mapping[str, Any], spec: LoraConfig | None = None) -> list[str]:
        """As TorchTrainerEngine.state_differences, plus mode (and, full mode, world size and stage)."""
        diffs = super().state_differences(meta, spec)
        theirs = meta.get("mode", "lora")
        if theirs != self.mode:
            diffs.append(f"training mode: checkpoint {theirs!r}, this resource {self.mode!r}")
        elif self.mode == "full":
            for key, mine in (("world_size", self.world_size), ("zero_stage", self.zero_stage)):
                if meta.get(key) != mine:
                    diffs.append(f"DeepSpeed {key}: checkpoint {meta.get(key)!r}, this resource {mine!r} "
                                 "(full-mode checkpoints resume on the same layout)")
        return diffs

    @staticmethod
    def _group_of(st: TrainerAdapter) -> list[int]:
        """The optimizer param group (0 = A, 1 = B) of each of ``st.params``."""
        return [0] * len(st.params_a) + [1] * len(st.params_b)
