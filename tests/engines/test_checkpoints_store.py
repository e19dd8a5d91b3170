"""Checkpoint store through a real resource: list, download, delete, corruption, names, mismatches.

Also: a write killed halfway never appears in a listing, and a checkpoint of a
different base model is refused naming what differs (an in-process Resource
on a second tiny model reads the same storage directory).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import together_train as tt
from _checkpoint_helpers import train
from together_train import errors


@pytest.fixture(scope="module")
def trained(resource):
    """A session trained one step, with a training and an inference checkpoint."""
    vocab = resource.get_capabilities().vocab_size
    s = resource.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=1), name="store")
    train(s, [5], vocab)
    state = s.save_state("st").result(timeout=120)
    weights = s.save_weights("w").result(timeout=120)
    yield {"session": s, "state": state, "weights": weights, "vocab": vocab}
    s.stop()


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_list_download_delete(resource, trained, tmp_path):
    s = trained["session"]
    listed = {c.uri: c for c in resource.list_checkpoints(s.session_id)}
    assert set(listed) == {trained["state"].uri, trained["weights"].uri}
    assert listed[trained["state"].uri].size_bytes > 0 and listed[trained["state"].uri].step == 1
    assert trained["state"].uri in {c.uri for c in resource.list_checkpoints()}

    dest = resource.download_checkpoint(trained["state"].uri, tmp_path / "dl")
    manifest = json.loads((dest / "manifest.json").read_text())
    assert manifest["files"]
    for rel, meta in manifest["files"].items():
        assert (dest / rel).stat().st_size == meta["size"] and _sha(dest / rel) == meta["sha256"]
        assert (dest / rel).read_bytes() == (trained["state"].path / rel).read_bytes()

    extra = s.save_weights("to-delete").result(timeout=120)
    resource.delete_checkpoint(extra.uri)
    assert extra.uri not in {c.uri for c in resource.list_checkpoints(s.session_id)}
    assert not extra.path.exists()
    with pytest.raises(errors.NotFoundError):
        resource.delete_checkpoint(extra.uri)
    with pytest.raises(errors.NotFoundError):
        resource.download_checkpoint(extra.uri, tmp_path / "gone")


def test_download_streams_large_files_in_chunks(resource, tmp_path):
    """A merged export (~26 MB of fp32 weights for the tiny model) crosses several 2 MiB chunks."""
    s = resource.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=1))
    try:
        merged = s.save_weights("merged-dl", merged=True).result(timeout=300)
    finally:
        s.stop()
    big = max((p for p in merged.path.iterdir()), key=lambda p: p.stat().st_size)
    assert big.stat().st_size > 3 * (2 << 20)
    dest = resource.download_checkpoint(merged.uri, tmp_path / "merged")
    assert _sha(dest / big.name) == _sha(big)


def test_duplicate_name_is_already_exists(trained):
    with pytest.raises(errors.AlreadyExistsError):
        trained["session"].save_state("st").result(timeout=120)


@pytest.mark.parametrize("name", ["../escape", "a/b", "/abs", "..", ".hidden", "", "x" * 200, "sp ace"])
def test_bad_names_are_refused(trained, name):
    s = trained["session"]
    with pytest.raises(errors.InvalidArgumentError):
        s.save_state(name).result(timeout=60)
    with pytest.raises(errors.InvalidArgumentError):
        s.save_weights(name).result(timeout=60)


@pytest.mark.parametrize(
    "uri",
    [
        "together-train://../state/x",
        "together-train://s-1/state/../../etc",
        "together-train://s-1/other/x",
        "file:///etc/passwd",
        "together-train://s-1/state/x/y",
    ],
)
def test_bad_uris_are_refused(resource, trained, uri, tmp_path):
    with pytest.raises(errors.InvalidArgumentError):
        trained["session"].load_state(uri).result(timeout=60)
    with pytest.raises(errors.InvalidArgumentError):
        resource.delete_checkpoint(uri)
    with pytest.raises(errors.InvalidArgumentError):
        resource.download_checkpoint(uri, tmp_path / "x")
    with pytest.raises(errors.InvalidArgumentError):
        resource.create_session(checkpoint_uri=uri)
    with pytest.raises(errors.InvalidArgumentError):
        resource.list_checkpoints("../..")


def test_corrupted_checkpoint_is_refused_with_data_loss(resource, trained, tmp_path):
    s = trained["session"]
    ckpt = s.save_state("to-corrupt").result(timeout=120)
    target = ckpt.path / "trainer_state.safetensors"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01  # flip one bit in the tensor data
    target.write_bytes(bytes(data))
    before = s.info().step

    with pytest.raises(errors.InternalError) as info:
        s.load_state_with_optimizer(ckpt.uri).result(timeout=120)
    assert info.value.code == "DATA_LOSS"
    assert "corrupted" in str(info.value) and "trainer_state.safetensors" in str(info.value)
    assert s.info().step == before  # nothing was loaded
    with pytest.raises(errors.InternalError, match="corrupted"):
        resource.create_session(checkpoint_uri=ckpt.uri)
    with pytest.raises(errors.InternalError, match="corrupted"):
        resource.download_checkpoint(ckpt.uri, tmp_path / "corrupt")
    # A missing file is refused the same way.
    (ckpt.path / "adapter_config.json").unlink()
    with pytest.raises(errors.InternalError, match="corrupted"):
        s.load_state(ckpt.uri).result(timeout=120)


def test_inference_checkpoint_and_lora_shape_mismatch_are_refused(resource, trained):
    s = trained["session"]
    with pytest.raises(errors.InvalidArgumentError, match="inference checkpoint"):
        s.load_state(trained["weights"].uri).result(timeout=60)
    with pytest.raises(errors.NotFoundError):
        s.load_state(trained["state"].uri.rsplit("/", 1)[0] + "/nope").result(timeout=60)

    other = resource.create_session(lora=tt.LoraConfig(rank=8, alpha=8.0, seed=1))
    try:
        with pytest.raises(errors.FailedPreconditionError, match=r"LoRA rank: checkpoint 4, session 8"):
            other.load_state_with_optimizer(trained["state"].uri).result(timeout=60)
        assert other.info().step == 0
    finally:
        other.stop()
    with pytest.raises(errors.FailedPreconditionError, match="LoRA alpha"):
        resource.create_session(lora=tt.LoraConfig(rank=4, alpha=16.0), checkpoint_uri=trained["state"].uri)
    with pytest.raises(errors.FailedPreconditionError, match="LoRA target_modules"):
        resource.create_session(
            lora=tt.LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj"]), checkpoint_uri=trained["state"].uri
        )


def test_different_base_model_is_refused_naming_it(trained, tmp_path):
    """An in-process Resource on a Qwen2-shaped tiny model reads the same storage."""
    from _models import build_tiny_model
    from together_train_server.engines.torch_trainer import TorchTrainerEngine
    from together_train_server.service.errors import ServiceError
    from together_train_server.service.replicas.pool import ReplicaPool
    from together_train_server.service.resource import Resource

    storage = trained["state"].path.parents[3]
    engine = TorchTrainerEngine(build_tiny_model(tmp_path / "qwen", arch="qwen2", seed=0))
    res = Resource(engine, ReplicaPool([]), storage)
    try:
        with pytest.raises(ServiceError) as info:
            res.sessions.create_session(None, checkpoint_uri=trained["state"].uri)
        assert info.value.code == "FAILED_PRECONDITION"
        assert "base model model_id" in info.value.message and "architecture" in info.value.message
        assert not [s for s in res.session_table.list_sessions() if s.state == "ACTIVE"]  # the slot was not kept
    finally:
        res.close()


_KILLED_WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from together_train_server.service.checkpoints.store import CheckpointStore
    store = CheckpointStore(Path(sys.argv[1]))
    with store.writer("s-killed", "state", "partial", step=3) as tmp:
        with open(tmp / "trainer_state.safetensors", "wb") as f:
            f.write(b"x" * 100000)
            f.flush()
            print("writing", flush=True)
            time.sleep(60)
    """
)


def test_write_killed_halfway_is_never_listed(resource, trained):
    from together_train_server.service.checkpoints.store import CheckpointStore

    storage = trained["state"].path.parents[3]
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(storage)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    partial_dir = storage / "sessions" / "s-killed" / "state"
    assert [p.name for p in partial_dir.iterdir() if p.name.startswith(".tmp-partial-")]  # it was half written
    assert not [c for c in resource.list_checkpoints() if c.name == "partial"]
    assert not [c for c in resource.list_checkpoints("s-killed")]
    with pytest.raises(errors.NotFoundError):
        resource.create_session(checkpoint_uri="together-train://s-killed/state/partial")
    # The next store opened on this directory (a restarted resource) removes the dead writer's leftovers.
    CheckpointStore(storage)
    assert not [p for p in partial_dir.iterdir() if p.name.startswith(".tmp-partial-")]
