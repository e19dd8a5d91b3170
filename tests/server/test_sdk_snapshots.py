"""The gRPC SDK samples fixed weights: a snapshot of a session (`Session.snapshot`) and a saved checkpoint by URI
(`ResourceClient.sample(checkpoint_uri=...)`), while the session trains on.

Through the suite's shared real resource (tests/conftest.py). The reference is the session's own trainer
forward at the step the snapshot or checkpoint was taken, computed before any further training (sampler and
trainer logprobs agree within 1e-4 in fp32: tests/server/test_e2e_versions.py); sampled logprobs are compared at
temperature 1 (no filter), where a sampled token's logprob is the model's own.
"""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest

import together_train as tt

PROMPT = [1, 420, 1003, 77, 9120, 15]
TOKENS = PROMPT + [311, 2048, 5, 600, 31]
LOGPROB_ATOL = 1e-4
TIMEOUT = 120
PARAMS = tt.SamplingParams(max_tokens=8, temperature=1.0, seed=21, ignore_eos=True)


def _train_step(session, seed: int, lr: float = 5e-2) -> None:
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, 49152, size=17)
    session.forward_backward(
        [tt.Sample(model_input=toks[:-1], loss_fn_inputs={"target_tokens": toks[1:], "weights": np.ones(16, np.float32)})],
        "cross_entropy",
    )
    session.optim_step(tt.AdamParams(learning_rate=lr))


def _trainer_logprobs(session, tokens) -> np.ndarray:
    tokens = np.asarray(tokens)
    sample = tt.Sample(model_input=tokens[:-1],
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": np.zeros(len(tokens) - 1, np.float32)})
    return np.asarray(session.forward([sample], "cross_entropy", return_logprobs=True).result(timeout=TIMEOUT).logprobs[0])


def _close(what: str, got, want, tol: float = LOGPROB_ATOL) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = float(np.max(np.abs(got - want)))
    assert got.shape == want.shape and err <= tol, f"{what}: max |delta| {err:.3g} > {tol} ({got[:4]} vs {want[:4]})"


def _check_sampled(what: str, session, out) -> None:
    """Each sequence's sampled logprobs are the trainer's logprobs of those tokens now (temperature 1)."""
    for j, seq in enumerate(out.sequences):
        ref = _trainer_logprobs(session, PROMPT + list(seq.tokens))
        _close(f"{what}[{j}]", seq.logprobs, ref[len(PROMPT) - 1:])


def test_snapshot_stays_fixed_while_the_session_trains_on(session):
    _train_step(session, 1)
    _train_step(session, 2)
    snap = session.snapshot().result(timeout=TIMEOUT)  # queued after both steps, in the session's order
    assert snap.policy_version == 2 and snap.session_id == session.session_id, snap
    ref = _trainer_logprobs(session, TOKENS)
    lp = snap.compute_logprobs([TOKENS]).result(timeout=TIMEOUT)
    assert lp.policy_version == 2
    _close("snapshot compute_logprobs at step 2", lp.logprobs[0], ref)
    first = snap.sample(PROMPT, PARAMS, num_samples=2).result(timeout=TIMEOUT)
    assert first.policy_version == 2
    _check_sampled("snapshot sample at step 2", session, first)

    for seed in (3, 4):
        _train_step(session, seed)
    assert session.weights_sync().result(timeout=TIMEOUT).policy_version == 4
    now = session.compute_logprobs([TOKENS]).result(timeout=TIMEOUT)
    assert now.policy_version == 4 and np.max(np.abs(now.logprobs[0] - ref)) > 1e-3  # the session moved on
    again = snap.compute_logprobs([TOKENS]).result(timeout=TIMEOUT)
    np.testing.assert_array_equal(again.logprobs[0], lp.logprobs[0])
    later = snap.sample(PROMPT, PARAMS, num_samples=2).result(timeout=TIMEOUT)
    assert [s.tokens for s in later.sequences] == [s.tokens for s in first.sequences]
    assert [s.logprobs for s in later.sequences] == [s.logprobs for s in first.sequences]

    snap.close()
    assert snap.released
    with pytest.raises(tt.FailedPreconditionError, match=snap.snapshot_id):
        snap.sample(PROMPT, PARAMS)
    # The resource refuses it too (another handle on the same id), naming it; a second release is a no-op.
    other = tt.Snapshot(session.client, snap.snapshot_id, session.session_id, 2)
    with pytest.raises(tt.FailedPreconditionError, match=f"{snap.snapshot_id}.*released"):
        other.compute_logprobs([TOKENS]).result(timeout=TIMEOUT)
    other.close()


def test_snapshot_of_a_fresh_adapter_and_of_loaded_weights(resource, session):
    """A fresh adapter's snapshot is the base model (version -1); a session created from a checkpoint
    snapshots the loaded weights (step 0 loads: tests/conformance/test_imported_weights_served.py's Tinker road)."""
    with session.snapshot().result(timeout=TIMEOUT) as fresh:
        assert fresh.policy_version == -1
        got = fresh.compute_logprobs([TOKENS]).result(timeout=TIMEOUT)
        np.testing.assert_array_equal(got.logprobs[0], resource.compute_logprobs([TOKENS]).result(timeout=TIMEOUT)
                                      .logprobs[0])
    assert fresh.released
    _train_step(session, 5)
    _train_step(session, 6)
    state = session.save_state("snap-src").result(timeout=TIMEOUT)
    s0 = resource.create_session(checkpoint_uri=state.uri)  # step 2, loaded
    try:
        ref = _trainer_logprobs(s0, TOKENS)
        with s0.snapshot().result(timeout=TIMEOUT) as snap:
            assert snap.policy_version == 2
            _close("snapshot of a loaded session", snap.compute_logprobs([TOKENS]).result(timeout=TIMEOUT).logprobs[0],
                   ref)
    finally:
        s0.stop()


def test_sampler_checkpoint_by_uri(resource, session):
    _train_step(session, 7)
    info = session.save_weights("sampler-1").result(timeout=TIMEOUT)
    ref = _trainer_logprobs(session, TOKENS)
    out = resource.sample(PROMPT, PARAMS, num_samples=2, checkpoint_uri=info.uri).result(timeout=TIMEOUT)
    assert out.policy_version == 1
    _check_sampled("checkpoint sample at step 1", session, out)
    _train_step(session, 8)
    session.weights_sync().result(timeout=TIMEOUT)
    lp = resource.compute_logprobs([TOKENS], checkpoint_uri=info.uri).result(timeout=TIMEOUT)
    _close("checkpoint compute_logprobs after more training", lp.logprobs[0], ref)
    later = resource.sample(PROMPT, PARAMS, num_samples=2, checkpoint_uri=info.uri).result(timeout=TIMEOUT)
    assert [s.tokens for s in later.sequences] == [s.tokens for s in out.sequences]


def test_unknown_names_are_not_found_naming_them(resource, session):
    uri = f"together-train://{session.session_id}/weights/no-such-ckpt"
    with pytest.raises(tt.NotFoundError, match="no-such-ckpt"):
        resource.sample(PROMPT, PARAMS, checkpoint_uri=uri).result(timeout=TIMEOUT)
    ghost = tt.Snapshot(resource, "snap-0123456789abcdef", session.session_id, 0)
    with pytest.raises(tt.NotFoundError, match="snap-0123456789abcdef") as e:
        ghost.sample(PROMPT, PARAMS).result(timeout=TIMEOUT)
    assert e.value.key == "snapshot_id"
    with pytest.raises(tt.NotFoundError, match="snap-0123456789abcdef"):
        ghost.compute_logprobs([TOKENS]).result(timeout=TIMEOUT)
    ghost.close()  # releasing an unknown id through a handle is quiet


def test_a_dropped_handle_is_released(session):
    _train_step(session, 9)
    snap = session.snapshot().result(timeout=TIMEOUT)
    sid = snap.snapshot_id
    snap.compute_logprobs([TOKENS]).result(timeout=TIMEOUT)
    del snap
    gc.collect()
    probe = tt.Snapshot(session.client, sid, session.session_id, 1)
    probe._finalizer.detach()  # only a probe: it must not release anything itself
    deadline = time.monotonic() + 30
    while True:  # the release runs on the client's worker threads
        try:
            probe.compute_logprobs([TOKENS]).result(timeout=TIMEOUT)
        except tt.FailedPreconditionError as e:
            assert "released" in str(e)
            break
        assert time.monotonic() < deadline, "the garbage-collected snapshot was not released"
        time.sleep(0.2)


def test_wire_refuses_ambiguous_or_incomplete_names(resource, session):
    """Over the raw wire: a Sample naming two weights sources, a SNAPSHOT score without an id and a release
    without one are INVALID_ARGUMENT naming the field."""
    from together_train._proto import generator_pb2, session_pb2

    req = generator_pb2.SampleRequest(session_id=session.session_id, snapshot_id="snap-0123456789abcdef",
                                      prompt=PROMPT, params=PARAMS.to_proto())
    with pytest.raises(tt.InvalidArgumentError, match="session_id and snapshot_id") as e:
        resource._call(resource._generator.Sample, req, what="Sample")
    assert e.value.key == "snapshot_id"
    score = generator_pb2.ComputeLogprobsRequest(source=generator_pb2.SNAPSHOT,
                                                 sequences=[generator_pb2.TokenSequence(tokens=TOKENS)])
    with pytest.raises(tt.InvalidArgumentError, match="snapshot_id") as e:
        resource._call(resource._generator.ComputeLogprobs, score, what="ComputeLogprobs")
    assert e.value.key == "snapshot_id"
    with pytest.raises(tt.InvalidArgumentError, match="snapshot_id"):
        resource._call(resource._sessions.ReleaseSnapshot, session_pb2.ReleaseSnapshotRequest(), what="Release")
