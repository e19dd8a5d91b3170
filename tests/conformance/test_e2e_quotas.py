"""Per-API-key quotas on a real resource with two keys, through the SDK (gRPC) and Together's HTTP API.

Each refusal is RESOURCE_EXHAUSTED naming the limit and its value (HTTP 429, same words, not retried);
one key at its limit never refuses the other; a refused operation keeps its seq_id and changes nothing.
Operations are kept in flight deterministically by holding them back: the client skips seq_id 0, so the
server holds 1..3 until 0 arrives (held-back operations count as in flight).
"""

from __future__ import annotations

import numpy as np
import pytest

import together_train as tt
from together_train import errors

together = pytest.importorskip("together")
from together import Together  # noqa: E402

KEYS = ("key-quota-a", "key-quota-b")
LORA = tt.LoraConfig(rank=2, alpha=4.0)
BUDGET = 100  # model_input tokens per key, trained or scored


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quotas")
    key_file = tmp / "keys"
    key_file.write_text("\n".join(KEYS) + "\n")
    key_file.chmod(0o600)
    with tt.launch_local(model=str(tiny_model_dir), generators=0, storage_dir=tmp / "storage", api_key=KEYS[0],
                         http_port=0,
                         extra_args=["--api-key-file", str(key_file), "--max-sessions-per-key", "2",
                                     "--max-queued-per-key", "3", "--max-tokens-per-key", str(BUDGET),
                                     "--trainer-threads", "1"]) as a:
        b = tt.ResourceClient(a.address, api_key=KEYS[1])
        try:
            yield a, b, a.http_url
        finally:
            b.close()


def _batch(vocab: int, n: int = 5) -> list[tt.Sample]:
    t = np.arange(1, n + 2) % vocab
    return [tt.Sample(model_input=t[:-1], loss_fn_inputs={"target_tokens": t[1:], "weights": np.ones(n, np.float32)})]


def _together(key: str, url: str) -> Together:
    return Together(api_key=key, base_url=url, max_retries=3)


def test_sessions_per_key(served, tiny_model_dir):
    a, b, url = served
    mine = [a.create_session(lora=LORA) for _ in range(2)]
    try:
        with pytest.raises(errors.ResourceExhaustedError, match=r"max_sessions_per_key=2") as e:
            a.create_session(lora=LORA)
        assert "2 active sessions" in str(e.value)
        other = b.create_session(lora=LORA)  # the other key is not counted against
        client = _together(KEYS[0], url)
        mr = client.post_training.model_resources.create(base_model=str(tiny_model_dir))
        with pytest.raises(together.RateLimitError) as h:
            client.post_training.sessions.create(model_resources_id=mr.id, lora_config={"rank": 2})
        assert h.value.status_code == 429 and "max_sessions_per_key=2" in str(h.value), str(h.value)
        other.stop()
    finally:
        for s in mine:
            s.stop()
    again = a.create_session(lora=LORA)  # a stopped session frees the key's place
    again.stop()


def test_queued_operations_per_key(served, tiny_model_dir):
    a, b, url = served
    vocab = a.capabilities.vocab_size
    s = a.create_session(lora=LORA)
    client = _together(KEYS[0], url)
    mr = client.post_training.model_resources.create(base_model=str(tiny_model_dir))
    t_sess = client.post_training.sessions.create(model_resources_id=mr.id, lora_config={"rank": 2})
    try:
        s._next_seq = 1  # skip seq_id 0: 1..3 are held back, in flight
        held = [s.forward_backward(_batch(vocab)) for _ in range(3)]
        refused = s.forward_backward(_batch(vocab))  # seq_id 4
        with pytest.raises(errors.ResourceExhaustedError, match=r"max_queued_per_key=3") as e:
            refused.result(timeout=60)
        assert "3 trainer operations queued or running" in str(e.value)
        assert s.operation_status(refused.operation_id).started_at == 0.0  # refused: never ran
        # The other key is not limited by this one's flight.
        bs = b.create_session(lora=LORA)
        assert np.isfinite(bs.forward_backward(_batch(vocab)).result(timeout=60).loss)
        bs.stop()
        # Together's API: 429 with the same words, not retried.
        full = np.arange(1, 7)
        sample = {"model_input": {"chunks": [{"encoded_text": {"tokens": full[:-1].tolist()}}]},
                  "loss_fn_inputs": {"target_tokens": {"data": full[1:].tolist(), "dtype": "int64"},
                                     "weights": {"data": [1.0] * 5, "dtype": "float32"}}}
        with pytest.raises(together.RateLimitError) as h:
            client.post_training.operations.forward_backward(
                t_sess.id, idempotency_key="quota-fb", loss={"type": "LOSS_TYPE_CROSS_ENTROPY"}, samples=[sample])
        assert "max_queued_per_key=3" in str(h.value), str(h.value)
        # seq_id 0 arrives (refused too: the key still has 3 in flight), which releases 1..3: they run.
        s._next_seq = 0
        with pytest.raises(errors.ResourceExhaustedError):
            s.forward_backward(_batch(vocab)).result(timeout=60)
        for f in held:
            assert np.isfinite(f.result(timeout=60).loss)
        s._next_seq = 5
        assert s.optim_step(tt.AdamParams(learning_rate=1e-3)).result(timeout=60).step == 1
    finally:
        s.stop()
        client.post_training.sessions.stop(t_sess.id)


def test_token_budget_per_key(served, tiny_model_dir):
    a, b, url = served
    vocab = a.capabilities.vocab_size
    s = b.create_session(lora=LORA)
    client = _together(KEYS[1], url)
    mr = client.post_training.model_resources.create(base_model=str(tiny_model_dir))
    t_sess = client.post_training.sessions.create(model_resources_id=mr.id, lora_config={"rank": 2})
    try:
        [u] = b.usage()
        used = u.trained_tokens + u.forward_tokens  # earlier tests of this module spent some
        assert used < BUDGET - 2
        assert np.isfinite(s.forward(_batch(vocab, BUDGET - used - 1)).result(timeout=60).loss)
        with pytest.raises(errors.ResourceExhaustedError, match=r"max_tokens_per_key=100") as e:
            s.forward_backward(_batch(vocab, 2)).result(timeout=60)
        assert f"{BUDGET - 1} model_input tokens used or queued + 2 in this request" in str(e.value)
        full = np.arange(1, 4)  # 2 tokens through Together's API: 429, the same words
        sample = {"model_input": {"chunks": [{"encoded_text": {"tokens": full[:-1].tolist()}}]},
                  "loss_fn_inputs": {"target_tokens": {"data": full[1:].tolist(), "dtype": "int64"},
                                     "weights": {"data": [1.0] * 2, "dtype": "float32"}}}
        with pytest.raises(together.RateLimitError) as h:
            client.post_training.operations.forward_backward(
                t_sess.id, idempotency_key="budget-fb", loss={"type": "LOSS_TYPE_CROSS_ENTROPY"}, samples=[sample])
        assert h.value.status_code == 429 and "max_tokens_per_key=100" in str(h.value), str(h.value)
        assert s.forward(_batch(vocab, 1)).result(timeout=60).loss is not None  # exactly at the budget: allowed
        [u] = b.usage()
        assert u.trained_tokens + u.forward_tokens == BUDGET
    finally:
        s.stop()
        client.post_training.sessions.stop(t_sess.id)


def test_a_negative_limit_is_refused_naming_the_flag(capsys):
    import argparse

    from together_train_server.config import ServeConfig, add_flags, from_namespace

    parser = argparse.ArgumentParser()
    add_flags(parser, ServeConfig)  # serve's flags, the per-key limits among them
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-queued-per-key", "-1"])
    assert "--max-queued-per-key: must be an integer >= 0, got '-1'" in capsys.readouterr().err
    cfg = from_namespace(ServeConfig, parser.parse_args(["--max-sessions-per-key", "3", "--scheduler", "fifo"])).tenancy()
    assert (cfg.scheduler, cfg.max_sessions_per_key, cfg.max_queued_per_key) == ("fifo", 3, 0)
