"""`together-train cluster` on a simulated 2-node Ray cluster (issue 41): what routing through the control plane
costs, and how long a resource takes to start.

Runs itself inside a network namespace of its own with only loopback (``unshare --net``; Ray binds the
host's address otherwise, and on 127.0.0.1 there), starts Ray's ``cluster_utils.Cluster`` (a head and a node
with a ``trainer_node`` resource, 200 MB object store each), a control plane process with a one-model catalog
(a tiny random Llama: hidden 64, 2 layers; or ``--model DIR``), and prints:

- ``create_resource_s``: create_resource request to READY (placement, both processes loading the model);
- ``route_overhead_fb``: median time of one forward_backward (+ its wait) through the control plane divided
  by the same call's median on the resource's own port, calls alternating, same run, same samples;
- ``route_overhead_sample``: the same for one ``sample`` (8 tokens, seeded);
- ``load_avg``: ``os.getloadavg()`` before and after (timings on a busy machine are not the machine's).

``replace_replica_s`` and ``lost_requests`` (issue 41) are not measured: replacing a lost replica is not built.

    python benchmarks/cluster.py --quick     # 20 alternating pairs per call (~3 minutes on 2 cores)
    python benchmarks/cluster.py --pairs 100
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _outer(argv: list[str]) -> int:
    if shutil.which("unshare") is None:
        raise SystemExit("needs unshare (util-linux) for a loopback-only network namespace")
    env = {**os.environ, "TT_CLUSTER_NETNS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "server"), str(ROOT / "tests"),
                                          os.environ.get("PYTHONPATH", "")])}
    cmd = " ".join([sys.executable, str(Path(__file__).resolve()), *argv])
    return subprocess.run(["unshare", "--net", "sh", "-c", f"ip link set lo up && exec {cmd}"], env=env).returncode


def _median_ratio(routed: list[float], direct: list[float]) -> float:
    return statistics.median(routed) / statistics.median(direct)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="20 pairs per call")
    ap.add_argument("--pairs", type=int, default=60, help="alternating routed/direct pairs per call (default 60)")
    ap.add_argument("--model", default=None, help="model directory (default: a tiny random Llama)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    if os.environ.get("TT_CLUSTER_NETNS") != "1":
        return _outer(sys.argv[1:])
    pairs = 20 if args.quick else args.pairs
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import numpy as np
    from ray.cluster_utils import Cluster

    import together_train as tt

    load_before = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="tt-bench-cluster-"))
    model = args.model
    if model is None:
        from _models import build_tiny_model

        model = str(build_tiny_model(tmp / "tiny", arch="llama", seed=0))
    catalog = tmp / "catalog.json"
    catalog.write_text(json.dumps({"models": [{
        "name": "tiny", "model": model, "trainer_resources": {"num_cpus": 1, "trainer_node": 1},
        "replica_resources": {"num_cpus": 1}}]}))
    common = dict(object_store_memory=200 << 20, node_ip_address="127.0.0.1")
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=2, **common))
    cluster.add_node(num_cpus=2, resources={"trainer_node": 1}, **common)
    cluster.wait_for_nodes()
    port_file = tmp / "port"
    plane = subprocess.Popen([sys.executable, "-m", "together_train_server.cli", "cluster", "--ray-address",
                              cluster.address, "--catalog", str(catalog), "--port", "0", "--port-file",
                              str(port_file), "--storage", str(tmp / "storage"), "--log-level", "warning"])
    try:
        while not (port_file.exists() and port_file.read_text()):
            if plane.poll() is not None:
                raise SystemExit(f"the control plane exited with {plane.returncode}")
            time.sleep(0.2)
        with tt.ClusterClient(f"127.0.0.1:{port_file.read_text()}") as client:
            t0 = time.perf_counter()
            routed = client.create_resource("tiny", timeout=600)
            create_s = time.perf_counter() - t0
            direct = tt.ResourceClient(routed.info["address"])
            vocab = direct.get_capabilities().vocab_size
            rng = np.random.default_rng(0)
            tokens = rng.integers(0, vocab, size=65)
            batch = [tt.Sample(model_input=tokens[:-1], loss_fn_inputs={"target_tokens": tokens[1:],
                                                                          "weights": np.ones(64, np.float32)})]
            sessions = {"routed": routed.create_session(lora=tt.LoraConfig(rank=8, seed=0)),
                        "direct": direct.create_session(lora=tt.LoraConfig(rank=8, seed=0))}
            params = tt.SamplingParams(max_tokens=8, seed=0, ignore_eos=True)
            times: dict[str, dict[str, list[float]]] = {"fb": {"routed": [], "direct": []},
                                                        "sample": {"routed": [], "direct": []}}
            for i in range(pairs + 1):  # the first pair warms up
                order = ("routed", "direct") if i % 2 == 0 else ("direct", "routed")
                for way in order:
                    s = sessions[way]
                    t = time.perf_counter()
                    s.forward_backward(batch, "cross_entropy").result(timeout=120)
                    fb = time.perf_counter() - t
                    t = time.perf_counter()
                    s.sample([1, 2, 3, 4], params).result(timeout=120)
                    sm = time.perf_counter() - t
                    if i:
                        times["fb"][way].append(fb)
                        times["sample"][way].append(sm)
            figures = {
                "create_resource_s": round(create_s, 2),
                "route_overhead_fb": round(_median_ratio(times["fb"]["routed"], times["fb"]["direct"]), 4),
                "route_overhead_sample": round(_median_ratio(times["sample"]["routed"], times["sample"]["direct"]), 4),
                "fb_direct_ms": round(1e3 * statistics.median(times["fb"]["direct"]), 2),
                "sample_direct_ms": round(1e3 * statistics.median(times["sample"]["direct"]), 2),
                "pairs": pairs,
                "replace_replica_s": None, "lost_requests": None,   # not built (docs/cluster.md)
                "load_avg": [round(x, 2) for x in load_before + os.getloadavg()],
            }
            direct.close()
            client.stop_resource(routed.resource_id)
    finally:
        plane.terminate()
        plane.wait(60)
        cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    for k, v in figures.items():
        print(f"{k}={v}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
