"""Export a session as a standard Hugging Face model directory (``save_weights(merged=True)``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from .model_loading import load_causal_lm

__all__ = ["write_merged_lora", "write_model_dir"]


def write_model_dir(model: torch.nn.Module, tokenizer: Any, out: Path,
                    state_dict: Mapping[str, torch.Tensor] | None = None) -> Path:
    """``model.save_pretrained`` (safetensors; ``state_dict`` instead of the model's own when given),
    the tokenizer files and ``chat_template.jinja`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    template = getattr(tokenizer, "chat_template", None)
    if template and not (out / "chat_template.jinja").exists():
        (out / "chat_template.jinja").write_text(template)
    return out


def write_merged_lora(peft_model: Any, adapter_name: str, train_unembed: bool, model_dir: Path, dtype: str,
                      tokenizer: Any, out: Path) -> Path:
    """The base (a fresh copy from ``model_dir``) with one adapter of ``peft_model`` merged in, written to ``out``.

    For every LoRA layer of the adapter ``W' = W + scaling * (B @ A)``, computed in
    float32 by peft's ``get_delta_weight`` and cast to the base dtype. With
    ``train_unembed`` the trained ``lm_head`` copy replaces the output projection and
    the embeddings are untied (``tie_word_embeddings = False``; the input embedding
    stays the base's). The shared frozen base is never modified (the copy needs one
    extra model's memory while it runs).
    """
    from peft.tuners.lora import LoraLayer

    merged, _ = load_causal_lm(model_dir, dtype=dtype, device="cpu")
    targets = dict(merged.named_modules())
    inner = peft_model.base_model.model
    with torch.no_grad():
        for name, mod in inner.named_modules():
            if isinstance(mod, LoraLayer) and adapter_name in getattr(mod, "lora_A", {}):
                w = targets[name].weight
                delta = mod.get_delta_weight(adapter_name).detach().to("cpu", torch.float32)
                w.copy_((w.float() + delta).to(w.dtype))
        if train_unembed:
            wrapper = None
            for mod in inner.modules():
                if hasattr(mod, "modules_to_save") and adapter_name in getattr(mod, "modules_to_save", {}):
                    wrapper = mod
            if wrapper is not None:
                head = wrapper.modules_to_save[adapter_name].weight.detach().to("cpu").clone()
                out_emb = merged.get_output_embeddings()
                out_emb.weight = torch.nn.Parameter(head.to(out_emb.weight.dtype), requires_grad=False)
                merged.config.tie_word_embeddings = False
                text_cfg = getattr(merged.config, "get_text_config", lambda: None)()
                if text_cfg is not None:
                    text_cfg.tie_word_embeddings = False
    write_model_dir(merged, tokenizer, out)
    del merged
    return out
