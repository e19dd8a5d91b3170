"""Trainer engine: one frozen base model, many LoRA adapters (transformers + peft).

Each adapter has its own ``torch.optim.AdamW`` and step counter (docs/design.md §6).
Gradients accumulate across ``forward(..., backward=True)`` calls until
``optim_step``. Not thread-safe: the service layer runs one operation at a
time on an engine.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from together_train.types.adam_params import ADAM_FIELDS, adam_range_error

from . import losses as _losses
from .loss_specs import LOSS_SPECS, complete_params, required_inputs
from .lora import default_target_modules, is_lora_b, make_lora_config, quiet_peft
from .model_loading import load_causal_lm, resolve_model_dir
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
    # peft state-dict key -> parameter, found once by adapter_tensors.
    state_keys: dict[str, torch.nn.Parameter] | None = None

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
            sample boundaries and in order, into micro-batches of at most this
            many padded tokens (a single longer sample runs alone); their
            gradients accumulate, and request-wide loss normalisers (grpo) are
            computed over the whole request first, so the result equals the
            unsplit one (up to float summation order).

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

    def __init__(self, model_dir: str | os.PathLike | None, *, dtype: str = "float32",
                 device: str = "cpu", micro_batch_tokens: int = 8192) -> None:
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
        self._peft = None               # PeftModel, created with the first adapter
        self._adapters: dict[str, _Adapter] = {}
        self._counter = 0
        self._pending_delete: list[str] = []   # peft cannot delete its last adapter

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
        from peft import get_peft_model

        if adapter_id in self._adapters:
            raise ValueError(f"adapter {adapter_id!r} already exists")
        self._counter += 1
        name = f"ad{self._counter}"   # peft-safe name (no dots, not a substring of "lora_")
        config = make_lora_config(spec, self.lora_target_modules, str(self.model_dir))
        devstate = torch.random.get_rng_state()
        torch.manual_seed(int(spec.seed))
        try:
            with quiet_peft():
                if self._peft is None:
                    self._peft = get_peft_model(self._base, config, adapter_name=name)
                else:
                    self._peft.add_adapter(name, config)
        finally:
            torch.random.set_rng_state(devstate)
        a, b, names = [], [], []
        for pname, p in self._peft.named_parameters():
            if f".{name}." not in pname:
                continue
            names.append(pname)
            (b if is_lora_b(pname) else a).append(p)
        # LoRA+ (Hayou et al. 2024): only B gets lr * ratio; A and full modules
        # (lm_head copy) use lr, as in peft's create_loraplus_optimizer.
        opt = torch.optim.AdamW(
            [{"params": a, "name": "A"}, {"params": b, "name": "B"}], lr=0.0, foreach=False
        )
        self._adapters[adapter_id] = _Adapter(adapter_id, name, spec, a, b, opt, 0, names)
        self._adapters[adapter_id].rng_state = torch.Generator().manual_seed(int(spec.seed)).get_state()
        self._activate(self._adapters[adapter_id])
        self._flush_pending_deletes()
        return int(sum(p.numel() for p in a + b))

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
        for name in list(self._pending_delete):
            if not live:
                break  # keep one adapter inside peft; it is deleted after the next create
            active = self._peft.active_adapters
            if name in active:
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
        if self._peft.active_adapters != [st.name]:
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
        params, lens = self._check_forward(samples, loss_fn, loss_params)

        self._activate(st)
        batch = _losses.batch_stats([s.inputs for s in samples])
        groups = self._micro_batches(lens)
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
                g_total = self._forward_group(
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
        metrics = _losses.finalize_metrics(acc)
        metrics["loss:sum"] = total
        return ForwardOutput(
            loss=total,
            logprobs=lp_out if return_logprobs else None,
            elementwise_loss=el_out if return_elementwise else None,
            metrics=metrics,
        )

    def _check_forward(self, samples: Sequence[Sample], loss_fn: str,
                       loss_params: Mapping[str, Any] | None) -> tuple[dict[str, Any], list[int]]:
        """Validate a forward request; returns (loss params with defaults, sample lengths).

        Raises the errors listed in ``forward`` (KeyError, NotImplementedError, ValueError)
        before any state is touched. Shared with the DeepSpeed backend.
        """
        spec = LOSS_SPECS.get(loss_fn)
        if spec is None:
            raise KeyError(f"unknown loss {loss_fn!r}")
        if not spec.available:
            raise NotImplementedError(f"loss {loss_fn!r} is not available in this release")
        if not samples:
            raise ValueError("empty batch")
        params = complete_params(spec, loss_params)  # ParamError (a ValueError) naming the parameter
        needed = {i.name for i in spec.inputs if i.required} | set(required_inputs(loss_fn, params))
        lens = []
        for i, s in enumerate(samples):
            n = int(len(s.model_input))
            if n == 0:
                raise ValueError(f"sample {i}: empty model_input")
            if n > self.max_seq_len:
                raise ValueError(f"sample {i}: {n} tokens > max_seq_len {self.max_seq_len}")
            for name in sorted(needed):
                if name not in s.inputs:
                    raise ValueError(f"sample {i}: missing loss input {name!r}")
            for k, v in s.inputs.items():
                if len(v) != n:
                    raise ValueError(f"sample {i}: {k!r} has length {len(v)} != {n}")
            lens.append(n)
        return params, lens

    def _micro_batches(self, lens: Sequence[int]) -> list[list[int]]:
        """Consecutive groups of sample indices, each of padded size <= micro_batch_tokens."""
        groups: list[list[int]] = []
        cur: list[int] = []
        longest = 0
        for i, n in enumerate(lens):
            if cur and (len(cur) + 1) * max(longest, n) > self.micro_batch_tokens:
                groups.append(cur)
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, n)
        if cur:
            groups.append(cur)
        return groups

    def _forward_group(self, samples, lens, loss_fn, params, batch, backward,
                       return_logprobs, return_elementwise, acc, lp_out, el_out) -> float:
        """One micro-batch: right-padded forward, per-sample loss, backward. Returns its loss (sum)."""
        B, T = len(samples), max(lens)
        ids = torch.zeros((B, T), dtype=torch.long)
        mask = torch.zeros((B, T), dtype=torch.long)
        targets = torch.zeros((B, T), dtype=torch.long)
        for i, s in enumerate(samples):
            ids[i, : lens[i]] = torch.as_tensor(np.asarray(s.model_input, dtype=np.int64))
            targets[i, : lens[i]] = torch.as_tensor(np.asarray(s.inputs["target_tokens"], dtype=np.int64))
            mask[i, : lens[i]] = 1
        ids, mask, targets = ids.to(self.device), mask.to(self.device), targets.to(self.device)
        with torch.set_grad_enabled(backward):
            logits = self._model_logits(ids, mask).float()
            # log p(target) = logit[target] - logsumexp(logits), for the whole batch at once:
            # slicing [vocab]-wide logits per sample would make backward scatter a full-size
            # zero tensor per sample (~10% of an SFT step on SmolLM2-135M, CPU).
            lp_all = logits.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
            del logits
            total = None
            for i, s in enumerate(samples):
                n = lens[i]
                inputs = {k: torch.as_tensor(np.asarray(v)).to(self.device) for k, v in s.inputs.items()}
                lp = lp_all[i, :n]
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
    def adapter_tensors(self, adapter_id: str) -> dict[str, torch.Tensor]:
        """The adapter's weights as PEFT state-dict keys, float32 CPU copies.

        Keys are those of ``peft.get_peft_model_state_dict`` (adapter name
        stripped), e.g. ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``
        ``[r, in]``, ``...lora_B.weight`` ``[out, r]``, and
        ``base_model.model.lm_head.weight`` ``[vocab, hidden]`` with train_unembed.

        Raises:
            KeyError: unknown adapter.
        """
        from peft import get_peft_model_state_dict

        st = self._get(adapter_id)
        keys = st.state_keys if type(self) is TorchTrainerEngine else None  # DeepSpeed gathers: no cache
        if keys is None:
            sd = get_peft_model_state_dict(self._peft, adapter_name=st.name, save_embedding_layers=False)
            by_ptr = {p.data_ptr(): p for p in st.params}
            if type(self) is not TorchTrainerEngine or any(
                    by_ptr.get(v.data_ptr()) is None or by_ptr[v.data_ptr()].shape != v.shape for v in sd.values()):
                return {k: v.detach().to("cpu", torch.float32).clone() for k, v in sd.items()}
            # peft's state dict walks every module per call (~0.1 s on SmolLM2-135M): map its keys to
            # the adapter's own parameters once (the optimizer trains these same objects).
            keys = st.state_keys = {k: by_ptr[v.data_ptr()] for k, v in sd.items()}
        # One float32 buffer, the tensors back to back in key order (a weights push sends it as is).
        flat = torch.empty(sum(p.numel() for p in keys.values()), dtype=torch.float32)
        out, off = {}, 0
        for k, p in keys.items():
            out[k] = flat[off: off + p.numel()].view(p.shape)
            out[k].copy_(p.detach())
            off += p.numel()
        return out

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

    # ------------------------------------------------------------------ training checkpoints
    STATE_FORMAT = "together-train/trainer-state"
    STATE_FORMAT_VERSION = 1
    STATE_META = "trainer_state.json"
    STATE_TENSORS = "trainer_state.safetensors"

    def base_fingerprint(self) -> dict[str, Any]:
        """What identifies the frozen base model a checkpoint was trained on.

        Returns a JSON-able dict: ``model_id`` (directory name), ``architecture``,
        ``vocab_size``, ``hidden_size``, ``num_hidden_layers`` and
        ``config_sha256`` (sha256 of the model config with paths, dtype and
        library versions removed). The dtype is recorded too but is not part
        of the identity (an fp32-trained adapter may be loaded on a bf16 base).
        """
        if getattr(self, "_fingerprint", None) is None:
            cfg = self._base.config.to_dict()
            for k in ("_name_or_path", "torch_dtype", "dtype", "transformers_version", "use_cache",
                      "_attn_implementation_autoset", "_commit_hash"):
                cfg.pop(k, None)
            digest = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()
            self._fingerprint = {
                "model_id": self.model_id,
                "architecture": (cfg.get("architectures") or ["?"])[0],
                "vocab_size": self.vocab_size,
                "hidden_size": cfg.get("hidden_size"),
                "num_hidden_layers": cfg.get("num_hidden_layers"),
                "config_sha256": digest,
            }
        return dict(self._fingerprint, dtype=self.dtype)

    def _resolved_targets(self, spec: LoraConfig) -> list[str]:
        return sorted(spec.target_modules or self.lora_target_modules)

    @classmethod
    def read_state_meta(cls, state_dir: str | os.PathLike) -> dict[str, Any]:
        """The JSON metadata of a training checkpoint directory written by ``save_state``.

        Keys: ``format``, ``format_version``, ``step`` (int), ``lora`` (LoraConfig
        fields), ``base`` (``base_fingerprint()``), ``param_groups``
        (lr, betas, eps, weight_decay per group), ``params`` (names).

        Raises:
            FileNotFoundError: no ``trainer_state.json`` (not a training checkpoint).
            ValueError: not this format, or a newer format version.
        """
        meta = json.loads((Path(state_dir) / cls.STATE_META).read_text())
        if meta.get("format") != cls.STATE_FORMAT:
            raise ValueError(f"{state_dir} is not a together-train training checkpoint")
        if int(meta.get("format_version", 0)) > cls.STATE_FORMAT_VERSION:
            raise ValueError(f"{state_dir} has checkpoint format {meta['format_version']}, newer than this server's")
        return meta

    @staticmethod
    def spec_from_meta(meta: Mapping[str, Any]) -> LoraConfig:
        """The LoraConfig recorded in a training checkpoint's metadata."""
        lo = dict(meta["lora"])
        lo["target_modules"] = tuple(lo.get("target_modules") or ())
        return LoraConfig(**lo)

    def state_differences(self, meta: Mapping[str, Any], spec: LoraConfig | None = None) -> list[str]:
        """Why a checkpoint cannot be loaded here: base model or LoRA shape differences.

        Args:
            meta: ``read_state_meta`` of the checkpoint.
            spec: the receiving adapter's spec (None: check the base model only).

        Returns:
            Human-readable differences, e.g. ``"LoRA rank: checkpoint 4, session 8"``;
            empty when compatible. The base must match in model id and config;
            the LoRA shape in rank, alpha, target modules (resolved: empty =
            all linear layers) and train_unembed. Dropout and seed may differ.
        """
        diffs = []
        mine, theirs = self.base_fingerprint(), dict(meta.get("base") or {})
        for key in ("model_id", "architecture", "vocab_size", "hidden_size", "num_hidden_layers"):
            if theirs.get(key) != mine.get(key):
                diffs.append(f"base model {key}: checkpoint {theirs.get(key)!r}, this resource {mine.get(key)!r}")
        if not diffs and theirs.get("config_sha256") != mine.get("config_sha256"):
            diffs.append("base model config: the checkpoint's model config differs from this resource's "
                         f"(model_id {mine['model_id']!r})")
        if spec is not None:
            ck = self.spec_from_meta(meta)
            pairs = [
                ("rank", int(ck.rank), int(spec.rank)),
                ("alpha", float(ck.alpha), float(spec.alpha)),
                ("target_modules", self._resolved_targets(ck), self._resolved_targets(spec)),
                ("train_unembed", bool(ck.train_unembed), bool(spec.train_unembed)),
            ]
            for key, a, b in pairs:
                if a != b:
                    diffs.append(f"LoRA {key}: checkpoint {a!r}, session {b!r}")
        return diffs

    def _state_names(self, st: _Adapter) -> list[str]:
        """Adapter parameter names without the internal adapter name, aligned with ``st.params``."""
        by_id = {id(p): n for n, p in self.trainable_parameters(st.adapter_id).items()}
        return [by_id[id(p)].replace(f".{st.name}.", ".") for p in st.params]

    def save_state(self, adapter_id: str, out_dir: str | os.PathLike) -> Path:
        """Write a training checkpoint of the adapter into ``out_dir``.

        Files:
          - ``adapter_config.json``, ``adapter_model.safetensors``: the PEFT
            adapter (as ``save_adapter``; the directory loads with peft too).
          - ``trainer_state.safetensors``: ``param::<name>`` the live adapter
            parameters in their own dtype (float32 A/B), ``opt::<name>::<key>``
            AdamW state (``step`` float32 [], ``exp_avg``/``exp_avg_sq`` shaped
            like the parameter), ``rng::torch_cpu`` uint8 RNG state.
          - ``trainer_state.json``: step, LoRA spec, ``base_fingerprint()``,
            optimizer param-group hyper-parameters, parameter names.

        Accumulated gradients are not saved.

        Raises:
            KeyError: unknown adapter.
        """
        from dataclasses import asdict

        from safetensors.torch import save_file

        st = self._get(adapter_id)
        out = Path(out_dir)
        self.save_adapter(adapter_id, out)
        names = self._state_names(st)
        sd = self._optimizer_state_dict(st)
        tensors: dict[str, torch.Tensor] = {}
        for idx, (name, p) in enumerate(zip(names, st.params)):
            tensors[f"param::{name}"] = p.detach().to("cpu").clone().contiguous()
            for k, v in sd["state"].get(idx, {}).items():
                if torch.is_tensor(v):
                    tensors[f"opt::{name}::{k}"] = v.detach().to("cpu").clone().contiguous()
        if st.rng_state is not None:
            tensors["rng::torch_cpu"] = st.rng_state.clone()
        save_file(tensors, str(out / self.STATE_TENSORS), metadata={"format": "pt"})
        groups = []
        for g in sd["param_groups"]:
            groups.append({"name": g.get("name"), "lr": float(g["lr"]), "betas": [float(b) for b in g["betas"]],
                           "eps": float(g["eps"]), "weight_decay": float(g["weight_decay"])})
        spec = asdict(st.spec)
        spec["target_modules"] = list(st.spec.target_modules)
        meta = {
            "format": self.STATE_FORMAT,
            "format_version": self.STATE_FORMAT_VERSION,
            "step": int(st.step),
            "lora": spec,
            "base": self.base_fingerprint(),
            "param_groups": groups,
            "params": names,
        }
        (out / self.STATE_META).write_text(json.dumps(meta, indent=1))
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
        from safetensors.torch import load_file

        st = self._get(adapter_id)
        d = Path(state_dir)
        meta = self.read_state_meta(d)
        diffs = self.state_differences(meta, st.spec)
        if diffs:
            raise ValueError("checkpoint does not fit this adapter: " + "; ".join(diffs))
        tensors = load_file(str(d / self.STATE_TENSORS))
        names = self._state_names(st)
        for name, p in zip(names, st.params):
            t = tensors.get(f"param::{name}")
            if t is None:
                raise ValueError(f"checkpoint has no tensor for parameter {name}")
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"checkpoint tensor {name} has shape {tuple(t.shape)}, the adapter {tuple(p.shape)}")
        extra = {k.split("::", 1)[1] for k in tensors if k.startswith("param::")} - set(names)
        if extra:
            raise ValueError(f"checkpoint holds parameters this adapter lacks: {sorted(extra)[:3]}")
        new_opt = None
        if with_optimizer:
            live = st.optimizer.state_dict()
            state: dict[int, dict[str, torch.Tensor]] = {}
            for idx, name in enumerate(names):
                prefix = f"opt::{name}::"
                entry = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
                if entry:
                    state[idx] = entry
            saved_groups = meta.get("param_groups") or []
            groups = []
            for i, g in enumerate(live["param_groups"]):
                g = dict(g)
                if i < len(saved_groups):
                    sg = saved_groups[i]
                    g.update(lr=sg["lr"], betas=tuple(sg["betas"]), eps=sg["eps"], weight_decay=sg["weight_decay"])
                groups.append(g)
            new_opt = {"state": state, "param_groups": groups}
        with torch.no_grad():
            for name, p in zip(names, st.params):
                p.copy_(tensors[f"param::{name}"].to(p.device, p.dtype))
                p.grad = None
        if new_opt is not None:
            self._load_optimizer_state_dict(st, new_opt)
            if "rng::torch_cpu" in tensors:
                st.rng_state = tensors["rng::torch_cpu"].clone()
        else:
            self._reset_optimizer(st)
        st.step = int(meta["step"])
        return st.step

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
        from peft.tuners.lora import LoraLayer

        st = self._get(adapter_id)
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        merged, _ = load_causal_lm(self.model_dir, dtype=self.dtype, device="cpu")
        targets = dict(merged.named_modules())
        inner = self._peft.base_model.model
        with torch.no_grad():
            for name, mod in inner.named_modules():
                if isinstance(mod, LoraLayer) and st.name in getattr(mod, "lora_A", {}):
                    w = targets[name].weight
                    delta = mod.get_delta_weight(st.name).detach().to("cpu", torch.float32)
                    w.copy_((w.float() + delta).to(w.dtype))
            if st.spec.train_unembed:
                wrapper = None
                for mod in inner.modules():
                    if hasattr(mod, "modules_to_save") and st.name in getattr(mod, "modules_to_save", {}):
                        wrapper = mod
                if wrapper is not None:
                    head = wrapper.modules_to_save[st.name].weight.detach().to("cpu").clone()
                    out_emb = merged.get_output_embeddings()
                    out_emb.weight = torch.nn.Parameter(head.to(out_emb.weight.dtype), requires_grad=False)
                    merged.config.tie_word_embeddings = False
                    text_cfg = getattr(merged.config, "get_text_config", lambda: None)()
                    if text_cfg is not None:
                        text_cfg.tie_word_embeddings = False
        merged.save_pretrained(str(out), safe_serialization=True)
        self.tokenizer.save_pretrained(str(out))
        template = getattr(self.tokenizer, "chat_template", None)
        if template and not (out / "chat_template.jinja").exists():
            (out / "chat_template.jinja").write_text(template)
        del merged
        return out
