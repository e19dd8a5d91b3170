"""Observability of a real resource: operation logs, Prometheus /metrics, Health with one
entry per replica, `together-train status`, and the web dashboard in a real headless Chromium.

One resource process (tiny model, 1 generator replica, HTTP port, JSON logs) runs a scripted
workload once; the tests check the counters against what the script sent (counted here, on the
client side, independently of the server), the log lines against the operations' ids, and the
dashboard as a browser renders it. A second resource with two API keys checks that no scrape or
page shows another key's sessions.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import together_train as tt

PROMPT = [1, 5, 9, 14]
LENGTHS = [(12, 7, 20), (5, 9), (16,)]  # model_input tokens of the 3 training batches
SAMPLE_CALLS = 2
NUM_SAMPLES, MAX_TOKENS = 2, 6


def make_batch(seed: int, vocab: int, lengths) -> list[tt.Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        tokens = rng.integers(0, vocab, size=n + 1)
        out.append(tt.Sample(model_input=tokens[:-1], loss_fn_inputs={
            "target_tokens": tokens[1:], "weights": np.ones(n, dtype=np.float32)}))
    return out


def http_get(url: str, key: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"X-API-Key": key} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def parse_metrics(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from the Prometheus text format."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture(scope="module")
def observed(tiny_model_dir, tmp_path_factory):
    """A resource with --log-format json after a scripted workload; yields what the script sent."""
    tmp = tmp_path_factory.mktemp("observed")
    log_file = tmp / "server.log"
    with tt.launch_local(
        model=str(tiny_model_dir), generators=1, storage_dir=tmp / "storage", log_file=log_file, http_port=0,
        extra_args=["--trainer-threads", "1", "--generator-threads", "1", "--log-format", "json",
                    "--replica-probe-period-s", "0.5"],
    ) as client:
        vocab = client.get_capabilities().vocab_size
        s = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0), name="obs")
        adam = tt.AdamParams(learning_rate=1e-2)
        fb_ops, opt_results = [], []
        for i, lengths in enumerate(LENGTHS):
            fb = s.forward_backward(make_batch(i, vocab, lengths), "cross_entropy")
            fb.result(timeout=120)
            fb_ops.append(fb.operation_id)
            opt_results.append(s.optim_step(adam).result(timeout=120))
        bad = make_batch(9, vocab, (4,))
        bad[0].model_input[0] = vocab + 5  # outside the vocabulary: FAILED at validation
        with pytest.raises(tt.errors.InvalidArgumentError):
            s.forward_backward(bad, "cross_entropy").result(timeout=60)
        sync = s.weights_sync().result(timeout=120)
        sampled = 0
        for _ in range(SAMPLE_CALLS):
            res = s.sample(PROMPT, tt.SamplingParams(max_tokens=MAX_TOKENS, seed=3, ignore_eos=True),
                           num_samples=NUM_SAMPLES).result(timeout=120)
            sampled += sum(len(q.tokens) for q in res.sequences)
        ckpt = s.save_state("obs-ckpt").result(timeout=120)
        yield {"client": client, "session": s, "http": client.http_url, "log": log_file, "fb_ops": fb_ops,
               "opt": opt_results, "sync": sync, "sampled": sampled, "ckpt": ckpt, "vocab": vocab}


def test_metrics_count_exactly_what_the_workload_sent(observed):
    status, body = http_get(observed["http"] + "/metrics")
    assert status == 200
    m = parse_metrics(body.decode())
    sid = observed["session"].id

    def ops(kind: str, st: str) -> float:
        return m.get(("together_train_operations_total", (("kind", kind), ("status", st))), 0.0)

    assert ops("forward_backward", "SUCCEEDED") == len(LENGTHS)
    assert ops("forward_backward", "FAILED") == 1
    assert ops("optim_step", "SUCCEEDED") == len(LENGTHS)
    assert ops("weights_sync", "SUCCEEDED") == 1
    assert ops("sample", "SUCCEEDED") == SAMPLE_CALLS
    assert ops("save_state", "SUCCEEDED") == 1
    # Histograms count operations that ran: the refused forward_backward never started.
    assert m[("together_train_operation_queue_seconds_count", (("kind", "forward_backward"),))] == len(LENGTHS)
    assert m[("together_train_operation_run_seconds_count", (("kind", "optim_step"),))] == len(LENGTHS)
    assert m[("together_train_tokens_trained_total", ())] == sum(sum(x) for x in LENGTHS)
    assert observed["sampled"] == SAMPLE_CALLS * NUM_SAMPLES * MAX_TOKENS
    assert m[("together_train_tokens_sampled_total", ())] == observed["sampled"]
    assert m[("together_train_sessions_active", ())] == 1
    assert m[("together_train_queue_depth", (("session", sid),))] == 0
    assert m[("together_train_replicas", (("state", "healthy"),))] == 1
    assert m[("together_train_replicas", (("state", "unhealthy"),))] == 0
    assert m[("together_train_replica_restarts_total", ())] == 0
    assert m[("together_train_replica_outstanding_requests", (("replica", "replica-0"),))] == 0
    # Weights: one push of the adapter (float32 bytes of every LoRA tensor, from the checkpoint's file).
    from safetensors.numpy import load_file

    tensors = load_file(str(Path(observed["ckpt"].path) / "adapter_model.safetensors"))
    adapter_bytes = sum(t.size * 4 for t in tensors.values())
    assert observed["sync"].num_bytes == adapter_bytes
    assert m[("together_train_weights_sync_bytes_total", ())] == adapter_bytes
    assert m[("together_train_weights_sync_seconds_count", ())] == 1
    files = [p for p in Path(observed["ckpt"].path).rglob("*") if p.is_file() and p.name != "manifest.json"]
    assert m[("together_train_checkpoint_bytes_total", (("kind", "state"),))] == sum(p.stat().st_size for p in files)
    assert m[("process_resident_memory_bytes", ())] > 1e6
    assert ("process_cpu_seconds_total", ()) in m


def _events(log_file: Path) -> list[dict]:
    out = []
    for line in log_file.read_text().splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def test_json_log_has_one_line_per_operation_and_the_events(observed):
    sid = observed["session"].id
    deadline = time.time() + 10
    while True:  # the save_state line is written as the operation ends, before the client is told
        ev = _events(observed["log"])
        if any(e.get("event") == "checkpoint written" for e in ev) or time.time() > deadline:
            break
        time.sleep(0.2)
    ops = [e for e in ev if e.get("event") == "operation" and e.get("session") == sid]
    for e in ops:
        assert e["logger"] == "together_train_server.events" and e["level"] == "INFO"
        assert {"kind", "seq_id", "operation_id", "queue_s", "run_s", "status", "tokens_trained",
                "tokens_sampled", "error_code"} <= e.keys()
    fb = [e for e in ops if e["kind"] == "forward_backward" and e["status"] == "SUCCEEDED"]
    assert [e["operation_id"] for e in fb] == observed["fb_ops"]
    assert [e["seq_id"] for e in fb] == [0, 2, 4]
    assert [e["tokens_trained"] for e in fb] == [sum(x) for x in LENGTHS]
    failed = [e for e in ops if e["status"] == "FAILED"]
    assert len(failed) == 1 and failed[0]["error_code"] == "INVALID_ARGUMENT" and failed[0]["kind"] == "forward_backward"
    assert sum(e["tokens_sampled"] for e in ops if e["kind"] == "sample") == observed["sampled"]
    kinds = [e["kind"] for e in ops]
    assert kinds.count("optim_step") == len(LENGTHS) and kinds.count("weights_sync") == 1
    assert any(e.get("event") == "session created" and e["session"] == sid and e["session_name"] == "obs" for e in ev)
    pushed = [e for e in ev if e.get("event") == "weights pushed" and e["session"] == sid]
    assert len(pushed) == 1 and pushed[0]["version"] == len(LENGTHS) and pushed[0]["bytes"] == observed["sync"].num_bytes
    written = [e for e in ev if e.get("event") == "checkpoint written"]
    assert written and written[0]["uri"] == observed["ckpt"].uri and written[0]["bytes"] == observed["ckpt"].size_bytes
    assert any(e.get("event") == "replica started" and e["replica"] == "replica-0" for e in ev)


def test_health_and_status_list_each_replica(observed):
    from together_train._proto import generator_pb2
    from together_train.status import resource_status

    client, sid = observed["client"], observed["session"].id
    deadline = time.time() + 15
    while True:  # versions come from the replica's health probes (every 0.5 s here)
        health = client._call(client._generator.Health, generator_pb2.HealthRequest(), what="Health")
        if (health.replicas and health.replicas[0].loaded_versions.get(sid) == len(LENGTHS)) or time.time() > deadline:
            break
        time.sleep(0.3)
    assert health.ready and len(health.replicas) == 1
    r = health.replicas[0]
    assert (r.replica_id, r.state, r.outstanding_requests, r.restarts) == ("replica-0", "healthy", 0, 0)
    assert r.address.startswith("127.0.0.1:")
    assert dict(r.loaded_versions) == {sid: len(LENGTHS)}
    st = resource_status(client)
    assert st["replicas"][0]["versions"] == {sid: len(LENGTHS)}
    out = subprocess.run([sys.executable, "-m", "together_train_server.cli", "status", "--address", client.address,
                          "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    js = json.loads(out.stdout)
    assert [s["session_id"] for s in js["sessions"]] == [sid] and js["sessions"][0]["step"] == len(LENGTHS)
    assert js["replicas"][0]["state"] == "healthy"
    text = subprocess.run([sys.executable, "-m", "together_train_server.cli", "status", "--address", client.address],
                          capture_output=True, text=True, timeout=60)
    assert text.returncode == 0, text.stderr
    assert "REPLICA" in text.stdout and "replica-0" in text.stdout and f"{sid}@v{len(LENGTHS)}" in text.stdout
    assert sid in text.stdout and "1 healthy of 1" in text.stdout


def test_dashboard_state_has_sessions_curves_and_checkpoints(observed):
    status, body = http_get(observed["http"] + "/api/dashboard/state")
    assert status == 200
    st = json.loads(body)
    sid = observed["session"].id
    (s,) = [x for x in st["sessions"] if x["session_id"] == sid]
    assert s["step"] == len(LENGTHS) and s["synced_version"] == len(LENGTHS) and s["lora"]["rank"] == 4
    assert [p["step"] for p in s["curve"]] == [o.step for o in observed["opt"]]
    assert [p["grad_norm"] for p in s["curve"]] == pytest.approx([o.grad_norm for o in observed["opt"]])
    assert all(p["loss_per_token"] > 0 and p["tokens_per_s"] > 0 for p in s["curve"])
    assert st["checkpoints"][-1]["uri"] == observed["ckpt"].uri
    assert st["totals"]["tokens_trained"] == sum(sum(x) for x in LENGTHS)
    assert st["resource"]["mode"] == "lora" and st["resource"]["uptime_s"] > 0


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def _browser():
    """Playwright's Chromium driver on Debian's chromium (never a downloaded browser), or a skip reason."""
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (scripts/test.sh installs it with apt-get when it can)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright (pip, the dev extra) is not installed")
    return sync_playwright


def test_dashboard_in_a_real_browser_shows_the_session_and_updates(observed, tmp_path):
    sync_playwright = _browser()
    s, vocab = observed["session"], observed["vocab"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(observed["http"] + "/?interval=0.5")
            row = page.locator(f'#sessions tr[data-session="{s.id}"]')
            row.wait_for(timeout=30_000)
            step = s.info().step
            page.wait_for_function(
                f'document.querySelector(\'#sessions tr[data-session="{s.id}"] td.step\').textContent === "{step}"',
                timeout=30_000)
            line = page.locator(f'svg[data-session="{s.id}"][data-chart="loss_per_token"] path.line')
            assert int(line.get_attribute("data-points")) == step
            # Train one more step: the page updates without a reload.
            s.forward_backward(make_batch(7, vocab, (10,)), "cross_entropy").result(timeout=120)
            s.optim_step(tt.AdamParams(learning_rate=1e-2)).result(timeout=120)
            page.wait_for_function(
                f'document.querySelector(\'#sessions tr[data-session="{s.id}"] td.step\').textContent === "{step + 1}"',
                timeout=30_000)
            page.wait_for_function(
                f'document.querySelector(\'svg[data-session="{s.id}"][data-chart="grad_norm"] path.line\')'
                f'.getAttribute("data-points") === "{step + 1}"', timeout=30_000)
            assert page.locator('#replicas tr[data-replica="replica-0"] td.healthy').count() == 1
            assert observed["ckpt"].uri in page.locator("#checkpoints").inner_text()
            assert "forward_backward" in page.locator("#recent").inner_text()
            # Usage per key (one key, "none", without API keys): every model_input token trained, counted here.
            trained = sum(sum(x) for x in LENGTHS) + 10
            page.wait_for_function(
                f'document.querySelector(\'#usage tr[data-key="none"] td.trained\').textContent === "{trained}"',
                timeout=30_000)
            assert page.locator("#keyform").is_hidden()
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            assert not errors, errors
        finally:
            browser.close()
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000


def test_replica_death_is_logged_counted_and_listed(observed):
    """SIGKILL the replica: the log says it exited and restarted, /metrics counts one restart,
    Health lists it healthy again with its session's adapter re-pushed."""
    import signal

    from together_train._proto import generator_pb2

    client, sid = observed["client"], observed["session"].id
    server_pid = client.local_resource.process.pid
    out = subprocess.run(["pgrep", "-P", str(server_pid)], capture_output=True, text=True)
    (replica_pid,) = [int(p) for p in out.stdout.split()]
    os.kill(replica_pid, signal.SIGKILL)
    version = client.get_session(sid).synced_version
    deadline = time.time() + 120
    while True:
        m = parse_metrics(http_get(observed["http"] + "/metrics")[1].decode())
        health = client._call(client._generator.Health, generator_pb2.HealthRequest(), what="Health")
        r = health.replicas[0]
        if (m[("together_train_replica_restarts_total", ())] == 1 and r.state == "healthy"
                and r.loaded_versions.get(sid) == version) or time.time() > deadline:
            break
        time.sleep(0.5)
    assert m[("together_train_replica_restarts_total", ())] == 1
    assert (r.state, r.restarts, dict(r.loaded_versions)) == ("healthy", 1, {sid: version})
    assert m[("together_train_replicas", (("state", "healthy"),))] == 1
    msgs = [e["message"] for e in _events(observed["log"])]
    assert any("replica replica-0 exited; restarting" in x for x in msgs)
    assert any("replica replica-0 restarted (restart 1)" in x for x in msgs)
    assert any(e.get("event") == "replica started" and e["restarts"] == 1 for e in _events(observed["log"]))


@pytest.fixture(scope="module")
def keyed(tiny_model_dir, tmp_path_factory):
    """A resource with two API keys (text logs); one session per key, one training step each."""
    tmp = tmp_path_factory.mktemp("keyed")
    keys = tmp / "keys"
    keys.write_text("alice-key\nbob-key\n")
    keys.chmod(0o600)
    log_file = tmp / "server.log"
    with tt.launch_local(
        model=str(tiny_model_dir), generators=1, storage_dir=tmp / "storage", log_file=log_file, http_port=0,
        api_key="alice-key", extra_args=["--trainer-threads", "1", "--generator-threads", "1",
                                         "--api-key-file", str(keys)],
    ) as alice:
        bob = tt.ResourceClient(alice.address, api_key="bob-key", keepalive_interval_s=None)
        vocab = alice.get_capabilities().vocab_size
        sa = alice.create_session(lora=tt.LoraConfig(rank=4, seed=0), name="alice")
        sb = bob.create_session(lora=tt.LoraConfig(rank=4, seed=0), name="bob")
        for sess in (sa, sb):
            sess.forward_backward(make_batch(1, vocab, (6,)), "cross_entropy").result(timeout=120)
            sess.optim_step(tt.AdamParams(learning_rate=1e-2)).result(timeout=120)
        yield {"http": alice.http_url, "alice": sa.id, "bob": sb.id, "log": log_file, "client": alice}
        bob.close()


def test_metrics_and_dashboard_never_show_another_keys_sessions(keyed):
    url, a, b = keyed["http"], keyed["alice"], keyed["bob"]
    status, body = http_get(url + "/metrics")  # anonymous scrape: resource-wide series only
    assert status == 200
    text = body.decode()
    m = parse_metrics(text)
    assert a not in text and b not in text
    assert m[("together_train_sessions_active", ())] == 2
    assert m[("together_train_operations_total", (("kind", "optim_step"), ("status", "SUCCEEDED")))] == 2
    status, body = http_get(url + "/metrics", key="alice-key")
    assert status == 200 and a in body.decode() and b not in body.decode()
    assert parse_metrics(body.decode())[("together_train_queue_depth", (("session", a),))] == 0
    status, body = http_get(url + "/metrics", key="tml-bob-key")
    assert status == 200 and b in body.decode() and a not in body.decode()
    assert http_get(url + "/metrics", key="wrong")[0] == 401
    status, body = http_get(url + "/api/dashboard/state")
    st = json.loads(body)
    assert st["auth_required"] and not st["authorized"] and st["sessions"] == [] and st["recent"] == []
    assert a not in body.decode() and b not in body.decode()
    assert st["resource"]["active_sessions"] == 2
    st = json.loads(http_get(url + "/api/dashboard/state", key="alice-key")[1])
    assert [s["session_id"] for s in st["sessions"]] == [a]
    assert b not in json.dumps(st)
    assert http_get(url + "/api/dashboard/state", key="wrong")[0] == 401
    assert http_get(url + "/")[0] == 200  # the page itself is public; it asks for the key


def test_text_log_lines_name_session_kind_and_status(keyed):
    lines = keyed["log"].read_text().splitlines()
    a = keyed["alice"]
    ops = [ln for ln in lines if "together_train_server.events INFO operation" in ln and f"session={a}" in ln]
    assert any("kind=forward_backward" in ln and "seq_id=0" in ln and "status=SUCCEEDED" in ln
               and "tokens_trained=6" in ln for ln in ops), ops
    assert any("kind=optim_step" in ln and "seq_id=1" in ln for ln in ops), ops
    assert any("session created" in ln and f"session={a}" in ln for ln in lines)


def test_dashboard_asks_for_the_key_once_and_keeps_it_in_the_tab(keyed, tmp_path):
    sync_playwright = _browser()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(keyed["http"] + "/?interval=0.5")
            page.locator("#keyform").wait_for(state="visible", timeout=30_000)
            assert keyed["alice"] not in page.content()
            page.fill("#apikey", "alice-key")
            page.click("#keyform button")
            page.locator(f'#sessions tr[data-session="{keyed["alice"]}"]').wait_for(timeout=30_000)
            assert keyed["bob"] not in page.content()
            page.reload()  # kept in sessionStorage: no second prompt
            page.locator(f'#sessions tr[data-session="{keyed["alice"]}"]').wait_for(timeout=30_000)
            assert page.locator("#keyform").is_hidden()
            page.screenshot(path=str(tmp_path / "dashboard-keyed.png"), full_page=True)
        finally:
            browser.close()
