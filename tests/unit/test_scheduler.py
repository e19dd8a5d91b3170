"""The trainer's ready-operation order (service/core/scheduler.py), on plain records.

Fairness is checked by ORDER, never by time: which operations run before which.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import pytest

from together_train_server.service.core.scheduler import (
    FIXED_COST,
    FairPolicy,
    FifoPolicy,
    ReadyQueue,
    make_policy,
    order_of,
)

_ids = itertools.count()


@dataclass
class Rec:
    """The fields of an OperationRecord the scheduler reads."""

    session_id: str
    seq_id: int
    tokens: int = 0
    tenant: str = ""
    terminal: bool = False
    operation_id: str = ""

    def __post_init__(self) -> None:
        self.operation_id = self.operation_id or f"op-{next(_ids)}"


def flood(tenant: str, sessions: int, ops: int, tokens: int) -> list[Rec]:
    """`ops` operations per session, submitted session by session (the worst arrival order for fairness)."""
    return [Rec(f"{tenant}-s{i}", seq, tokens, tenant) for i in range(sessions) for seq in range(ops)]


def test_each_session_keeps_seq_order_and_nothing_is_lost():
    recs = flood("a", 3, 5, 300) + flood("b", 2, 4, 40) + [Rec("c-s0", 0, 0, "c")]
    for policy in (FairPolicy(), FifoPolicy()):
        out = order_of(policy, recs)
        assert sorted(r.operation_id for r in out) == sorted(r.operation_id for r in recs)
        for sid in {r.session_id for r in recs}:
            seqs = [r.seq_id for r in out if r.session_id == sid]
            assert seqs == sorted(seqs), (type(policy).__name__, sid, seqs)


def test_a_small_step_of_another_key_waits_for_at_most_one_flooding_operation():
    # Key A: 7 sessions x 6 operations of 512 tokens, all queued before key B's 64-token forward_backward
    # and its optim_step arrive.
    a = flood("A", 7, 6, 512)
    b = [Rec("B-s0", 0, 64, "B"), Rec("B-s0", 1, 0, "B")]
    q = ReadyQueue("fair")
    for r in a:
        q.put(r)
    first = q.get()  # A's operation that is running when B arrives
    for r in b:
        q.put(r)
    order = [first] + [q.get() for _ in range(len(a) + len(b) - 1)]
    place = {r.operation_id: i for i, r in enumerate(order)}
    a_before_b = sum(1 for r in a if place[r.operation_id] < place[b[0].operation_id]) - 1  # minus the running one
    assert a_before_b <= 1, [(r.session_id, r.seq_id) for r in order[:6]]
    # The optim_step (FIXED_COST) follows within one more of A's operations.
    between = place[b[1].operation_id] - place[b[0].operation_id] - 1
    assert between <= 1, between
    # FIFO runs every queued A operation first.
    fifo = order_of(FifoPolicy(), a[1:] + b)
    assert fifo.index(b[0]) == len(a) - 1


def test_tokens_are_shared_evenly_between_keys_and_between_a_keys_sessions():
    # A: one session of 512-token ops; B: four sessions of 128-token ops. Over any long prefix of the order,
    # each key gets about half the tokens, and B's sessions about equal shares of B's.
    a = flood("A", 1, 40, 512)
    b = flood("B", 4, 40, 128)
    out = order_of(FairPolicy(), a + b)[:60]
    tok = {"A": 0, "B": 0}
    per_session: dict[str, int] = {}
    for r in out:
        tok[r.tenant] += r.tokens
        if r.tenant == "B":
            per_session[r.session_id] = per_session.get(r.session_id, 0) + r.tokens
    assert abs(tok["A"] - tok["B"]) <= 512 + 128, tok
    assert max(per_session.values()) - min(per_session.values()) <= 128, per_session


def test_operations_without_tokens_cost_the_fixed_cost():
    # Two keys, one sends 32 optim_steps (FIXED_COST each), the other 32-token forwards: they alternate.
    a = [Rec("A-s0", i, 0, "A") for i in range(6)]
    b = [Rec("B-s0", i, FIXED_COST, "B") for i in range(6)]
    out = order_of(FairPolicy(), a + b)
    assert [r.tenant for r in out] == ["A", "B"] * 6


def test_cancelled_records_are_skipped_uncharged_and_positions_follow_the_order():
    a = flood("A", 2, 3, 512)
    b = [Rec("B-s0", 0, 64, "B")]
    q = ReadyQueue("fair")
    for r in a + b:
        q.put(r)
    expected = order_of(FairPolicy(), a + b)
    assert [q.position(r.operation_id) for r in expected] == list(range(1, len(expected) + 1))
    assert q.position("op-unknown") == 0
    a[0].terminal = True  # cancelled while queued
    q.put(Rec("C-s0", 0, 64, "C"))  # any change recomputes the places
    got = [q.get() for _ in range(len(a) + 1)]
    assert a[0] not in got and len(q) == 0


def test_get_batch_takes_distinct_sessions_in_order_up_to_the_budget():
    a = flood("A", 3, 2, 100)
    b = flood("B", 2, 2, 100)
    q = ReadyQueue("fair")
    for r in a + b:
        q.put(r)
    expected = order_of(FairPolicy(), a + b)
    batch = q.get_batch(token_budget=350)
    assert batch == expected[:3]
    assert len({r.session_id for r in batch}) == 3
    # The first is taken whatever its cost.
    assert q.get_batch(token_budget=1) == expected[3:4]
    fifo = ReadyQueue("fifo")
    for r in a:
        fifo.put(r)
    assert fifo.get_batch(token_budget=10_000) == [a[0]]  # a[1] is the same session: the batch stops there


def test_close_wakes_a_waiting_get_and_drain_returns_the_rest():
    q = ReadyQueue("fair")
    got: list = []
    t = threading.Thread(target=lambda: got.append(q.get()))
    t.start()
    q.close()
    t.join(5)
    assert got == [None]
    q.put(Rec("A-s0", 0, 1, "A"))
    assert len(q.drain()) == 1 and q.get(timeout=0.01) is None


def test_unknown_scheduler_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown scheduler 'lifo'; one of \['fair', 'fifo'\]"):
        make_policy("lifo")
