"""A replica's adapter rules without gRPC: `service.replica_host.ReplicaHost` over a real torch generator engine.

The tiny Llama (`_models.tiny_model`) is served by `TorchGeneratorEngine`; adapters are real PEFT
state dicts from `TorchTrainerEngine.adapter_tensors`, their ``lora_B`` filled with seeded random
values (a fresh adapter's ``lora_B`` is zero, which would score like the base).

1. The base: ``resolve("")`` is the base model at version -1 and scores exactly as the engine's
   base; a session nothing was pushed for is "holds no weights" (retryable FAILED_PRECONDITION).
2. Versions: a push older than the one held is ignored and answered with the held version (the
   newer weights keep scoring, bit for bit); a newer one replaces it; scoring reports the version.
3. Residency: at most `max_adapters` loaded; a push past it evicts the least recently used (a
   request touches its adapter), which leaves the engine but keeps its version; a request for it
   is "holds no weights ... evicted"; pushing it again loads it (scores as before, bit for bit)
   and evicts the next least recently used.
4. Drop: forgets version and engine adapter; an evicted or unknown one drops without error.
5. Bad input: a push the engine refuses is INVALID_ARGUMENT naming "tensors" and changes nothing.
6. Sampling through the host reports the version that served, and counts as outstanding meanwhile.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from _models import tiny_model
from together_train_server.engines.types import LoraConfig, SamplingParams
from together_train_server.service.errors import ServiceError
from together_train_server.service.replica_host.host import ReplicaHost, Resolved

SEQS = [[1, 504, 3458, 314, 260, 3575, 282, 4649, 47, 2], [7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def engine(model_dir):
    from together_train_server.engines.torch_generator import TorchGeneratorEngine

    gen = TorchGeneratorEngine(model_dir)
    yield gen
    gen.close()


@pytest.fixture(scope="module")
def adapters(model_dir):
    """Five distinct adapters (spec, tensors): rank 4, lora_B random (seed k)."""
    from together_train_server.engines.torch_trainer import TorchTrainerEngine

    trainer = TorchTrainerEngine(model_dir)
    out = []
    for k in range(5):
        spec = LoraConfig(rank=4, alpha=8.0, seed=k)
        trainer.create_adapter(f"a{k}", spec)
        g = torch.Generator().manual_seed(100 + k)
        tensors = {name: (torch.randn(t.shape, generator=g) * 0.5 if "lora_B" in name else t.clone())
                   for name, t in trainer.adapter_tensors(f"a{k}").items()}
        out.append((spec, tensors))
    return out


@pytest.fixture
def host(engine):
    h = ReplicaHost(engine, replica_id="r-test", max_adapters=2)
    yield h
    for key in list(engine.adapter_keys):
        engine.drop_adapter(key)


@contextlib.contextmanager
def lacks(session: str, evicted: bool):
    """Expects the "holds no weights" answer: its code, retryable, key, and the eviction note or none."""
    with pytest.raises(ServiceError) as info:
        yield
    err = info.value
    assert err.code == "FAILED_PRECONDITION" and err.retryable and err.key == "session_id", err
    assert f"replica r-test holds no weights for session {session}" in str(err), str(err)
    assert ("evicted" in str(err)) == evicted, str(err)


def scores(host, session):
    logprobs, version = host.compute_logprobs(SEQS, session)
    return [np.asarray(lp) for lp in logprobs], version


def test_base_resolves_and_scores_as_the_engine(host, engine):
    assert host.resolve("") == Resolved(None, -1)
    got, version = scores(host, None)
    assert version == -1
    for a, b in zip(got, engine.compute_logprobs(SEQS, None)):
        np.testing.assert_array_equal(a, b)
    with lacks("nobody", evicted=False):
        host.resolve("nobody")
    with lacks("nobody", evicted=False):
        host.compute_logprobs(SEQS, "nobody")
    assert host.versions() == {}


def test_an_older_push_is_ignored_and_a_newer_one_replaces(host, engine, adapters):
    (spec0, t0), (spec1, t1), (spec2, t2) = adapters[:3]
    assert host.load("s", spec0, t0, 5) == 5
    v5, version = scores(host, "s")
    assert version == 5 and host.resolve("s") == Resolved("s", 5)
    # an older version arriving late: answered with the held one, nothing changes
    assert host.load("s", spec1, t1, 4) == 5
    again, version = scores(host, "s")
    assert version == 5 and host.versions() == {"s": 5}
    for a, b in zip(again, v5):
        np.testing.assert_array_equal(a, b)
    # a newer one replaces it, and scores differently
    assert host.load("s", spec2, t2, 6) == 6
    v6, version = scores(host, "s")
    assert version == 6 and host.versions() == {"s": 6}
    assert not np.allclose(v6[0], v5[0], atol=1e-3), (v6[0], v5[0])
    assert engine.adapter_version("s") == 6


def test_lru_eviction_at_the_limit_and_reload_on_demand(host, engine, adapters):
    (sa, ta), (sb, tb), (sc, tc) = adapters[:3]
    host.load("a", sa, ta, 1)
    host.load("b", sb, tb, 1)
    before_a, _ = scores(host, "a")     # a is now the most recently used
    host.load("c", sc, tc, 1)           # past the limit of 2: b, the least recently used, goes
    assert sorted(engine.adapter_keys) == ["a", "c"]
    assert host.versions() == {"a": 1, "b": 1, "c": 1}   # an evicted adapter keeps its version
    assert host.residency.evictions == 1
    with lacks("b", evicted=True):
        host.resolve("b")
    # the resource re-pushes b: it loads again, and a (now the least recently used) goes
    host.resolve("c")
    before_b_reload = host.residency.evictions
    assert host.load("b", sb, tb, 1) == 1
    assert sorted(engine.adapter_keys) == ["b", "c"] and host.residency.evictions == before_b_reload + 1
    with lacks("a", evicted=True):
        host.compute_logprobs(SEQS, "a")
    host.load("a", sa, ta, 1)           # reloaded a scores exactly as before its eviction
    after_a, version = scores(host, "a")
    assert version == 1
    for x, y in zip(after_a, before_a):
        np.testing.assert_array_equal(x, y)


def test_drop_forgets_version_and_engine_adapter(host, engine, adapters):
    (sa, ta), (sb, tb), (sc, tc) = adapters[:3]
    host.load("a", sa, ta, 3)
    host.drop("a")
    assert host.versions() == {} and "a" not in engine.adapter_keys
    with lacks("a", evicted=False):
        host.resolve("a")
    host.drop("a")        # unknown now: nothing happens
    host.drop("never")
    host.load("a", sa, ta, 1)
    host.load("b", sb, tb, 1)
    host.load("c", sc, tc, 1)            # evicts a
    host.drop("a")                       # evicted: dropped from the table, the engine holds nothing to drop
    assert host.versions() == {"b": 1, "c": 1} and sorted(engine.adapter_keys) == ["b", "c"]
    assert len(host.residency) == 2


def test_a_refused_push_changes_nothing(host, engine, adapters):
    (sa, ta), (sb, tb) = adapters[:2]
    host.load("a", sa, ta, 1)
    before, _ = scores(host, "a")
    bad = dict(tb)
    missing = next(iter(bad))
    del bad[missing]
    with pytest.raises(ServiceError) as info:
        host.load("a", sb, bad, 2)
    err = info.value
    assert err.code == "INVALID_ARGUMENT" and err.key == "tensors", err
    assert "pushed adapter rejected" in str(err), str(err)
    assert host.versions() == {"a": 1} and engine.adapter_version("a") == 1
    after, version = scores(host, "a")
    assert version == 1
    for x, y in zip(after, before):
        np.testing.assert_array_equal(x, y)


def test_sampling_reports_the_serving_version(host, adapters):
    (sa, ta), = adapters[:1]
    host.load("a", sa, ta, 7)
    resolved = host.resolve("a")
    params = SamplingParams(max_tokens=4, seed=3, ignore_eos=True)
    with host.in_flight():
        assert host.status().outstanding == 1
        fut = host.submit(resolved, SEQS[0], params, 2)
        out, version = host.outcome(fut, resolved)
    assert version == 7 and len(out.sequences) == 2
    assert host.status().outstanding == 0 and host.status().versions == {"a": 7}
    base = Resolved(None, -1)
    out, version = host.outcome(host.submit(base, SEQS[0], params), base)
    assert version == -1 and len(out.sequences) == 1
