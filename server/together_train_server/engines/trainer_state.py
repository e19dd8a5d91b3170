"""The training-checkpoint format (``save_state`` / ``load_state``) of the trainer engines.

A training checkpoint directory holds the PEFT adapter (``adapter_config.json``,
``adapter_model.safetensors``; written by the engine's ``save_adapter``) and:

- ``trainer_state.safetensors``: ``param::<name>`` the live adapter parameters
  in their own dtype (float32 A/B), ``opt::<name>::<key>`` their AdamW state
  (``step`` float32 ``[]``, ``exp_avg`` / ``exp_avg_sq`` shaped like the
  parameter), ``rng::torch_cpu`` the session's uint8 RNG state;
- ``trainer_state.json``: ``format``, ``format_version``, ``step``, ``lora``
  (LoraConfig fields), ``base`` (`base_fingerprint`), ``param_groups`` (lr,
  betas, eps, weight_decay per group), ``params`` (names). A full-mode
  DeepSpeed checkpoint adds ``mode``, ``zero_stage``, ``world_size`` and keeps
  its tensors in DeepSpeed's own ``zero/`` directory.

``<name>`` is the peft parameter name without the internal adapter name, so a
checkpoint loads into any session of the same shape, on either backend.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from .types import LoraConfig

__all__ = ["STATE_FORMAT", "STATE_FORMAT_VERSION", "STATE_META", "STATE_TENSORS", "base_fingerprint",
           "read_state_meta", "spec_from_meta", "state_differences", "param_groups_meta", "write_state",
           "read_state"]

STATE_FORMAT = "together-train/trainer-state"
STATE_FORMAT_VERSION = 1
STATE_META = "trainer_state.json"
STATE_TENSORS = "trainer_state.safetensors"
RNG_KEY = "rng::torch_cpu"


def base_fingerprint(config: Mapping[str, Any], model_id: str, vocab_size: int) -> dict[str, Any]:
    """What identifies the frozen base model a checkpoint was trained on (JSON-able).

    Args:
        config: the model config as a dict (``PretrainedConfig.to_dict()``).

    Returns:
        ``model_id`` (directory name), ``architecture``, ``vocab_size``, ``hidden_size``,
        ``num_hidden_layers`` and ``config_sha256`` (sha256 of the config without paths,
        dtype and library versions). The engine adds ``dtype``, which is not part of the
        identity (an fp32-trained adapter may be loaded on a bf16 base).
    """
    cfg = dict(config)
    for k in ("_name_or_path", "torch_dtype", "dtype", "transformers_version", "use_cache",
              "_attn_implementation_autoset", "_commit_hash"):
        cfg.pop(k, None)
    digest = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()
    return {
        "model_id": model_id,
        "architecture": (cfg.get("architectures") or ["?"])[0],
        "vocab_size": vocab_size,
        "hidden_size": cfg.get("hidden_size"),
        "num_hidden_layers": cfg.get("num_hidden_layers"),
        "config_sha256": digest,
    }


def read_state_meta(state_dir: str | os.PathLike) -> dict[str, Any]:
    """The JSON metadata of a training checkpoint directory (keys: see the module docstring).

    Raises:
        FileNotFoundError: no ``trainer_state.json`` (not a training checkpoint).
        ValueError: not this format, or a newer format version.
    """
    meta = json.loads((Path(state_dir) / STATE_META).read_text())
    if meta.get("format") != STATE_FORMAT:
        raise ValueError(f"{state_dir} is not a together-train training checkpoint")
    if int(meta.get("format_version", 0)) > STATE_FORMAT_VERSION:
        raise ValueError(f"{state_dir} has checkpoint format {meta['format_version']}, newer than this server's")
    return meta


def spec_from_meta(meta: Mapping[str, Any]) -> LoraConfig:
    """The LoraConfig recorded in a training checkpoint's metadata."""
    lo = dict(meta["lora"])
    lo["target_modules"] = tuple(lo.get("target_modules") or ())
    return LoraConfig(**lo)


def state_differences(meta: Mapping[str, Any], mine: Mapping[str, Any], spec: LoraConfig | None,
                      resolve_targets: Callable[[LoraConfig], list[str]]) -> list[str]:
    """Why a checkpoint cannot be loaded here: base model or LoRA shape differences.

    Args:
        meta: `read_state_meta` of the checkpoint; mine: this engine's base fingerprint.
        spec: the receiving adapter's spec (None: check the base model only).
        resolve_targets: a spec's target modules as trained (empty = the model's default set).

    Returns:
        Human-readable differences, e.g. ``"LoRA rank: checkpoint 4, session 8"``; empty
        when compatible. The base must match in model id and config; the LoRA shape in
        rank, alpha, resolved target modules and train_unembed. Dropout and seed may differ.
    """
    diffs = []
    theirs = dict(meta.get("base") or {})
    for key in ("model_id", "architecture", "vocab_size", "hidden_size", "num_hidden_layers"):
        if theirs.get(key) != mine.get(key):
            diffs.append(f"base model {key}: checkpoint {theirs.get(key)!r}, this resource {mine.get(key)!r}")
    if not diffs and theirs.get("config_sha256") != mine.get("config_sha256"):
        diffs.append("base model config: the checkpoint's model config differs from this resource's "
                     f"(model_id {mine['model_id']!r})")
    if spec is not None:
        ck = spec_from_meta(meta)
        pairs = [
            ("rank", int(ck.rank), int(spec.rank)),
            ("alpha", float(ck.alpha), float(spec.alpha)),
            ("target_modules", resolve_targets(ck), resolve_targets(spec)),
            ("train_unembed", bool(ck.train_unembed), bool(spec.train_unembed)),
        ]
        for key, a, b in pairs:
            if a != b:
                diffs.append(f"LoRA {key}: checkpoint {a!r}, session {b!r}")
    return diffs


def spec_meta(spec: LoraConfig) -> dict[str, Any]:
    """``spec`` as the JSON ``lora`` entry."""
    out = asdict(spec)
    out["target_modules"] = list(spec.target_modules)
    return out


def param_groups_meta(groups: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The optimizer param groups' hyper-parameters as the JSON ``param_groups`` entry."""
    return [{"name": g.get("name"), "lr": float(g["lr"]), "betas": [float(b) for b in g["betas"]],
             "eps": float(g["eps"]), "weight_decay": float(g["weight_decay"])} for g in groups]


def write_state(out: Path, names: Sequence[str], params: Sequence[torch.Tensor], optimizer_sd: Mapping[str, Any],
                rng_state: torch.Tensor | None, spec: LoraConfig, step: int, base: Mapping[str, Any]) -> None:
    """Write ``trainer_state.safetensors`` and ``trainer_state.json`` into ``out``.

    Args:
        names / params: the adapter's parameters and their checkpoint names (aligned).
        optimizer_sd: an AdamW ``state_dict()`` whose ``state`` is indexed like ``params``.
        rng_state: the session's torch CPU RNG state (uint8), or None.
        base: the base fingerprint (with dtype).
    """
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for idx, (name, p) in enumerate(zip(names, params)):
        tensors[f"param::{name}"] = p.detach().to("cpu").clone().contiguous()
        for k, v in optimizer_sd["state"].get(idx, {}).items():
            if torch.is_tensor(v):
                tensors[f"opt::{name}::{k}"] = v.detach().to("cpu").clone().contiguous()
    if rng_state is not None:
        tensors[RNG_KEY] = rng_state.clone()
    save_file(tensors, str(out / STATE_TENSORS), metadata={"format": "pt"})
    meta = {
        "format": STATE_FORMAT,
        "format_version": STATE_FORMAT_VERSION,
        "step": int(step),
        "lora": spec_meta(spec),
        "base": dict(base),
        "param_groups": param_groups_meta(optimizer_sd["param_groups"]),
        "params": list(names),
    }
    (out / STATE_META).write_text(json.dumps(meta, indent=1))


def read_state(state_dir: Path, meta: Mapping[str, Any], names: Sequence[str], params: Sequence[torch.Tensor],
               live_groups: Sequence[Mapping[str, Any]] | None
               ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None, torch.Tensor | None]:
    """Read and check a checkpoint's tensors against the receiving adapter; touches nothing.

    Args:
        names / params: the adapter's parameters and their checkpoint names (aligned).
        live_groups: the adapter's AdamW ``param_groups`` to restore the optimizer into, or
            None (without optimizer).

    Returns:
        ``(weights by name, optimizer state_dict or None, RNG state or None)``; the
        state_dict's ``state`` is indexed like ``params``, its groups are ``live_groups``
        with the saved hyper-parameters.

    Raises:
        ValueError: a parameter missing, mis-shaped, or one the adapter lacks.
    """
    from safetensors.torch import load_file

    tensors = load_file(str(state_dir / STATE_TENSORS))
    for name, p in zip(names, params):
        t = tensors.get(f"param::{name}")
        if t is None:
            raise ValueError(f"checkpoint has no tensor for parameter {name}")
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"checkpoint tensor {name} has shape {tuple(t.shape)}, the adapter {tuple(p.shape)}")
    extra = {k.split("::", 1)[1] for k in tensors if k.startswith("param::")} - set(names)
    if extra:
        raise ValueError(f"checkpoint holds parameters this adapter lacks: {sorted(extra)[:3]}")
    weights = {name: tensors[f"param::{name}"] for name in names}
    if live_groups is None:
        return weights, None, None
    state: dict[int, dict[str, torch.Tensor]] = {}
    for idx, name in enumerate(names):
        prefix = f"opt::{name}::"
        entry = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        if entry:
            state[idx] = entry
    saved_groups = meta.get("param_groups") or []
    groups = []
    for i, g in enumerate(live_groups):
        g = dict(g)
        if i < len(saved_groups):
            sg = saved_groups[i]
            g.update(lr=sg["lr"], betas=tuple(sg["betas"]), eps=sg["eps"], weight_decay=sg["weight_decay"])
        groups.append(g)
    rng = tensors[RNG_KEY].clone() if RNG_KEY in tensors else None
    return weights, {"state": state, "param_groups": groups}, rng
