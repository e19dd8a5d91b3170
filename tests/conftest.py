"""Shared fixtures: a tiny random model on disk and a real resource process serving it.

The resource is started through the public SDK (`together_train.launch_local`),
i.e. a real `together-train serve` process with a real generator replica
process, on a free loopback port; tests talk to it over gRPC.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama (hidden 64, 2 layers, context 256) with the SmolLM2 tokenizer."""
    from together_train_server.engines.model_loading import build_tiny_model

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
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)
