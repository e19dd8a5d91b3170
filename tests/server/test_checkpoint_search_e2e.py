"""Checkpoint metadata, search, TTL, keep-last-K and storage usage through a real resource.

One `together-train serve` process (tiny random model, one replica, API keys alice/bob/root with root an
admin key, TTL sweeps every 0.2 s) is driven through the SDK over gRPC, the CLI, the tinker SDK (0.38)
and the /v1/checkpoints HTTP routes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import together_train as tt

ALICE, BOB, ROOT = "k-alice", "k-bob", "k-root"


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys")
    (keys / "api").write_text(f"{ALICE}\n{BOB}\n{ROOT}\n")
    (keys / "admin").write_text(f"{ROOT}\n")
    storage = tmp_path_factory.mktemp("storage")
    with tt.launch_local(model=str(tiny_model_dir), generators=1, storage_dir=storage, api_key=ALICE, http_port=0,
                         extra_args=["--trainer-threads", "1", "--generator-threads", "1", "--api-key-file",
                                     str(keys / "api"), "--admin-key-file", str(keys / "admin"),
                                     "--checkpoint-sweep-s", "0.2"]) as client:
        yield client, storage, keys


def _other(client, key: str) -> tt.ResourceClient:
    return tt.ResourceClient(client.address, api_key=key, keepalive_interval_s=None)


def _dirs(storage: Path, session_id: str) -> set[str]:
    """Walk the storage directory: '<kind>/<name>' of every file of the session."""
    base = storage / "sessions" / session_id
    return {"/".join(p.relative_to(base).parts[:2]) for p in base.rglob("*") if p.is_file()} if base.exists() else set()


def test_save_search_update_keep_last_and_ttl(served):
    client, storage, _ = served
    s = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0), keep_last=2)
    s.save_weights("w0", user_metadata={"exp": "e1", "i": "0"}, pinned=True).result(timeout=120)
    for i in range(1, 4):
        s.save_weights(f"w{i}", user_metadata={"exp": "e1", "i": str(i)}).result(timeout=120)
    # keep_last=2 of the session: w1 went when w3 was saved; the pinned w0 is neither removed nor counted
    assert _dirs(storage, s.session_id) == {"weights/w0", "weights/w2", "weights/w3"}
    rows, cur = client.search_checkpoints(user_metadata={"exp": "e1"}, limit=1)
    seen = [rows[0].name]
    while cur:
        rows, cur = client.search_checkpoints(user_metadata={"exp": "e1"}, limit=1, cursor=cur)
        seen += [r.name for r in rows]
    assert seen == ["w3", "w2", "w0"]  # newest first through the cursor
    w2 = client.search_checkpoints(user_metadata={"exp": "e1", "i": "2"})[0]
    assert [c.name for c in w2] == ["w2"] and w2[0].type == "sampler" and w2[0].user_metadata == {"exp": "e1", "i": "2"}
    on_disk = sum(p.stat().st_size for p in (storage / "sessions" / s.session_id / "weights" / "w2").iterdir()
                  if p.name != "manifest.json")
    assert w2[0].size_bytes == on_disk
    for bad in (0, 201):
        with pytest.raises(tt.errors.InvalidArgumentError, match="limit must be 1-200"):
            client.search_checkpoints(limit=bad)
    upd = client.update_checkpoint(w2[0].uri, user_metadata={"exp": "e2"}, ttl_seconds=3600)
    assert upd.user_metadata == {"exp": "e2"} and upd.expires_at > time.time() + 3500
    assert [c.name for c in client.search_checkpoints(user_metadata={"exp": "e2"})[0]] == ["w2"]
    # a training checkpoint with a 1 s TTL is deleted by the resource's sweeper, files and row
    st = s.save_state("st", user_metadata={"exp": "ttl"}, ttl_seconds=1).result(timeout=120)
    assert [c.type for c in client.search_checkpoints(user_metadata={"exp": "ttl"})[0]] == ["training"]
    deadline = time.time() + 30
    while client.search_checkpoints(user_metadata={"exp": "ttl"})[0] and time.time() < deadline:
        time.sleep(0.2)
    assert client.search_checkpoints(user_metadata={"exp": "ttl"})[0] == []
    assert "state/st" not in _dirs(storage, s.session_id) and st.uri not in [c.uri for c in client.list_checkpoints()]
    mine = client.search_checkpoints(limit=200)[0]
    assert client.storage_usage() == {mine[0].owner: sum(c.size_bytes for c in mine)}
    # deleting by hand frees the files and the row at once (walk the storage directory), and the usage drops
    before = client.storage_usage()[mine[0].owner]
    client.delete_checkpoint(w2[0].uri)
    assert _dirs(storage, s.session_id) == {"weights/w0", "weights/w3"}
    assert client.search_checkpoints(user_metadata={"exp": "e2"})[0] == []
    assert client.storage_usage()[mine[0].owner] == before - w2[0].size_bytes
    # the usage meter (service/usage/) counts the same bytes from the registry rows lifecycle keeps
    (key_usage,) = [u for u in client.usage() if not u.session_id]
    assert key_usage.checkpoint_bytes == client.storage_usage()[mine[0].owner]


def test_bad_save_options_fail_the_operation_naming_the_field(served):
    client, storage, _ = served
    s = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
    with pytest.raises(tt.errors.InvalidArgumentError, match="user_metadata") as err:
        s.save_weights("bad", user_metadata={"note": "x" * 1025}).result(timeout=120)
    assert err.value.key == "user_metadata.note"
    with pytest.raises(tt.errors.InvalidArgumentError, match="ttl_seconds"):
        s.save_state("bad2", ttl_seconds=-5).result(timeout=120)
    assert _dirs(storage, s.session_id) == set()
    s.save_weights("good").result(timeout=120)  # the session goes on


def test_keys_see_their_own_and_admin_sees_all(served):
    client, _, _ = served
    s = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
    s.save_weights("mine", user_metadata={"who": "alice"}).result(timeout=120)
    with _other(client, BOB) as bob, _other(client, ROOT) as root:
        assert bob.search_checkpoints(user_metadata={"who": "alice"})[0] == []
        with pytest.raises(tt.errors.PermissionDeniedError):
            bob.search_checkpoints(owner="*")
        found = root.search_checkpoints(owner="*", user_metadata={"who": "alice"})[0]
        assert [c.name for c in found] == ["mine"]
        alice_tag = found[0].owner
        assert [c.name for c in root.search_checkpoints(owner=alice_tag, user_metadata={"who": "alice"})[0]] == ["mine"]
        assert alice_tag in root.storage_usage()
        with pytest.raises(tt.errors.NotFoundError):
            bob.update_checkpoint(found[0].uri, pinned=True)


def test_cli_and_http_search(served):
    client, _, keys = served
    s = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
    uri = s.save_weights("cli", user_metadata={"via": "cli"}).result(timeout=120).uri
    (keys / "alice").write_text(ALICE + "\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "together_train_server.cli", "checkpoints"]
    out = subprocess.run([*cmd, "search", "--address", client.address, "--api-key-file", str(keys / "alice"),
                          "--metadata", "via=cli", "--json"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)["checkpoints"]
    assert [c["uri"] for c in got] == [uri] and got[0]["size_bytes"] > 0
    out = subprocess.run([*cmd, "search", "--address", client.address, "--api-key-file", str(keys / "alice"),
                          "--limit", "500"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "limit must be 1-200" in out.stdout, (out.stdout, out.stderr)
    out = subprocess.run([*cmd, "update", uri, "--address", client.address, "--api-key-file", str(keys / "alice"),
                          "--metadata", "via=cli2", "--pin"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    headers = {"Authorization": f"Bearer {ALICE}"}
    r = httpx.post(f"{client.http_url}/v1/checkpoints/search", json={"user_metadata": {"via": "cli2"}},
                   headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    (row,) = r.json()["checkpoints"]
    assert row["uri"] == uri and row["pinned"] is True and row["size_bytes"] > 0
    r = httpx.post(f"{client.http_url}/v1/checkpoints/search", json={"limit": 0}, headers=headers, timeout=60)
    assert r.status_code == 400 and r.json()["key"] == "limit"
    r = httpx.patch(f"{client.http_url}/v1/checkpoints", json={"uri": uri, "user_metadata": {"k": 1}},
                    headers=headers, timeout=60)
    assert r.status_code == 400 and r.json()["key"] == "user_metadata.k", r.text


def test_tinker_save_with_metadata_and_ttl(served, tiny_model_dir):
    tinker = pytest.importorskip("tinker")
    client, _, _ = served
    sc = tinker.ServiceClient(base_url=client.http_url, api_key="tml-" + ALICE)
    try:
        tc = sc.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=0).result()
        path = tc.save_state("tk", ttl_seconds=7200, user_metadata={"src": "tinker"}).result().path
        rest = tinker.RestClient(base_url=client.http_url, api_key="tml-" + ALICE)
        (ck,) = [c for c in rest.list_user_checkpoints().result().checkpoints if c.tinker_path == path]
        assert ck.user_metadata == {"src": "tinker"} and ck.expires_at is not None and ck.size_bytes > 0
        rest.set_checkpoint_ttl_from_tinker_path(path, None).result()
        (ck,) = [c for c in rest.list_user_checkpoints().result().checkpoints if c.tinker_path == path]
        assert ck.expires_at is None
        found = client.search_checkpoints(user_metadata={"src": "tinker"})[0]
        assert [c.type for c in found] == ["training"]
    finally:
        sc.close("success").result()
