"""Usage as Prometheus series labelled by key, with bounded cardinality.

``together_train_usage_<field>_total{key}`` for every metered quantity (counters: they only grow, and
survive restarts because they are read from the registry), ``together_train_usage_checkpoint_bytes{key}``
(a gauge: deleting a checkpoint lowers it). ``key`` is the first 12 hex digits of the key's owner tag
(a sha256 tag, never the key; "none" without API keys). At most `MAX_KEYS` keys get their own series,
the ones with the most tokens; the others are summed under ``key="other"``.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from together_train_server.service.usage.meter import UsageMeter, UsageTotals
from together_train_server.service.usage.store import FIELDS

MAX_KEYS = 50


def key_label(tag: str) -> str:
    """The ``key`` label of an owner tag."""
    return tag[:12] if tag else "none"


def _capped(keys: list[UsageTotals]) -> list[tuple[str, UsageTotals]]:
    def weight(u: UsageTotals) -> int:
        return u.trained_tokens + u.forward_tokens + u.sampled_tokens + u.prefill_tokens

    ranked = sorted(keys, key=weight, reverse=True)
    out = [(key_label(u.key), u) for u in ranked[:MAX_KEYS]]
    if len(ranked) > MAX_KEYS:
        other = UsageTotals(key="other")
        for u in ranked[MAX_KEYS:]:
            other.add(u.as_dict())
            other.checkpoint_bytes += u.checkpoint_bytes
        out.append(("other", other))
    return out


def usage_families(meter: UsageMeter, see: Callable[[str], bool] | None) -> Iterator:
    """The usage metric families of the keys (owner tags) `see` accepts (None: none, the families empty)."""
    keys = [] if see is None else [u for tag, u in meter.keys().items() if see(tag)]
    rows = _capped(keys)
    for f in FIELDS:
        fam = CounterMetricFamily(f"together_train_usage_{f}", f"Usage: {f.replace('_', ' ')} per API key "
                                  "(docs/operating.md)", labels=["key"])
        for label, u in rows:
            fam.add_metric([label], getattr(u, f))
        yield fam
    gauge = GaugeMetricFamily("together_train_usage_checkpoint_bytes", "Usage: bytes of checkpoints in storage "
                              "per API key", labels=["key"])
    for label, u in rows:
        gauge.add_metric([label], u.checkpoint_bytes)
    yield gauge
