"""Per-row LoRA over one pass of the frozen base: rows of several adapters in one forward (the clock cycle).

Inside `RowLora`, every peft LoRA ``Linear`` layer of the model computes its base
projection only (its adapters disabled) and a forward hook adds, for each row ``b``
of the ``[B, T, in]`` input, that row's own adapter's term

    ``y_b = W x_b + s_b * B_b (A_b d_b(x_b))``

(peft's vanilla LoRA, ``result + lora_B(lora_A(dropout(x))) * scaling``, in the same
operation order). The adapters of the pass are stacked into ``[K, r_max, in]`` /
``[K, out, r_max]`` and applied to each slot's contiguous block of rows with two
grouped matrix products (``torch._grouped_mm`` over the flattened ``[B*T, in]``
input, offsets at the slots' row ends; vLLM's punica/SGMV kernels do the same for
serving) on a GPU. On CPU, and where grouped products are missing or refuse the
shapes or dtype (older torch, an older GPU), ``A_b``/``B_b`` are gathered per row
and applied with two ``torch.bmm``. On CPU both give bit-identical results (measured,
float32, torch 2.13), and the same values as the adapter's own ``F.linear`` on its rows.
Adapters of different ranks, or not targeting a layer, are zero-padded to ``r_max``
(zero rows of A, zero columns of B): the extra terms are exact zeros, so the result
is the adapter's own (``x + 0 = x`` in IEEE arithmetic for finite x). Zero-padding rather than one group per rank keeps one pair of
matrix products per layer; the padding costs ``(r_max - r_k) / r_max`` of the
LoRA terms only, which are ``r / in`` of the base's work. Gradients reach each
trainable adapter's own A/B through the stack; a slot that is not trainable
(a forward without backward) uses detached weights, so its ``.grad`` is never
touched.

LoRA dropout (``d_b``) draws, for each slot whose op trains with dropout > 0,
from the slot's own ``torch.Generator``, a mask of the shape the op's rows
have alone (``[n_k, T_k, in]``, in the same layer order), as torch's CPU
dropout does (``bernoulli_(1 - p)``, ``div_(1 - p)``, multiply): the draws,
and so the result, equal the op's alone.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F

__all__ = ["Slot", "RowLora", "lora_layers", "unsupported_layer", "grouped_mm_works", "prefers_grouped"]

# (device type, dtype, in, r, out) -> whether torch._grouped_mm runs forward and backward there.
_GROUPED_OK: dict[tuple[str, torch.dtype, int, int, int], bool] = {}


@dataclass
class Slot:
    """One adapter's rows in the pass.

    Attributes:
        name: the peft adapter name.
        start, stop: its rows ``[start, stop)`` of the ``[B, T]`` batch.
        length: the padded length its rows have alone (``T_k <= T``).
        trainable: gradients flow to its weights (the op runs backward).
        dropout: its LoRA dropout probability, applied when ``trainable`` and ``> 0``.
        generator: its dropout stream (CPU ``torch.Generator``); None when no dropout is drawn.
    """

    name: str
    start: int
    stop: int
    length: int
    trainable: bool
    dropout: float = 0.0
    generator: torch.Generator | None = None


def lora_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The peft LoRA ``Linear`` layers of ``model``, in module order."""
    from peft.tuners.lora.layer import Linear

    return [m for m in model.modules() if isinstance(m, Linear)]


def unsupported_layer(model: torch.nn.Module, names: Sequence[str]) -> str | None:
    """Why a pass over adapters ``names`` cannot be per-row here (None when it can).

    Per-row LoRA covers vanilla LoRA on ``nn.Linear`` layers: not GPT-2's ``Conv1D``
    (``fan_in_fan_out``) nor a peft variant (DoRA).
    """
    for m in lora_layers(model):
        if getattr(m, "fan_in_fan_out", False):
            return "fan_in_fan_out LoRA layers (Conv1D)"
        if any(n in getattr(m, "lora_variant", {}) for n in names):
            return "a LoRA variant (DoRA)"
    return None


def grouped_mm_works(device: torch.device, dtype: torch.dtype, d_in: int, r: int, d_out: int) -> bool:
    """Whether ``torch._grouped_mm`` computes a LoRA term ``[M, in] -> [M, r] -> [M, out]`` here, with its backward.

    Probed once per (device type, dtype, in, r, out) on two tiny groups: CUDA's kernel
    needs a recent GPU, bf16 and 16-byte aligned strides, and refuses (a host-side
    check) otherwise. Never raises.
    """
    key = (device.type, dtype, d_in, r, d_out)
    ok = _GROUPED_OK.get(key)
    if ok is None:
        fn = getattr(torch, "_grouped_mm", None)
        ok = False
        if fn is not None:
            try:
                with torch.enable_grad():
                    x = torch.ones(32, d_in, dtype=dtype, device=device, requires_grad=True)
                    a = torch.ones(2, r, d_in, dtype=dtype, device=device, requires_grad=True)
                    b = torch.ones(2, d_out, r, dtype=dtype, device=device, requires_grad=True)
                    offs = torch.tensor([16, 32], dtype=torch.int32, device=device)
                    y = fn(fn(x, a.transpose(1, 2), offs=offs), b.transpose(1, 2), offs=offs)
                    y.backward(torch.ones_like(y))   # a dense gradient, as the hook's `* scale` gives it
                ok = bool(torch.isfinite(y).all()) and tuple(y.shape) == (32, d_out)
            except (RuntimeError, TypeError, NotImplementedError):
                ok = False
        _GROUPED_OK[key] = ok
    return ok


def prefers_grouped(device: torch.device, dtype: torch.dtype, d_in: int, r: int, d_out: int) -> bool:
    """``RowLora``'s ``"auto"``: grouped products on a GPU that runs them (`grouped_mm_works`), else per-row
    ``bmm`` (on CPU the two take the same time at SmolLM2-135M's sizes; grouped is ~20 % slower at a tiny
    model's). Never raises."""
    return device.type == "cuda" and grouped_mm_works(device, dtype, d_in, r, d_out)


class RowLora:
    """Context manager: the model's LoRA layers apply each row's own adapter (module docstring).

    Args:
        model: the peft model.
        slots: the adapters of the pass, rows contiguous and in order, covering ``[0, B)``.
        matmul: ``"auto"`` (`prefers_grouped` decides per layer shape), ``"grouped"`` or ``"bmm"``.

    Raises:
        ValueError: slots that do not tile the rows; an unknown `matmul`.
    """

    def __init__(self, model: torch.nn.Module, slots: Sequence[Slot], matmul: str = "auto") -> None:
        self.slots = list(slots)
        if not self.slots or self.slots[0].start != 0 or any(
                a.stop != b.start for a, b in zip(self.slots, self.slots[1:])):
            raise ValueError("slots must tile the batch's rows in order")
        if matmul not in ("auto", "grouped", "bmm"):
            raise ValueError(f"matmul must be auto, grouped or bmm, not {matmul!r}")
        self.matmul = matmul
        self.layers = lora_layers(model)
        rows = [k for k, s in enumerate(self.slots) for _ in range(s.stop - s.start)]
        self.row_slot = torch.tensor(rows, dtype=torch.long)
        self.row_ends = torch.tensor([s.stop for s in self.slots], dtype=torch.int32)
        self._handles: list[Any] = []
        self._disabled: list[tuple[torch.nn.Module, bool]] = []

    def __enter__(self) -> "RowLora":
        try:
            for m in self.layers:
                self._disabled.append((m, m._disable_adapters))
                m._disable_adapters = True   # the layer computes its base projection only
                self._handles.append(m.register_forward_hook(self._hook))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        for m, old in self._disabled:
            m._disable_adapters = old
        self._handles, self._disabled = [], []

    def _stacks(self, m: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(A [K, r, in], B [K, out, r], scale [K])`` of layer ``m`` over the slots, zero-padded to one rank."""
        ranks = [m.lora_A[s.name].weight.shape[0] if s.name in m.lora_A else 0 for s in self.slots]
        r = max(max(ranks), 1)
        d_in, d_out = m.in_features, m.out_features
        a_list, b_list, scale = [], [], []
        for s, rk in zip(self.slots, ranks):
            if rk == 0:
                a_list.append(x.new_zeros((r, d_in)))
                b_list.append(x.new_zeros((d_out, r)))
                scale.append(0.0)
                continue
            a, b = m.lora_A[s.name].weight, m.lora_B[s.name].weight
            if not s.trainable:
                a, b = a.detach(), b.detach()
            a_list.append(F.pad(a, (0, 0, 0, r - rk)) if rk < r else a)
            b_list.append(F.pad(b, (0, r - rk)) if rk < r else b)
            scale.append(float(m.scaling[s.name]))
        return torch.stack(a_list), torch.stack(b_list), torch.tensor(scale, dtype=x.dtype, device=x.device)

    def _dropped(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with each dropout slot's rows multiplied by its own mask (drawn at its alone shape)."""
        if not any(s.generator is not None and s.dropout > 0 for s in self.slots):
            return x
        parts = []
        for s in self.slots:
            xs = x[s.start: s.stop]
            if s.generator is not None and s.dropout > 0:
                own = xs[:, : s.length]
                noise = torch.empty(own.shape, dtype=x.dtype, device=x.device)
                noise.bernoulli_(1.0 - s.dropout, generator=s.generator).div_(1.0 - s.dropout)
                own = own * noise
                xs = F.pad(own, (0, 0, 0, x.shape[1] - s.length)) if s.length < x.shape[1] else own
            parts.append(xs)
        return torch.cat(parts)

    def _hook(self, m: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        x = args[0]
        a, b, scale = self._stacks(m, x)
        idx = self.row_slot.to(x.device)
        xd = self._dropped(x.to(a.dtype))
        n_rows, t, d_in = xd.shape
        grouped = self.matmul == "grouped" or (
            self.matmul == "auto" and prefers_grouped(xd.device, a.dtype, d_in, a.shape[1], b.shape[1]))
        if grouped:   # each slot's rows are one block of [B*T, in]: no per-row copies of A and B
            offs = (self.row_ends * t).to(xd.device)
            u2 = torch._grouped_mm(xd.reshape(n_rows * t, d_in), a.transpose(1, 2), offs=offs)   # [B*T, r]
            delta = torch._grouped_mm(u2, b.transpose(1, 2), offs=offs).view(n_rows, t, -1)      # [B, T, out]
        else:
            u = torch.bmm(xd, a.index_select(0, idx).transpose(1, 2))           # [B, T, r]
            delta = torch.bmm(u, b.index_select(0, idx).transpose(1, 2))         # [B, T, out]
        return (out + delta * scale.index_select(0, idx)[:, None, None]).to(out.dtype)


@contextlib.contextmanager
def requires_grad(params: Sequence[torch.nn.Parameter]) -> Iterator[None]:
    """``params`` require grad inside the block; each flag restored after."""
    old = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(True)
        yield
    finally:
        for p, o in zip(params, old):
            p.requires_grad_(o)
