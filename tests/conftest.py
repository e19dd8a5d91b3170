"""Shared fixtures: a tiny random model on disk and a real resource process serving it.

The resource is started through the public SDK (`together_train.launch_local`),
i.e. a real `together-train serve` process with a real generator replica
process, on a free loopback port; tests talk to it over gRPC.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# This checkout's packages come first, in this process and in every server process a test starts, so a
# second checkout never runs the code of the tree that happens to be pip-installed in editable mode.
_ROOT = Path(__file__).resolve().parent.parent
_OWN_PATHS = [str(_ROOT), str(_ROOT / "server"), str(_ROOT / "cookbook")]
sys.path[:0] = [p for p in _OWN_PATHS if p not in sys.path]
os.environ["PYTHONPATH"] = os.pathsep.join(_OWN_PATHS + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
# The tiers (tests/unit, engines, server, conformance, long) share the helpers here (_models.py, _served.py, ...)
# and import fixtures from each other's modules: every tier folder is on sys.path.
_TESTS = _ROOT / "tests"
TIERS = ("unit", "engines", "server", "conformance", "long")
sys.path[:0] = [p for p in [str(_TESTS)] + [str(_TESTS / t) for t in TIERS] if p not in sys.path]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_collection_modifyitems(config, items):
    """Each test is marked with its tier, read from its folder (``-m unit``, ``-m "not long"``)."""
    for item in items:
        parts = Path(str(item.fspath)).relative_to(_TESTS).parts
        if len(parts) > 1 and parts[0] in TIERS:
            item.add_marker(getattr(pytest.mark, parts[0]))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama (hidden 64, 2 layers, context 256) with the SmolLM2 tokenizer."""
    from _models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", seed=0)


@pytest.fixture(scope="session")
def resource(tiny_model_dir, tmp_path_factory):
    """A ResourceClient connected to a real local resource (1 generator replica) on the tiny model."""
    import together_train as tt

    storage = tmp_path_factory.mktemp("storage")
    with tt.launch_local(
        model=str(tiny_model_dir),
        generators=1,
        storage_dir=storage,
        extra_args=["--max-sessions", "64", "--trainer-threads", "1", "--generator-threads", "1"],
    ) as client:
        yield client


@pytest.fixture()
def session(resource):
    """A fresh LoRA session (rank 4, seed 0), stopped after the test."""
    import together_train as tt

    s = resource.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
    yield s
    try:
        s.stop()
    except Exception:
        pass


@pytest.fixture(scope="session")
def tiny_model_dir_1k(tmp_path_factory):
    """The tiny random Llama with 1024 positions (the embedded template's tools system turn is ~330 tokens):
    the HTTP API tests with tools and constrained decoding share it."""
    from _models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-1k"), arch="llama", seed=0, max_positions=1024)


@pytest.fixture(scope="session")
def tokenizer_1k(tiny_model_dir_1k):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir_1k)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)
