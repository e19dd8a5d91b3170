"""Trainer engine: one frozen base model, many LoRA adapters (transformers + peft).

Each adapter has its own ``torch.optim.AdamW`` and step counter (docs/design.md §6).
Gradients accumulate across ``forward(..., backward=True)`` calls until
``optim_step``. Not thread-safe: the service layer runs one operation at a
time on an engine. Parts shared with the DeepSpeed engines live apart: request
checks, micro-batching and padding (trainer_batching.py), the training-checkpoint
format (trainer_state.py), the merged export (merged_export.py).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from together_train.types.adam_params import ADAM_FIELDS, adam_range_error

from . import losses as _losses
from . import session_pages, trainer_state
from .lora_layers import LoraLayerIndex
from .lora import FlatSource, FlatTensors, default_target_modules, flat_copy, is_lora_b, make_lora_config, quiet_peft, snapshot_dtype
from .merged_export import write_merged_lora
from .model_loading import load_causal_lm, resolve_model_dir
from .activation_checkpointing import LayerCheckpointing
from .chunked_logprobs import chunk_rows
from .length_batching import MAX_PADDING_FRACTION, restore_order
from .short_steps import run_sized
from .memory_estimate import ModelDims, dims_of, engine_estimate
from .trainer_batching import check_forward, micro_batches, model_target_logprobs, right_pad, target_logprobs
from .interfaces import TrainerCapabilities
from .types import AdamParams, ForwardOutput, LoraConfig, OptimOutput, Sample

__all__ = ["TorchTrainerEngine"]


@dataclass
class _Adapter:
    adapter_id: str
    name: str                      # internal peft adapter name
    spec: LoraConfig
    params_a: list[torch.nn.Parameter]   # lora_A and full modules (lr)
    params_b: list[torch.nn.Parameter]   # lora_B (lr * lora_plus_ratio)
    optimizer: torch.optim.AdamW
    step: int = 0
    param_names: list[str] = field(default_factory=list)
    # Per-adapter torch CPU RNG state (uint8), swapped in around training-mode
    # forwards so each session has its own LoRA-dropout stream (isolation,
    # exact resume); seeded from spec.seed.
    rng_state: torch.Tensor | None = None
    # The parameters by peft state-dict key, found once by adapter_tensors (its snapshots' source).
    snapshot_source: FlatSource | None = None
    # peft parameter name -> parameter (model order), found at creation.
    named: dict[str, torch.nn.Parameter] = field(default_factory=dict)

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return self.params_a + self.params_b


class TorchTrainerEngine:
    """LoRA trainer over a frozen causal LM.

    Args:
        model_dir: local Hugging Face directory, or ``None``/``"embedded"``
            for the embedded SmolLM2-135M-Instruct (see ``resolve_model_dir``).
        dtype: base model dtype, ``"float32"`` | ``"bfloat16"`` | ``"float16"``.
            LoRA A/B parameters and their optimizer state are float32 (peft
            upcasts adapter weights); a ``train_unembed`` lm_head copy keeps
            the base dtype. Logprobs are computed in float32.
        device: torch device string.
        micro_batch_tokens: token budget of one model forward. A request whose
            padded size (samples x longest sample) exceeds it is split, at
            sample boundaries and grouped by length (``length_batching``), into
            micro-batches of at most this many padded tokens (a single longer
            sample runs alone); their gradients accumulate, and request-wide
            loss normalisers (grpo) are computed over the whole request first,
            so the result equals the unsplit one (up to float summation order).
        activation_checkpointing: ``"auto"`` | ``"on"`` | ``"off"`` (``activation_checkpointing``).
            The head always runs in chunks of ``logprob_chunk_rows`` positions (``chunked_logprobs``).

    Attributes:
        model_id: name of the base model (directory name).
        vocab_size: rows of the unembedding (valid token ids are ``[0, vocab_size)``).
        max_seq_len: the model's context length (``max_position_embeddings``);
            a sample's ``model_input`` may hold at most this many tokens.
        dtype: the base dtype name.
        lora_target_modules: the default (and allowed) LoRA target module names.
        mode: ``"lora"`` (this engine trains LoRA adapters only).
        backend_name: ``"TorchTrainerEngine"`` (capabilities' ``trainer_backend``).

    Implements `engines.interfaces.TrainerEngine`.

    Raises:
        FileNotFoundError: model directory missing.
    """

    mode = "lora"
    backend_name = "TorchTrainerEngine"
    # Paging (save_session/load_session), the clock cycle (forward_many), long sequences (layer
    # recomputation, the head in chunks); LoRA only (full weights: --trainer deepspeed).
    capabilities = TrainerCapabilities(paging=True, clock_cycle=True, long_context=True)
    # adapter_tensors may map peft's state-dict keys to the adapter's parameters once (the
    # DeepSpeed workers gather instead: no cache).
    cache_state_keys = True
    # The head applied in chunks of positions after the forward (chunked_logprobs); False: in the forward.
    chunked_head = True
    # Adapters added/activated/deleted per LoRA layer (lora_layers.py: O(1) in their number); the
    # DeepSpeed workers keep peft's own walks.
    fast_adapter_table = True
    head_for = None   # what the head's chunks call instead of the module (trainer_batching.model_target_logprobs)

    def __init__(self, model_dir: str | os.PathLike | None, *, dtype: str = "float32",
                 device: str = "cpu", micro_batch_tokens: int = 8192,
                 activation_checkpointing: str = "auto") -> None:
        if int(micro_batch_tokens) < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
        self.micro_batch_tokens = int(micro_batch_tokens)
        path = resolve_model_dir(model_dir)
        self.model_dir = path
        self.device = torch.device(device)
        self.dtype = dtype
        self._base, self.tokenizer = self._load_model(path, dtype, device)
        cfg = self._base.config
        self.model_id = path.name
        unembed = self._base.get_output_embeddings().weight
        # ds_shape: the full shape of a ZeRO-3 partitioned weight (DeepSpeed backend).
        self.vocab_size = int(getattr(unembed, "ds_shape", unembed.shape)[0])
        self.max_seq_len = int(getattr(cfg, "max_position_embeddings", 0) or 2048)
        # Computed before peft wraps the layers; also what capabilities list.
        self.lora_target_modules = default_target_modules(self._base)
        # Long sequences: layer recomputation, the head in chunks of positions, length grouping.
        self.checkpointing = LayerCheckpointing(self._base, activation_checkpointing)
        self.logprob_chunk_rows = chunk_rows(self.vocab_size)
        self.max_padding_fraction = MAX_PADDING_FRACTION
        self._peft = None               # PeftModel, created with the first adapter
        self._adapters: dict[str, _Adapter] = {}
        self._counter = 0
        self._pending_delete: list[str] = []   # peft cannot delete its last adapter
        self._layer_index: LoraLayerIndex | None = None   # set with the first adapter

    def _load_model(self, path: Path, dtype: str, device: str):
        """``(model, tokenizer)`` of the base (the DeepSpeed backend loads ZeRO-3 partitioned)."""
        return load_causal_lm(path, dtype=dtype, device=device)

    # ------------------------------------------------------------------ adapters
    @property
    def adapter_ids(self) -> list[str]:
        """Ids of the live adapters."""
        return list(self._adapters)

    def create_adapter(self, adapter_id: str, spec: LoraConfig) -> int:
        """Add a LoRA adapter with its own AdamW; returns its trainable parameter count.

        ``torch.manual_seed(spec.seed)`` is set right before peft creates the
        adapter, so A's Kaiming-uniform init is reproducible (B starts at 0;
        an ``lm_head`` copy starts equal to the base unembedding).

        Raises:
            ValueError: id already used, or invalid spec (rank, alpha, dropout,
                target modules).
        """
        if adapter_id in self._adapters:
            raise ValueError(f"adapter {adapter_id!r} already exists")
        self._counter += 1
        name = f"ad{self._counter}"   # peft-safe name (no dots, not a substring of "lora_")
        config = make_lora_config(spec, self.lora_target_modules, str(self.model_dir))
        devstate = torch.random.get_rng_state()
        torch.manual_seed(int(spec.seed))
        try:
            named = self._add_peft_adapter(name, config)
        finally:
            torch.random.set_rng_state(devstate)
        a, b, names = [], [], []
        for pname, p in named:
            names.append(pname)
            (b if is_lora_b(pname) else a).append(p)
        # LoRA+ (Hayou et al. 2024): only B gets lr * ratio; A and full modules
        # (lm_head copy) use lr, as in peft's create_loraplus_optimizer.
        opt = torch.optim.AdamW([{"params": a, "name": "A"}, {"params": b, "name": "B"}], lr=0.0, foreach=False)
        self._adapters[adapter_id] = _Adapter(adapter_id, name, spec, a, b, opt, 0, names)
        self._adapters[adapter_id].rng_state = torch.Generator().manual_seed(int(spec.seed)).get_state()
        self._adapters[adapter_id].named = dict(named)
        self._activate(self._adapters[adapter_id])
        self._flush_pending_deletes()
        return int(sum(p.numel() for p in a + b))

    def _add_peft_adapter(self, name: str, config) -> list[tuple[str, torch.nn.Parameter]]:
        """Add peft adapter ``name``; returns its ``(parameter name, parameter)`` pairs in model order.

        Through `LoraLayerIndex` when it applies (O(1) in the number of adapters; bit-identical
        weights), else through peft's ``add_adapter`` (walks every module and adapter).
        """
        from peft import get_peft_model

        index = self._layer_index if self.fast_adapter_table else None
        if index is not None and index.fits(config):
            index.add(name, config)
            return index.adapter_parameters(name)
        with quiet_peft():
            if self._peft is None:
                self._peft = get_peft_model(self._base, config, adapter_name=name)
            else:
                self._peft.add_adapter(name, config)
        self._layer_index = LoraLayerIndex(self._peft)
        return [(n, p) for n, p in self._peft.named_parameters() if f".{name}." in n]

    def drop_adapter(self, adapter_id: str) -> None:
        """Remove an adapter, its optimizer and gradients.

        Raises:
            KeyError: unknown adapter.
        """
        st = self._get(adapter_id)
        del self._adapters[adapter_id]
        for p in st.params:
            p.grad = None
        st.optimizer.state.clear()
        self._pending_delete.append(st.name)
        self._flush_pending_deletes()

    def _flush_pending_deletes(self) -> None:
        live = {a.name for a in self._adapters.values()}
        index = self._layer_index if self.fast_adapter_table else None
        for name in list(self._pending_delete):
            if not live:
                break  # keep one adapter inside peft; it is deleted after the next create
            if index is not None and index.usable:
                index.delete(name, next(iter(live)))
            else:
                if name in self._peft.active_adapters:
                    self._peft.set_adapter(next(iter(live)))
                self._peft.delete_adapter(name)
            self._pending_delete.remove(name)

    def _get(self, adapter_id: str) -> _Adapter:
        try:
            return self._adapters[adapter_id]
        except KeyError:
            raise KeyError(f"unknown adapter {adapter_id!r}") from None

    def _activate(self, st: _Adapter) -> None:
        # set_adapter flips requires_grad (only the active adapter trains);
        # it leaves .grad alone, so other adapters' accumulated gradients survive.
        index = self._layer_index if self.fast_adapter_table else None
        if index is not None and index.usable:
            index.activate(st.name, st.params)
        elif self._peft.active_adapters != [st.name]:
            self._peft.set_adapter(st.name)

    def step(self, adapter_id: str) -> int:
        """Optimizer steps taken by the adapter. Raises KeyError if unknown."""
        return self._get(adapter_id).step

    def spec(self, adapter_id: str) -> LoraConfig:
        """The adapter's LoraConfig. Raises KeyError if unknown."""
        return self._get(adapter_id).spec

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        adapter_id: str,
        samples: Sequence[Sample],
        loss_fn: str,
        loss_params: Mapping[str, Any] | None = None,
        *,
        backward: bool = False,
        return_logprobs: bool = False,
        return_elementwise: bool = False,
    ) -> ForwardOutput:
        """Score a batch with the adapter and optionally accumulate gradients.

        The batch (or each micro-batch, see ``micro_batch_tokens``) is
        right-padded into one ``[B, max n_i]`` forward with an attention mask;
        per sample, ``logits[:n_i]`` (float32) go through
        ``log_softmax`` and the target token's logprob is gathered:
        ``p_t = log softmax(logits_t)[target_tokens[t]]`` (untempered, nats).
        The loss of each sample is ``sum_t elementwise_t`` (see ``losses``);
        the returned loss is the sum over samples, never a mean. With
        ``backward=True`` its gradient is added to the adapter's ``.grad``.

        The model runs in eval mode (deterministic) unless ``backward`` and the
        adapter has LoRA dropout > 0.

        Args:
            adapter_id: the adapter.
            samples: validated samples (``model_input`` int64 ``[n_i]``,
                ``inputs`` with the loss's keys, each ``[n_i]``).
            loss_fn: a name in ``LOSS_SPECS`` that is available.
            loss_params: loss parameters (defaults from the spec).
            backward: accumulate gradients.
            return_logprobs / return_elementwise: include per-token arrays.

        Returns:
            ForwardOutput: ``loss`` = sum of every sample's ``elementwise``
            (a sum over positions; grpo's terms carry its aggregation's
            normaliser); ``metrics`` from ``losses.finalize_metrics``: sums
            (``loss:sum``, ``num_tokens:sum``, ``weight:sum`` for
            cross_entropy) and means over selected tokens (``ratio:mean``,
            ``clip_low_frac:mean``, ``clip_high_frac:mean``, ``kl:mean``)
            where the loss defines them.

        Raises:
            KeyError: unknown adapter or loss. NotImplementedError: loss not
            available. ValueError: empty batch, mismatched lengths, sample
            longer than ``max_seq_len``, empty sample, missing input, bad
            loss parameter (``loss_specs.ParamError``). FloatingPointError: the
            loss or the gradient is not finite. On any error the adapter's
            accumulated gradient is left exactly as it was.
        """
        st = self._get(adapter_id)
        params, lens = check_forward(samples, loss_fn, loss_params, self.max_seq_len)

        self._activate(st)
        batch = _losses.batch_stats([s.inputs for s in samples])
        groups = micro_batches(lens, self.micro_batch_tokens, self.max_padding_fraction)
        order = [i for g in groups for i in g]
        # Failure leaves the accumulated gradient as it was: stash it, let the
        # backward passes accumulate into fresh .grad, then add the stash back
        # (old + new: the same float operation autograd's accumulation does).
        stash = [p.grad for p in st.params] if backward else None
        if backward:
            for p in st.params:
                p.grad = None
        train_mode = backward and st.spec.dropout > 0
        self._peft.train(train_mode)
        rng_outer = self._rng_enter(st, train_mode)
        total = 0.0
        acc: dict[str, float] = {}
        lp_out: list[np.ndarray] = []
        el_out: list[np.ndarray] = []
        try:
            for group in groups:
                g_total = run_sized(  # short: heap reuse on its own thread/arena; long: freed blocks leave (memory.py)
                    len(group) * max(lens[i] for i in group), self._forward_group,
                    [samples[i] for i in group], [lens[i] for i in group], loss_fn, params, batch,
                    backward, return_logprobs, return_elementwise, acc, lp_out, el_out,
                )
                total += g_total
            if not math.isfinite(total):
                raise FloatingPointError(
                    f"the {loss_fn} loss of this batch is not finite ({total}); nothing was accumulated "
                    "(check advantages and sampler logprobs: r = exp(p - q) may overflow)"
                )
            if backward:
                for p in st.params:
                    if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                        raise FloatingPointError(
                            f"the {loss_fn} gradient of this batch is not finite; nothing was accumulated"
                        )
        except BaseException:
            if backward:
                for p, old in zip(st.params, stash):
                    p.grad = old
            raise
        finally:
            self._peft.eval()
            self._rng_exit(st, rng_outer)
        if backward:
            for p, old in zip(st.params, stash):
                if old is not None:
                    p.grad = old if p.grad is None else old.add_(p.grad)
        lp_out, el_out = restore_order(lp_out, order), restore_order(el_out, order)
        metrics = _losses.finalize_metrics(acc)
        metrics["loss:sum"] = total
        return ForwardOutput(
            loss=total,
            logprobs=lp_out if return_logprobs else None,
            elementwise_loss=el_out if return_elementwise else None,
            metrics=metrics,
        )

    def forward_many(self, items: Sequence[Any]) -> list[ForwardOutput | BaseException]:
        """Several sessions' forwards in as few passes over the base as fit (``cross_session.forward_many``).

        Args:
            items: ``cross_session.ForwardItem``s (``forward``'s arguments), one per session.

        Returns:
            Per item, in order, its ``ForwardOutput`` or the exception ``forward`` would have raised;
            each equals the item's result alone up to float32 summation order.
        """
        from .cross_session import forward_many

        return forward_many(self, items)

    def _forward_group(self, samples, lens, loss_fn, params, batch, backward,
                       return_logprobs, return_elementwise, acc, lp_out, el_out) -> float:
        """One micro-batch: right-padded forward, per-sample loss, backward. Returns its loss (sum)."""
        ids, mask, targets = right_pad(samples, lens, self.device)
        self.checkpointing.enabled = self.checkpointing.wanted(ids.numel(), backward)
        with torch.set_grad_enabled(backward):
            if self.chunked_head:
                lp_flat = model_target_logprobs(self._head_model(), lambda: self._model_logits(ids, mask), mask,
                                                targets, self.logprob_chunk_rows, self.head_for)
            else:   # one head call per forward (ZeRO-3: every rank must gather the head as often as the others)
                lp_flat = target_logprobs(self._model_logits(ids, mask), targets)[mask.bool()]
            starts = np.cumsum([0, *lens])
            total = None
            for i, s in enumerate(samples):
                n = lens[i]
                inputs = {k: torch.as_tensor(np.asarray(v)).to(self.device) for k, v in s.inputs.items()}
                lp = lp_flat[starts[i]: starts[i] + n]
                res = _losses.compute_loss(loss_fn, lp, inputs, params, batch)
                s_loss = res.elementwise.sum()
                total = s_loss if total is None else total + s_loss
                for k, v in res.metrics.items():
                    acc[k] = acc.get(k, 0.0) + float(v)
                if return_logprobs:
                    lp_out.append(lp.detach().float().cpu().numpy().astype(np.float32))
                if return_elementwise:
                    el_out.append(res.elementwise.detach().float().cpu().numpy().astype(np.float32))
            value = float(total.detach())
            if backward:
                self._backward_group(total, value)
        return value

    def memory_estimate(self, lens: Sequence[int], backward: bool, adapter_id: str | None = None):
        """``memory_estimate.MicroBatchEstimate`` of a request of samples of ``lens`` (its largest micro-batch)."""
        return engine_estimate(self, lens, backward, self._adapters.get(adapter_id or ""))

    def model_dims(self) -> ModelDims:
        """The base model's sizes and this engine's dtype (``memory_estimate.ModelDims``)."""
        return dims_of(self._base.config, self.dtype)

    def _head_model(self) -> torch.nn.Module:
        """The model whose output embedding ``_model_logits`` applies (peft's; the base without peft)."""
        return self._peft if self._peft is not None else self._base

    def _model_logits(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` of the active adapter for right-padded ``ids``/``mask`` ``[B, T]`` int64.

        The padding mask is not passed on: with right padding a real position
        only attends to earlier positions, which are all real, so the causal
        mask alone gives the same logits there (padded positions are never
        read). Without an explicit mask SDPA takes its faster causal path
        (measured ~8% of an SFT step on SmolLM2-135M, CPU).
        """
        del mask
        return self._peft(input_ids=ids, use_cache=False).logits

    def _backward_group(self, total: torch.Tensor, value: float) -> None:
        """Backpropagate one micro-batch's summed loss (skipped when not finite; ``forward`` raises after)."""
        if math.isfinite(value):
            total.backward()

    def zero_grad(self, adapter_id: str) -> None:
        """Drop the adapter's accumulated gradients. Raises KeyError if unknown."""
        for p in self._get(adapter_id).params:
            p.grad = None

    def grad_norm(self, adapter_id: str) -> float:
        """Global L2 norm of the adapter's accumulated gradient (0 when none)."""
        grads = [p.grad for p in self._get(adapter_id).params if p.grad is not None]
        if not grads:
            return 0.0
        return float(torch.nn.utils.get_total_norm(grads, 2.0))

    # ------------------------------------------------------------------ optimizer
    @staticmethod
    def _check_cfg(cfg: AdamParams) -> float:
        """Check AdamW hyper-parameters (before any state changes); returns the learning rate as a float.

        Raises:
            ValueError: naming the first field that is not finite or outside its range (the
                SDK's ``ADAM_RANGES``, which the service validated against already), e.g.
                ``"learning_rate must be finite and >= 0, got -1.0"``.
        """
        values = {f: float(getattr(cfg, f)) for f in ADAM_FIELDS}
        bad = adam_range_error(values)
        if bad is not None:
            name, text = bad
            raise ValueError(f"{name} must be finite and {text}, got {getattr(cfg, name)}")
        return values["learning_rate"]

    def optim_step(self, adapter_id: str, cfg: AdamParams) -> OptimOutput:
        """Apply one AdamW step with the accumulated gradients, then zero them.

        Every hyper-parameter is written into the param groups on each call
        (no hidden schedule): group A (lora_A, lm_head copy) gets
        ``lr = cfg.learning_rate``, group B (lora_B) ``lr * cfg.lora_plus_ratio``;
        both get ``betas``, ``eps``, ``weight_decay`` (decoupled, AdamW).
        With ``grad_clip_norm > 0`` the gradients are clipped by
        ``torch.nn.utils.clip_grad_norm_`` (global L2 norm over the adapter's
        parameters). Parameters without a gradient are skipped by AdamW (as in
        torch). Gradients are set to None afterwards and the step counter
        increments.

        Returns:
            OptimOutput(step, pre-clip grad norm, learning rate of A).

        Raises:
            KeyError: unknown adapter. ValueError: invalid hyper-parameters.
            FloatingPointError: non-finite gradient norm; the step is not
            applied, the gradients are discarded and the step is not counted.
        """
        st = self._get(adapter_id)
        lr = self._check_cfg(cfg)
        params = [p for p in st.params if p.grad is not None]
        if params:
            if cfg.grad_clip_norm > 0:
                norm = torch.nn.utils.clip_grad_norm_(params, float(cfg.grad_clip_norm))
            else:
                norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
            norm = float(norm)
        else:
            norm = 0.0
        if not math.isfinite(norm):
            self.zero_grad(adapter_id)
            raise FloatingPointError(f"non-finite gradient norm ({norm}); step skipped, gradients dropped")
        ga, gb = st.optimizer.param_groups
        for g, glr in ((ga, lr), (gb, lr * float(cfg.lora_plus_ratio))):
            g["lr"] = glr
            g["betas"] = (float(cfg.beta1), float(cfg.beta2))
            g["eps"] = float(cfg.eps)
            g["weight_decay"] = float(cfg.weight_decay)
        st.optimizer.step()
        st.optimizer.zero_grad(set_to_none=True)
        st.step += 1
        return OptimOutput(step=st.step, grad_norm=norm, learning_rate=lr)

    # ------------------------------------------------------------------ export
    def adapter_tensors(self, adapter_id: str, dtype: str = "float32") -> FlatTensors:
        """The adapter's weights as PEFT state-dict keys: CPU copies in `dtype`, one flat buffer.

        Keys are those of ``peft.get_peft_model_state_dict`` (adapter name
        stripped), e.g. ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``
        ``[r, in]``, ``...lora_B.weight`` ``[out, r]``, and
        ``base_model.model.lm_head.weight`` ``[vocab, hidden]`` with train_unembed.
        A `FlatTensors`: views of one buffer, back to back in key order, filled
        by one converting ``_foreach_copy_`` from the parameters (`FlatSource`,
        found once per adapter): a weights push snapshots in the replicas'
        dtype (``"bfloat16"``: half the bytes of float32, the same rounding as
        casting later) and sends the buffer as it is.

        Raises:
            KeyError: unknown adapter. ValueError: `dtype` not float32/bfloat16/float16.
        """
        from peft import get_peft_model_state_dict

        td = snapshot_dtype(dtype)
        st = self._get(adapter_id)
        src = st.snapshot_source if self.cache_state_keys else None
        if src is None:
            sd = get_peft_model_state_dict(self._peft, adapter_name=st.name, save_embedding_layers=False)
            by_ptr = {p.data_ptr(): p for p in st.params}
            if not self.cache_state_keys or any(
                    by_ptr.get(v.data_ptr()) is None or by_ptr[v.data_ptr()].shape != v.shape for v in sd.values()):
                return flat_copy(sd, td)
            # peft's state dict walks every module per call (~0.1 s on SmolLM2-135M): map its keys to
            # the adapter's own parameters once (the optimizer trains these same objects).
            src = st.snapshot_source = FlatSource({k: by_ptr[v.data_ptr()] for k, v in sd.items()})
        return src.copy(td)

    def save_adapter(self, adapter_id: str, out_dir: str | os.PathLike) -> Path:
        """Write a PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``).

        Loadable with ``PeftModel.from_pretrained(base, out_dir)`` and by vLLM.
        ``base_model_name_or_path`` is the local model directory.

        Raises:
            KeyError: unknown adapter.
        """
        from safetensors.torch import save_file

        st = self._get(adapter_id)
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        config = self._peft.peft_config[st.name]
        config.base_model_name_or_path = str(self.model_dir)
        config.save_pretrained(str(out))
        tensors = {k: v.contiguous() for k, v in self.adapter_tensors(adapter_id).items()}
        save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        return out

    def trainable_parameters(self, adapter_id: str) -> dict[str, torch.nn.Parameter]:
        """The adapter's live parameters by peft parameter name (for tests/checkpoints)."""
        st = self._get(adapter_id)
        if st.named:
            return dict(st.named)
        named = dict(self._peft.named_parameters())
        return {n: named[n] for n in st.param_names}

    def optimizer(self, adapter_id: str) -> torch.optim.AdamW:
        """The adapter's optimizer (for checkpointing)."""
        return self._get(adapter_id).optimizer

    # ------------------------------------------------------------------ RNG
    def _rng_enter(self, st: _Adapter, active: bool) -> torch.Tensor | None:
        """Swap the adapter's own torch CPU RNG stream in (LoRA dropout); returns the outer state.

        Only when ``active`` (a training-mode forward, i.e. dropout > 0), so
        one session's dropout draws never shift another's and a training
        checkpoint restores the stream exactly. Pair with ``_rng_exit``.
        (On CUDA, dropout draws from the device generator, not per-session.)
        """
        if not active or st.rng_state is None:
            return None
        outer = torch.random.get_rng_state()
        torch.random.set_rng_state(st.rng_state)
        return outer

    def _rng_exit(self, st: _Adapter, outer: torch.Tensor | None) -> None:
        """Keep the adapter's advanced RNG state and restore the outer one."""
        if outer is None:
            return
        st.rng_state = torch.random.get_rng_state()
        torch.random.set_rng_state(outer)

    # ------------------------------------------------------------------ training checkpoints (trainer_state.py)
    def base_fingerprint(self) -> dict[str, Any]:
        """What identifies the frozen base model (``trainer_state.base_fingerprint``), plus its ``dtype``."""
        if getattr(self, "_fingerprint", None) is None:
            self._fingerprint = trainer_state.base_fingerprint(self._base.config.to_dict(), self.model_id,
                                                               self.vocab_size)
        return dict(self._fingerprint, dtype=self.dtype)

    def _resolved_targets(self, spec: LoraConfig) -> list[str]:
        return sorted(spec.target_modules or self.lora_target_modules)

    @staticmethod
    def read_state_meta(state_dir: str | os.PathLike) -> dict[str, Any]:
        """``trainer_state.read_state_meta``: a training checkpoint's JSON metadata.

        Raises:
            FileNotFoundError: not a training checkpoint. ValueError: another or a newer format.
        """
        return trainer_state.read_state_meta(state_dir)

    @staticmethod
    def spec_from_meta(meta: Mapping[str, Any]) -> LoraConfig:
        """The LoraConfig recorded in a training checkpoint's metadata."""
        return trainer_state.spec_from_meta(meta)

    def state_differences(self, meta: Mapping[str, Any], spec: LoraConfig | None = None) -> list[str]:
        """Why a checkpoint cannot be loaded here (``trainer_state.state_differences``); empty when it fits.

        ``spec``: the receiving adapter's (None: check the base model only). Target modules
        compare resolved (empty = all linear layers); dropout and seed may differ.
        """
        return trainer_state.state_differences(meta, self.base_fingerprint(), spec, self._resolved_targets)

    def _state_names(self, st: _Adapter) -> list[str]:
        """Adapter parameter names without the internal adapter name, aligned with ``st.params``."""
        by_id = {id(p): n for n, p in self.trainable_parameters(st.adapter_id).items()}
        return [by_id[id(p)].replace(f".{st.name}.", ".") for p in st.params]

    def save_state(self, adapter_id: str, out_dir: str | os.PathLike) -> Path:
        """Write a training checkpoint of the adapter into ``out_dir`` (format: engines/trainer_state.py).

        The PEFT adapter (as ``save_adapter``; the directory loads with peft too), the
        live parameters, their AdamW state, the RNG state, step, LoRA spec and
        ``base_fingerprint()``. Accumulated gradients are not saved.

        Raises:
            KeyError: unknown adapter.
        """
        st = self._get(adapter_id)
        out = Path(out_dir)
        self.save_adapter(adapter_id, out)
        trainer_state.write_state(out, self._state_names(st), st.params, self._optimizer_state_dict(st),
                                  st.rng_state, st.spec, st.step, self.base_fingerprint())
        return out

    def _optimizer_state_dict(self, st: _Adapter) -> dict[str, Any]:
        """The adapter's AdamW ``state_dict()``: per-parameter state indexed like ``st.params``."""
        return st.optimizer.state_dict()

    def _load_optimizer_state_dict(self, st: _Adapter, sd: dict[str, Any]) -> None:
        """Inverse of ``_optimizer_state_dict`` (after the weights were copied in)."""
        st.optimizer.load_state_dict(sd)

    def _reset_optimizer(self, st: _Adapter) -> None:
        """Fresh AdamW state (the next step is a first Adam step)."""
        st.optimizer.state.clear()

    def load_state(self, adapter_id: str, state_dir: str | os.PathLike, with_optimizer: bool) -> int:
        """Load a ``save_state`` checkpoint into an existing adapter; returns its step.

        Weights are copied into the live parameters (same dtype: bit-exact).
        With ``with_optimizer`` the AdamW moments and per-parameter step,
        the param-group hyper-parameters and the adapter's RNG state are
        restored too, so training continues bit-for-bit as if never
        interrupted. Without it the optimizer is fresh (empty AdamW state: the
        next step is a first Adam step) and the RNG stream is kept. Either
        way the adapter's step counter (= policy version) becomes the
        checkpoint's step, since it names the weights, and accumulated
        gradients are dropped. Nothing changes when an error is raised.

        Raises:
            KeyError: unknown adapter. FileNotFoundError / ValueError: not a
            training checkpoint, an incompatible base or LoRA shape (the
            message names what differs), missing or mis-shaped tensors.
        """
        st = self._get(adapter_id)
        d = Path(state_dir)
        meta = self.read_state_meta(d)
        diffs = self.state_differences(meta, st.spec)
        if diffs:
            raise ValueError("checkpoint does not fit this adapter: " + "; ".join(diffs))
        names = self._state_names(st)
        live = st.optimizer.state_dict()["param_groups"] if with_optimizer else None
        weights, new_opt, rng = trainer_state.read_state(d, meta, names, st.params, live)
        with torch.no_grad():
            for name, p in zip(names, st.params):
                p.copy_(weights[name].to(p.device, p.dtype))
                p.grad = None
        if new_opt is not None:
            self._load_optimizer_state_dict(st, new_opt)
            if rng is not None:
                st.rng_state = rng
        else:
            self._reset_optimizer(st)
        st.step = int(meta["step"])
        return st.step

    # ------------------------------------------------------------------ paging (session_pages.py)
    def save_session(self, adapter_id: str, path: str | os.PathLike) -> int:
        """Write the adapter's full state (weights, gradients, AdamW, RNG, step) as one page; returns bytes.

        Crash-safe and checksummed (``session_pages.write_page``); the adapter stays loaded.

        Raises:
            KeyError: unknown adapter. OSError: the write failed; the previous page is untouched.
        """
        return session_pages.save_session(self, adapter_id, path)

    def load_session(self, adapter_id: str, spec: LoraConfig, path: str | os.PathLike) -> int:
        """Create adapter ``adapter_id`` from a `save_session` page, bit-exactly; returns its step.

        Raises:
            PageCorrupt (ValueError, status DATA_LOSS): unreadable, another session's, or a failed
                checksum; nothing is created. ValueError: the id exists.
        """
        return session_pages.load_session(self, adapter_id, spec, path)

    # ------------------------------------------------------------------ merged export
    def save_merged(self, adapter_id: str, out_dir: str | os.PathLike) -> Path:
        """Write a standard Hugging Face model directory with the adapter merged in.

        A fresh copy of the base model is loaded from ``model_dir`` (the shared
        frozen base is never modified; this needs one extra model's memory
        while it runs). For every LoRA layer of the adapter,
        ``W' = W + scaling * (B @ A)`` computed in float32 by peft's
        ``get_delta_weight`` and cast to the base dtype. With
        ``train_unembed`` the trained ``lm_head`` copy replaces the output
        projection and the embeddings are untied
        (``tie_word_embeddings = False``; the input embedding stays the base's).
        The directory holds ``config.json``, ``generation_config.json``,
        ``model.safetensors``, the tokenizer files and ``chat_template.jinja``;
        ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads it as is.

        Raises:
            KeyError: unknown adapter.
        """
        st = self._get(adapter_id)
        return write_merged_lora(self._peft, st.name, st.spec.train_unembed, self.model_dir, self.dtype,
                                 self.tokenizer, Path(out_dir))
