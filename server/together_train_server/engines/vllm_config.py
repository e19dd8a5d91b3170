"""``vllm.EngineArgs`` for the vLLM generator engine, computed without importing vllm.

`engine_args_kwargs` is pure (tests check the flags it sets without vLLM);
`config_overrides` holds the fixes a model directory needs before vLLM loads it.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["config_overrides", "engine_args_kwargs", "vllm_available"]


def vllm_available() -> bool:
    """True when ``import vllm`` would succeed (checked without importing it)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None



def engine_args_kwargs(
    path: str | os.PathLike,
    *,
    dtype: str,
    device: str,
    seed: int,
    max_model_len: int,
    max_num_seqs: int,
    enforce_eager: bool | None,
    max_loras: int,
    max_lora_rank: int,
    max_cpu_loras: int | None,
    gpu_memory_utilization: float,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The keyword arguments of ``vllm.EngineArgs`` for :class:`VllmGeneratorEngine` (pure; no vllm import).

    ``enforce_eager=None`` becomes ``device == "cpu"`` (CUDA graphs on a GPU);
    ``max_cpu_loras=None`` becomes ``max(max_loras, 16)``;
    ``gpu_memory_utilization`` is passed only off CPU. ``extra`` (engine
    kwargs and config fixes) is merged last.

    Raises:
        ValueError: ``max_loras < 1`` or ``gpu_memory_utilization`` outside (0, 1].
    """
    if int(max_loras) < 1:
        raise ValueError(f"max_loras must be >= 1, got {max_loras}")
    if not 0.0 < float(gpu_memory_utilization) <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    eager = (str(device) == "cpu") if enforce_eager is None else bool(enforce_eager)
    return dict(
        model=str(path),
        tokenizer=str(path),
        dtype=dtype,
        seed=seed,
        max_model_len=int(max_model_len),
        max_num_seqs=int(max_num_seqs),
        enforce_eager=eager,
        enable_prefix_caching=True,
        enable_lora=True,
        max_loras=int(max_loras),
        max_lora_rank=int(max_lora_rank),
        max_cpu_loras=int(max_cpu_loras or max(int(max_loras), 16)),
        logprobs_mode="processed_logprobs",
        # EOS is the engine's business (see module doc), not vLLM's defaults.
        generation_config="vllm",
        # Token-id prompts only; no chat/MM preprocessing.
        skip_tokenizer_init=False,
        **({"gpu_memory_utilization": float(gpu_memory_utilization)} if device != "cpu" else {}),
        **(extra or {}),
    )



def config_overrides(hf_config: Any, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``engine_kwargs`` plus the config fixes vLLM needs for a model of ``hf_config``.

    The embedded model's directory is converted from a GGUF file: its
    weights are plain dequantized safetensors, but transformers leaves
    ``quantization_config: {quant_method: gguf}`` in config.json, which
    vLLM refuses ("Unknown quantization method: gguf"). It is dropped
    through ``hf_overrides`` (the directory itself is not rewritten).
    """
    kwargs = dict(engine_kwargs)
    qc = getattr(hf_config, "quantization_config", None)
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    if str(method).lower() == "gguf" and "hf_overrides" not in kwargs:
        kwargs["hf_overrides"] = {"quantization_config": None}
    return kwargs
