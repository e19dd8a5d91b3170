"""`serve --allocator`: a real server process runs on tcmalloc when the library is installed (it re-executes
itself once, before loading the model; its replicas inherit it), on glibc when asked, and says so.

The speed and memory figures are in engines/allocator.py and benchmarks/long_context.py; the estimates' check
under tcmalloc is tests/conformance/test_memory_admission.py::test_estimates_hold_on_tcmalloc.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

import together_train as tt
from _models import random_samples
from together_train_server.engines.allocator import tcmalloc_library

needs_tcmalloc = pytest.mark.skipif(tcmalloc_library() is None,
                                    reason="libtcmalloc_minimal is not installed (apt-get install libtcmalloc-minimal4)")


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids = (task / "children").read_text().split()
        out.extend(int(k) for k in kids)
    return out


def _one_step(client) -> float:
    s = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
    try:
        samples = [tt.Sample(model_input=x.model_input, loss_fn_inputs=dict(x.inputs))
                   for x in random_samples([40, 25], client.get_capabilities().vocab_size, seed=3)]
        return s.forward_backward(samples, "cross_entropy").result(timeout=300).loss
    finally:
        s.stop()


@needs_tcmalloc
def test_auto_runs_the_server_and_its_replica_on_tcmalloc_with_the_same_losses(tiny_model_dir, tmp_path):
    losses = {}
    for choice in ("auto", "glibc"):
        with tt.launch_local(model=str(tiny_model_dir), generators=1, storage_dir=tmp_path / choice,
                             extra_args=["--allocator", choice, "--trainer-threads", "1",
                                         "--generator-threads", "1"]) as c:
            pid = c.local_resource.process.pid
            replicas = _children(pid)
            assert replicas, "no replica process under the server"
            on = ["libtcmalloc" in _maps(p) for p in [pid, *replicas]]
            assert on == [choice == "auto"] * len(on), (choice, on)
            losses[choice] = _one_step(c)
    # One allocator or the other: the same math, bit for bit.
    assert losses["auto"] == losses["glibc"], losses


def test_unknown_allocator_is_refused_in_one_line():
    out = subprocess.run([sys.executable, "-m", "together_train_server.cli", "serve", "--allocator", "jemalloc"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "--allocator" in out.stderr and "jemalloc" in out.stderr, out.stderr


def test_tcmalloc_asked_without_the_library_names_the_package(monkeypatch):
    from together_train_server.engines import allocator

    monkeypatch.setattr(allocator, "tcmalloc_library", lambda: None)
    monkeypatch.setattr(allocator, "tcmalloc_active", lambda: False)
    with pytest.raises(ValueError, match="libtcmalloc-minimal4"):
        allocator.reexec_with_tcmalloc("tcmalloc")
    assert allocator.reexec_with_tcmalloc("auto") == "glibc"   # auto falls back without a word of error
