"""Session limits, idle expiry and restarts, each on its own short-lived resource (no replicas).

- `--max-sessions 2`: a third session is RESOURCE_EXHAUSTED; stopping one frees its slot.
- `--idle-timeout 3`: a session without calls expires (the sweeper runs every
  timeout/4), one kept alive with KeepAlive does not; a stopped or expired
  session answers every call with FAILED_PRECONDITION saying which.
- Restart: a resource process started again on the same `--storage` lists the
  checkpoints written before, and a session recreated from the last training
  checkpoint continues bit-for-bit.
"""

from __future__ import annotations

import time

import pytest

import together_train as tt
from _checkpoint_helpers import make_batch, train
from together_train import errors

LORA = tt.LoraConfig(rank=4, alpha=8.0, seed=0)
THREADS = ["--trainer-threads", "1"]


def _every_call_refused(s: tt.Session, word: str, uri: str, vocab: int) -> None:
    batch = make_batch(1, vocab)
    calls = {
        "forward": lambda: s.forward(batch, loss_fn="cross_entropy"),
        "forward_backward": lambda: s.forward_backward(batch, loss_fn="cross_entropy"),
        "optim_step": lambda: s.optim_step(tt.AdamParams(learning_rate=1e-3)),
        "weights_sync": lambda: s.weights_sync(),
        "save_state": lambda: s.save_state("late"),
        "save_weights": lambda: s.save_weights("late"),
        "load_state": lambda: s.load_state(uri),
        "load_state_with_optimizer": lambda: s.load_state_with_optimizer(uri),
        "sample": lambda: s.sample([1, 2, 3], tt.SamplingParams(max_tokens=2)),
        "compute_logprobs": lambda: s.compute_logprobs([[1, 2, 3]]),
        "keep_alive": lambda: s.keep_alive(),
    }
    for what, call in calls.items():
        with pytest.raises(errors.FailedPreconditionError, match=word) as info:
            out = call()
            if hasattr(out, "result"):
                out.result(timeout=60)
        assert s.session_id in str(info.value), what


def test_max_sessions_idle_expiry_and_dead_sessions(tiny_model_dir, tmp_path):
    with tt.launch_local(
        model=str(tiny_model_dir),
        generators=0,
        storage_dir=tmp_path / "storage",
        extra_args=["--max-sessions", "2", "--idle-timeout", "3", *THREADS],
        client_kwargs={"keepalive_interval_s": None},  # keep-alive by hand here (the SDK's own: test_sdk_keepalive)
    ) as client:
        vocab = client.get_capabilities().vocab_size
        assert client.get_capabilities().max_sessions == 2
        kept, stopped = client.create_session(lora=LORA), client.create_session(lora=LORA)
        with pytest.raises(errors.ResourceExhaustedError, match="max_sessions=2"):
            client.create_session(lora=LORA)
        uri = kept.save_state("ok").result(timeout=60).uri
        stopped.stop()
        idle = client.create_session(lora=LORA)  # the stopped session's slot is free again

        deadline = time.time() + 20
        while client.get_session(idle.session_id).state != "expired":
            assert time.time() < deadline, "idle session did not expire"
            kept.keep_alive()
            time.sleep(0.5)
        assert client.get_session(kept.session_id).state == "active"
        assert client.get_session(stopped.session_id).state == "stopped"
        assert {i.session_id: i.state for i in client.list_sessions()}[idle.session_id] == "expired"

        _every_call_refused(stopped, "stopped", uri, vocab)
        _every_call_refused(idle, "expired", uri, vocab)
        with pytest.raises(errors.FailedPreconditionError, match="keep_alive"):
            idle.forward(make_batch(1, vocab), loss_fn="cross_entropy")
        # The expired session's slot is free; the kept one still trains.
        client.create_session(lora=LORA)
        assert train(kept, [3], vocab)


def test_restart_recreates_a_session_from_its_last_training_checkpoint(tiny_model_dir, tmp_path):
    storage = tmp_path / "storage"
    args = dict(model=str(tiny_model_dir), generators=0, storage_dir=storage, extra_args=THREADS)
    with tt.launch_local(**args) as client:
        vocab = client.get_capabilities().vocab_size
        s = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, dropout=0.1, seed=0))
        train(s, [1, 2], vocab)
        last = s.save_state("last").result(timeout=60)
        expected = train(s, [3, 4], vocab)
        weights = s.save_weights("final").result(timeout=60)

    with tt.launch_local(**args) as client:
        listed = {c.uri for c in client.list_checkpoints()}
        assert {last.uri, weights.uri} <= listed
        assert {c.uri for c in client.list_checkpoints(s.session_id)} == {last.uri, weights.uri}
        with pytest.raises(errors.NotFoundError):
            client.get_session(s.session_id)  # sessions do not survive; checkpoints do
        again = client.create_session(checkpoint_uri=last.uri, with_optimizer=True)
        assert again.info().step == 2 and again.info().lora.dropout == 0.1
        assert train(again, [3, 4], vocab) == expected
