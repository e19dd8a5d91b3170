"""Importing a PEFT adapter trained elsewhere (ResourceClient.import_adapter, gRPC ImportAdapter).

The adapter is built with plain peft on the tiny random model (B set to random values so it changes the
output), streamed to a real resource in small chunks, and checked against the independent reference:
plain transformers + peft scoring the same tokens with that adapter directory. Each kind of bad adapter is
refused naming the file and tensor, with the storage directory unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import together_train as tt

# float32 logprobs of the same model computed by two code paths differ by summation order only: a few
# float32 ulps of the logits (|logit| < 10 here) carried through log_softmax; 1e-4 bounds that with margin.
TOL = 1e-4
TOKENS = [np.array([5, 17, 99, 3, 250, 41, 8, 77, 1000, 12]), np.array([300, 2, 9, 4000, 55, 6])]


def make_peft_adapter(model_dir: Path, out: Path, *, r: int = 4, alpha: float = 8.0,
                      targets=("q_proj", "v_proj"), seed: int = 0) -> Path:
    """A LoRA adapter saved by peft itself, with random (non-zero) A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn_like(p) * 0.2)
    model.save_pretrained(out)
    return out


def peft_logprobs(model_dir: Path, adapter_dir: Path, seqs) -> list[np.ndarray]:
    """log p(seq[i+1] | seq[:i+1]) with plain transformers + peft (the independent reference)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            logits = model(torch.tensor(s[:-1])[None]).logits[0].double()
            out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(s[1:])[:, None])[:, 0].numpy())
    return out


def _tree(storage: Path) -> dict[str, int]:
    """Every checkpoint file under the storage directory (relative path -> size)."""
    return {str(p.relative_to(storage)): p.stat().st_size for p in (storage / "sessions").rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def served(resource):
    """The suite's shared resource (tests/conftest.py) and its storage directory."""
    return resource, resource.storage_dir


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, tmp_path_factory):
    return make_peft_adapter(tiny_model_dir, tmp_path_factory.mktemp("peft") / "adapter")


def test_imported_adapter_matches_peft_and_trains_on(served, adapter, tiny_model_dir):
    client, _ = served
    ref = peft_logprobs(tiny_model_dir, adapter, TOKENS)
    info = client.import_adapter(adapter, "from-peft", type="training", user_metadata={"src": "peft"},
                                 chunk_bytes=4096)  # many chunks
    assert info.kind == "state" and info.uri.endswith("/state/from-peft") and info.step == 0
    s = client.create_session(checkpoint_uri=info.uri)
    samples = [tt.Sample(model_input=t[:-1], loss_fn_inputs={"target_tokens": t[1:],
                                                             "weights": np.ones(len(t) - 1, np.float32)})
               for t in TOKENS]
    got = s.forward(samples, "cross_entropy", return_logprobs=True).result(timeout=120).logprobs
    for i, (a, b) in enumerate(zip(got, ref)):
        err = float(np.max(np.abs(np.asarray(a, np.float64) - b)))
        assert err <= TOL, f"sequence {i}: max |delta logprob| {err:.3g} > {TOL} (ours {a[:4]}, peft {b[:4]})"
    base = client.compute_logprobs([TOKENS[0]]).result(timeout=120).logprobs[0]
    assert np.max(np.abs(base - ref[0])) > 100 * TOL  # the adapter does change the output
    loss0 = s.forward_backward(samples, "cross_entropy").result(timeout=120).loss
    step = s.optim_step(tt.AdamParams(learning_rate=1e-2)).result(timeout=120)
    assert step.step == 1  # fresh optimizer: the first step of this session
    loss1 = s.forward(samples, "cross_entropy").result(timeout=120).loss
    assert loss1 < loss0, (loss0, loss1)
    assert [c.name for c in client.search_checkpoints(user_metadata={"src": "peft"})[0]] == ["from-peft"]


def test_imported_sampler_checkpoint_scores_like_peft(served, adapter, tiny_model_dir):
    client, _ = served
    ref = peft_logprobs(tiny_model_dir, adapter, TOKENS)
    info = client.import_adapter(adapter, "sampler", type="sampler")
    assert info.kind == "weights"
    got = client.compute_logprobs(TOKENS, checkpoint_uri=info.uri).result(timeout=120).logprobs
    for i, (a, b) in enumerate(zip(got, ref)):
        # the replica scores prompt tokens; position 0 has no logprob there
        a = np.asarray(a, np.float64)[-len(b):]
        err = float(np.max(np.abs(a - b)))
        assert err <= TOL, f"sequence {i}: max |delta logprob| {err:.3g} > {TOL}"


def test_reimport_of_the_same_files_takes_the_new_metadata_ttl_and_pin(served, adapter):
    """The same files under the same name are the same checkpoint (an import is idempotent), and the
    newer call's user_metadata, TTL and pin replace the older ones (they were dropped silently)."""
    client, _ = served
    first = client.import_adapter(adapter, "again", type="sampler", user_metadata={"run": "r1"})
    second = client.import_adapter(adapter, "again", type="sampler", user_metadata={"run": "r2"},
                                   ttl_seconds=3600, pinned=True)
    assert second.uri == first.uri
    assert client.search_checkpoints(user_metadata={"run": "r1"})[0] == []
    (row,), _ = client.search_checkpoints(user_metadata={"run": "r2"})
    assert row.uri == first.uri and row.pinned and row.expires_at > time.time() + 3000, row


def test_broken_upload_resumes_where_it_stopped(served, adapter):
    """A stream that breaks mid-file keeps what arrived (GetImportProgress); import_adapter then sends only
    the rest (the resource refuses a chunk at any other offset), the stored files are the source's bytes, and
    a retry of the finished import gets the same checkpoint back."""
    import grpc

    from together_train._proto import resource_pb2
    from together_train.adapter_upload import adapter_files, upload_id_for, upload_messages

    client, storage = served
    files = adapter_files(adapter)
    uid = upload_id_for("resumed", "training", files)
    header = resource_pb2.ImportAdapterHeader(name="resumed", type="training", upload_id=uid)

    stop = threading.Event()

    def stalled():  # part of the files, then the client hangs until the call is cancelled
        for i, m in enumerate(upload_messages(header, files, 1024)):
            if i == 6:
                stop.wait(60)
                return
            yield m

    def kept() -> dict[str, int]:
        return dict(client._resource.GetImportProgress(resource_pb2.GetImportProgressRequest(upload_id=uid),
                                                       timeout=30, metadata=client._metadata).received)

    call = client._resource.ImportAdapter.future(stalled(), timeout=60, metadata=client._metadata)
    deadline = time.time() + 30
    while sum(kept().values()) < 5 * 1024 and time.time() < deadline:  # 5 chunks of 1 KiB have arrived
        time.sleep(0.05)
    call.cancel()  # the connection breaks mid-file
    stop.set()
    with pytest.raises(grpc.FutureCancelledError):
        call.result()
    time.sleep(0.5)  # the resource's handler sees the cancellation
    progress = kept()
    total = sum(f.stat().st_size for _, f, _ in files)
    assert 0 < sum(progress.values()) < total, progress
    info = client.import_adapter(adapter, "resumed", type="training", chunk_bytes=1024)
    stored = Path(client.download_checkpoint(info.uri, storage.parent / "resumed-dl"))
    ours = load_file(str(stored / "adapter_model.safetensors"))
    theirs = load_file(str(adapter / "adapter_model.safetensors"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k].float()) for k in ours)
    assert kept() == {}
    assert client.import_adapter(adapter, "resumed", type="training").uri == info.uri


def _edit_config(d: Path, **kv) -> None:
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg.update(kv)
    (d / "adapter_config.json").write_text(json.dumps(cfg))


def _edit_tensors(d: Path, fn) -> None:
    t = load_file(str(d / "adapter_model.safetensors"))
    save_file(fn(t), str(d / "adapter_model.safetensors"))


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def _nan(t):
    t[Q_A][0, 0] = float("nan")
    return t


def _inf(t):
    t[Q_A.replace("lora_A", "lora_B")][1, 0] = float("inf")
    return t


BAD = {
    "base model": (lambda d: _edit_config(d, base_model_name_or_path="other-org/Other-Model-7B"),
                   "adapter_config.json", "Other-Model-7B"),
    "target module": (lambda d: _edit_config(d, target_modules=["q_proj", "v_proj", "w_nope"]),
                      "adapter_config.json", "w_nope"),
    "rank vs shape": (lambda d: _edit_config(d, r=8), f"adapter_model.safetensors:{Q_A}", "disagrees with rank r=8"),
    "nan": (lambda d: _edit_tensors(d, _nan), f"adapter_model.safetensors:{Q_A}", "NaN/inf"),
    "inf": (lambda d: _edit_tensors(d, _inf), f"adapter_model.safetensors:{Q_A.replace('lora_A', 'lora_B')}",
            "NaN/inf"),
    "dtype": (lambda d: _edit_tensors(d, lambda t: {**t, Q_A: t[Q_A].to(torch.int8)}),
              f"adapter_model.safetensors:{Q_A}", "not a float type"),
    "key layout": (lambda d: _edit_tensors(d, lambda t: {**t, "model.embed.extra.weight": torch.zeros(2, 2)}),
                   "adapter_model.safetensors:model.embed.extra.weight", "not a LoRA key"),
    "unreadable file": (lambda d: (d / "adapter_model.safetensors").write_bytes(b"\x00garbage" * 10),
                        "adapter_model.safetensors", "not a readable safetensors file"),
    "missing layer": (lambda d: _edit_tensors(d, lambda t: {k: v for k, v in t.items() if "layers.1.self_attn.v_proj"
                                                            not in k}),
                      "adapter_model.safetensors:base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight",
                      "no lora_A"),
    "dora": (lambda d: _edit_config(d, use_dora=True), "adapter_config.json", "use_dora"),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_adapter_is_refused_naming_file_and_tensor_nothing_stored(served, adapter, tmp_path, kind):
    client, storage = served
    edit, key, words = BAD[kind]
    bad = tmp_path / "bad"
    shutil.copytree(adapter, bad)
    edit(bad)
    before, listed = _tree(storage), client.list_checkpoints()
    with pytest.raises(tt.errors.InvalidArgumentError) as err:
        client.import_adapter(bad, f"bad-{kind.replace(' ', '-')}", type="training")
    assert err.value.key == key, err.value
    assert words in str(err.value) and key.split(":")[0] in str(err.value), err.value
    assert _tree(storage) == before and client.list_checkpoints() == listed
    assert not list((storage / ".uploads").iterdir())


def test_cli_import_adapter(served, adapter, tmp_path):
    client, storage = served
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "together_train_server.cli", "import-adapter", "--address", client.address]
    out = subprocess.run([*cmd, str(adapter), "--name", "via-cli", "--type", "sampler", "--metadata", "src=cli"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    uri = out.stdout.strip().splitlines()[-1]
    assert uri.startswith("together-train://import-") and uri.endswith("/weights/via-cli")
    assert [c.uri for c in client.search_checkpoints(user_metadata={"src": "cli"})[0]] == [uri]
    bad = tmp_path / "bad"
    shutil.copytree(adapter, bad)
    _edit_config(bad, target_modules=["q_proj", "v_proj", "w_nope"])
    before = _tree(storage)
    out = subprocess.run([*cmd, str(bad)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "adapter_config.json" in out.stdout and "w_nope" in out.stdout, out
    assert _tree(storage) == before


_IMPORTER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from together_train_server.engines.torch_trainer import TorchTrainerEngine
    from together_train_server.service.checkpoints.adapter_import import AdapterImporter
    from together_train_server.service.checkpoints.lifecycle import CheckpointLifecycle
    from together_train_server.service.checkpoints.registry import Registry
    from together_train_server.service.checkpoints.store import CheckpointStore
    root, model, adapter = (Path(a) for a in sys.argv[1:4])
    engine = TorchTrainerEngine(str(model))
    reg = Registry(root)
    store = CheckpointStore(root, registry=reg, base_model=engine.model_id)
    imp = AdapterImporter(store, CheckpointLifecycle(store, reg), engine, 64)
    print("ready", flush=True)
    for i in range(1000):
        imp.import_dir(adapter, name=f"a{i:04d}", as_type="training" if i % 2 else "sampler")
""")


def test_import_killed_midway_lists_only_whole_checkpoints(adapter, tiny_model_dir, tmp_path):
    """SIGKILL a process importing in a loop (it spends nearly all its time inside an import, so the kill lands
    mid-import): after a restart every listed checkpoint is whole (verifies against its manifest, has every
    file of its kind), every row has its files and no partial directory is left. One process start (~20 s
    under load) keeps this quick; tests/unit/test_checkpoint_lifecycle.py kills sweeps at several points."""
    from together_train_server.service.checkpoints.registry import Registry
    from together_train_server.service.checkpoints.store import CheckpointStore

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    root = tmp_path / "storage"
    for delay in (0.5,):
        proc = subprocess.Popen([sys.executable, "-c", _IMPORTER, str(root), str(tiny_model_dir), str(adapter)],
                                env=env, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        reg = Registry(root)
        store = CheckpointStore(root, registry=reg)  # a restart: stale partials of dead writers removed
        for c in store.list():
            store.get(c.uri, verify=True)
            want = {"adapter_config.json", "adapter_model.safetensors"} | (
                {"trainer_state.json", "trainer_state.safetensors"} if c.kind == "state" else set())
            assert want <= set(c.files), (c.uri, c.files)
        assert list((root / "sessions").glob("*/*/.*")) == []  # no partial directory left
        assert sorted(reg.uris()) == sorted(c.uri for c in store.list())  # every row has its whole files
        reg.close()
