"""Short micro-batches run on the ``short-steps`` thread with a high mmap threshold (engines/short_steps.run_sized).

Only where memory comes from changes: the same forward_backward + optim_step run
with and without it gives the same loss and the same adapter weights, bit for bit
(same ops, same intra-op thread count). The long-sequence side (freed blocks leave,
peaks within the admission estimate after short steps) is
tests/conformance/test_memory_admission.py::test_estimate_is_not_exceeded.
"""

from __future__ import annotations

import threading

import pytest
import torch

from _models import build_tiny_model, random_samples


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-arena"))


def test_run_sized_places_short_and_long_micro_batches():
    from together_train_server.engines import memory, short_steps as ss

    assert memory.set_mmap_threshold(1 << 20, env={}) == 1 << 20
    here = threading.current_thread()
    short = ss.run_sized(ss.SHORT_MICRO_BATCH_TOKENS, threading.current_thread)
    assert short is not here and short.name.startswith(ss.SHORT_STEPS_THREAD), short.name
    assert ss._Sized.current == ss.SHORT_MMAP_THRESHOLD
    assert ss.run_sized(ss.SHORT_MICRO_BATCH_TOKENS + 1, threading.current_thread) is here
    assert ss._Sized.current == 1 << 20
    assert ss.run_sized(8, lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(ZeroDivisionError):   # what fn raises reaches the caller
        ss.run_sized(8, lambda: 1 / 0)


def _train(model_dir, monkeypatch, sized: bool):
    from together_train_server.engines import memory, short_steps
    from together_train_server.engines.torch_trainer import TorchTrainerEngine
    from together_train_server.engines.types import AdamParams, LoraConfig

    memory.set_mmap_threshold(1 << 20, env={})
    if not sized:
        monkeypatch.setattr(short_steps._Sized, "pool", None)
    eng = TorchTrainerEngine(model_dir)
    threads: list[str] = []
    inner = eng._forward_group

    def recording(*args):
        threads.append(threading.current_thread().name)
        return inner(*args)

    monkeypatch.setattr(eng, "_forward_group", recording)
    eng.create_adapter("a", LoraConfig(rank=4, alpha=8.0, seed=0))
    loss = eng.forward("a", random_samples([40, 33, 17], eng.vocab_size, seed=3), "cross_entropy", backward=True).loss
    eng.optim_step("a", AdamParams(learning_rate=1e-2))
    monkeypatch.undo()
    return loss, eng.adapter_tensors("a"), threads


def test_short_step_results_unchanged(model_dir, monkeypatch):
    loss_on, w_on, threads_on = _train(model_dir, monkeypatch, sized=True)
    loss_off, w_off, threads_off = _train(model_dir, monkeypatch, sized=False)
    assert threads_on and all(t.startswith("short-steps") for t in threads_on), threads_on
    assert threads_off and not any(t.startswith("short-steps") for t in threads_off), threads_off
    assert loss_on == loss_off, (loss_on, loss_off)
    for k in w_off:
        assert torch.equal(w_on[k], w_off[k]), (k, (w_on[k] - w_off[k]).abs().max().item())
