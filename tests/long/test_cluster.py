"""`together-train cluster` on a simulated Ray cluster (issue 41): Ray's `ray.cluster_utils.Cluster` runs three
nodes on this machine (a head, a trainer node with custom resource ``trainer_node``, a replica node with
``replica_node``), and a real control plane process serves a catalog of two tiny base models; tests talk
to it through the SDK's `ClusterClient` over gRPC.

Ray binds the host's address, and this machine (like CI's) may have only loopback: so the module runs
itself again inside a network namespace of its own with only loopback (``unshare --net``), where Ray
uses 127.0.0.1 throughout; `test_cluster_in_own_network_namespace` is that run, the other tests run only
inside it. Skipped when Ray is not installed or ``unshare --net`` is not permitted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import together_train as tt

INNER = os.environ.get("TT_CLUSTER_NETNS") == "1"
PROMPT = [1, 2, 3, 4, 5]


def _ray_missing() -> str | None:
    try:
        import ray  # noqa: F401
    except ImportError:
        return "Ray is not installed (pip install 'together-train[cluster]')"
    return None


def _no_netns() -> str | None:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "needs unshare and ip (util-linux, iproute2) for a loopback-only network namespace"
    r = subprocess.run(["unshare", "--net", "true"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`unshare --net` is not permitted here ({r.stderr.strip()}): Ray must not bind the host's network"
    return None


@pytest.mark.skipif(INNER, reason="this is the outer run")
def test_cluster_in_own_network_namespace():
    """Run this module's cluster tests inside a loopback-only network namespace; they must all pass."""
    why = _ray_missing() or _no_netns()
    if why:
        pytest.skip(why)
    env = {**os.environ, "TT_CLUSTER_NETNS": "1"}
    inner = f"{sys.executable} -m pytest -q -x -rs -p no:cacheprovider {Path(__file__)}"
    r = subprocess.run(["unshare", "--net", "sh", "-c", f"ip link set lo up && exec {inner}"], env=env,
                       cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=540)
    print(r.stdout[-20000:])
    print(r.stderr[-5000:], file=sys.stderr)
    assert r.returncode == 0, f"the cluster tests failed inside the network namespace (rc {r.returncode})"
    assert re.search(r"\b[1-9]\d* passed", r.stdout), r.stdout[-2000:]
    # Inside, only the tests of the outer run (this one, and those that need no Ray) may be skipped.
    skips = [line for line in r.stdout.splitlines() if line.startswith("SKIPPED")]
    assert all("outer run" in line for line in skips), skips


inner = pytest.mark.skipif(not INNER, reason="runs inside test_cluster_in_own_network_namespace")


_OK = {"name": "m", "model": "embedded"}


@pytest.mark.skipif(INNER, reason="no Ray needed: the outer run checks it")
@pytest.mark.parametrize("entry, message", [
    ({"model": "embedded"}, r"models\[0\]\.name: expected a name"),
    ({**_OK, "model": ""}, r"models\[0\] \(m\)\.model: expected a model directory"),
    ({**_OK, "trainer": {"backend": "jax"}}, r"\(m\)\.trainer\.backend: expected one of torch, deepspeed, got 'jax'"),
    ({**_OK, "trainer": {"backend": "deepspeed", "zero_stage": 2}}, r"\(m\)\.trainer\.backend: .*not built yet"),
    ({**_OK, "trainer": {"backend": "torch", "ranks": 2}}, r"\(m\)\.trainer: the torch trainer has one rank"),
    ({**_OK, "generator": {"engine": "tgi"}}, r"\(m\)\.generator\.engine: expected one of torch, vllm"),
    ({**_OK, "replicas": {"min": 2, "default": 1, "max": 3}}, r"\(m\)\.replicas: expected min <= default <= max"),
    ({**_OK, "replica_resources": {"num_gpus": -1}}, r"\(m\)\.replica_resources\.num_gpus: expected a number >= 0"),
    ({**_OK, "replica_resources": {"memory": "lots"}}, r"\(m\)\.replica_resources\.memory: expected bytes or a size"),
    ({**_OK, "trainer_resources": {"GPU": 1}}, r"\(m\)\.trainer_resources\.GPU: write num_cpus / num_gpus"),
    ({**_OK, "replicas": {"max": 0}}, r"\(m\)\.replicas\.max: expected an integer >= 1, got 0"),
    ({**_OK, "inactive_timout": 5}, r"\(m\): unknown key\(s\) inactive_timout"),
])
def test_catalog_refuses_bad_entries_naming_entry_and_key(entry, message):
    from together_train_server.cluster.catalog import CatalogError, parse_catalog

    with pytest.raises(CatalogError, match=message):
        parse_catalog({"models": [entry]}, "cat.yaml")


@pytest.mark.skipif(INNER, reason="no Ray needed: the outer run checks it")
def test_cluster_command_refuses_a_bad_catalog_before_starting_ray(tmp_path):
    path = tmp_path / "catalog.json"
    path.write_text(json.dumps({"models": [{"name": "m", "model": "embedded", "replicas": {"min": 0}}]}))
    r = subprocess.run([sys.executable, "-m", "together_train_server.cli", "cluster", "--catalog", str(path),
                        "--port", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"together-train cluster: error: {path}: models[0] (m).replicas.min: expected an integer >= 1, got 0" \
        in r.stderr, r.stderr


@pytest.mark.skipif(INNER, reason="no Ray needed: the outer run checks it")
def test_catalog_yaml_resources_and_lookup(tmp_path):
    from together_train_server.cluster.catalog import CatalogError, RayResources, load_catalog

    path = tmp_path / "catalog.yaml"
    path.write_text("models:\n  - name: tiny\n    model: embedded\n"
                    "    trainer_resources: {num_cpus: 2, num_gpus: 1, memory: 1.5GiB, trainer_node: 1}\n"
                    "    replicas: {min: 1, default: 2, max: 4}\n    inactive_timeout: 60\n")
    e = load_catalog(path).get("tiny")
    assert e.trainer_resources == RayResources(2.0, 1.0, int(1.5 * (1 << 30)), {"trainer_node": 1.0})
    assert e.trainer_resources.bundle() == {"CPU": 2.0, "GPU": 1.0, "memory": float(int(1.5 * (1 << 30))),
                                            "trainer_node": 1.0}
    assert (e.min_replicas, e.default_replicas, e.max_replicas, e.inactive_timeout) == (1, 2, 4, 60.0)
    with pytest.raises(CatalogError, match="'other' is not in the catalog; it serves: tiny"):
        load_catalog(path).get("other")
    path.write_text("models: [")
    with pytest.raises(CatalogError, match=f"--catalog {path}: not valid YAML"):
        load_catalog(path)
    with pytest.raises(CatalogError, match="cannot read it"):
        load_catalog(tmp_path / "missing.json")


@pytest.fixture(scope="module")
def ray_cluster():
    """Five Ray nodes on 127.0.0.1 (object store 200 MB each, logical CPUs): head, trainer node, replica node,
    two nodes with one ``spread_node`` each (one replica apiece)."""
    from ray.cluster_utils import Cluster

    common = dict(object_store_memory=200 << 20, node_ip_address="127.0.0.1")
    c = Cluster(initialize_head=True, head_node_args=dict(num_cpus=2, **common))
    nodes = {"trainer": c.add_node(num_cpus=4, num_gpus=1, resources={"trainer_node": 4}, **common),
             "replica": c.add_node(num_cpus=4, resources={"replica_node": 4}, **common),
             "spread1": c.add_node(num_cpus=1, resources={"spread_node": 1}, **common),
             "spread2": c.add_node(num_cpus=1, resources={"spread_node": 1}, **common)}
    c.wait_for_nodes()
    try:
        yield c, nodes
    finally:
        c.shutdown()


@pytest.fixture(scope="module")
def catalog(tmp_path_factory):
    from _models import build_tiny_model

    root = tmp_path_factory.mktemp("cluster")
    a = build_tiny_model(root / "tiny-llama", arch="llama", seed=0)
    b = build_tiny_model(root / "tiny-qwen", arch="qwen2", seed=1)
    placed = {"trainer_resources": {"num_cpus": 1, "trainer_node": 1},
              "replica_resources": {"num_cpus": 1, "replica_node": 1}}
    models = [
        {"name": "tiny-a", "model": str(a), **placed, "replicas": {"min": 1, "default": 1, "max": 2}},
        {"name": "tiny-b", "model": str(b), **placed},
        {"name": "tiny-idle", "model": str(a), **placed, "inactive_timeout": 4},
        {"name": "tiny-spread", "model": str(a), "trainer_resources": {"num_cpus": 1, "trainer_node": 1},
         "replica_resources": {"num_cpus": 1, "spread_node": 1}, "replicas": {"min": 1, "default": 2, "max": 2}},
        # Placeable on the replica node, but never while tiny-a holds one of its replica_node units.
        {"name": "tiny-wait", "model": str(a), "trainer_resources": {"num_cpus": 1, "replica_node": 4},
         "replica_resources": {"num_cpus": 1}},
        {"name": "tiny-huge", "model": str(a), "trainer_resources": {"num_gpus": 8}},
    ]
    path = root / "catalog.json"
    path.write_text(json.dumps({"models": models}))
    return path


@pytest.fixture(scope="module")
def cluster(ray_cluster, catalog, tmp_path_factory):
    """A real control plane process on the simulated cluster; yields (ClusterClient, Ray nodes by role)."""
    c, nodes = ray_cluster
    port_file = tmp_path_factory.mktemp("cp") / "port"
    proc = subprocess.Popen([sys.executable, "-m", "together_train_server.cli", "cluster", "--ray-address", c.address,
                             "--catalog", str(catalog), "--port", "0", "--port-file", str(port_file),
                             "--storage", str(catalog.parent / "storage"), "--parent-pid", str(os.getpid())])
    try:
        t_end = time.monotonic() + 120
        while not (port_file.exists() and port_file.read_text()):
            assert proc.poll() is None, f"the control plane exited with {proc.returncode}"
            assert time.monotonic() < t_end, "the control plane did not serve within 120 s"
            time.sleep(0.2)
        with tt.ClusterClient(f"127.0.0.1:{port_file.read_text()}") as client:
            yield client, nodes
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.fixture(scope="module")
def two(cluster):
    """A resource of each of the two base models, created side by side."""
    client, _ = cluster
    t0 = time.monotonic()
    pending = [client.create_resource(m, wait=False) for m in ("tiny-a", "tiny-b")]
    handles = [client.resource(client.wait_ready(p.resource_id, 300)["resource_id"]) for p in pending]
    print(f"two resources READY in {time.monotonic() - t0:.1f} s")
    yield handles
    for h in handles:
        h.close()


def _batch(vocab: int, seed: int) -> list[tt.Sample]:
    from _checkpoint_helpers import make_batch

    return make_batch(seed, vocab)


@inner
def test_unknown_model_and_unplaceable_request_are_refused(cluster):
    client, _ = cluster
    with pytest.raises(tt.InvalidArgumentError, match="tiny-a, tiny-b, tiny-huge, tiny-idle, tiny-spread, tiny-wait"):
        client.create_resource("no-such-model")
    with pytest.raises(tt.InvalidArgumentError, match="allows 1 to 2"):
        client.create_resource("tiny-a", replicas=3)
    with pytest.raises(tt.FailedPreconditionError, match=r"GPU: 8 \(most on one node: 1\)"):
        client.create_resource("tiny-huge")
    assert [r for r in client.list_resources() if r["base_model"] in ("no-such-model", "tiny-huge")] == []
    with pytest.raises(tt.NotFoundError, match="no resource 'tiny-a-00000000'"):
        client.get_resource("tiny-a-00000000")


@inner
def test_two_base_models_placed_by_custom_resources(cluster, two):
    client, nodes = cluster
    for h in two:
        info = client.get_resource(h.resource_id)
        assert info["state"] == "READY", info
        actors = info["actors"]
        assert actors[f"{h.resource_id}/trainer/0"] == nodes["trainer"].node_id, actors
        assert actors[f"{h.resource_id}/replica/0"] == nodes["replica"].node_id, actors
    # `cluster status` prints the layout.
    out = subprocess.run([sys.executable, "-m", "together_train_server.cli", "cluster", "status",
                          "--address", client.address], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for h in two:
        assert f"{h.resource_id}/trainer/0  node {nodes['trainer'].node_id}" in out.stdout, out.stdout


@inner
def test_train_and_sample_through_one_address_sessions_stay_apart(two):
    a, b = two
    sa = a.create_session(lora=tt.LoraConfig(rank=4, seed=0))
    sb = b.create_session(lora=tt.LoraConfig(rank=4, seed=0))
    for s, h in ((sa, a), (sb, b)):
        fb = s.forward_backward(_batch(h.get_capabilities().vocab_size, 0), "cross_entropy").result(timeout=120)
        assert np.isfinite(fb.loss)
        s.optim_step(tt.AdamParams(learning_rate=1e-2)).result(timeout=120)
        s.weights_sync().result(timeout=120)
        res = s.sample(PROMPT, tt.SamplingParams(max_tokens=4, seed=0, ignore_eos=True)).result(timeout=120)
        assert len(res.sequences[0].tokens) == 4
        assert res.policy_version == 1, res
    # A's session is not B's: B's resource has never seen it.
    with pytest.raises(tt.NotFoundError):
        b.get_session(sa.session_id)
    assert [s.session_id for s in a.list_sessions()] == [sa.session_id]


@inner
def test_routing_forwards_the_resource_answer_unchanged(two):
    """The same step through the control plane and on the resource's own port: identical float32 results."""
    a = two[0]
    direct = tt.ResourceClient(a.info["address"])
    vocab = a.get_capabilities().vocab_size
    routed_s = a.create_session(lora=tt.LoraConfig(rank=4, seed=7))
    direct_s = direct.create_session(lora=tt.LoraConfig(rank=4, seed=7))
    try:
        r = routed_s.forward_backward(_batch(vocab, 3), "cross_entropy", return_logprobs=True).result(timeout=120)
        d = direct_s.forward_backward(_batch(vocab, 3), "cross_entropy", return_logprobs=True).result(timeout=120)
        assert r.loss == d.loss, (r.loss, d.loss)
        for x, y in zip(r.logprobs, d.logprobs):
            np.testing.assert_array_equal(x, y)
        # An error comes back as the resource raised it (code, message, sample index and key).
        errors = []
        for s in (routed_s, direct_s):
            with pytest.raises(tt.InvalidArgumentError) as err:
                bad = _batch(vocab, 3) + [tt.Sample(model_input=[1, vocab + 5, 2], loss_fn_inputs={
                    "target_tokens": np.array([1, 2, 3]), "weights": np.ones(3, np.float32)})]
                s.forward_backward(bad, "cross_entropy", validate=False).result(timeout=120)
            errors.append((re.sub(r"op-[0-9a-f]+", "OP", str(err.value)), err.value.sample_index, err.value.key))
        assert errors[0] == errors[1] and errors[0][2], errors
    finally:
        routed_s.stop()
        direct_s.stop()
        direct.close()


@inner
def test_pending_shows_rays_reason_and_stop_frees_it(cluster, two):
    client, _ = cluster
    h = client.create_resource("tiny-wait", wait=False)
    t_end = time.monotonic() + 30
    info = client.get_resource(h.resource_id)
    while not info["reason"] and time.monotonic() < t_end:
        time.sleep(0.5)
        info = client.get_resource(h.resource_id)
    assert info["state"] == "PENDING" and "replica_node" in info["reason"], info
    with pytest.raises(tt.UnavailableError, match="PENDING"):
        h.list_sessions()
    assert client.stop_resource(h.resource_id)["state"] in ("STOPPING", "STOPPED")


@inner
def test_idle_resource_stops_and_frees_its_ray_resources(cluster, ray_cluster):
    import ray

    client, _ = cluster
    h = client.create_resource("tiny-idle", timeout=300)
    assert h.get_capabilities().vocab_size > 0
    t0 = time.monotonic()
    info = client.get_resource(h.resource_id)
    while info["state"] != "STOPPED" and time.monotonic() - t0 < 60:
        time.sleep(0.5)
        info = client.get_resource(h.resource_id)
    assert info["state"] == "STOPPED" and "idle" in info["reason"], info
    print(f"idle stop: STOPPED {time.monotonic() - t0:.1f} s after its last call (inactive_timeout 4 s)")
    with pytest.raises(tt.UnavailableError, match="STOPPED"):
        h.list_sessions()
    ray.init(address=ray_cluster[0].address, namespace="together-train")
    try:
        names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if isinstance(a, dict)}
        assert not any(n.startswith(h.resource_id) for n in names), names
    finally:
        ray.shutdown()


@inner
def test_lost_replica_node_loses_no_request_and_serves_the_latest_version(cluster, ray_cluster):
    """Two replicas on two nodes; one node is removed while samples are in flight: every sample is served
    (by the other replica), from the session's latest synced version."""
    c, nodes = ray_cluster
    client, _ = cluster
    h = client.create_resource("tiny-spread", timeout=300)
    by_id = {n.node_id: role for role, n in nodes.items()}
    roles = sorted(by_id[h.info["actors"][f"{h.resource_id}/replica/{i}"]] for i in range(2))
    assert roles == ["spread1", "spread2"], h.info
    s = h.create_session(lora=tt.LoraConfig(rank=4, seed=0))
    vocab = h.get_capabilities().vocab_size
    for seed in (0, 1):
        s.forward_backward(_batch(vocab, seed), "cross_entropy").result(timeout=120)
        s.optim_step(tt.AdamParams(learning_rate=1e-2)).result(timeout=120)
        s.weights_sync().result(timeout=120)
    params = tt.SamplingParams(max_tokens=160, seed=0, ignore_eos=True)
    futures = [s.sample(PROMPT, params) for _ in range(8)]
    time.sleep(0.3)
    lost = by_id[h.info["actors"][f"{h.resource_id}/replica/0"]]
    in_flight = sum(not f.done() for f in futures)
    c.remove_node(nodes[lost])
    assert in_flight > 0, "every sample was done before the node was removed: nothing was tested"
    results = [f.result(timeout=180) for f in futures]
    print(f"lost replica node: {in_flight} of 8 samples in flight, all served")
    assert [r.policy_version for r in results] == [2] * 8, [r.policy_version for r in results]
    assert all(len(r.sequences[0].tokens) == 160 for r in results)
    after = s.sample(PROMPT, params).result(timeout=120)
    assert after.policy_version == 2 and after.sequences[0].tokens == results[0].sequences[0].tokens
    s.stop()
    client.stop_resource(h.resource_id)


@inner
def test_lost_trainer_node_fails_calls_at_once_naming_it(cluster, two, ray_cluster):
    """Last: removing the trainer node takes both resources' trainers."""
    c, nodes = ray_cluster
    client, _ = cluster
    a = two[0]
    c.remove_node(nodes["trainer"])
    t0 = time.monotonic()
    with pytest.raises(tt.UnavailableError, match=f"trainer {a.resource_id}/trainer/0 on node .* lost"):
        while time.monotonic() - t0 < 60:
            a.list_sessions()
            time.sleep(0.2)
    took = time.monotonic() - t0
    print(f"lost trainer: calls failed naming it {took:.1f} s after its node was removed")
    assert took < 15, f"calls failed {took:.1f} s after the trainer node was removed"
    assert client.get_resource(a.resource_id)["state"] == "FAILED"
