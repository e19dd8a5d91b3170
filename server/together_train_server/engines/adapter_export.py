"""An adapter's weights out of the trainer: flat snapshots (weights pushes) and PEFT adapter directories.

The merged export (the base with the adapter merged in) is merged_export.py; the training
checkpoint format is trainer_state.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from .lora import FlatSource, FlatTensors, flat_copy, snapshot_dtype
from .trainer_adapters import TrainerAdapter

__all__ = ["adapter_snapshot", "write_peft_adapter"]


def adapter_snapshot(peft_model: Any, st: TrainerAdapter, dtype: str, *, cache: bool) -> FlatTensors:
    """``st``'s weights under peft state-dict keys: CPU copies in ``dtype``, views of one flat buffer.

    Keys are those of ``peft.get_peft_model_state_dict`` (adapter name stripped), e.g.
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` ``[r, in]``,
    ``...lora_B.weight`` ``[out, r]``, and ``base_model.model.lm_head.weight`` ``[vocab, hidden]``
    with train_unembed; back to back in key order, filled by one converting ``_foreach_copy_``.
    With ``cache`` the keys are mapped to ``st``'s own parameters once (``st.snapshot_source``):
    peft's state dict walks every module per call (~0.1 s on SmolLM2-135M).

    Raises:
        ValueError: ``dtype`` not float32/bfloat16/float16.
    """
    from peft import get_peft_model_state_dict

    td = snapshot_dtype(dtype)
    src = st.snapshot_source if cache else None
    if src is None:
        sd = get_peft_model_state_dict(peft_model, adapter_name=st.name, save_embedding_layers=False)
        by_ptr = {p.data_ptr(): p for p in st.params}
        if not cache or any(
                by_ptr.get(v.data_ptr()) is None or by_ptr[v.data_ptr()].shape != v.shape for v in sd.values()):
            return flat_copy(sd, td)
        # The optimizer trains these same objects: the mapping stays valid for the adapter's life.
        src = st.snapshot_source = FlatSource({k: by_ptr[v.data_ptr()] for k, v in sd.items()})
    return src.copy(td)


def write_peft_adapter(peft_model: Any, st: TrainerAdapter, tensors: Mapping[str, torch.Tensor],
                       model_dir: Path, out: Path) -> Path:
    """Write ``adapter_config.json`` (``base_model_name_or_path`` = ``model_dir``) and
    ``adapter_model.safetensors`` (``tensors``, `adapter_snapshot`'s keys) into ``out``.

    Loadable with ``PeftModel.from_pretrained(base, out)`` and by vLLM.
    """
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = peft_model.peft_config[st.name]
    config.base_model_name_or_path = str(model_dir)
    config.save_pretrained(str(out))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    return out
