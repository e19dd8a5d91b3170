"""Sampling and scoring through the resource's GeneratorService (routed to a real replica process).

Tolerance for logprob agreement between the KV-cached decode, the replica's
full-sequence scoring and the trainer's forward: 1e-4 absolute (fp32, CPU;
different kernels and batch shapes change only the last bits).
"""

from __future__ import annotations

import numpy as np

import together_train as tt

PROMPT = [1, 420, 1003, 77, 9120, 15]
LOGPROB_ATOL = 1e-4


def test_same_seed_same_tokens_and_num_samples_differ(session):
    params = tt.SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    a = session.sample(PROMPT, params, num_samples=4).result(timeout=120)
    b = session.sample(PROMPT, params, num_samples=4).result(timeout=120)
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert len({tuple(s.tokens) for s in a.sequences}) == 4
    c = session.sample(PROMPT, tt.SamplingParams(max_tokens=12, seed=99, ignore_eos=True)).result(timeout=120)
    assert c.sequences[0].tokens != a.sequences[0].tokens


def test_max_tokens_ends_with_length(session):
    res = session.sample(PROMPT, tt.SamplingParams(max_tokens=5, seed=0, ignore_eos=True), num_samples=2).result(timeout=120)
    for s in res.sequences:
        assert len(s.tokens) == 5 and len(s.logprobs) == 5
        assert s.stop_reason == "length"


def test_stop_token_ids_end_with_stop(session):
    free = session.sample(PROMPT, tt.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)).result(timeout=120)
    toks = free.sequences[0].tokens
    stop_id = toks[3]
    first = toks.index(stop_id)
    res = session.sample(
        PROMPT, tt.SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_id], ignore_eos=True)
    ).result(timeout=120)
    seq = res.sequences[0]
    assert seq.stop_reason == "stop"
    assert seq.tokens == toks[: first + 1]  # the stop token is included


def test_stop_string_ends_with_stop(session, tokenizer):
    free = session.sample(PROMPT, tt.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)).result(timeout=120)
    toks = free.sequences[0].tokens
    text = tokenizer.decode(toks[2:4])
    stop = text.strip()[:3] or text
    res = session.sample(
        PROMPT, tt.SamplingParams(max_tokens=10, temperature=0.0, stop=[stop], ignore_eos=True)
    ).result(timeout=120)
    seq = res.sequences[0]
    assert seq.stop_reason == "stop"
    assert stop in tokenizer.decode(seq.tokens)
    assert len(seq.tokens) <= 4
    assert stop not in tokenizer.decode(seq.tokens[:-1])  # ends at the token completing the stop string


def test_sampled_logprobs_equal_compute_logprobs(session):
    res = session.sample(PROMPT, tt.SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True),
                         num_samples=3).result(timeout=120)
    seqs = [PROMPT + s.tokens for s in res.sequences]
    scored = session.compute_logprobs(seqs).result(timeout=120)
    for s, lp in zip(res.sequences, scored.logprobs if hasattr(scored, "logprobs") else scored):
        np.testing.assert_allclose(np.asarray(lp)[len(PROMPT) - 1 :], s.logprobs, atol=LOGPROB_ATOL)


def test_prompt_logprobs_equal_compute_logprobs(session):
    res = session.sample(PROMPT, tt.SamplingParams(max_tokens=1, seed=0), prompt_logprobs=True, top_k_prompt_logprobs=3).result(timeout=120)
    scored = session.compute_logprobs([PROMPT]).result(timeout=120)
    lp = scored.logprobs[0] if hasattr(scored, "logprobs") else scored[0]
    np.testing.assert_allclose(res.prompt_logprobs, lp, atol=LOGPROB_ATOL)
    assert len(res.top_k_prompt_logprobs) == len(PROMPT) - 1


def _trainer_logprobs(session, tokens):
    sample = tt.Sample(
        model_input=tokens[:-1], loss_fn_inputs={"target_tokens": tokens[1:], "weights": np.zeros(len(tokens) - 1, np.float32)}
    )
    return session.forward([sample], "cross_entropy", return_logprobs=True).result(timeout=120).logprobs[0]


def _generator_logprobs(session, tokens):
    scored = session.compute_logprobs([tokens]).result(timeout=120)
    return np.asarray(scored.logprobs[0] if hasattr(scored, "logprobs") else scored[0])


def test_weights_sync_publishes_trainer_weights(session):
    tokens = PROMPT + [311, 2048, 5, 600, 31]
    before_gen = _generator_logprobs(session, tokens)
    np.testing.assert_allclose(before_gen, _trainer_logprobs(session, tokens), atol=LOGPROB_ATOL)
    v0 = session.sample(PROMPT, tt.SamplingParams(max_tokens=3, seed=0)).result(timeout=120)
    assert v0.policy_version == 0

    rng = np.random.default_rng(0)
    for _ in range(3):
        toks = rng.integers(0, 49152, size=17)
        w = np.ones(16, np.float32)
        sample = tt.Sample(model_input=toks[:-1], loss_fn_inputs={"target_tokens": toks[1:], "weights": w})
        session.forward_backward([sample], "cross_entropy")
        session.optim_step(tt.AdamParams(learning_rate=5e-2))
    trained = _trainer_logprobs(session, tokens)
    assert np.max(np.abs(trained - before_gen)) > 1e-3  # training changed the trainer's policy

    # Before the sync the generator still serves version 0.
    np.testing.assert_allclose(_generator_logprobs(session, tokens), before_gen, atol=1e-6)

    sync = session.weights_sync().result(timeout=120)
    assert sync.policy_version == 3
    np.testing.assert_allclose(_generator_logprobs(session, tokens), trained, atol=LOGPROB_ATOL)
    v3 = session.sample(PROMPT, tt.SamplingParams(max_tokens=3, seed=0)).result(timeout=120)
    assert v3.policy_version == 3
    assert all(span.policy_version == 3 for s in v3.sequences for span in s.version_spans)
