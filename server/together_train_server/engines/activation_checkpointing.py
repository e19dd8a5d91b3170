"""Activation checkpointing of a transformers model's decoder layers, switched per micro-batch.

Without it backward keeps every decoder layer's intermediate activations
(attention projections, MLP gate/up products, norms: on SmolLM2-135M about
1.3 MB per token over its 30 layers in float32). With it each layer's forward
runs inside ``torch.utils.checkpoint`` (non-reentrant, Chen et al. 2016,
arXiv:1604.06174): only the layer's input is kept (``hidden_size`` floats per
token per layer) and backward recomputes the layer, costing about one more
forward of the decoder. The RNG state is saved and restored around the
recomputation (torch's ``preserve_rng_state``), so LoRA dropout draws the same
masks: values and gradients are those without checkpointing.

Selective recomputation (Korthikanti et al. 2022, arXiv:2205.05198, section 4):
the attention kernel's outputs (``scaled_dot_product_attention``: the
``[B, heads, T, head_dim]`` output and its logsumexp) are saved too, so the
recomputation redoes only the projections, norms and MLP, whose cost grows
linearly with T, not the attention, which grows as T^2 and is most of a long
forward (SmolLM2, 4K positions: ~1.2 of 2.0 TFLOP). Saving it costs
``hidden_size`` floats per token per layer more (SmolLM2, 8K tokens: ~570 MB);
SmolLM2 2K tokens, one forward_backward: 35.5 s -> 29.3 s, peak 304 -> 445 MB
above the process (2 idle cores). The saved tensors are what the recomputation
would produce (same op, same inputs): values and gradients are unchanged.

transformers' own ``gradient_checkpointing_enable`` applies only in training
mode, and the trainer runs its forwards in eval mode (deterministic) unless a
session has LoRA dropout; so the layers' ``forward`` is wrapped per instance
here, with a switch the engine sets for each micro-batch. Non-reentrant
checkpointing needs no input that requires grad (frozen embeddings + peft work
as is) and lets module hooks (peft's, DeepSpeed ZeRO-3's parameter gathering)
run again during the recomputation.

Modes (``serve --activation-checkpointing``): ``on``, ``off``, or ``auto``:
on for a backward micro-batch of at least ``AUTO_MIN_TOKENS`` padded tokens
(``batch x longest sample``), where the saved activations outweigh what the
recomputation costs (measured on SmolLM2-135M, 2 CPU cores: docs/operating.md).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["MODES", "AUTO_MIN_TOKENS", "LayerCheckpointing", "decoder_layers"]

MODES = ("auto", "on", "off")
AUTO_MIN_TOKENS = 2048

# The attention kernels whose outputs checkpointed layers keep (selective recomputation, module docstring):
# torch's scaled_dot_product_attention lowers to one of these on CPU / CUDA.
SAVED_OPS = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    if hasattr(torch.ops.aten, name))


def _keep_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective() -> Any:
    return create_selective_checkpoint_contexts(_keep_attention)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a transformers model (``GradientCheckpointingLayer`` instances, or the
    classes named in ``_no_split_modules``), outermost first in module order."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover - older transformers
        GradientCheckpointingLayer = ()
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules()
             if (GradientCheckpointingLayer and isinstance(m, GradientCheckpointingLayer))
             or type(m).__name__ in names]
    # Keep only the outermost ones (a layer class may nest another).
    inner = {id(c) for m in found for c in m.modules() if c is not m}
    return [m for m in found if id(m) not in inner]


class LayerCheckpointing:
    """Wraps every decoder layer's ``forward`` of ``model`` once; ``enabled`` switches checkpointing.

    Args:
        model: the base transformers model (before or after peft wraps it:
            peft injects into the layers' linear modules, not the layers).
        mode: ``"auto"``, ``"on"`` or ``"off"`` (see module docstring).
        auto_min_tokens: the ``auto`` threshold in padded tokens per micro-batch.

    Raises:
        ValueError: unknown mode.
    """

    def __init__(self, model: torch.nn.Module, mode: str = "auto", auto_min_tokens: int = AUTO_MIN_TOKENS) -> None:
        if mode not in MODES:
            raise ValueError(f"activation checkpointing must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.auto_min_tokens = int(auto_min_tokens)
        self.enabled = False
        self.layers = decoder_layers(model)
        for layer in self.layers:
            layer.forward = self._wrap(layer.forward)

    def _wrap(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        def checkpointed(*args: Any, **kwargs: Any) -> Any:
            if self.enabled and torch.is_grad_enabled():
                return checkpoint(forward, *args, use_reentrant=False, context_fn=_selective, **kwargs)
            return forward(*args, **kwargs)

        return checkpointed

    def wanted(self, padded_tokens: int, backward: bool) -> bool:
        """Whether a micro-batch of ``padded_tokens`` (``B x T``) checkpoints under this mode."""
        if not backward or self.mode == "off":
            return False
        return self.mode == "on" or padded_tokens >= self.auto_min_tokens
