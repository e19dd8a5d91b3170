"""The order in which the trainer worker runs ready operations (docs/design.md §5 "Scheduling").

An operation is *ready* once every earlier seq_id of its session has been
accepted (`SessionQueue` releases them in seq order). Ready operations wait in
a `ReadyQueue` under one of two policies:

- `FairPolicy` (``serve --scheduler fair``, the default): deficit round-robin
  (Shreedhar & Varghese, "Efficient fair queuing using deficit round robin",
  SIGCOMM 1995) across tenants (the API key owning the session), then, inside
  a tenant, across its sessions. Each visit of a round gives a flow `quantum`
  tokens of credit; a flow's head operation runs once the credit covers its
  cost (`cost_of`: its model_input tokens, or `FIXED_COST` for an operation
  without tokens: optim_step, weights_sync, checkpoints) and the cost is
  charged to both levels. Within a session operations stay in seq_id order:
  each session is a FIFO and only its head can be chosen. With the quantum
  no larger than the cheapest operation of a flow, a visit runs at most one
  of the flow's operations, so a tenant that becomes ready waits for at most
  the operation running now plus about one operation of every other tenant.
- `FifoPolicy` (``--scheduler fifo``): one global FIFO, the behaviour before
  the fair scheduler (kept for benchmarks/multitenant.py's comparison).

An operation is never split: the trainer engine runs a request's micro-batches
inside one call that activates the adapter, swaps its RNG stream and stashes
its accumulated gradient so that a failure leaves it untouched; interleaving
another session between micro-batches would have to save and restore all of
that, so other tenants wait at most for one whole operation.

Both policies hand out either the next operation (`ReadyQueue.get`) or a set
of ready operations of distinct sessions up to a token budget, in the
policy's order (`ReadyQueue.get_batch`), for a worker that runs several at a
time. Records that became terminal while queued (cancelled, refused) are
dropped without being charged.
"""

from __future__ import annotations

import collections
import math
import threading
from typing import Callable, Generic, Iterable, Protocol, TypeVar

# Cost charged for an operation without model_input tokens (optim_step, weights_sync, checkpoints): tokens.
FIXED_COST = 32
# Credit a flow gets per visit of a round (tokens); at most the cheapest operation so a visit runs one of them.
QUANTUM = FIXED_COST
SCHEDULERS = ("fair", "fifo")


class Queued(Protocol):
    """What the scheduler reads of a ready operation (`operations.OperationRecord` has it): its id, session,
    tenant (the owning API key; "" without keys), model_input tokens (its cost) and whether it ended."""

    @property
    def operation_id(self) -> str: ...
    @property
    def session_id(self) -> str: ...
    @property
    def tenant(self) -> str: ...
    @property
    def tokens(self) -> int: ...
    @property
    def terminal(self) -> bool: ...


Q = TypeVar("Q", bound=Queued)


def cost_of(rec: Queued) -> int:
    """Scheduling cost of an operation record: its ``tokens`` (model_input tokens), at least `FIXED_COST`."""
    return max(int(getattr(rec, "tokens", 0) or 0), FIXED_COST)


class _Drr:
    """Deficit round-robin over flows (tenants, or a tenant's sessions, by id); the caller supplies each flow's head cost.

    `choose` only looks (and grants a visit's credit): calling it again without `charge` returns the same
    flow, so a caller can inspect the choice before committing to it.
    """

    def __init__(self, quantum: int) -> None:
        self.quantum = quantum
        self.order: collections.deque[str] = collections.deque()  # active flows; the head is being visited
        self.deficit: dict[str, int] = {}
        self.granted = False  # the head already got this visit's quantum

    def clone(self) -> _Drr:
        c = _Drr(self.quantum)
        c.order, c.deficit, c.granted = collections.deque(self.order), dict(self.deficit), self.granted
        return c

    def add(self, flow: str) -> None:
        """A flow with work: joins the end of the round (a new flow starts with no credit)."""
        if flow not in self.deficit:
            self.deficit[flow] = 0
            self.order.append(flow)

    def remove(self, flow: str) -> None:
        """A flow with no work left leaves the round and loses its credit (DRR: an idle flow banks nothing)."""
        if flow not in self.deficit:
            return
        if self.order[0] == flow:
            self.granted = False
        self.order.remove(flow)
        del self.deficit[flow]

    def choose(self, cost: Callable[[str], int]) -> str:
        """The flow whose head runs next. Requires at least one flow."""
        unserved = 0
        while True:
            head = self.order[0]
            if not self.granted:
                self.deficit[head] += self.quantum
                self.granted = True
            if cost(head) <= self.deficit[head]:
                return head
            self.order.rotate(-1)
            self.granted = False
            unserved += 1
            if unserved == len(self.order):  # a whole round served nobody: skip the rounds that would too
                rounds = min(math.ceil((cost(f) - self.deficit[f]) / self.quantum) for f in self.order)
                for f in self.order:
                    self.deficit[f] += (rounds - 1) * self.quantum
                unserved = 0

    def charge(self, flow: str, cost: int, drained: bool) -> None:
        """`flow`'s head ran at `cost`; `drained`: it has no work left."""
        self.deficit[flow] -= cost
        if drained:
            self.remove(flow)


class Policy(Protocol[Q]):
    """An ordering of ready operations (not thread-safe: `ReadyQueue` locks around it)."""

    def push(self, rec: Q) -> None: ...

    def peek(self) -> Q | None: ...

    def pop(self) -> Q | None: ...

    def clone(self) -> Policy[Q]: ...

    def __len__(self) -> int: ...


class FifoPolicy(Generic[Q]):
    """One FIFO across every session and tenant."""

    def __init__(self) -> None:
        self._q: collections.deque[Q] = collections.deque()

    def push(self, rec: Q) -> None:
        self._q.append(rec)

    def peek(self) -> Q | None:
        while self._q and self._q[0].terminal:
            self._q.popleft()
        return self._q[0] if self._q else None

    def pop(self) -> Q | None:
        rec = self.peek()
        if rec is not None:
            self._q.popleft()
        return rec

    def clone(self) -> FifoPolicy[Q]:
        c: FifoPolicy[Q] = FifoPolicy()
        c._q = collections.deque(self._q)
        return c

    def __len__(self) -> int:
        return sum(1 for r in self._q if not r.terminal)


class FairPolicy(Generic[Q]):
    """Deficit round-robin across tenants, then across a tenant's sessions; each session a FIFO (module doc).

    A record's tenant is its ``tenant`` attribute (the owning API key; "" without keys), its session its
    ``session_id``.
    """

    def __init__(self, quantum: int = QUANTUM) -> None:
        self.quantum = quantum
        self._tenants = _Drr(quantum)
        self._sessions: dict[str, _Drr] = {}  # tenant -> DRR over its sessions
        self._fifo: dict[str, collections.deque[Q]] = {}  # session -> its ready records in seq order

    def clone(self) -> FairPolicy[Q]:
        c: FairPolicy[Q] = FairPolicy(self.quantum)
        c._tenants = self._tenants.clone()
        c._sessions = {t: d.clone() for t, d in self._sessions.items()}
        c._fifo = {s: collections.deque(q) for s, q in self._fifo.items()}
        return c

    def push(self, rec: Q) -> None:
        tenant, sid = getattr(rec, "tenant", ""), rec.session_id
        self._fifo.setdefault(sid, collections.deque()).append(rec)
        self._sessions.setdefault(tenant, _Drr(self.quantum)).add(sid)
        self._tenants.add(tenant)

    def __len__(self) -> int:
        return sum(1 for q in self._fifo.values() for r in q if not r.terminal)

    def _purge(self) -> None:
        """Drop records that ended while queued (cancelled, refused); flows left empty leave their rounds."""
        for tenant, drr in list(self._sessions.items()):
            for sid in list(drr.order):
                q = self._fifo[sid]
                if any(r.terminal for r in q):
                    self._fifo[sid] = q = collections.deque(r for r in q if not r.terminal)
                if not q:
                    del self._fifo[sid]
                    drr.remove(sid)
            if not drr.order:
                del self._sessions[tenant]
                self._tenants.remove(tenant)

    def _choose(self) -> tuple[str, str] | None:
        self._purge()
        if not self._tenants.order:
            return None
        pick: dict[str, str] = {}

        def session_of(tenant: str) -> str:
            if tenant not in pick:
                pick[tenant] = self._sessions[tenant].choose(lambda sid: cost_of(self._fifo[sid][0]))
            return pick[tenant]

        tenant = self._tenants.choose(lambda t: cost_of(self._fifo[session_of(t)][0]))
        return tenant, session_of(tenant)

    def peek(self) -> Q | None:
        chosen = self._choose()
        return None if chosen is None else self._fifo[chosen[1]][0]

    def pop(self) -> Q | None:
        chosen = self._choose()
        if chosen is None:
            return None
        tenant, sid = chosen
        q = self._fifo[sid]
        rec = q.popleft()
        cost = cost_of(rec)
        if not q:
            del self._fifo[sid]
        drr = self._sessions[tenant]
        drr.charge(sid, cost, drained=not q)
        self._tenants.charge(tenant, cost, drained=not drr.order)
        if not drr.order:
            del self._sessions[tenant]
        return rec


def make_policy(name: str) -> Policy[Q]:
    """``"fair"`` or ``"fifo"``. Raises ValueError naming the choices for anything else."""
    if name == "fair":
        return FairPolicy()
    if name == "fifo":
        return FifoPolicy()
    raise ValueError(f"unknown scheduler {name!r}; one of {list(SCHEDULERS)}")


class ReadyQueue(Generic[Q]):
    """The thread-safe queue of ready operations the trainer worker takes from, in a `Policy`'s order.

    Args:
        policy: `FairPolicy`, `FifoPolicy` or a name for `make_policy`.
    """

    def __init__(self, policy: Policy[Q] | str = "fair") -> None:
        self.policy: Policy[Q] = make_policy(policy) if isinstance(policy, str) else policy
        self.name = policy if isinstance(policy, str) else type(policy).__name__
        self._cond = threading.Condition()
        self._closed = False
        self._version = 0
        self._positions: tuple[int, dict[str, int]] = (-1, {})

    def put(self, rec: Q) -> None:
        with self._cond:
            self.policy.push(rec)
            self._version += 1
            self._cond.notify()

    def close(self) -> None:
        """Wake every `get`: they return None from now on."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def get(self, timeout: float | None = None) -> Q | None:
        """The next operation in the policy's order, waiting for one; None once closed or after `timeout` s."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                rec = self.policy.pop()
                if rec is not None:
                    self._version += 1
                    return rec
                if not self._cond.wait(timeout) and timeout is not None:
                    return None

    def get_batch(self, token_budget: int, timeout: float | None = None) -> list[Q]:
        """Ready operations of distinct sessions in the policy's order, up to `token_budget` tokens of cost.

        Waits like `get` for the first; the first is taken whatever its cost (it could never run otherwise).
        Stops at the first operation that would exceed the budget or whose session is already in the batch
        (taking a later one instead would run it out of the policy's order). Empty once closed or on timeout.
        """
        first = self.get(timeout)
        if first is None:
            return []
        batch, used, sessions = [first], cost_of(first), {first.session_id}
        with self._cond:
            while True:
                nxt = self.policy.peek()
                if nxt is None or nxt.session_id in sessions or used + cost_of(nxt) > token_budget:
                    return batch
                self.policy.pop()
                self._version += 1
                batch.append(nxt)
                used += cost_of(nxt)
                sessions.add(nxt.session_id)

    def drain(self) -> list[Q]:
        """Remove and return every queued operation (shutdown), in the policy's order."""
        out: list[Q] = []
        with self._cond:
            while (rec := self.policy.pop()) is not None:
                out.append(rec)
            self._version += 1
        return out

    def position(self, operation_id: str) -> int:
        """1-based place of a queued operation in the order it would run now (1 = next); 0 when not queued.

        Computed by running the policy on a copy (O(queued operations)), cached until the queue changes.
        """
        with self._cond:
            version, table = self._positions
            if version != self._version:
                copy = self.policy.clone()
                table = {}
                while (rec := copy.pop()) is not None:
                    table[rec.operation_id] = len(table) + 1
                self._positions = (self._version, table)
            return table.get(operation_id, 0)

    def __len__(self) -> int:
        with self._cond:
            return len(self.policy)


def order_of(policy: Policy[Q], records: Iterable[Q]) -> list[Q]:
    """The order `policy` runs `records` in when all are ready at once (a copy of the policy is used)."""
    copy = policy.clone()
    for r in records:
        copy.push(r)
    out: list[Q] = []
    while (rec := copy.pop()) is not None:
        out.append(rec)
    return out
