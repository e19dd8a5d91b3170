"""The control plane of ``together-train cluster``: model resources created on Ray from the catalog.

A resource is one placement group holding its trainer's bundle and one bundle per replica (resources per
the catalog entry), a `ReplicaActor` per replica and a `TrainerActor` (rank 0) with the replicas attached,
all named ``<resource_id>/trainer/<rank>`` / ``<resource_id>/replica/<i>`` in the Ray namespace
``together-train``. States: PENDING (Ray has not placed it; ``reason`` says what it waits for) -> STARTING
(actors placed, processes loading) -> READY (its gRPC address routes) -> STOPPING -> STOPPED, or FAILED (``reason``).
A request no node of the cluster could ever hold is refused at once, naming the missing resource.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from together_train_server.cluster.actors import ReplicaActor, TrainerActor
from together_train_server.cluster.catalog import Catalog, CatalogError, ModelEntry

__all__ = ["NAMESPACE", "ClusterError", "ControlPlane", "ResourceRecord"]

log = logging.getLogger("together_train_server.cluster")

NAMESPACE = "together-train"
PENDING, STARTING, READY, FAILED, STOPPING, STOPPED = "PENDING", "STARTING", "READY", "FAILED", "STOPPING", "STOPPED"


class ClusterError(Exception):
    """A refused control-plane request; `code` is a gRPC status name (NOT_FOUND, FAILED_PRECONDITION, ...)."""

    def __init__(self, code: str, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.retryable = retryable


@dataclass
class ResourceRecord:
    """One model resource as the control plane knows it (times: ``time.time()`` seconds)."""

    resource_id: str
    entry: ModelEntry
    replicas: int
    inactive_timeout: float
    state: str = PENDING
    reason: str = ""
    address: str = ""
    created_at: float = field(default_factory=time.time)
    ready_at: float = 0.0
    last_used: float = field(default_factory=time.monotonic)
    pg: PlacementGroup | None = None
    trainer: Any = None
    replica_actors: list[Any] = field(default_factory=list)
    nodes: dict[str, str] = field(default_factory=dict)   # actor name -> Ray node id

    def trainer_name(self) -> str:
        return f"{self.resource_id}/trainer/0"

    def view(self) -> dict[str, Any]:
        """JSON-ready summary (the Cluster API's resource object)."""
        return {"resource_id": self.resource_id, "base_model": self.entry.name, "mode": self.entry.mode,
                "state": self.state, "reason": self.reason, "address": self.address, "replicas": self.replicas,
                "inactive_timeout": self.inactive_timeout, "created_at": self.created_at,
                "ready_at": self.ready_at, "actors": dict(self.nodes)}


def _missing(bundle: dict[str, float], nodes: list[dict[str, Any]]) -> list[str]:
    """The resources of `bundle` that no alive node has enough of in total (empty: some node could hold it)."""
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive")]
    if any(all(r.get(k, 0.0) >= v for k, v in bundle.items()) for r in alive):
        return []
    short = [k for k, v in bundle.items() if not any(r.get(k, 0.0) >= v for r in alive)]
    if not short:  # each is somewhere, never together
        return [f"{bundle} together on one node"]
    return [f"{k}: {bundle[k]:g} (most on one node: {max((r.get(k, 0.0) for r in alive), default=0.0):g})"
            for k in short]


def _refused(address: str) -> str:
    """Why a TCP connection to host:port is refused, or '' when it connects (or only times out: busy)."""
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1.0).close()
    except ConnectionRefusedError:
        return f"its port {address} refuses connections (the actor's node or process is gone)"
    except OSError:
        return ""
    return ""


class ControlPlane:
    """Creates, watches and stops the resources of one catalog on the connected Ray cluster.

    Args:
        catalog: what may be created.
        storage: each resource's checkpoints go under ``storage/<resource_id>`` (a path every node reads).
        startup_timeout: seconds a resource's processes may take to serve once placed.
        placement_timeout: seconds a PENDING resource waits for Ray before it FAILS (0 = forever).
    """

    def __init__(self, catalog: Catalog, storage: Path, *, startup_timeout: float = 600.0,
                 placement_timeout: float = 0.0, watch_period_s: float = 1.0) -> None:
        self.catalog = catalog
        self.storage = Path(storage)
        self.startup_timeout = startup_timeout
        self.placement_timeout = placement_timeout
        self._records: dict[str, ResourceRecord] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._watch_period_s = watch_period_s
        self._watcher = threading.Thread(target=self._watch, name="cluster-watch", daemon=True)
        self._watcher.start()

    # ------------------------------------------------------------------ requests
    def create(self, base_model: str, replicas: int | None = None, inactive_timeout: float | None = None) -> dict:
        """Start creating a resource of `base_model`; returns its view (state PENDING) at once.

        Raises:
            ClusterError: INVALID_ARGUMENT (not in the catalog, replicas outside min..max, a bad timeout),
                FAILED_PRECONDITION (no node of the cluster could ever hold a bundle: naming the resource).
        """
        try:
            entry = self.catalog.get(base_model)
        except CatalogError as e:
            raise ClusterError("INVALID_ARGUMENT", str(e)) from None
        n = entry.default_replicas if replicas is None else replicas
        if isinstance(n, bool) or not isinstance(n, int) or not entry.min_replicas <= n <= entry.max_replicas:
            raise ClusterError("INVALID_ARGUMENT", f"replicas: {base_model!r} allows {entry.min_replicas} to "
                                                   f"{entry.max_replicas}, got {n!r}")
        timeout = entry.inactive_timeout if inactive_timeout is None else inactive_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise ClusterError("INVALID_ARGUMENT", f"inactive_timeout: expected seconds >= 0, got {timeout!r}")
        nodes = ray.nodes()
        for what, bundle in (("trainer rank", entry.trainer_resources.bundle()),
                             ("replica", entry.replica_resources.bundle())):
            missing = _missing(bundle, nodes)
            if missing:
                raise ClusterError("FAILED_PRECONDITION",
                                   f"{base_model!r}: no node of the Ray cluster could ever hold a {what} "
                                   f"({bundle}): missing {'; '.join(missing)}")
        rid = f"{base_model}-{uuid.uuid4().hex[:8]}"
        rec = ResourceRecord(rid, entry, n, float(timeout))
        with self._lock:
            self._records[rid] = rec
        threading.Thread(target=self._build, args=(rec,), name=f"build-{rid}", daemon=True).start()
        return rec.view()

    def get(self, resource_id: str) -> dict:
        """The view of one resource (ClusterError NOT_FOUND: unknown id, naming the known ones)."""
        return self._record(resource_id).view()

    def list(self) -> list[dict]:
        """Every resource's view, oldest first (stopped ones included)."""
        with self._lock:
            return [r.view() for r in self._records.values()]

    def stop(self, resource_id: str, reason: str = "stopped on request") -> dict:
        """Stop a resource's actors and free its placement group (checkpoints stay); returns its view."""
        rec = self._record(resource_id)
        self._teardown(rec, STOPPED, reason)
        return rec.view()

    def route(self, resource_id: str | None) -> str:
        """The gRPC address of a READY resource; counts as a call for its inactive timeout.

        Without an id, the only READY resource, if there is exactly one.

        Raises:
            ClusterError: NOT_FOUND (unknown id), UNAVAILABLE (not READY: its state and reason, e.g. a lost
                trainer), INVALID_ARGUMENT (no id and not exactly one READY resource).
        """
        if not resource_id:
            with self._lock:
                ready = [r for r in self._records.values() if r.state == READY]
            if len(ready) != 1:
                raise ClusterError("INVALID_ARGUMENT", "name the resource (metadata together-train-resource; the "
                                                       f"SDK's ClusterClient does): {len(ready)} are READY")
            rec = ready[0]
        else:
            rec = self._record(resource_id)
        if rec.state != READY:  # worth a retry while it starts; a stopped or failed one is no transient error
            raise ClusterError("UNAVAILABLE", f"resource {rec.resource_id} is {rec.state}"
                                              + (f": {rec.reason}" if rec.reason else ""),
                               retryable=rec.state in (PENDING, STARTING))
        rec.last_used = time.monotonic()
        return rec.address

    def check_trainer(self, resource_id: str | None) -> None:
        """After a failed forward: if the resource's trainer actor is gone, mark it FAILED (naming it)."""
        if not resource_id:
            return
        with self._lock:
            rec = self._records.get(resource_id)
        if rec is not None and rec.state == READY:
            self._probe(rec, timeout=1.0)

    def close(self) -> None:
        """Stop every resource this control plane started."""
        self._closed.set()
        with self._lock:
            recs = list(self._records.values())
        for rec in recs:
            self._teardown(rec, STOPPED, "the control plane stopped")

    # ------------------------------------------------------------------ internals
    def _record(self, resource_id: str) -> ResourceRecord:
        with self._lock:
            rec = self._records.get(resource_id)
            known = sorted(self._records)
        if rec is None:
            raise ClusterError("NOT_FOUND", f"no resource {resource_id!r} on this cluster; known: "
                                            f"{', '.join(known) or '(none)'}")
        return rec

    def _build(self, rec: ResourceRecord) -> None:
        try:
            self._place(rec)
            if rec.state != PENDING:
                return
            self._start(rec)
        except Exception as e:  # a failed build is the resource's state, not the control plane's crash
            log.exception("resource %s failed to start", rec.resource_id)
            self._teardown(rec, FAILED, f"{type(e).__name__}: {e}")

    def _place(self, rec: ResourceRecord) -> None:
        """One placement group: the trainer's bundle first, then one per replica; waits, PENDING with why."""
        e = rec.entry
        bundles = [e.trainer_resources.bundle() or {"CPU": 0.001}] + \
                  [e.replica_resources.bundle() or {"CPU": 0.001} for _ in range(rec.replicas)]
        rec.pg = placement_group(bundles, strategy="PACK", name=rec.resource_id)
        ready = rec.pg.ready()
        t0 = time.monotonic()
        while rec.state == PENDING:
            done, _ = ray.wait([ready], timeout=1.0)
            if done:
                return
            free = ray.available_resources()
            rec.reason = (f"waiting for Ray to place {len(bundles)} bundle(s) {bundles}: the cluster has free now "
                          f"{ {k: free.get(k, 0.0) for b in bundles for k in b} }")
            if self.placement_timeout and time.monotonic() - t0 > self.placement_timeout:
                raise TimeoutError(f"not placed within {self.placement_timeout:.0f} s ({rec.reason})")

    def _start(self, rec: ResourceRecord) -> None:
        e, pg = rec.entry, rec.pg
        assert pg is not None, "placed first"
        rec.state, rec.reason = STARTING, "loading the model on the trainer and the replicas"
        secret = secrets.token_hex(16)
        replicas = []
        for i in range(rec.replicas):
            name = f"{rec.resource_id}/replica/{i}"
            actor = ReplicaActor.options(  # type: ignore[attr-defined]
                name=name, namespace=NAMESPACE, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=1 + i),
                **e.replica_resources.actor_options(),
            ).remote(name, e.model, e.engine, secret, max(1, int(e.replica_resources.num_cpus)))
            replicas.append(actor)
        rec.replica_actors = replicas
        addresses = ray.get([a.address.remote(self.startup_timeout) for a in replicas])
        storage = self.storage / rec.resource_id
        storage.mkdir(parents=True, exist_ok=True)
        serve_args = ["--model", e.model, "--mode", e.mode, "--trainer", e.trainer, "--engine", e.engine,
                      "--max-sessions", str(e.max_sessions), "--storage", str(storage),
                      "--trainer-threads", str(max(1, int(e.trainer_resources.num_cpus))),
                      "--startup-timeout", str(self.startup_timeout)]
        rec.trainer = TrainerActor.options(  # type: ignore[attr-defined]
            name=rec.trainer_name(), namespace=NAMESPACE, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
            **e.trainer_resources.actor_options(),
        ).remote(serve_args, addresses, secret)
        address = ray.get(rec.trainer.address.remote(self.startup_timeout))
        names = [rec.trainer_name()] + [f"{rec.resource_id}/replica/{i}" for i in range(rec.replicas)]
        nodes = ray.get([rec.trainer.node_id.remote()] + [a.node_id.remote() for a in replicas])
        rec.nodes = dict(zip(names, nodes))
        with self._lock:
            if rec.state != STARTING:  # stopped while starting
                return
            rec.address, rec.state, rec.reason, rec.ready_at = address, READY, "", time.time()
            rec.last_used = time.monotonic()
        log.info("resource %s READY at %s (%s)", rec.resource_id, address, rec.nodes)

    def _probe(self, rec: ResourceRecord, timeout: float) -> None:
        """Mark `rec` FAILED when its trainer is known lost: Ray says the actor died or its process exited, or,
        while Ray has not noticed yet (a lost node is declared dead after its health checks, ~15 s by
        default), the trainer's port refuses connections (its serve process ends with its actor)."""
        try:
            alive = ray.get(rec.trainer.alive.remote(), timeout=timeout)
            why = "" if alive else "its serve process exited"
        except ray.exceptions.GetTimeoutError:
            why = _refused(rec.address)
        except ray.exceptions.RayError as e:
            why = f"the actor died ({type(e).__name__})"
        if why:
            node = rec.nodes.get(rec.trainer_name(), "?")
            self._teardown(rec, FAILED, f"trainer {rec.trainer_name()} on node {node} lost: {why}")

    def _watch(self) -> None:
        """Idle stop (inactive_timeout) and lost trainers, every `watch_period_s`."""
        while not self._closed.wait(self._watch_period_s):
            with self._lock:
                ready = [r for r in self._records.values() if r.state == READY]
            for rec in ready:
                try:
                    if rec.inactive_timeout and time.monotonic() - rec.last_used > rec.inactive_timeout:
                        log.info("resource %s idle for %.0f s: stopping", rec.resource_id, rec.inactive_timeout)
                        self._teardown(rec, STOPPED, f"idle for its inactive_timeout ({rec.inactive_timeout:g} s)")
                    else:
                        self._probe(rec, timeout=5.0)
                except Exception:  # the watcher must survive one resource's trouble
                    log.exception("watching %s", rec.resource_id)

    def _teardown(self, rec: ResourceRecord, state: str, reason: str) -> None:
        """End `rec`'s actors (their processes first, gracefully, all at once) and free its placement group.

        A stop shows STOPPING until its Ray resources are free, then STOPPED; a failure shows FAILED at once.
        """
        with self._lock:
            if rec.state in (STOPPING, STOPPED, FAILED):
                return
            rec.state, rec.reason, rec.address = (STOPPING if state == STOPPED else state), reason, ""
        actors = [a for a in [rec.trainer, *rec.replica_actors] if a is not None]
        try:
            ray.get([a.stop.remote() for a in actors], timeout=20)
        except Exception:  # already dead (a lost node) or stuck: killed below
            pass
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        if rec.pg is not None:
            try:
                remove_placement_group(rec.pg)
            except Exception:
                pass
        with self._lock:
            rec.state = state
        log.info("resource %s %s: %s", rec.resource_id, state, reason)
