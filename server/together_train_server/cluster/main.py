"""``together-train cluster``: join (or start) Ray, run the control plane and its routing port until stopped;
``together-train cluster status``: print each resource, its actors, their nodes and states."""

from __future__ import annotations

import logging
import threading

import ray

from together_train.cache import default_storage_dir
from together_train_server.cluster.catalog import load_catalog
from together_train_server.cluster.control import NAMESPACE, ControlPlane
from together_train_server.cluster.router import build_router
from together_train_server.config import ClusterConfig
from together_train_server.process_lifecycle import wait_for_stop, watch_parent

__all__ = ["run_cluster", "print_status"]

log = logging.getLogger("together_train_server.cluster")


def run_cluster(cfg: ClusterConfig) -> int:
    """Serve until SIGTERM/SIGINT (or `cfg.parent_pid` gone); then stop every actor started here.

    Raises:
        CatalogError: the catalog is unreadable or invalid (before Ray starts).
    """
    catalog = load_catalog(cfg.catalog)  # a bad catalog fails before anything starts
    stop = threading.Event()
    if cfg.parent_pid:
        threading.Thread(target=watch_parent, args=(cfg.parent_pid, stop), daemon=True).start()
    if cfg.ray_address:
        ray.init(address=cfg.ray_address, namespace=NAMESPACE, log_to_driver=False)
    else:
        ray.init(namespace=NAMESPACE, num_cpus=cfg.num_cpus, object_store_memory=cfg.object_store_mb << 20,
                 include_dashboard=False, log_to_driver=False)
    plane = ControlPlane(catalog, cfg.storage or default_storage_dir(), startup_timeout=cfg.startup_timeout,
                         placement_timeout=cfg.placement_timeout)
    try:
        server, port = build_router(plane, cfg.host, cfg.port)
        if cfg.port_file is not None:
            tmp = cfg.port_file.with_suffix(".tmp")
            tmp.write_text(str(port))
            tmp.replace(cfg.port_file)
        print(f"together-train cluster serving {', '.join(sorted(catalog.models))} on {cfg.host}:{port} "
              f"(Ray {ray.get_runtime_context().gcs_address}, namespace {NAMESPACE})", flush=True)
        wait_for_stop(stop)
        server.stop(grace=1).wait()
    finally:
        plane.close()
        ray.shutdown()
    return 0


def print_status(address: str) -> int:
    """Print each resource of the control plane at `address`: state, reason, actors and their nodes."""
    from together_train.cluster_client import ClusterClient

    with ClusterClient(address) as client:
        resources = client.list_resources()
    if not resources:
        print("no resources")
    for r in resources:
        print(f"{r['resource_id']}  {r['base_model']}  {r['state']}  replicas={r['replicas']}  {r['address']}"
              + (f"  ({r['reason']})" if r["reason"] else ""))
        for name, node in sorted(r["actors"].items()):
            print(f"    {name}  node {node}")
    return 0
