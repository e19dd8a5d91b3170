"""The usage meter's sums and their SQLite table (service/usage/), without a server: exact integer sums,
visible before a flush, kept across a reopen of the file, and the Prometheus key cap."""

from __future__ import annotations

import sqlite3

from together_train_server.service.usage.meter import UsageMeter
from together_train_server.service.usage.prometheus import MAX_KEYS, key_label, usage_families
from together_train_server.service.usage.store import UsageStore

OWNERS = {"s-a1": "tag-a", "s-a2": "tag-a", "s-b1": "tag-b"}


def meter(path) -> UsageMeter:
    return UsageMeter(UsageStore(path), OWNERS.get, tag_of=lambda key: f"tag-{key}", flush_s=3600)


class Rec:
    def __init__(self, session_id: str, kind: str, tokens: int, trainer_s: float) -> None:
        self.session_id, self.kind, self.tokens, self.trainer_s = session_id, kind, tokens, trainer_s


def test_sums_are_exact_visible_before_a_flush_and_kept_across_a_reopen(tmp_path):
    path = tmp_path / "registry.sqlite3"
    m = meter(path)
    m.operation_ended(Rec("s-a1", "forward_backward", 39, 0.5), "SUCCEEDED")
    m.operation_ended(Rec("s-a1", "forward_backward", 7, 0.25), "FAILED")  # time counted, tokens not
    m.operation_ended(Rec("s-a2", "forward", 17, 0.125), "SUCCEEDED")
    m.operation_ended(Rec("s-a2", "optim_step", 0, 0.0625), "SUCCEEDED")
    m.add("s-b1", sampled_tokens=24, sampler_seconds=1.5, prefill_tokens=60, prefix_cache_tokens=20)
    m.add("s-unknown", sampled_tokens=5)  # a session nobody owns: dropped
    m.add("", sampled_tokens=5)  # no session: dropped
    s = m.sessions()  # nothing flushed yet
    assert (s["s-a1"].trained_tokens, s["s-a1"].trainer_seconds) == (39, 0.75)
    assert (s["s-a2"].forward_tokens, s["s-a2"].optimizer_steps) == (17, 1)
    assert set(s) == {"s-a1", "s-a2", "s-b1"}
    m.flush()
    m.add("s-a1", sampled_tokens=3)  # half in the file, half in memory
    k = m.keys()
    assert (k["tag-a"].trained_tokens, k["tag-a"].forward_tokens, k["tag-a"].sampled_tokens) == (39, 17, 3)
    assert (k["tag-b"].prefill_tokens, k["tag-b"].prefix_cache_tokens) == (60, 20)
    assert m.tokens_of_owner("a") == 56
    m.close()  # writes the rest
    again = meter(path)
    assert {t: (u.trained_tokens, u.sampled_tokens, u.trainer_seconds) for t, u in again.keys().items()} == {
        "tag-a": (39, 3, 0.9375), "tag-b": (0, 24, 0.0)}
    again.close()


def test_checkpoint_bytes_come_from_the_registry_rows(tmp_path):
    path = tmp_path / "registry.sqlite3"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE checkpoints (uri TEXT, session_id TEXT, owner TEXT, size_bytes INTEGER)")
    db.executemany("INSERT INTO checkpoints VALUES (?, ?, ?, ?)",
                   [("u1", "s-a1", "tag-a", 100), ("u2", "s-a1", "tag-a", 23), ("u3", "s-b1", "tag-b", 7)])
    db.commit()
    db.close()
    m = meter(path)
    assert {t: u.checkpoint_bytes for t, u in m.keys().items()} == {"tag-a": 123, "tag-b": 7}
    m.close()


def test_prometheus_series_are_capped_and_the_rest_summed_as_other(tmp_path):
    m = meter(tmp_path / "registry.sqlite3")
    owners = {f"s-{i}": f"{i:012x}{0:020x}" for i in range(MAX_KEYS + 10)}
    m._owner_of = owners.get
    for i, sid in enumerate(owners):
        m.add(sid, trained_tokens=1000 + i)  # the 10 smallest keys go to "other"
    fams = {f.name: f for f in usage_families(m, lambda tag: True)}
    samples = {s.labels["key"]: s.value for s in fams["together_train_usage_trained_tokens"].samples}
    assert len(samples) == MAX_KEYS + 1
    assert samples["other"] == sum(1000 + i for i in range(10))
    assert samples[key_label(f"{MAX_KEYS + 9:012x}{0:020x}")] == 1000 + MAX_KEYS + 9
    assert all(len(label) <= 12 for label in samples)
    mine = {f.name: f for f in usage_families(m, lambda tag: tag == f"{3:012x}{0:020x}")}
    assert [s.labels["key"] for s in mine["together_train_usage_trained_tokens"].samples] == [key_label(f"{3:012x}{0:020x}")]
    assert all(not f.samples for f in usage_families(m, None))
    m.close()
