"""Generator replica pool: routing, weight pushes, deadlines and health probes (docs/design.md §2, §7).

The pool holds replica clients (`ReplicaConnection`; the gRPC client lives in the wire
layer, `together_train_server.wire.replica_client`); here is only the routing,
the bookkeeping and the supervision policy, so it can be driven in tests
without a network.

Failure handling (README "Failures"):

- Every call to a replica has a deadline sized from its work (`Deadlines`).
  A call that misses it, or finds the replica gone, marks the replica down
  (out of routing) and the request is retried on another replica.
- `supervise` probes every replica's Health with a deadline. A replica that
  misses `probe_misses` probes in a row is marked down; its in-flight calls
  are cancelled (and so retried elsewhere); when the resource spawned it, it
  is killed and restarted (`Restarter`). A down replica that answers a probe
  again, or a restarted one, is reconciled (`replace`): every adapter it
  holds at another version than the pool's latest is dropped and the latest
  pushed, then it is routed to again.
- A live replica whose probe shows it lost an adapter (restart, drop, lost
  push) gets it re-pushed; a request that still meets "holds no weights"
  re-pushes the adapter to that replica and is retried.
- A weights push (`publish`) completes once the replicas that answer hold the
  version: a replica that has not acknowledged it within the sync deadline
  (`Deadlines.for_sync`, about a second for a LoRA) is a laggard: it is not
  routed to for that adapter key, nor sent new pushes, until its push ends.
  When that push succeeds it is caught up in the background to every key's
  latest version (then routed to again); when it fails (the push deadline
  `for_bytes`, or the probes) it is marked down as below. A push fails
  (UNAVAILABLE, naming each replica and why) only when no replica took it.
- A replica whose health probe goes unanswered for ``suspect_after_s`` (0.5 s)
  is suspect until a probe answers (service/replicas/supervision.py): new
  requests go to the others, and a sample / compute_logprobs in flight there
  is re-issued on another replica at once (`route(hedge=True)`), so a stopped
  replica costs a sample about half a second, not the probes' detection time.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, Callable, Generic, Iterator, Mapping, TypeVar

from together_train_server.engines.lora import tensor_bytes
from together_train_server.service.errors import ServiceError
from together_train_server.service.replicas.errors import ReplicaError, ReplicaLacksWeights, ReplicaUnavailable  # noqa: F401 (re-exported)
from together_train_server.service.replicas.deadlines import Deadlines, deadlines_from_args  # noqa: F401 (re-exported)
from together_train_server.service.replicas.client import ReplicaConnection
from together_train_server.service.replicas.supervision import Restarter, ReplicaSupervisor, SupervisedState  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    import torch

    from together_train_server.engines.types import LoraConfig

T = TypeVar("T")
# The replica clients the pool holds: what the pool needs (`ReplicaConnection`) and whatever its callers'
# `route` calls use (the sampling path's `ReplicaClient`, service/sampling/replica_sampler.py).
C = TypeVar("C", bound=ReplicaConnection)
log = logging.getLogger(__name__)


class ReplicaPool(Generic[C]):
    """Routes requests to the replica with the fewest outstanding requests.

    A replica that raises ReplicaUnavailable is marked down and the request is
    retried on another; when none is live, a request waits up to
    `deadlines.wait_for_replica_s` for one to come back (see `replace`). The
    pool keeps each adapter key's latest pushed version (sessions and
    ``ckpt:<uri>`` keys) so a replica that comes back gets every current
    version before it serves again.

    Args:
        clients: the replicas, in a fixed order (replica ids must be unique).
        deadlines: call deadlines and probe policy (default `Deadlines()`).
        wait_for_replica_s: overrides ``deadlines.wait_for_replica_s``.

    Attributes:
        supervisor: its `ReplicaSupervisor` (probes, suspicion, restarts), started by `supervise`.
    """

    def __init__(
        self,
        clients: list[C],
        *,
        deadlines: Deadlines | None = None,
        wait_for_replica_s: float | None = None,
    ) -> None:
        d = deadlines or Deadlines()
        if wait_for_replica_s is not None:
            d = dataclasses.replace(d, wait_for_replica_s=wait_for_replica_s)
        self.deadlines = d
        self._clients = list(clients)
        for c in self._clients:
            c.deadlines = d
        self._outstanding = {c.replica_id: 0 for c in self._clients}
        self._down: set[str] = set()
        self._lock = threading.Lock()
        self._up = threading.Condition(self._lock)
        self._push_locks: dict[str, threading.Lock] = {}
        # key -> (version, lora, tensors) last pushed, re-pushed to replicas that lost it.
        self._latest: dict[str, tuple[int, LoraConfig, Mapping[str, torch.Tensor]]] = {}
        self._executor = ThreadPoolExecutor(max_workers=max(4, 8 * len(self._clients)), thread_name_prefix="push")
        self._closed = threading.Event()
        # Laggards (see `publish`): key -> {replica id: version it must hold before serving the key};
        # a stalled replica has a push in flight past its sync deadline and is sent no new push.
        self._lagging: dict[str, dict[str, int]] = {}
        self._stalled: dict[str, int] = {}  # replica id -> pushes in flight past their sync deadline
        self._suspect: set[str] = set()  # replicas whose last probe is unanswered past suspect_after_s
        self.supervisor: ReplicaSupervisor[C] = ReplicaSupervisor(self)

    def __len__(self) -> int:
        return len(self._clients)

    @property
    def replica_ids(self) -> list[str]:
        return [c.replica_id for c in self._clients]

    def client(self, replica_id: str) -> C:
        """The client in `replica_id`'s slot now (raises StopIteration for an unknown id)."""
        with self._lock:
            return next(c for c in self._clients if c.replica_id == replica_id)

    # ----- supervision (service/replicas/supervision.py) ---------------------------------------
    def supervise(self, restarters: Mapping[str, Restarter[C]] | None = None) -> None:
        """Start the probe threads (`ReplicaSupervisor.start`)."""
        self.supervisor.start(dict(restarters or {}))

    def stop_supervising(self) -> None:
        """Stop the probe threads (before replica processes are terminated on shutdown)."""
        self.supervisor.stop()

    def set_suspect(self, replica_id: str, suspect: bool) -> None:
        """Route new requests away from `replica_id` (and re-issue its hedged calls) while suspect."""
        with self._lock:
            was = replica_id in self._suspect
            if suspect == was:
                return
            if suspect:
                self._suspect.add(replica_id)
            else:
                self._suspect.discard(replica_id)
            self._up.notify_all()  # wakes hedged calls waiting on this replica (route)
        if suspect:
            log.warning("replica %s did not answer a health probe within %.2f s: requests go to the others "
                        "until it does", replica_id, self.deadlines.suspect_after_s)
        else:
            log.warning("replica %s answers again", replica_id)

    def adopt(self, replica_id: str, client: C) -> None:
        """Put a restarted replica's client in its slot, still out of routing, so the probes reach
        the new process even when the first `replace` fails (the next probe round retries it)."""
        client.deadlines = self.deadlines
        with self._lock:
            i = next(i for i, c in enumerate(self._clients) if c.replica_id == replica_id)
            old, self._clients[i] = self._clients[i], client
            client.replica_id = replica_id
            self._down.add(replica_id)
        if old is not client:
            old.close()

    def refresh(self, client: C, held: dict[str, int]) -> None:
        """Re-push to a live replica what its probe (`held`) shows it lost; keys with a push under way
        are left to that push. Raises ReplicaUnavailable."""
        self._reconcile(client, held, blocking=False)

    def _push_lock(self, key: str) -> threading.Lock:
        with self._lock:
            return self._push_locks.setdefault(key, threading.Lock())

    # ----- routing ---------------------------------------------------------------------------
    def _routable(self, exclude: set[str], key: str) -> list[C]:
        """The replicas a request for `key` may go to now, but those in `exclude` (caller holds ``_lock``):
        not down, not stalled, not lagging behind the key's latest version."""
        lag = self._lagging.get(key, {}) if key else {}
        return [c for c in self._clients if c.replica_id not in self._down and c.replica_id not in exclude
                and c.replica_id not in lag and c.replica_id not in self._stalled]

    def _acquire(self, exclude: set[str], key: str = "") -> C:
        with self._lock:
            def live_now() -> list[C]:
                return self._routable(exclude, key)

            live = live_now()
            if not live and self._clients:
                # Every replica is down or already tried: wait for one to come back (replace()).
                exclude.clear()
                self._up.wait_for(lambda: bool(live_now()), timeout=self.deadlines.wait_for_replica_s)
                live = live_now()
            if not live:
                raise ServiceError(
                    "UNAVAILABLE" if self._clients else "FAILED_PRECONDITION",
                    f"no generator replica is available (waited {self.deadlines.wait_for_replica_s:.0f} s; "
                    f"down: {', '.join(sorted(self._down))})"
                    if self._clients
                    else "this resource has no generator replicas (start it with --generators N)",
                    retryable=bool(self._clients),
                )
            # A suspect replica (service/replicas/supervision.py) gets requests only when all are suspect.
            live = [c for c in live if c.replica_id not in self._suspect] or live
            best = min(live, key=lambda c: self._outstanding[c.replica_id])
            self._outstanding[best.replica_id] += 1
            return best

    def _release(self, client: C) -> None:
        with self._lock:
            if client.replica_id in self._outstanding:
                self._outstanding[client.replica_id] = max(0, self._outstanding[client.replica_id] - 1)

    def route(self, call: Callable[[C], T], key: str = "", *, hedge: bool = False) -> T:
        """Run `call` on the least-loaded live replica, retrying on others if one is down.

        Args:
            call: the request, given a replica client.
            key: the adapter key the request uses ("" = base model): a replica
                that lost it gets the latest version re-pushed before the retry.
            hedge: `call` has no side effect (sample, compute_logprobs): when its
                replica turns suspect (a health probe unanswered past
                ``deadlines.suspect_after_s``) while another replica is not, the call
                is re-issued there and the first one's answer is dropped when it comes.

        Raises:
            ServiceError: UNAVAILABLE (retryable) when no replica came back in
                time; FAILED_PRECONDITION on a resource without replicas, or
                when a replica lacks an adapter the pool has no version of.
        """
        tried: set[str] = set()
        repushed: set[str] = set()
        while True:
            client = self._acquire(tried, key)
            if hedge and len(self._clients) > 1:
                fut = self._run_hedged(call, client, key, tried)
                if fut is None:  # its replica turned suspect: re-issued elsewhere
                    tried.add(client.replica_id)
                    continue
                try:
                    return fut.result()
                except (ReplicaUnavailable, ReplicaLacksWeights) as e:
                    self._recover(client, e, key, tried, repushed)
                continue
            try:
                return call(client)
            except (ReplicaUnavailable, ReplicaLacksWeights) as e:
                self._recover(client, e, key, tried, repushed)
            finally:
                self._release(client)

    def _run_hedged(self, call: Callable[[C], T], client: C, key: str,
                    tried: set[str]) -> "Future[T] | None":
        """Run `call(client)` on its own thread; its finished future, or None once `client` is suspect
        and another replica `_acquire` would pick for `key` (not in `tried`) is not (the call then runs
        on and its answer is dropped; `client` counts it as outstanding until it ends)."""
        fut: Future[T] = Future()

        def run() -> None:
            try:
                fut.set_result(call(client))
            except BaseException as e:  # handed to the waiting caller
                fut.set_exception(e)
            finally:
                self._release(client)
                with self._lock:
                    self._up.notify_all()

        threading.Thread(target=run, name=f"hedged-{client.replica_id}", daemon=True).start()
        rid = client.replica_id
        with self._lock:
            while not fut.done():
                # The same choice as _acquire's: an alternative that only lags for `key` would send the
                # retry straight back to this replica.
                if rid in self._suspect and any(
                        c.replica_id not in self._suspect for c in self._routable(tried | {rid}, key)):
                    log.warning("replica %s is suspect: its request is re-issued on another replica", rid)
                    return None
                self._up.wait(timeout=0.5)  # woken by the call's end and by suspicion changes
        return fut

    def route_stream(self, call: Callable[[C], Iterator[T]], key: str = "") -> Iterator[T]:
        """`route` for a streamed answer: yields the items of `call(client)` as they come.

        A replica that fails before its first item is handled as in `route`
        (marked down and retried elsewhere, or the adapter re-pushed); the
        replica counts as busy until the stream ends. Once items were yielded
        the answer cannot be restarted elsewhere without repeating them, so a
        failure then is UNAVAILABLE (retryable) naming the replica.

        Raises:
            ServiceError: as `route`, and UNAVAILABLE for a replica lost mid-stream.
        """
        tried: set[str] = set()
        repushed: set[str] = set()
        while True:
            client = self._acquire(tried, key)
            started = False
            try:
                for item in call(client):
                    started = True
                    yield item
                return
            except (ReplicaUnavailable, ReplicaLacksWeights) as e:
                if started:
                    if isinstance(e, ReplicaUnavailable):
                        self.mark_down(client.replica_id, str(e))
                    raise ServiceError("UNAVAILABLE", f"the answer stopped part-way: {e}", retryable=True) from e
                self._recover(client, e, key, tried, repushed)
            finally:
                self._release(client)

    def _recover(self, client: C, e: Exception, key: str, tried: set[str], repushed: set[str]) -> None:
        """After a routed call failed on `client`: mark it down (retry elsewhere) or re-push the adapter it lost.

        Raises:
            ServiceError: FAILED_PRECONDITION when the pool has no version of the lost adapter, or
                re-pushing did not help.
        """
        if isinstance(e, ReplicaUnavailable):
            tried.add(client.replica_id)
            self.mark_down(client.replica_id, str(e))
            return
        assert isinstance(e, ReplicaLacksWeights)
        e.key = e.key or key
        with self._lock:
            known = e.key in self._latest
        if not known or client.replica_id in repushed:
            raise ServiceError("FAILED_PRECONDITION", str(e), retryable=True) from e  # str(e) names the key
        repushed.add(client.replica_id)
        # An adapter evicted by the replica's --max-adapters is loaded on demand (normal): INFO, not WARNING.
        log.log(logging.INFO if "evicted" in str(e) else logging.WARNING,
                "replica %s lost adapter %s: re-pushing it before retrying", client.replica_id, e.key)
        try:
            self._repush(client, e.key)
        except ReplicaUnavailable as err:
            tried.add(client.replica_id)
            self.mark_down(client.replica_id, str(err))

    def mark_down(self, replica_id: str, reason: str = "") -> None:
        """Stop routing to a replica until `replace` brings it back; cancel its calls in flight.

        The cancelled calls raise ReplicaUnavailable in their callers, so routed
        requests are retried elsewhere and a waiting push counts it as failed.
        """
        with self._lock:
            newly = replica_id not in self._down
            self._down.add(replica_id)
            client = next((c for c in self._clients if c.replica_id == replica_id), None)
        if newly:
            log.warning("replica %s taken out of routing: %s", replica_id, reason or "marked down")
            if client is not None:
                client.cancel_inflight()

    def is_down(self, replica_id: str) -> bool:
        with self._lock:
            return replica_id in self._down

    def snapshot(self) -> list[dict[str, Any]]:
        """Each replica as the pool sees it, in pool order (metrics, dashboard, `together-train status`).

        Returns:
            dicts with ``replica_id``, ``address`` ("" when the client has none), ``state``
            (``healthy`` routed to, ``unhealthy`` out of routing, ``restarting`` its process is being
            restarted), ``outstanding`` (requests in flight), ``restarts`` (processes restarted) and
            ``versions`` ({adapter key: version} at its last health probe; {} before the first).
        """
        states = [self.supervisor.state(rid) for rid in self.replica_ids]
        with self._lock:
            return [
                {
                    "replica_id": c.replica_id,
                    "address": str(getattr(c, "address", "") or ""),
                    "state": "restarting" if seen.restarting
                    else "unhealthy" if c.replica_id in self._down else "healthy",
                    "outstanding": int(self._outstanding.get(c.replica_id, 0)),
                    "restarts": seen.restarts,
                    "versions": seen.versions,
                }
                for c, seen in zip(self._clients, states)
            ]

    # ----- reconciling a replica with the latest versions ------------------------------------------
    def _repush(self, client: C, key: str) -> None:
        """Push `key`'s latest version to one replica (serialised with the key's other pushes)."""
        with self._push_lock(key):
            with self._lock:
                latest = self._latest.get(key)
            if latest is not None:
                client.push(key, *latest)

    def _reconcile(
        self,
        client: C,
        held: dict[str, int],
        *,
        blocking: bool,
        finish: Callable[[], None] | None = None,
    ) -> None:
        """Make `client` hold exactly the pool's latest version of every key.

        `held` is what its probe reported. A key held at a newer version than
        the latest is dropped first (a replica never replaces a version by an
        older one, and the latest may be older after a load_state); a key the
        pool no longer knows is dropped. With `blocking` False, keys whose push
        is under way are left to that push. `finish` runs under the pool lock
        once nothing is left to do, so no push_all can slip in between.
        Raises ReplicaUnavailable.
        """
        have = dict(held)
        skipped: dict[str, int] = {}
        while True:
            with self._lock:
                unknown = [k for k in have if k not in self._latest]
                todo = [k for k, v in self._latest.items() if have.get(k) != v[0] and skipped.get(k) != v[0]]
                if not unknown and not todo:
                    if finish is not None:
                        finish()
                    return
            for key in unknown + todo:
                lock = self._push_lock(key)
                if not lock.acquire(blocking=blocking):
                    # A push of this key is under way: it reaches this replica too, or fails and marks it down.
                    with self._lock:
                        skipped[key] = self._latest.get(key, (-2,))[0]
                    if key in unknown:
                        have.pop(key)  # left to that push (or drop_all); checked again next probe
                    continue
                try:
                    with self._lock:
                        latest = self._latest.get(key)
                    if latest is None or have.get(key, -1) > latest[0]:
                        client.drop(key)
                        have.pop(key, None)
                    if latest is not None:
                        client.push(key, *latest)
                        have[key] = latest[0]
                finally:
                    lock.release()

    def replace(self, replica_id: str, client: C) -> None:
        """Bring a replica (restarted, or answering again) back: reconcile its adapters, then route to it.

        Raises:
            ReplicaUnavailable: the replica failed a probe or a re-push (it stays down).
        """
        client.deadlines = self.deadlines
        held = client.probe()
        old: list[C] = []

        def swap_in() -> None:  # under self._lock, with every latest version on the replica
            i = next(i for i, c in enumerate(self._clients) if c.replica_id == replica_id)
            if self._clients[i] is not client:
                old.append(self._clients[i])
            client.replica_id = replica_id
            self._clients[i] = client
            self._outstanding[replica_id] = 0
            self._down.discard(replica_id)
            self._stalled.pop(replica_id, None)
            self._suspect.discard(replica_id)  # it just answered a probe
            for lag in self._lagging.values():
                lag.pop(replica_id, None)  # it holds every latest version now
            self._up.notify_all()

        self._reconcile(client, held, blocking=True, finish=swap_in)
        for c in old:
            c.close()
        log.warning("replica %s is routed to again", replica_id)

    # ----- weights ---------------------------------------------------------------------------
    def snapshot_dtype(self) -> str:
        """The dtype to snapshot an adapter in for a push: the wire dtype every replica in the pool
        reported (``known_wire_dtype``, from its Health), else "float32" (each push converts).

        A snapshot in the replicas' dtype is converted once, on the trainer, and sent as it is."""
        with self._lock:
            seen = {getattr(c, "known_wire_dtype", None) for c in self._clients}
        dtype = seen.pop() if len(seen) == 1 else None
        return str(dtype) if dtype is not None else "float32"

    def push_all(self, session_id: str, version: int, lora: LoraConfig, tensors: Mapping[str, torch.Tensor]) -> int:
        """`publish` and return the bytes sent per replica."""
        return self.publish(session_id, version, lora, tensors)[0]

    def publish(self, session_id: str, version: int, lora: LoraConfig, tensors: Mapping[str, torch.Tensor]) -> tuple[int, int]:
        """Push one adapter key's version to every live replica; returns (bytes per replica, replicas).

        Pushes of one key are serialised so versions arrive in order. The call
        returns once every replica took the version, or once
        ``deadlines.for_sync(bytes)`` passed and at least one did: a replica
        still pushing then is a laggard, not routed to for this key (nor sent
        other pushes) until its push ends; it never serves an older version
        than the one returned here. A laggard whose push succeeds is caught up
        in the background (`_laggard_done`); one whose push misses its own
        deadline ``deadlines.for_bytes(bytes)``, or is gone, is marked down and
        serves again only after `replace` re-pushed it. The second value is the
        number of replicas that serve `version` (or newer) when it returns.

        Raises:
            ServiceError: UNAVAILABLE naming each replica when none accepted the
                push; FAILED_PRECONDITION without replicas; a replica's refusal
                (INTERNAL) as raised by its client.
        """
        if not self._clients:
            raise ServiceError("FAILED_PRECONDITION", "this resource has no generator replicas to sync to")
        lock = self._push_lock(session_id)
        with self._lock:
            if self._latest.get(session_id, (-1,))[0] <= version:
                self._latest[session_id] = (version, lora, tensors)

            def live() -> list[C]:
                return [c for c in self._clients if c.replica_id not in self._down]

            # All down (restarting): a replica that comes back gets this version in replace().
            self._up.wait_for(lambda: bool(live()), timeout=self.deadlines.wait_for_replica_s)
            targets = live()
            # A stalled replica gets no new push (it would queue behind the stalled one): it lags for
            # this key and is caught up when its push ends. Unless every live replica is stalled.
            stalled = [c for c in targets if c.replica_id in self._stalled]
            if len(stalled) < len(targets):
                targets = [c for c in targets if c.replica_id not in self._stalled]
                lag = self._lagging.setdefault(session_id, {})
                for c in stalled:
                    lag[c.replica_id] = max(version, lag.get(c.replica_id, -1))
        if not targets:
            raise ServiceError(
                "UNAVAILABLE",
                f"no generator replica is up to receive the weights (waited {self.deadlines.wait_for_replica_s:.0f} s)",
                retryable=True,
            )
        nbytes = tensor_bytes(tensors)
        with lock:
            t0 = time.monotonic()
            futures = {self._executor.submit(c.push, session_id, version, lora, tensors): c for c in targets}
            pending = set(futures)
            sizes, errors, refused = [], [], None

            def collect(done: set[Future]) -> None:
                nonlocal refused
                for f in done:
                    c = futures[f]
                    try:
                        sizes.append(f.result())
                        self._acknowledged(c, session_id, version)
                    except ReplicaUnavailable as e:
                        errors.append(f"{c.replica_id}: {e}")
                        self.mark_down(c.replica_id, f"weights push of {session_id} v{version} failed: {e}")
                    except ServiceError as e:
                        refused = e

            done, pending = wait(pending, timeout=max(0.0, self.deadlines.for_sync(nbytes) - (time.monotonic() - t0)))
            collect(done)
            while pending and not sizes and refused is None:  # nobody took it yet: wait for the first one
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                collect(done)
            for f in pending:
                c = futures[f]
                with self._lock:
                    self._stalled[c.replica_id] = self._stalled.get(c.replica_id, 0) + 1
                    lag = self._lagging.setdefault(session_id, {})
                    lag[c.replica_id] = max(version, lag.get(c.replica_id, -1))
                log.warning("replica %s has not taken %s v%d within %.1f s: out of routing for it until it does",
                            c.replica_id, session_id, version, self.deadlines.for_sync(nbytes))
                f.add_done_callback(functools.partial(self._laggard_done, c, session_id, version))
        if refused is not None:
            raise refused
        if not sizes:
            raise ServiceError("UNAVAILABLE", "weights push failed on every replica: " + "; ".join(errors), retryable=True)
        return sizes[0], len(sizes)

    def _acknowledged(self, client: C, key: str, version: int) -> None:
        """`client` holds `key` at `version` (or newer): routed to for the key again if it lagged."""
        with self._lock:
            lag = self._lagging.get(key, {})
            if lag.get(client.replica_id, version + 1) <= version:
                del lag[client.replica_id]
                self._up.notify_all()

    def _laggard_done(self, client: C, key: str, version: int, fut: Future) -> None:
        """A push that outlived its sync deadline ended: mark the replica down, or catch it up."""
        with self._lock:
            current = any(c is client for c in self._clients)
            if current and client.replica_id in self._stalled:
                self._stalled[client.replica_id] -= 1
                if self._stalled[client.replica_id] <= 0:
                    del self._stalled[client.replica_id]
                self._up.notify_all()
        if not current:
            return  # replaced meanwhile: replace() reconciled the new client
        try:
            fut.result()
        except Exception as e:
            self.mark_down(client.replica_id, f"late weights push of {key} v{version} failed: {e}")
            return
        self._acknowledged(client, key, version)
        if not self._closed.is_set():
            try:
                self._executor.submit(self._catch_up, client)
            except RuntimeError:  # the pool is closing
                pass

    def _catch_up(self, client: C) -> None:
        """Push the latest version of every key `client` lags on (in the background, off the key locks)."""
        with self._lock:
            if client.replica_id in self._stalled or not any(c is client for c in self._clients):
                return  # another late push is still out; its end catches up
            todo = [(k, self._latest[k]) for k, lag in self._lagging.items() if client.replica_id in lag
                    and k in self._latest]
        for key, latest in todo:
            try:
                client.push(key, *latest)  # a replica never replaces a newer version by an older one
            except Exception as e:
                self.mark_down(client.replica_id, f"catching up {key} v{latest[0]} failed: {e}")
                return
            self._acknowledged(client, key, latest[0])

    def drop_all(self, session_id: str) -> None:
        """Forget an adapter key on every replica (best effort, each within its deadline).

        A replica that is down or misses the drop is reconciled (the key dropped)
        before it serves again.
        """
        with self._lock:
            self._push_locks.pop(session_id, None)
            self._latest.pop(session_id, None)
            self._lagging.pop(session_id, None)
            targets = [c for c in self._clients if c.replica_id not in self._down]
        futures = [(c, self._executor.submit(c.drop, session_id)) for c in targets]
        for c, f in futures:
            try:
                f.result()
            except ReplicaUnavailable as e:
                self.mark_down(c.replica_id, f"drop of {session_id} failed: {e}")
            except Exception as e:  # a refusal: nothing to undo
                log.warning("replica %s refused to drop %s: %s", c.replica_id, session_id, e)

    def close(self) -> None:
        """Stop supervising, cancel pending pushes and close every client."""
        self._closed.set()
        self.stop_supervising()
        self._executor.shutdown(wait=False, cancel_futures=True)
        for c in self._clients:
            c.close()
