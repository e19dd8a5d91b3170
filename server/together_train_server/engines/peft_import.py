"""Read, check and convert a PEFT LoRA adapter trained elsewhere (``adapter_config.json`` +
``adapter_model.safetensors``) into this server's checkpoint formats (engines/trainer_state.py).

`check_adapter` reads nothing but the two files and the base model's config: the base's linear layers and
their shapes come from the model built on the ``meta`` device (`base_linears`: no weights, no memory).
Every problem is an `AdapterProblem` naming the file and, where there is one, the tensor:

- ``adapter_config.json``: unreadable JSON, not ``peft_type`` LORA, a base model other than this
  resource's, settings this trainer cannot reproduce (``use_rslora``, ``use_dora``, ``rank_pattern``,
  ``alpha_pattern``, ``layers_to_transform``, a bias, ``modules_to_save``, target modules as a regex),
  a target module the base does not have, a rank out of range;
- ``adapter_model.safetensors``: unreadable, a key not in PEFT's LoRA layout (``<base_model.model.>
  <module path>.lora_A|lora_B.weight``), a non-float dtype, a shape that disagrees with the rank or the
  base layer (A ``[r, in]``, B ``[out, r]``), NaN/inf, a target layer without its A or B.

The scaling is peft's ``lora_alpha / r`` (Hu et al. 2021), the same as this trainer's LoRA layers.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from .lora import default_target_modules, make_lora_config
from .trainer_state import STATE_FORMAT, STATE_FORMAT_VERSION, STATE_META, STATE_TENSORS, spec_meta
from .types import LoraConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<ab>lora_A|lora_B)(?:\.[A-Za-z0-9_-]+)?\.weight$")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Config settings whose non-default value changes what the adapter computes (this trainer has none of them).
_UNSUPPORTED = {"use_rslora": False, "use_dora": False, "rank_pattern": {}, "alpha_pattern": {},
                "layers_to_transform": None, "layers_pattern": None, "bias": "none", "modules_to_save": None,
                "fan_in_fan_out": False}


class AdapterProblem(ValueError):
    """Why an adapter cannot be imported.

    Attributes:
        file: the adapter file at fault (``adapter_config.json`` / ``adapter_model.safetensors``).
        tensor: the tensor key at fault, or "".
    """

    def __init__(self, file: str, message: str, tensor: str = "") -> None:
        where = f"{file}" + (f", tensor {tensor}" if tensor else "")
        super().__init__(f"{where}: {message}")
        self.file, self.tensor = file, tensor


@dataclass(frozen=True)
class CheckedAdapter:
    """An adapter that passed `check_adapter`.

    Attributes:
        spec: its LoRA shape (rank, alpha, dropout, target modules as named in its config).
        tensors: float32 CPU tensors under PEFT state-dict keys
            ``base_model.model.<module path>.lora_A.weight`` ``[r, in]`` / ``...lora_B.weight`` ``[out, r]``.
    """

    spec: LoraConfig
    tensors: dict[str, torch.Tensor]


@functools.lru_cache(maxsize=4)
def base_linears(model_dir: str) -> dict[str, tuple[int, int]]:
    """The base model's linear layers inside its blocks: module path -> (out_features, in_features).

    Built from ``config.json`` on the ``meta`` device (no weights are read or allocated).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    targets = set(default_target_modules(model))
    return {name: (int(m.out_features), int(m.in_features)) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets}


def _read_config(src: Path, model_id: str, max_rank: int) -> dict[str, Any]:
    try:
        cfg = json.loads((src / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise AdapterProblem(CONFIG_FILE, f"not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise AdapterProblem(CONFIG_FILE, "must be a JSON object")
    if str(cfg.get("peft_type", "")).upper() != "LORA":
        raise AdapterProblem(CONFIG_FILE, f"peft_type {cfg.get('peft_type')!r} is not LORA")
    base = str(cfg.get("base_model_name_or_path") or "")
    if base and Path(base.rstrip("/")).name != model_id:
        raise AdapterProblem(CONFIG_FILE, f"base_model_name_or_path {base!r} is not this resource's base model "
                             f"{model_id!r}")
    for key, default in _UNSUPPORTED.items():
        v = cfg.get(key, default)
        if v not in (default, None) and not (isinstance(default, dict) and not v):
            raise AdapterProblem(CONFIG_FILE, f"{key}={v!r} is not supported by this trainer (only plain LoRA: "
                                 f"{key}={default!r})")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= max_rank:
        raise AdapterProblem(CONFIG_FILE, f"r must be an integer rank from 1 to {max_rank}, got {r!r}")
    alpha = cfg.get("lora_alpha", r)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise AdapterProblem(CONFIG_FILE, f"lora_alpha must be a number > 0, got {alpha!r}")
    if isinstance(cfg.get("target_modules"), str) or not cfg.get("target_modules"):
        raise AdapterProblem(CONFIG_FILE, "target_modules must be a non-empty list of module names (a regex string "
                             "is not supported)")
    return cfg


def _read_tensors(src: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(src / WEIGHTS_FILE), framework="pt", device="cpu") as f:
            keys = list(f.keys())
            for k in keys:
                try:
                    out[k] = f.get_tensor(k)
                except Exception as e:  # a dtype torch cannot hold, a truncated buffer
                    raise AdapterProblem(WEIGHTS_FILE, f"cannot be read ({e})", tensor=k) from None
    except AdapterProblem:
        raise
    except Exception as e:  # not a safetensors file, a bad header
        raise AdapterProblem(WEIGHTS_FILE, f"not a readable safetensors file ({e})") from None
    if not out:
        raise AdapterProblem(WEIGHTS_FILE, "holds no tensor")
    return out


def _check_tensor(k: str, t: torch.Tensor, want: tuple[int, int], r: int) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise AdapterProblem(WEIGHTS_FILE, f"dtype {t.dtype} is not a float type (float16/bfloat16/float32/float64)",
                             tensor=k)
    if tuple(t.shape) != want:
        raise AdapterProblem(WEIGHTS_FILE, f"shape {tuple(t.shape)} disagrees with rank r={r} and the base layer: "
                             f"expected {want}", tensor=k)
    if not bool(torch.isfinite(t).all()):
        raise AdapterProblem(WEIGHTS_FILE, f"holds {int((~torch.isfinite(t)).sum())} NaN/inf value(s)", tensor=k)


def check_adapter(src: str | Path, *, model_id: str, model_dir: str | Path, max_rank: int) -> CheckedAdapter:
    """Read and check a PEFT adapter directory against the base model; stores nothing.

    Args:
        src: the directory holding `ADAPTER_FILES`.
        model_id: this resource's base model id (the basename ``base_model_name_or_path`` must have, if set).
        model_dir: the base model's directory (its config gives the layers, `base_linears`).
        max_rank: the largest rank accepted.

    Raises:
        AdapterProblem: naming the file and tensor (see the module docstring).
    """
    src = Path(src)
    for name in ADAPTER_FILES:
        if not (src / name).is_file():
            raise AdapterProblem(name, f"missing from {src}")
    cfg = _read_config(src, model_id, max_rank)
    r, linears = int(cfg["r"]), base_linears(str(model_dir))
    leaves = {p.rsplit(".", 1)[-1] for p in linears}
    targets = sorted(set(cfg["target_modules"]))
    bad = [t for t in targets if t not in leaves]
    if bad:
        raise AdapterProblem(CONFIG_FILE, f"target module(s) {bad} not in the base model's blocks (it has "
                             f"{sorted(leaves)})")
    out: dict[str, torch.Tensor] = {}
    for k, t in _read_tensors(src).items():
        m = _KEY.match(k)
        if m is None:
            raise AdapterProblem(WEIGHTS_FILE, "not a LoRA key (expected <module path>.lora_A.weight or "
                                 ".lora_B.weight)", tensor=k)
        module = m["module"]
        if module not in linears or module.rsplit(".", 1)[-1] not in targets:
            raise AdapterProblem(WEIGHTS_FILE, f"module {module!r} is not a targeted linear layer of the base model",
                                 tensor=k)
        fan_out, fan_in = linears[module]
        _check_tensor(k, t, (r, fan_in) if m["ab"] == "lora_A" else (fan_out, r), r)
        out[f"base_model.model.{module}.{m['ab']}.weight"] = t.to(torch.float32).contiguous()
    for module in sorted(p for p in linears if p.rsplit(".", 1)[-1] in targets):
        for ab in ("lora_A", "lora_B"):
            if f"base_model.model.{module}.{ab}.weight" not in out:
                raise AdapterProblem(WEIGHTS_FILE, f"no {ab} for targeted layer {module} (an adapter must cover every "
                                     "layer its target_modules name)", tensor=f"base_model.model.{module}.{ab}.weight")
    spec = LoraConfig(rank=r, alpha=float(cfg.get("lora_alpha", r)), dropout=float(cfg.get("lora_dropout") or 0.0),
                      target_modules=tuple(targets))
    return CheckedAdapter(spec, out)


def write_adapter(out: Path, adapter: CheckedAdapter, available_targets: list[str], model_dir: str | Path) -> None:
    """Write the adapter as this server writes one (`save_adapter`): our ``adapter_config.json`` (base path =
    `model_dir`) and float32 ``adapter_model.safetensors``."""
    from safetensors.torch import save_file

    make_lora_config(adapter.spec, available_targets, str(model_dir)).save_pretrained(str(out))
    save_file(dict(sorted(adapter.tensors.items())), str(out / WEIGHTS_FILE), metadata={"format": "pt"})


def write_training_state(out: Path, adapter: CheckedAdapter, available_targets: list[str], model_dir: str | Path,
                         base: Mapping[str, Any]) -> None:
    """Write a step-0 training checkpoint (engines/trainer_state.py format) with no optimizer state: loading it
    starts a fresh AdamW. ``param::<name>`` are the PEFT keys (the parameter names without the adapter name).

    Args:
        base: the engine's base fingerprint (`trainer_state.base_fingerprint` plus dtype).
    """
    from safetensors.torch import save_file

    write_adapter(out, adapter, available_targets, model_dir)
    names = sorted(adapter.tensors)
    save_file({f"param::{n}": adapter.tensors[n] for n in names}, str(out / STATE_TENSORS), metadata={"format": "pt"})
    meta = {"format": STATE_FORMAT, "format_version": STATE_FORMAT_VERSION, "step": 0, "lora": spec_meta(adapter.spec),
            "base": dict(base), "param_groups": [], "params": names, "imported": True}
    (out / STATE_META).write_text(json.dumps(meta, indent=1))

