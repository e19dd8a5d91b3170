"""A ``DynamicCache`` whose layers grow into spare columns instead of re-concatenating every step.

``transformers.DynamicLayer.update`` appends a decode step's keys/values with
``torch.cat([keys, new], dim=-2)``: every step copies the whole cache of every
layer, O(T) per step. The torch generator profiled that copy at 15 % of a
decode step (SmolLM2-135M, 64 rows, ``benchmarks/sampling.py --quick``,
torch.profiler: ``aten::cat``). `GrowingLayer` keeps each layer's keys and
values in a buffer ``[rows, kv_heads, capacity, head_dim]`` with ``HEADROOM``
spare columns; ``keys``/``values`` are views of its first ``T`` columns, an
update writes the new columns in place, and the buffer is reallocated (one copy)
only when it is full. The values are the same tensors ``DynamicLayer`` would
hold (a copy, no arithmetic), so outputs are bit-identical.

The engine still replaces ``layer.keys``/``layer.values`` wholesale (rows
leaving: ``index_select``; rows joining: ``torch.cat``; padding trimmed): a
tensor that is not the view of the layer's buffer is adopted as the new
contents and gets a buffer with headroom at the next update.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

__all__ = ["GrowingLayer", "HEADROOM", "make_growing"]

# Spare columns per reallocation: a reallocation copies the cache once every HEADROOM decode
# steps instead of every step; the spare memory is HEADROOM / T of the cache (T = its columns).
HEADROOM = 32


class GrowingLayer(DynamicLayer):
    """``DynamicLayer`` with a preallocated column buffer (see the module docstring).

    ``keys``/``values``: ``[rows, kv_heads, T, head_dim]`` views of ``_kbuf``/``_vbuf``
    ``[rows, kv_heads, T + spare, head_dim]`` (same dtype/device as the model's states).
    """

    _kbuf: torch.Tensor | None = None
    _vbuf: torch.Tensor | None = None

    def _owns(self, t: torch.Tensor, buf: torch.Tensor | None) -> bool:
        # t is the view of buf's first columns that update() left (nothing replaced it since)
        return (buf is not None and t.dim() == 4 and t.data_ptr() == buf.data_ptr()
                and t.shape[:2] == buf.shape[:2] and t.stride() == buf.stride())

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states``/``value_states`` ``[rows, kv_heads, s, head_dim]``; returns the views of all ``T + s``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self.keys.shape[-2] if self.keys.numel() else 0
        s = key_states.shape[-2]
        if not (self._owns(self.keys, self._kbuf) and self._owns(self.values, self._vbuf)
                and n + s <= self._kbuf.shape[-2]):
            shape = list(key_states.shape)
            shape[-2] = n + s + HEADROOM
            kbuf, vbuf = key_states.new_empty(shape), value_states.new_empty(shape)
            if n:
                kbuf[:, :, :n].copy_(self.keys)
                vbuf[:, :, :n].copy_(self.values)
            self._kbuf, self._vbuf = kbuf, vbuf
        self._kbuf[:, :, n:n + s].copy_(key_states)
        self._vbuf[:, :, n:n + s].copy_(value_states)
        self.keys, self.values = self._kbuf[:, :, :n + s], self._vbuf[:, :, :n + s]
        return self.keys, self.values

    def reset(self) -> None:
        """Drop the buffers with the contents."""
        self._kbuf = self._vbuf = None
        super().reset()


def make_growing(cache) -> None:
    """Turn the plain ``DynamicLayer`` layers of ``cache`` (a ``DynamicCache``) into `GrowingLayer`, in place.

    Other layer kinds (sliding windows, ...) are left as they are.
    """
    for layer in cache.layers:
        if type(layer) is DynamicLayer:
            layer.__class__ = GrowingLayer
