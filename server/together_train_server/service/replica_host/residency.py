"""Which adapters a generator replica keeps loaded: at most ``capacity``, least recently used evicted.

A replica serves many sessions' adapters but holds only ``capacity`` of them in its engine
(``--max-adapters``). The replica's adapter host (`host.ReplicaHost`) calls `touch` when a
request uses an adapter and `loaded` after a push; `loaded` names the adapters to drop from
the engine. An evicted adapter keeps its version in the replica's table, so the resource's
health probes do not re-push it on every probe; a request for it answers "holds no weights",
and the resource's pool re-pushes that key's latest version (it keeps every key's latest
tensors, service/replicas/pool.py) and retries: the adapter is loaded on demand, evicting the
next least recently used one.

Plain Python, no torch; not thread-safe (the host holds its lock around every call).
"""

from __future__ import annotations

import collections

__all__ = ["AdapterResidency"]


class AdapterResidency:
    """LRU order of a replica's loaded adapters and the set evicted from its engine.

    Args:
        capacity: most adapters loaded at once (0 = no limit).

    Raises:
        ValueError: a negative capacity.
    """

    def __init__(self, capacity: int = 0) -> None:
        if int(capacity) < 0:
            raise ValueError(f"max adapters must be >= 0, got {capacity}")
        self.capacity = int(capacity)
        self._order: collections.OrderedDict[str, None] = collections.OrderedDict()   # loaded, oldest first
        self.evicted: set[str] = set()
        self.evictions = 0

    def is_evicted(self, key: str) -> bool:
        return key in self.evicted

    def touch(self, key: str) -> None:
        """``key`` served a request: it becomes the most recently used (a no-op for a key not loaded)."""
        if key in self._order:
            self._order.move_to_end(key)

    def loaded(self, key: str) -> list[str]:
        """``key`` was just loaded into the engine; returns the keys to drop from it (oldest first)."""
        self.evicted.discard(key)
        self._order[key] = None
        self._order.move_to_end(key)
        out = []
        while self.capacity and len(self._order) > self.capacity:
            victim, _ = self._order.popitem(last=False)
            self.evicted.add(victim)
            out.append(victim)
        self.evictions += len(out)
        return out

    def forget(self, key: str) -> bool:
        """``key`` is dropped for good; returns True when it was loaded in the engine (drop it there)."""
        self.evicted.discard(key)
        return self._order.pop(key, 0) is None

    def __len__(self) -> int:
        return len(self._order)
