"""Export an inference checkpoint for serving elsewhere, and check it against the resource's own sampler.

- `vllm_refusals(config)`: why vLLM's ``--lora-modules`` (``LoRARequest``) would not load a PEFT adapter
  as it is: a full ``lm_head`` / embedding copy (``modules_to_save``: vLLM LoRA has no such weights; export
  ``merged=True`` instead, which vLLM serves as a model), DoRA, a bias, a rank over vLLM's largest
  (``--max-lora-rank`` accepts up to 512), target modules given as a regex. Split q/k/v and gate/up names
  need no mapping: vLLM packs them itself (``packed_modules_mapping``), and a base with fused names (Phi-3
  ``qkv_proj``) is trained under those same names.
- `export_adapter`: download a ``save_weights`` adapter and, for vLLM, refuse with those reasons (nothing
  is left at the destination then).
- `parity`: score a fixed prompt set with the downloaded adapter in plain transformers + peft and with the
  resource's sampler (``compute_logprobs(checkpoint_uri=...)``); ``max |delta logprob|`` against a tolerance
  from the dtype (`tolerance`). ``together-train check-adapter`` prints it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Prompts of the parity check (the resource's tokenizer encodes them; fixed so figures compare across runs).
PROMPTS = (
    "The capital of France is Paris, and the capital of Italy is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Q: What is 17 times 23?\nA: 17 times 23 is",
    "Once upon a time, in a small village by the sea, there lived",
)
VLLM_MAX_LORA_RANK = 512
_EPS = {"float32": 2.0 ** -23, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10, "float64": 2.0 ** -52}


def vllm_refusals(cfg: dict[str, Any]) -> list[str]:
    """Reasons vLLM would refuse a PEFT adapter config (empty: it loads as is)."""
    out = []
    saved = [m for m in (cfg.get("modules_to_save") or []) if m]
    if saved:
        out.append(f"modules_to_save {saved}: the adapter carries a full trained copy of {', '.join(saved)} "
                   "(train_unembed); vLLM LoRA loads only lora_A/lora_B pairs. Export with merged=True (a full model "
                   "vLLM serves) or train without train_unembed")
    if cfg.get("use_dora"):
        out.append("use_dora: vLLM serves plain LoRA only")
    if (cfg.get("bias") or "none") != "none":
        out.append(f"bias={cfg.get('bias')!r}: vLLM LoRA has no bias terms")
    if isinstance(cfg.get("target_modules"), str):
        out.append("target_modules is a regex; vLLM needs a list of module names")
    if int(cfg.get("r") or 0) > VLLM_MAX_LORA_RANK:
        out.append(f"rank {cfg.get('r')} is over vLLM's largest --max-lora-rank ({VLLM_MAX_LORA_RANK})")
    return out


def export_adapter(client: Any, uri: str, dest: str | Path, *, for_vllm: bool = False) -> Path:
    """Download the adapter checkpoint `uri` into `dest`; with `for_vllm`, refuse what vLLM cannot load.

    Raises:
        ValueError: a merged or training checkpoint, or (for_vllm) the `vllm_refusals` reasons; `dest`
            is not created then.
    """
    dest = Path(dest)
    with tempfile.TemporaryDirectory(prefix=".export-", dir=dest.parent if dest.parent.exists() else None) as tmp:
        got = client.download_checkpoint(uri, tmp)
        cfg_file = Path(got) / "adapter_config.json"
        if not cfg_file.is_file() or "/weights/" not in uri:
            raise ValueError(f"{uri} is not an adapter inference checkpoint (save_weights without merged=True)")
        reasons = vllm_refusals(json.loads(cfg_file.read_text())) if for_vllm else []
        if reasons:
            raise ValueError(f"{uri} cannot be served by vLLM --lora-modules: " + "; ".join(reasons))
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(got, dest)
    return dest


def base_model_dir(client: Any, uri: str) -> Path:
    """The adapter's ``base_model_name_or_path`` when it is a directory on this machine (a resource on the
    same host records its model directory there).

    Raises:
        ValueError: it is not (give the base model directory explicitly).
    """
    with tempfile.TemporaryDirectory() as tmp:
        got = client.download_checkpoint(uri, tmp)
        cfg = json.loads((Path(got) / "adapter_config.json").read_text()) if (
            Path(got) / "adapter_config.json").is_file() else {}
    base = Path(str(cfg.get("base_model_name_or_path") or ""))
    if not str(base) or not (base / "config.json").is_file():
        raise ValueError(f"the base model directory of {uri} ({str(base) or 'not recorded'}) is not on this machine: "
                         "pass --model DIR")
    return base


def tolerance(dtype: str, max_abs_logprob: float) -> float:
    """Largest |delta logprob| two correct implementations may show in `dtype`.

    Each logit is a dot product whose rounding differs between kernels by a few units in the last place of
    the logit, and log_softmax subtracts the log-sum-exp (of the size of the largest logit): 16 ulps of
    ``1 + max |logprob|`` covers both with margin (float32: ~2e-5 for logprobs near -10).
    """
    return 16 * _EPS[dtype] * (1.0 + max_abs_logprob)


@dataclass(frozen=True)
class Parity:
    """What `parity` measured: ``max_abs_delta`` (nats) over ``tokens`` scored positions, the ``tolerance``."""

    max_abs_delta: float
    tolerance: float
    dtype: str
    tokens: int

    @property
    def ok(self) -> bool:
        return self.max_abs_delta <= self.tolerance


def parity(client: Any, uri: str, model_dir: str | Path, prompts: tuple[str, ...] = PROMPTS) -> Parity:
    """Score `prompts` with the adapter `uri` in transformers + peft (on `model_dir`, the resource's dtype)
    and with the resource's sampler; the largest |delta logprob| over every scored token."""
    import numpy as np
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    dtype = client.get_capabilities().dtype
    tok = client.get_tokenizer()
    seqs = [np.asarray(tok.encode(p), np.int64) for p in prompts]
    with tempfile.TemporaryDirectory() as tmp:
        adapter = export_adapter(client, uri, Path(tmp) / "adapter")
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
        model = PeftModel.from_pretrained(base, str(adapter)).eval()
        ref = []
        with torch.no_grad():
            for s in seqs:
                logits = model(torch.tensor(s[:-1])[None]).logits[0].float()
                ref.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(s[1:])[:, None])[:, 0].double().numpy())
    got = client.compute_logprobs(seqs, checkpoint_uri=uri).result(timeout=600).logprobs
    deltas = [np.abs(np.asarray(g, np.float64)[-len(r):] - r) for g, r in zip(got, ref)]
    worst = max(float(d.max()) for d in deltas)
    big = max(float(np.abs(r).max()) for r in ref)
    return Parity(worst, tolerance(dtype, big), dtype, sum(len(r) for r in ref))
