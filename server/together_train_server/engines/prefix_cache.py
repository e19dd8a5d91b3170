"""Prefix cache: key/value blocks of token prefixes kept across requests (torch generator engine).

What is cached
--------------
A request's prompt blocks after its prefill, and, when a stream finishes,
the blocks of its prompt + completion: every token the stream fed forward
(all sampled tokens but the last, which never went through the model). So
turn k+1 of a conversation, whose prompt is turn k's prompt + answer + a new
user message, reuses turn k's answer too, as vLLM and SGLang do. A decode
step computes a token's keys/values at the same position as a prefill
would (each row keeps its own position ids), so a cached answer is what a
fresh prefill of it gives, up to matmul-shape rounding.

Layout and keys
---------------
A sequence is cut into blocks of ``block_size`` tokens (default 16, as vLLM's
default block size); only whole blocks are cached, so hits are multiples of
``block_size``. A block is stored once as one tensor ``[layers, 2, kv_heads,
block_size, head_dim]`` (keys then values, after rotary embedding: exactly
what ``transformers.DynamicCache`` holds for those positions) in the model's
dtype and device. Blocks form a tree (a radix tree at block granularity, as
in SGLang's RadixAttention and vLLM's hashed-block chains): a block is found
by ``(namespace, parent block id, its token ids)``, so a hit is exact (no
hash collisions) and a block's keys/values are only ever reused after the
very same preceding tokens.

``namespace`` names the weights that computed the blocks: the engine passes
a number it gives every adapter *load* (a new number for every
``load_adapter``, even an in-place one, and 0 for the base model), so a
cached prefix never crosses a weights change or an adapter, and
:meth:`PrefixCache.drop_namespace` frees the blocks of weights that no
longer serve.

Bound and eviction
------------------
The tensors held never exceed ``max_bytes`` (``--prefix-cache-mb``): before a
block is added, least-recently-used blocks are evicted (a block's
descendants go with it: without their parent they can never be found). A
lookup touches the blocks it matched from the deepest to the root, so a
parent is always more recently used than its children and leaves go first.

Thread safety: one lock; the engine calls it from its scheduler thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:  # torch is imported where used: the CLI reads the defaults below without it
    import torch

__all__ = ["PrefixCache", "DEFAULT_PREFIX_CACHE_MB", "DEFAULT_BLOCK_SIZE"]

DEFAULT_PREFIX_CACHE_MB = 512     # --prefix-cache-mb default (SmolLM2-135M fp32: ~46 KB a token, ~11k tokens)
DEFAULT_BLOCK_SIZE = 16           # tokens per block (hits are multiples of it)

_ROOT = -1


@dataclass(eq=False)
class _Block:
    id: int
    key: tuple                    # (namespace, parent id, token ids)
    kv: torch.Tensor              # [layers, 2, kv_heads, block_size, head_dim]
    nbytes: int
    children: set[int] = field(default_factory=set)


class PrefixCache:
    """Bounded LRU store of KV blocks of token prefixes (prompts, prompts + completions), looked up by token blocks.

    Args:
        max_bytes: bound on the bytes of block tensors held (> 0).
        block_size: tokens per block (>= 1).

    Attributes:
        stats: counters (``lookups``, ``hit_tokens``, ``inserted_blocks``,
            ``evicted_blocks``) and ``bytes`` held now.
    """

    def __init__(self, max_bytes: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if int(max_bytes) <= 0:
            raise ValueError(f"prefix cache max_bytes must be > 0, got {max_bytes}")
        if int(block_size) < 1:
            raise ValueError(f"prefix cache block_size must be >= 1, got {block_size}")
        self.max_bytes = int(max_bytes)
        self.block_size = int(block_size)
        self._lock = threading.Lock()
        self._by_key: dict[tuple, _Block] = {}
        self._lru: OrderedDict[int, _Block] = OrderedDict()    # oldest first
        self._next_id = 0
        self.bytes = 0
        self.stats = {"lookups": 0, "hit_tokens": 0, "inserted_blocks": 0, "evicted_blocks": 0}

    def __len__(self) -> int:
        return len(self._lru)

    def _key(self, namespace: int, parent: int, tokens: Sequence[int], j: int) -> tuple:
        bs = self.block_size
        return (namespace, parent, tuple(tokens[j * bs:(j + 1) * bs]))

    def lookup(self, namespace: int, tokens: Sequence[int], max_tokens: int) -> list[torch.Tensor]:
        """The cached blocks of the longest cached prefix of ``tokens``, at most ``max_tokens`` long.

        Args:
            namespace: the weights' number (see the module docstring).
            tokens: the prompt's token ids.
            max_tokens: longest prefix wanted (the engine passes ``len(prompt) - 1``:
                the last prompt token is always recomputed, for its logits).

        Returns:
            the blocks' tensors ``[layers, 2, kv_heads, block_size, head_dim]`` in
            order; the hit is ``len(result) * block_size`` tokens. Marks them used.
        """
        n = max(0, min(int(max_tokens), len(tokens))) // self.block_size
        found: list[_Block] = []
        with self._lock:
            self.stats["lookups"] += 1
            parent = _ROOT
            for j in range(n):
                b = self._by_key.get(self._key(namespace, parent, tokens, j))
                if b is None:
                    break
                found.append(b)
                parent = b.id
            for b in reversed(found):                 # deepest first: parents end up more recent
                self._lru.move_to_end(b.id)
            self.stats["hit_tokens"] += len(found) * self.block_size
        return [b.kv for b in found]

    def match(self, namespace: int, tokens: Sequence[int], max_tokens: int) -> int:
        """Tokens :meth:`lookup` would return now (whole blocks), without marking anything used."""
        n = max(0, min(int(max_tokens), len(tokens))) // self.block_size
        with self._lock:
            parent, j = _ROOT, 0
            while j < n:
                b = self._by_key.get(self._key(namespace, parent, tokens, j))
                if b is None:
                    break
                parent, j = b.id, j + 1
        return j * self.block_size

    def insert(self, namespace: int, tokens: Sequence[int], first_block: int,
               block_kv: Callable[[int], torch.Tensor]) -> int:
        """Store the whole blocks of ``tokens`` from block ``first_block`` on.

        Blocks ``< first_block`` must be cached already (they were the hit);
        when one of them was evicted meanwhile nothing is stored. A block
        already cached is only marked used. A sequence longer than the bound
        keeps its first blocks only (evicting anything else first). ``block_kv(j)`` returns block
        ``j``'s tensor (copied by the caller: the cache keeps it as given).

        Returns:
            the number of blocks added.
        """
        bs = self.block_size
        n = len(tokens) // bs
        added = 0
        with self._lock:
            parent = _ROOT
            chain: list[_Block] = []
            for j in range(n):
                key = self._key(namespace, parent, tokens, j)
                b = self._by_key.get(key)
                if b is None:
                    if j < first_block:
                        break                         # an evicted ancestor: the chain is gone
                    kv = block_kv(j)
                    nbytes = kv.numel() * kv.element_size()
                    if nbytes > self.max_bytes:
                        break
                    self._make_room(nbytes, keep=chain)
                    if chain and chain[-1].id not in self._lru:
                        break                         # a parent could not be kept
                    if self.bytes + nbytes > self.max_bytes:
                        break                         # the chain itself fills the bound: its tail is not kept
                    b = _Block(self._next_id, key, kv, nbytes)
                    self._next_id += 1
                    self._by_key[key] = b
                    self._lru[b.id] = b
                    if parent != _ROOT:
                        self._lru[parent].children.add(b.id)
                    self.bytes += nbytes
                    added += 1
                    self.stats["inserted_blocks"] += 1
                chain.append(b)
                parent = b.id
            for b in reversed(chain):
                self._lru.move_to_end(b.id)
        return added

    def _make_room(self, nbytes: int, keep: list[_Block]) -> None:
        keep_ids = {b.id for b in keep}
        while self.bytes + nbytes > self.max_bytes and self._lru:
            victim = next((b for b in self._lru.values() if b.id not in keep_ids), None)
            if victim is None:
                return
            self._remove(victim)

    def _remove(self, b: _Block) -> None:
        stack = [b]
        while stack:
            x = stack.pop()
            if self._lru.pop(x.id, None) is None:
                continue
            del self._by_key[x.key]
            self.bytes -= x.nbytes
            self.stats["evicted_blocks"] += 1
            stack.extend(self._lru[c] for c in x.children if c in self._lru)
            parent = self._lru.get(x.key[1])
            if parent is not None:
                parent.children.discard(x.id)

    def drop_namespace(self, namespace: int) -> None:
        """Free every block computed by the weights ``namespace`` (they will never be looked up again)."""
        with self._lock:
            for b in [b for b in self._lru.values() if b.key[0] == namespace]:
                self._remove(b)

    def clear(self) -> None:
        """Free every block."""
        with self._lock:
            self._by_key.clear()
            self._lru.clear()
            self.bytes = 0


def common_blocks(a: Sequence[int], b: Sequence[int], limit: int, block_size: int) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, at most ``limit``, rounded down to whole blocks."""
    n = min(len(a), len(b), int(limit))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i // block_size * block_size


def supports_prefix_cache(config) -> bool:
    """True when every layer of the model's ``DynamicCache`` is a plain full-attention layer.

    Sliding-window (and other) layers drop or transform old positions, so
    their blocks are not reusable as stored; the engine then runs without a cache.
    """
    from transformers.cache_utils import DynamicCache, DynamicLayer

    layers = DynamicCache(config=config).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def past_cache(config, hits: list[list[torch.Tensor]], past_len: int):
    """A ``DynamicCache`` of ``len(hits)`` rows holding each row's cached blocks, left-padded to ``past_len``.

    Row ``i`` holds ``torch.cat(hits[i])`` in its last ``len(hits[i]) * block_size``
    columns of ``past_len``; the columns before are zeros (the caller's
    attention mask has 0 there). Returns ``DynamicCache`` with keys/values
    ``[rows, kv_heads, past_len, head_dim]`` per layer.
    """
    import torch
    from transformers.cache_utils import DynamicCache

    ref = next(h[0] for h in hits if h)
    n_layers, _, heads, _, head_dim = ref.shape
    past = ref.new_zeros((n_layers, 2, len(hits), heads, past_len, head_dim))
    for i, blocks in enumerate(hits):
        if blocks:
            kv = torch.cat(blocks, dim=-2)                          # [layers, 2, heads, c, head_dim]
            past[:, :, i, :, past_len - kv.shape[-2]:] = kv
    return DynamicCache(ddp_cache_data=[(past[j, 0], past[j, 1]) for j in range(n_layers)], config=config)


def cache_block(cache, row: int, start: int, block_size: int) -> torch.Tensor:
    """A copy of columns ``[start, start + block_size)`` of row ``row`` of a ``DynamicCache``.

    Returns ``[layers, 2, kv_heads, block_size, head_dim]`` (a new tensor, not a view).
    """
    import torch

    end = start + block_size
    return torch.stack([torch.stack([layer.keys[row, :, start:end], layer.values[row, :, start:end]])
                        for layer in cache.layers])


def cache_columns(cache, row: int, cols: torch.Tensor) -> torch.Tensor:
    """A copy of the columns ``cols`` (int64 ``[n]``, in order; any gaps) of row ``row`` of a ``DynamicCache``.

    Returns ``[layers, 2, kv_heads, n, head_dim]`` (a new tensor).
    """
    import torch

    return torch.stack([torch.stack([layer.keys[row].index_select(-2, cols), layer.values[row].index_select(-2, cols)])
                        for layer in cache.layers])
