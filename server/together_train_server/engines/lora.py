"""LoRA helpers shared by the trainer and generator engines (peft glue).

Both engines must build the *same* peft ``LoraConfig`` from our
:class:`~.types.LoraConfig`, so that tensors exported by the trainer
(``get_peft_model_state_dict`` keys) load into the generator unchanged.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Iterator, Mapping, Sequence

import torch

from .types import LoraConfig

__all__ = [
    "UNEMBED_MODULE",
    "default_target_modules",
    "make_lora_config",
    "validate_spec",
    "quiet_peft",
    "is_lora_b",
    "read_peft_adapter",
    "SNAPSHOT_DTYPES",
    "snapshot_dtype",
    "flat_copy",
    "FlatLayout",
    "FlatSource",
    "FlatTensors",
    "tensor_bytes",
    "one_thread",
]

UNEMBED_MODULE = "lm_head"
# Dtypes an adapter snapshot may be taken in (the generator replicas' weights dtypes).
SNAPSHOT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def snapshot_dtype(name: str) -> torch.dtype:
    """The torch dtype of snapshot dtype `name`. Raises ValueError naming the accepted ones."""
    try:
        return SNAPSHOT_DTYPES[name]
    except KeyError:
        raise ValueError(f"adapter snapshot dtype {name!r} is not one of {sorted(SNAPSHOT_DTYPES)}") from None


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run this thread's torch ops single-threaded: for memory-bound passes over a weights buffer.

    A snapshot (one converting cat) and a replica's load (the finiteness check,
    the copy into the parameters) only move bytes: one core moves several GB/s,
    and on busy cores every multi-threaded op waits for a descheduled OpenMP
    thread. Measured on 2 cores at load 7-9, rank 128 (39 M values) cat'ed into
    bf16: 42-74 ms on one thread, 310-530 ms on two. The thread count is the
    calling thread's (OpenMP's is per thread) and is restored after.
    """
    n = torch.get_num_threads()
    if n > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if n > 1:
            torch.set_num_threads(n)


class FlatLayout:
    """Names, shapes and element counts of tensors that lie back to back in one flat buffer, in name order.

    Built once per adapter layout (the trainer keeps one per adapter, `FlatSource`); compared by
    identity, so a weights push can key what it derives from a layout (the header's tensor list)
    on the object itself.
    """

    __slots__ = ("names", "shapes", "sizes", "numel", "_name_set", "__weakref__")

    def __init__(self, names: Sequence[str], shapes: Sequence[Sequence[int]]) -> None:
        self.names = tuple(names)
        self.shapes = tuple(torch.Size(s) for s in shapes)
        self.sizes = tuple(int(math.prod(s)) for s in self.shapes)
        self.numel = sum(self.sizes)
        self._name_set: frozenset[str] | None = None

    def __contains__(self, name: object) -> bool:
        if self._name_set is None:
            self._name_set = frozenset(self.names)
        return name in self._name_set

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> FlatLayout:
        """The layout of `tensors` (in their key order)."""
        return cls(list(tensors), [t.shape for t in tensors.values()])


class FlatTensors(Mapping[str, torch.Tensor]):
    """name -> tensor where every tensor is a view of ``flat`` (1-D, back to back in ``layout`` order).

    What `flat_copy` returns (a trainer snapshot) and what a replica receives a push into:
    a push sends (or copies) ``flat`` as one piece and reads names and shapes from
    ``layout``, without walking 420 views; the views themselves are cut on first use
    (~2.5 ms of Python for a rank-32 SmolLM2-135M adapter, paid only by readers that
    want tensors). Read-only.

    Args:
        flat: 1-D tensor of ``layout.numel`` elements.
        layout: the names and shapes, in buffer order.
        views: the views when the caller has them already (must match `layout`).
    """

    def __init__(self, flat: torch.Tensor, layout: FlatLayout, views: dict[str, torch.Tensor] | None = None) -> None:
        if flat.dim() != 1 or flat.numel() != layout.numel:
            raise ValueError(f"a flat buffer of {layout.numel} elements is needed, got shape {tuple(flat.shape)}")
        self.flat, self.layout = flat, layout
        self._views = views

    @property
    def views(self) -> dict[str, torch.Tensor]:
        """name -> view of ``flat`` (cut once, then kept)."""
        if self._views is None:
            parts = self.flat.split(self.layout.sizes) if self.layout.sizes else ()
            self._views = {k: v.view(shape) for k, v, shape in zip(self.layout.names, parts, self.layout.shapes)}
        return self._views

    @property
    def nbytes(self) -> int:
        """Bytes of all the tensors (``flat``'s)."""
        return self.flat.numel() * self.flat.element_size()

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.views[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout.names)

    def __len__(self) -> int:
        return len(self.layout.names)

    def __contains__(self, name: object) -> bool:  # without cutting the views (Mapping's would)
        return name in self.layout

    def __repr__(self) -> str:
        return f"FlatTensors({len(self)} tensors, {self.flat.numel()} x {self.flat.dtype}, {self.flat.device})"


def tensor_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Total bytes of `tensors` (a `FlatTensors`' without cutting its views; values that are not tensors count 0)."""
    if isinstance(tensors, FlatTensors):
        return tensors.nbytes
    return sum(int(t.numel()) * int(t.element_size()) if hasattr(t, "numel") else 0 for t in tensors.values())


class FlatSource:
    """Tensors to snapshot again and again (an adapter's parameters): `copy` gives a `FlatTensors`.

    The layout and the flat views of the sources are worked out once; each `copy`
    is one ``torch._foreach_copy_`` into a fresh buffer's ``split`` (one op, not 420
    ``copy_`` calls, each an OpenMP region, which cost 4-17x more under load). If a
    source tensor was given new storage since (``.data`` replaced), the views are cut
    again. Rounding is ``Tensor.to(dtype)``'s.

    Args:
        tensors: name -> tensor (any device, any float dtype), in the order to lay out.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._src = list(tensors.values())  # the live objects: a parameter's .data may be replaced
        self.layout = FlatLayout.of(tensors)
        self._parts: list[torch.Tensor] = []
        self._key: list[tuple[int, tuple[int, ...]]] = []

    def _current_parts(self) -> list[torch.Tensor]:
        # Address and strides: a .data replaced by a new tensor, or by a view of the same memory
        # (a transpose, a reshape), is seen; strides also pin the shape of a contiguous tensor.
        key = [(t.data_ptr(), t.stride()) for t in self._src]
        if key != self._key:
            shapes = [t.shape for t in self._src]
            if shapes != list(self.layout.shapes):
                self.layout = FlatLayout(self.layout.names, shapes)
            parts = [t.detach().reshape(-1) for t in self._src]
            # Cached only while they are views (a non-contiguous source's reshape is a copy, stale later).
            views = [p.data_ptr() for p in parts] == [k[0] for k in key]
            self._parts, self._key = (parts, key) if views else ([], [])
            return parts
        return self._parts

    def copy(self, dtype: torch.dtype) -> FlatTensors:
        """A copy of the sources' current values in `dtype`, on the CPU, as one flat buffer."""
        parts = self._current_parts()
        sizes = self.layout.sizes
        dev = parts[0].device if parts else torch.device("cpu")
        if any(p.device != dev for p in parts):  # one op needs one device
            parts, dev = [p.cpu() for p in parts], torch.device("cpu")
        flat = torch.empty(self.layout.numel, dtype=dtype, device=dev)
        if parts:
            with one_thread():
                torch._foreach_copy_(list(flat.split(sizes)), parts)
        return FlatTensors(flat.cpu(), self.layout)


def flat_copy(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> FlatTensors:
    """Copies of `tensors` in `dtype` on the CPU, as views of one flat buffer (key order, back to back).

    ``FlatSource(tensors).copy(dtype)``: for tensors snapshotted once. Rank 32 on SmolLM2-135M,
    one thread: ~2.3 ms against 4.3 ms for a converting ``torch.cat``.
    """
    return FlatSource(tensors).copy(dtype)


def default_target_modules(model: torch.nn.Module) -> list[str]:
    """Leaf names of the linear layers inside the transformer blocks, sorted (peft's ``all-linear``).

    A linear layer is an ``nn.Linear`` or a transformers ``Conv1D`` (GPT-2's
    layers), as peft's ``target_modules="all-linear"`` counts them; "inside the
    blocks" means under a numbered child of a ``ModuleList`` (``model.layers.3``,
    ``transformer.h.0``). The output embedding (``lm_head``) is never a LoRA
    target (see ``LoraConfig.train_unembed``). Llama/Qwen2: ``down_proj, gate_proj,
    k_proj, o_proj, q_proj, up_proj, v_proj``; Phi-3: ``down_proj, gate_up_proj,
    o_proj, qkv_proj``; GPT-2: ``c_attn, c_fc, c_proj``.

    Raises:
        ValueError: the model has no linear layer inside numbered blocks.
    """
    from transformers.pytorch_utils import Conv1D

    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names: set[str] = set()
    for name, mod in model.named_modules():
        if not isinstance(mod, (torch.nn.Linear, Conv1D)) or mod is out_emb:
            continue
        parts = name.split(".")
        leaf = parts[-1]
        # A numbered path component is an index into the blocks' ModuleList.
        in_block = any(p.isdigit() for p in parts[:-1])
        if in_block and leaf != UNEMBED_MODULE and not any(p.startswith("lora_") for p in parts):
            names.add(leaf)
    if not names:
        raise ValueError("no linear layers found inside the transformer blocks (e.g. model.layers.N.*)")
    return sorted(names)


def validate_spec(spec: LoraConfig, available_targets: Sequence[str]) -> None:
    """Check a LoraConfig against the model's ``default_target_modules``.

    Raises:
        ValueError: rank < 1, alpha <= 0, dropout outside [0, 1), or a target
            module that matches no linear layer in the decoder blocks.
    """
    if int(spec.rank) < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {spec.rank}")
    if not spec.alpha > 0:
        raise ValueError(f"LoRA alpha must be > 0, got {spec.alpha}")
    if not 0.0 <= spec.dropout < 1.0:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {spec.dropout}")
    allowed = set(available_targets)
    bad = [t for t in spec.target_modules if t not in allowed]
    if bad:
        raise ValueError(f"unknown LoRA target modules {bad}; choose from {sorted(allowed)}")


def make_lora_config(spec: LoraConfig, available_targets: Sequence[str],
                     base_model_name_or_path: str | None = None):
    """The peft ``LoraConfig`` for ``spec``.

    ``available_targets`` is ``default_target_modules(base)`` computed on the
    *unwrapped* base model (once peft wraps layers they are no longer
    ``nn.Linear``).

    ``target_modules`` empty means all decoder-block linear layers (listed
    explicitly so the saved adapter_config.json is self-describing).
    ``train_unembed`` adds ``lm_head`` to ``modules_to_save``: a full,
    per-adapter trainable copy of the unembedding. For tied-embedding models
    (SmolLM2) that copy is untied: only the output projection is trained, the
    input embedding stays frozen.
    """
    from peft import LoraConfig as PeftLoraConfig

    validate_spec(spec, available_targets)
    targets = list(spec.target_modules) or list(available_targets)
    return PeftLoraConfig(
        r=int(spec.rank),
        lora_alpha=float(spec.alpha),
        lora_dropout=float(spec.dropout),
        target_modules=targets,
        modules_to_save=[UNEMBED_MODULE] if spec.train_unembed else None,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_name_or_path,
    )


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """Silence peft warnings that do not apply here (adapter-name prefix, tied lm_head)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*should not be contained in the prefix.*")
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        yield


def is_lora_b(param_name: str) -> bool:
    """True for LoRA B matrices (the parameters LoRA+ scales by the ratio)."""
    return ".lora_B." in param_name or ".lora_embedding_B." in param_name


def read_peft_adapter(path) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """Read a PEFT adapter directory written by ``save_adapter``/``save_state``.

    Args:
        path: directory holding ``adapter_config.json`` and ``adapter_model.safetensors``.

    Returns:
        ``(spec, tensors)``: the LoraConfig (rank ``r``, ``lora_alpha``,
        ``lora_dropout``, ``target_modules``, ``train_unembed`` when ``lm_head``
        is in ``modules_to_save``) and the float32 CPU tensors under their
        ``get_peft_model_state_dict`` keys (what ``load_adapter`` takes).

    Raises:
        FileNotFoundError: a file is missing (e.g. a merged checkpoint).
        ValueError: not a LoRA adapter config.
    """
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    d = Path(path)
    cfg_file, weights = d / "adapter_config.json", d / "adapter_model.safetensors"
    for f in (cfg_file, weights):
        if not f.is_file():
            raise FileNotFoundError(f"{f.name} not found in {d} (not an unmerged PEFT adapter directory)")
    cfg = json.loads(cfg_file.read_text())
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"{cfg_file}: peft_type {cfg.get('peft_type')!r} is not LORA")
    targets = cfg.get("target_modules") or []
    if isinstance(targets, str):
        raise ValueError(f"{cfg_file}: target_modules as a regex is not supported")
    spec = LoraConfig(
        rank=int(cfg["r"]),
        alpha=float(cfg.get("lora_alpha", cfg["r"])),
        dropout=float(cfg.get("lora_dropout", 0.0) or 0.0),
        target_modules=tuple(sorted(targets)),
        train_unembed=UNEMBED_MODULE in (cfg.get("modules_to_save") or []),
    )
    tensors = {k: v.float() for k, v in load_file(str(weights), device="cpu").items()}
    return spec, tensors
