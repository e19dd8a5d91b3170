"""ZeRO-3 partitioned model loading: no rank ever holds the whole model, on the host or the device.

`load_partitioned_lm` builds the model with transformers' DeepSpeed
integration (``from_config`` while an ``HfDeepSpeedConfig`` of stage 3 is
alive: constructed under ``deepspeed.zero.Init``, each parameter partitioned
onto this rank's device as it is created; weight initialisation skipped), then
copies the safetensors checkpoint in one module at a time:
``GatheredParameters(modifier_rank=0)`` gathers the module's parameters, rank
0 reads their tensors (one at a time) from the files and copies them in, and
leaving the context partitions them again. Peak memory per rank: its
partition plus one gathered module and one checkpoint tensor. Tied weights are
tied at construction (the tied ``lm_head`` is the embedding's parameter,
loaded once); buffers (RoPE frequencies) are computed at construction, and a
buffer the checkpoint holds is read by every rank. When a parameter has no
tensor of its name in ``*.safetensors`` (renamed keys, other formats) it falls
back to transformers' own ZeRO-3 ``from_pretrained``, which handles them but
reads the whole checkpoint into rank 0's host memory.

`reload_full_weights` puts a full-mode model's weights back to the
checkpoint's (a new full-mode session starts from the base), also one tensor
at a time.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from ..model_loading import load_causal_lm, torch_dtype
from .errors import FullModeError

__all__ = ["load_partitioned_lm", "reload_full_weights", "zero3_loading"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def zero3_loading(dtype: str, ds_config: Mapping[str, Any]) -> Iterator[Any]:
    """Context: transformers' ``from_config`` / ``from_pretrained`` inside it build the model partitioned.

    transformers' DeepSpeed integration: while an ``HfDeepSpeedConfig`` with
    stage 3 is alive, they construct the model under ``deepspeed.zero.Init``
    (every parameter is partitioned as it is created, on this rank's device) and
    tie weights afterwards; ``from_pretrained`` then loads its checkpoint module
    by module (``GatheredParameters``, modifier rank 0) after reading the whole
    checkpoint on rank 0 (the fallback of `load_partitioned_lm`). The zero.Init
    dtype follows the model dtype (``bf16``/``fp16`` ``enabled`` in the loading
    config only): it would otherwise cast a bfloat16 base to float32 in LoRA
    mode. The config object is dropped on exit, so later transformers/peft
    calls see no DeepSpeed config, as before.
    """
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    td = torch_dtype(dtype)
    cfg = dict(ds_config)
    cfg["bf16"] = {"enabled": td == torch.bfloat16}
    cfg["fp16"] = {"enabled": td == torch.float16}
    hf_cfg = HfDeepSpeedConfig(cfg)   # referenced (weakly) by transformers while alive
    try:
        yield hf_cfg
    finally:
        unset_hf_deepspeed_config()
        del hf_cfg


def load_partitioned_lm(path: Path, dtype: str, device: str, rank: int, ds_config: Mapping[str, Any]):
    """``(model, tokenizer)`` of ``path`` built and loaded ZeRO-3 partitioned (see the module docstring).

    Collective: every rank calls it. The model is frozen (``requires_grad`` False) and in eval mode.

    Raises:
        ValueError: a checkpoint tensor's shape differs from the model's (checked on every rank
            before any collective, so no rank is left waiting).
    """
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.initialization import no_init_weights

    where: dict[str, Path] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                where[k], shapes[k] = f, tuple(h.get_slice(k).get_shape())
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    with zero3_loading(dtype, ds_config):
        with no_init_weights():   # every weight comes from the checkpoint below
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dtype))
        params = dict(model.named_parameters())   # a tied weight once
        if any(n not in where for n in params):
            del model
            log.info("ZeRO-3: %s has parameter names outside its safetensors; loading through "
                     "transformers' from_pretrained (rank 0 reads the whole checkpoint)", path)
            return load_causal_lm(path, dtype=dtype, device=device)
    bad = [f"{n}: checkpoint {shapes[n]}, model {tuple(p.ds_shape)}" for n, p in params.items()
           if shapes[n] != tuple(p.ds_shape)]
    if bad:
        raise ValueError(f"{path}: checkpoint shapes do not fit the model: {'; '.join(bad[:3])}")
    _copy_partitioned(model, where, rank)
    with contextlib.suppress(OSError, ValueError):
        model.generation_config = GenerationConfig.from_pretrained(str(path), local_files_only=True)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _copy_partitioned(model: torch.nn.Module, where: Mapping[str, Path], rank: int) -> None:
    """Copy checkpoint tensors into a ZeRO-3 model, one module's parameters gathered at a time."""
    import deepspeed
    from safetensors import safe_open

    def copy(dst: torch.Tensor, name: str) -> None:
        # safetensors maps the file and get_tensor is a view of it: the pages copied from stay
        # in this process's RSS while the file is open, so it is opened per tensor.
        with safe_open(str(where[name]), framework="pt") as h:
            dst.copy_(h.get_tensor(name))

    seen: set[int] = set()
    with torch.no_grad():
        for prefix, mod in model.named_modules():   # the same order on every rank
            pre = prefix + "." if prefix else ""
            own = [(pre + n, p) for n, p in mod.named_parameters(recurse=False) if id(p) not in seen]
            seen.update(id(p) for _, p in own)
            if own:
                with deepspeed.zero.GatheredParameters([p for _, p in own], modifier_rank=0):
                    if rank == 0:
                        for name, p in own:
                            copy(p.data, name)
            for n, buf in mod.named_buffers(recurse=False):
                if buf is not None and pre + n in where:
                    copy(buf, pre + n)


def reload_full_weights(model: torch.nn.Module, model_dir: Path, device: torch.device, rank: int) -> None:
    """Every weight of a full-mode model (and ZeRO's fp32 master copy) back to ``model_dir``'s. Collective.

    Raises:
        FullModeError: the directory has no safetensors, or a parameter is not in them (restart
            the resource to start a new full-mode session).
    """
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FullModeError(f"{model_dir} has no *.safetensors to restore the base weights from; "
                            "restart the resource to start a new full-mode session")
    where = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            where.update({k: f for k in h.keys()})
    for name, p in model.named_parameters():
        if name not in where:
            raise FullModeError(f"{name} is not in {model_dir}'s safetensors; restart the resource "
                                "to start a new full-mode session")
        with safe_open(str(where[name]), framework="pt") as h:
            t = h.get_tensor(name).to(device)
        # ZeRO keeps an fp32 master copy apart from the model's weights: set both.
        if hasattr(p, "ds_id"):
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                if rank == 0:
                    p.data.copy_(t)
        else:
            with torch.no_grad():
                p.data.copy_(t)
        safe_set_full_fp32_param(p, t.to(torch.float32))
