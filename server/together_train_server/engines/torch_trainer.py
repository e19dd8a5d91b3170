"""Trainer engine: one frozen base model, many LoRA adapters (transformers + peft).

Each adapter has its own ``torch.optim.AdamW`` and step counter (docs/design.md §6).
Gradients accumulate across ``forward(..., backward=True)`` calls until
``optim_step``. Not thread-safe: the service layer runs one operation at a
time on an engine.

`TorchTrainerEngine` is the composition root of its parts (each its own module, shared
with the DeepSpeed workers, which subclass this engine and override its hooks): the adapter
table and peft layers (trainer_adapters.py), per-sample scoring and the gradient stash
(trainer_forward.py), AdamW (adamw.py), each adapter's RNG stream (adapter_rng.py), snapshots
and PEFT directories (adapter_export.py), request checks, micro-batching and padding
(trainer_batching.py), the training-checkpoint format (trainer_state.py), session pages
(session_pages.py) and the merged export (merged_export.py).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from . import losses as _losses
from . import session_pages, trainer_state
from .activation_checkpointing import LayerCheckpointing
from .adamw import adamw_step, drop_grads, grad_norm, new_adamw
from .adapter_export import adapter_snapshot, write_peft_adapter
from .adapter_rng import new_stream, own_stream, seeded
from .chunked_logprobs import chunk_rows
from .length_batching import MAX_PADDING_FRACTION
from .lora import FlatTensors, default_target_modules, make_lora_config
from .memory_estimate import ModelDims, dims_of, engine_estimate
from .merged_export import write_merged_lora
from .model_loading import load_causal_lm, resolve_model_dir
from .short_steps import run_sized
from .trainer_adapters import AdapterTable, TrainerAdapter, split_lora_parameters
from .trainer_batching import check_forward, micro_batches, model_target_logprobs, right_pad, target_logprobs
from .trainer_forward import GradStash, ScoreSheet
from .interfaces import TrainerCapabilities
from .types import AdamParams, ForwardOutput, LoraConfig, OptimOutput, Sample

__all__ = ["TorchTrainerEngine"]


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
        self.table = AdapterTable(self._base, fast=self.fast_adapter_table)
        self._fingerprint: dict[str, Any] | None = None

    def _load_model(self, path: Path, dtype: str, device: str):
        """``(model, tokenizer)`` of the base (the DeepSpeed backend loads ZeRO-3 partitioned)."""
        return load_causal_lm(path, dtype=dtype, device=device)

    # ------------------------------------------------------------------ adapters (trainer_adapters.py)
    @property
    def adapter_ids(self) -> list[str]:
        """Ids of the live adapters."""
        return list(self.table)

    def create_adapter(self, adapter_id: str, spec: LoraConfig) -> int:
        """Add a LoRA adapter with its own AdamW; returns its trainable parameter count.

        ``torch.manual_seed(spec.seed)`` is set right before peft creates the
        adapter, so A's Kaiming-uniform init is reproducible (B starts at 0;
        an ``lm_head`` copy starts equal to the base unembedding).

        Raises:
            ValueError: id already used, or invalid spec (rank, alpha, dropout,
                target modules).
        """
        if adapter_id in self.table:
            raise ValueError(f"adapter {adapter_id!r} already exists")
        name = self.table.new_name()
        config = make_lora_config(spec, self.lora_target_modules, str(self.model_dir))
        with seeded(spec.seed):
            named = self.table.add_layers(name, config)
        a, b = split_lora_parameters(named)
        st = TrainerAdapter(adapter_id, name, spec, a, b, new_adamw(a, b), 0, [n for n, _ in named],
                            rng_state=new_stream(spec.seed), named=dict(named))
        self.table.put(st)
        self._activate(st)
        self.table.flush_deletes()
        return st.numel

    def drop_adapter(self, adapter_id: str) -> None:
        """Remove an adapter, its optimizer and gradients.

        Raises:
            KeyError: unknown adapter.
        """
        st = self.table.remove(adapter_id)
        drop_grads(st.params)
        st.optimizer.state.clear()

    def _get(self, adapter_id: str) -> TrainerAdapter:
        """The adapter's record (``AdapterTable.get``). Raises KeyError if unknown."""
        return self.table.get(adapter_id)

    def _activate(self, st: TrainerAdapter) -> None:
        """Make ``st`` the adapter the model runs (a hook: full mode has no peft model)."""
        self.table.activate(st)

    def step(self, adapter_id: str) -> int:
        """Optimizer steps taken by the adapter. Raises KeyError if unknown."""
        return self._get(adapter_id).step

    def spec(self, adapter_id: str) -> LoraConfig:
        """The adapter's LoraConfig. Raises KeyError if unknown."""
        return self._get(adapter_id).spec

    # ------------------------------------------------------------------ forward
    def forward(self, adapter_id: str, samples: Sequence[Sample], loss_fn: str,
                loss_params: Mapping[str, Any] | None = None, *, backward: bool = False,
                return_logprobs: bool = False, return_elementwise: bool = False) -> ForwardOutput:
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
        adapter has LoRA dropout > 0 (`_run_groups`).

        Args: as ``interfaces.TrainerEngine.forward``: validated samples (``model_input``
            int64 ``[n_i]``, ``inputs`` with the loss's keys, each ``[n_i]``); ``loss_fn`` a name
            in ``LOSS_SPECS`` that is available, ``loss_params`` (defaults from the spec);
            ``backward``: accumulate gradients; ``return_*``: include per-token arrays.

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
        groups = micro_batches(lens, self.micro_batch_tokens, self.max_padding_fraction)
        sheet = ScoreSheet(return_logprobs, return_elementwise)
        stash = GradStash(st.params) if backward else None
        try:
            self._run_groups(st, samples, lens, groups, loss_fn, params, backward, sheet)
            sheet.check_finite(loss_fn)
            if stash is not None:
                stash.check_finite(loss_fn)
        except BaseException:
            if stash is not None:
                stash.restore()
            raise
        if stash is not None:
            stash.merge()
        return sheet.output([i for g in groups for i in g])

    def _run_groups(self, st: TrainerAdapter, samples: Sequence[Sample], lens: Sequence[int],
                    groups: Sequence[Sequence[int]], loss_fn: str, params: Mapping[str, Any], backward: bool,
                    sheet: ScoreSheet) -> None:
        """The micro-batches ``groups`` (indices into ``samples``), scored into ``sheet``; training mode and the
        adapter's own RNG stream only when ``backward`` and its LoRA dropout > 0 (eval mode after, always)."""
        batch = _losses.batch_stats([s.inputs for s in samples])   # request-wide normalisers (grpo)
        train_mode = backward and st.spec.dropout > 0
        self.table.peft.train(train_mode)
        try:
            with own_stream(st, train_mode):
                for group in groups:
                    run_sized(  # short: heap reuse on its own thread/arena; long: freed blocks leave (memory.py)
                        len(group) * max(lens[i] for i in group), self._forward_group,
                        [samples[i] for i in group], [lens[i] for i in group], loss_fn, params, batch, backward, sheet,
                    )
        finally:
            self.table.peft.eval()

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

    def _forward_group(self, samples: Sequence[Sample], lens: Sequence[int], loss_fn: str,
                       params: Mapping[str, Any], batch: Any, backward: bool, sheet: ScoreSheet) -> float:
        """One micro-batch: right-padded forward, per-sample loss into ``sheet``, backward. Returns its loss (sum)."""
        ids, mask, targets = right_pad(samples, lens, self.device)
        self.checkpointing.enabled = self.checkpointing.wanted(ids.numel(), backward)
        with torch.set_grad_enabled(backward):
            if self.chunked_head:
                lp_flat = model_target_logprobs(self.table.head_model(), lambda: self._model_logits(ids, mask), mask,
                                                targets, self.logprob_chunk_rows, self.head_for)
            else:   # one head call per forward (ZeRO-3: every rank must gather the head as often as the others)
                lp_flat = target_logprobs(self._model_logits(ids, mask), targets)[mask.bool()]
            total = sheet.score(lp_flat, samples, lens, loss_fn, params, batch, self.device)
            value = float(total.detach())
            if backward:
                self._backward_group(total, value)
        sheet.total += value
        return value

    def memory_estimate(self, lens: Sequence[int], backward: bool, adapter_id: str | None = None):
        """``memory_estimate.MicroBatchEstimate`` of a request of samples of ``lens`` (its largest micro-batch)."""
        return engine_estimate(self, lens, backward, self.table.find(adapter_id))

    def model_dims(self) -> ModelDims:
        """The base model's sizes and this engine's dtype (``memory_estimate.ModelDims``)."""
        return dims_of(self._base.config, self.dtype)

    def _model_logits(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` of the active adapter for right-padded ``ids``/``mask`` ``[B, T]`` int64.

        The padding mask is not passed on: with right padding a real position
        only attends to earlier positions, which are all real, so the causal
        mask alone gives the same logits there (padded positions are never
        read). Without an explicit mask SDPA takes its faster causal path
        (measured ~8% of an SFT step on SmolLM2-135M, CPU).
        """
        del mask
        return self.table.peft(input_ids=ids, use_cache=False).logits

    def _backward_group(self, total: torch.Tensor, value: float) -> None:
        """Backpropagate one micro-batch's summed loss (skipped when not finite; ``forward`` raises after)."""
        if math.isfinite(value):
            total.backward()

    def zero_grad(self, adapter_id: str) -> None:
        """Drop the adapter's accumulated gradients. Raises KeyError if unknown."""
        drop_grads(self._get(adapter_id).params)

    def grad_norm(self, adapter_id: str) -> float:
        """Global L2 norm of the adapter's accumulated gradient (0 when none)."""
        return grad_norm(self._get(adapter_id).params)

    # ------------------------------------------------------------------ optimizer (adamw.py)
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
        try:
            out = adamw_step(st.optimizer, st.params, cfg, st.step)
        except FloatingPointError:
            self.zero_grad(adapter_id)
            raise
        st.step = out.step
        return out

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
        return adapter_snapshot(self.table.peft, self._get(adapter_id), dtype, cache=self.cache_state_keys)

    def save_adapter(self, adapter_id: str, out_dir: str | os.PathLike) -> Path:
        """Write a PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``).

        Loadable with ``PeftModel.from_pretrained(base, out_dir)`` and by vLLM.
        ``base_model_name_or_path`` is the local model directory.

        Raises:
            KeyError: unknown adapter.
        """
        st = self._get(adapter_id)
        return write_peft_adapter(self.table.peft, st, self.adapter_tensors(adapter_id), self.model_dir, Path(out_dir))

    def trainable_parameters(self, adapter_id: str) -> dict[str, torch.nn.Parameter]:
        """The adapter's live parameters by peft parameter name (for tests/checkpoints)."""
        return self.table.parameters_by_name(self._get(adapter_id))

    def optimizer(self, adapter_id: str) -> torch.optim.Optimizer:
        """The adapter's optimizer (for checkpointing)."""
        return self._get(adapter_id).optimizer

    # ------------------------------------------------------------------ training checkpoints (trainer_state.py)
    def base_fingerprint(self) -> dict[str, Any]:
        """What identifies the frozen base model (``trainer_state.base_fingerprint``), plus its ``dtype``."""
        if self._fingerprint is None:
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
        trainer_state.write_state(out, self.table.state_names(st), st.params, self._optimizer_state_dict(st),
                                  st.rng_state, st.spec, st.step, self.base_fingerprint())
        return out

    def _optimizer_state_dict(self, st: TrainerAdapter) -> dict[str, Any]:
        """The adapter's AdamW ``state_dict()``: per-parameter state indexed like ``st.params``."""
        return st.optimizer.state_dict()

    def _load_optimizer_state_dict(self, st: TrainerAdapter, sd: dict[str, Any]) -> None:
        """Inverse of ``_optimizer_state_dict`` (after the weights were copied in)."""
        st.optimizer.load_state_dict(sd)

    def _reset_optimizer(self, st: TrainerAdapter) -> None:
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
        names = self.table.state_names(st)
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
        return write_merged_lora(self.table.peft, st.name, st.spec.train_unembed, self.model_dir, self.dtype,
                                 self.tokenizer, Path(out_dir))
