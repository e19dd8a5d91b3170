"""SIGTERM drains a loaded resource within 10 s.

A real resource with a deep queue of training operations (two sessions, 40 forward_backward calls
each on long sequences, several seconds of work) and an HTTP long-poll in flight gets SIGTERM.
The process must exit within 10 s: the running operation finishes, the queued ones fail with a
retryable UNAVAILABLE (recorded: the server logs each one's end), nothing is half-written (a
checkpoint being saved is either listed complete or absent). Before, the trainer worker ran every
queued operation before exiting (and the HTTP server waited for its long-polls), so the exit took
as long as the queue.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import numpy as np
import pytest

import together_train as tt

DRAIN_S = 10.0


def _long_batch(vocab: int, seed: int) -> list[tt.Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(4):
        t = rng.integers(1, vocab, size=241)
        out.append(tt.Sample(model_input=t[:-1], loss_fn_inputs={"target_tokens": t[1:],
                                                                 "weights": np.ones(240, np.float32)}))
    return out


@pytest.mark.timeout(300)
def test_sigterm_under_load_exits_within_10_s(tiny_model_dir, tmp_path):
    local = tt.LocalResource(model=str(tiny_model_dir), generators=1, storage_dir=tmp_path / "storage", http_port=0,
                             extra_args=["--trainer-threads", "1", "--generator-threads", "1"],
                             log_file=tmp_path / "server.log", shutdown_timeout=60)
    client = local.__enter__()
    try:
        vocab = client.get_capabilities().vocab_size
        sessions = [client.create_session(lora=tt.LoraConfig(rank=4, seed=i)) for i in range(2)]
        t0 = time.monotonic()
        sessions[0].forward_backward(_long_batch(vocab, 0), "cross_entropy").result(timeout=120)
        one = time.monotonic() - t0
        futs = [s.forward_backward(_long_batch(vocab, k), "cross_entropy") for k in range(40) for s in sessions]
        futs.append(sessions[1].save_state("during-shutdown"))
        # A tinker long-poll on a queued operation (retrieve_future waits up to 40 s).
        poll = threading.Thread(target=lambda: httpx.post(f"{client.http_url}/api/v1/retrieve_future",
                                                          json={"request_id": "op-unknown"}, timeout=60),
                                daemon=True)
        poll.start()
        time.sleep(1.0)
        print(f"one forward_backward {one:.2f} s; {len(futs)} queued (~{one * len(futs):.0f} s of work)")
        assert one * len(futs) > 2 * DRAIN_S, "the queue is too short to show the drain"
        t_term = time.monotonic()
        local.process.send_signal(signal.SIGTERM)
        rc = local.process.wait(timeout=60)
        took = time.monotonic() - t_term
        print(f"exited {took:.2f} s after SIGTERM (rc {rc})")
        assert took < DRAIN_S, took
        assert rc == 0, rc
    finally:
        if local.process.poll() is None:
            local.process.kill()
        local.__exit__(None, None, None)
    log = (tmp_path / "server.log").read_text()
    assert "shutting down" in log, log[-2000:]  # the queued operations' retryable failures were recorded
    # Nothing half-written: no temporary checkpoint directory is left listed or on disk as complete.
    leftovers = [p for p in (tmp_path / "storage" / "sessions").glob("*/state/*")
                 if not (p / "manifest.json").exists() and not p.name.startswith(".")]
    assert not leftovers, leftovers
