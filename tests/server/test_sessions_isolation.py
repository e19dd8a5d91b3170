"""Several LoRA sessions on one resource (the shared tiny resource, 1 replica).

- Isolation: training one session never changes another's outputs, optimizer
  or step, even with their operations interleaved (gradients accumulate per
  session); a session trained alongside others (one op at a time, so never in
  one clock cycle) ends bit-identical to one trained alone; stopping one leaves the others untouched (trainer and replica).
- A session created from a training checkpoint is served at the checkpoint's
  version at once (its adapter is pushed before the session is returned).
- SDK cleanup: leaving a session's `with` block cancels its queued
  operations, waits until every one is terminal, then stops the session.
"""

from __future__ import annotations

import numpy as np
import pytest

import together_train as tt
from _checkpoint_helpers import ADAM, assert_bit_equal, make_batch, state_tensors, train
from together_train import errors

LORA = tt.LoraConfig(rank=4, alpha=8.0, seed=0)
GREEDY = tt.SamplingParams(max_tokens=6, temperature=0.0)
PROMPT = [1, 504, 3120, 28, 9]


def _logprobs(session, probe):
    return session.forward(probe, loss_fn="cross_entropy", return_logprobs=True).result(timeout=120).logprobs


def test_sessions_are_isolated(resource):
    vocab = resource.get_capabilities().vocab_size
    probe = make_batch(500, vocab)
    s1, s2, alone = (resource.create_session(lora=LORA) for _ in range(3))
    try:
        before = _logprobs(s2, probe)
        train(s1, [1, 2], vocab)
        for a, b in zip(before, _logprobs(s2, probe)):
            assert np.array_equal(a, b)  # bit for bit
        assert s2.info().step == 0 and s1.info().step == 2

        # Interleave: s2's gradient must not see s1's backward passes, nor its optimizer steps.
        # Each op waits for the one before, so no two run in one clock cycle: a cycle's pass sums
        # in another order (equal within float32 summation error, tests/server/test_clock_cycle.py), and
        # this test asks for bit-identity.
        for i in range(2):
            s2.forward_backward(make_batch(100 + i, vocab), loss_fn="cross_entropy").result(timeout=120)
            s1.forward_backward(make_batch(200 + i, vocab), loss_fn="cross_entropy").result(timeout=120)
            s1.optim_step(ADAM).result(timeout=120)
            s2.optim_step(ADAM).result(timeout=120)
        train(alone, [100, 101], vocab)
        st2 = s2.save_state("iso").result(timeout=120)
        st_alone = alone.save_state("iso").result(timeout=120)
        assert_bit_equal(state_tensors(st2.path), state_tensors(st_alone.path))
        assert s2.info().step == 2 and s1.info().step == 4
        assert not np.array_equal(_logprobs(s1, probe)[0], _logprobs(s2, probe)[0])

        # Replicas: s2's samples do not change when s1 publishes or stops.
        assert s2.weights_sync().result(timeout=120).policy_version == 2
        first = s2.sample(PROMPT, GREEDY).result(timeout=120)
        s1.weights_sync().result(timeout=120)
        again = s2.sample(PROMPT, GREEDY).result(timeout=120)
        assert again.sequences[0].tokens == first.sequences[0].tokens and again.policy_version == 2
        s2_lp = _logprobs(s2, probe)
        s1.stop()
        after_stop = s2.sample(PROMPT, GREEDY).result(timeout=120)
        assert after_stop.sequences[0].tokens == first.sequences[0].tokens and after_stop.policy_version == 2
        for a, b in zip(s2_lp, _logprobs(s2, probe)):
            assert np.array_equal(a, b)
        assert train(s2, [300], vocab) and s2.info().step == 3
    finally:
        for s in (s1, s2, alone):
            s.stop()


def test_session_from_checkpoint_is_served_at_its_version(resource):
    vocab = resource.get_capabilities().vocab_size
    src = resource.create_session(lora=LORA)
    try:
        train(src, [7, 8], vocab, tt.AdamParams(learning_rate=5e-2))
        src.weights_sync().result(timeout=120)
        served = src.sample(PROMPT, GREEDY).result(timeout=120)
        base = resource.sample(PROMPT, GREEDY).result(timeout=120)
        ckpt = src.save_state("serve").result(timeout=120)
    finally:
        src.stop()
    assert served.policy_version == 2
    for with_optimizer in (False, True):
        s = resource.create_session(checkpoint_uri=ckpt.uri, with_optimizer=with_optimizer)
        try:
            info = s.info()
            assert info.step == 2 and info.synced_version == 2
            out = s.sample(PROMPT, GREEDY).result(timeout=120)  # no weights_sync needed
            assert out.policy_version == 2 and out.sequences[0].tokens == served.sequences[0].tokens
        finally:
            s.stop()
    # Loading into a session that already published a newer version replaces it on the replicas.
    s = resource.create_session(lora=LORA)
    try:
        train(s, [1, 2, 3], vocab)
        s.weights_sync().result(timeout=120)
        assert s.load_state(ckpt.uri).result(timeout=120).step == 2
        assert s.info().synced_version == 2
        out = s.sample(PROMPT, GREEDY).result(timeout=120)
        assert out.policy_version == 2 and out.sequences[0].tokens == served.sequences[0].tokens
        s.optim_step(ADAM).result(timeout=120)  # no gradient: AdamW skips, the version still advances
        assert s.weights_sync().result(timeout=120).policy_version == 3
    finally:
        s.stop()
    assert base.policy_version == -1


def test_context_manager_cancels_queued_waits_and_stops(resource):
    vocab = resource.get_capabilities().vocab_size
    heavy = make_batch(9, vocab, lengths=(250, 250))
    with resource.create_session(lora=LORA) as s:
        futs = [s.forward_backward(heavy, loss_fn="cross_entropy") for _ in range(20)]
    assert all(f.done() for f in futs)
    assert any(f.cancelled() for f in futs)
    assert not s.pending_operations()
    assert resource.get_session(s.session_id).state == "stopped"
    with pytest.raises(errors.FailedPreconditionError, match="stopped"):
        s.forward_backward(heavy, loss_fn="cross_entropy")
