"""The fair scheduler on a real resource: one API key floods 7 sessions, another key's small step runs next.

Checked by ORDER of execution (the server's start times of operations), never by durations: key B's
forward_backward, queued behind key A's whole backlog, starts after at most one of A's operations that
were still queued when B's arrived; FIFO (the policy unit test) would run all of them first. B's queue
position, read through GetOperation while queued, is near the front while A's last one is behind it.
"""

from __future__ import annotations

import numpy as np
import pytest

import together_train as tt

KEYS = ("key-flood", "key-small")


def samples(rng, n: int, length: int, vocab: int) -> list[tt.Sample]:
    out = []
    for _ in range(n):
        t = rng.integers(1, vocab, size=length + 1)
        out.append(tt.Sample(model_input=t[:-1], loss_fn_inputs={"target_tokens": t[1:],
                                                                 "weights": np.ones(length, np.float32)}))
    return out


@pytest.fixture(scope="module")
def two_keys(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fair")
    key_file = tmp / "keys"
    key_file.write_text("\n".join(KEYS) + "\n")
    key_file.chmod(0o600)
    with tt.launch_local(model=str(tiny_model_dir), generators=0, storage_dir=tmp / "storage", api_key=KEYS[0],
                         extra_args=["--api-key-file", str(key_file), "--max-sessions", "16",
                                     "--trainer-threads", "1"]) as flood_client:
        small_client = tt.ResourceClient(flood_client.address, api_key=KEYS[1])
        try:
            yield flood_client, small_client
        finally:
            small_client.close()


def test_another_keys_small_step_waits_for_at_most_one_flooding_operation(two_keys):
    flood_client, small_client = two_keys
    vocab = flood_client.capabilities.vocab_size
    rng = np.random.default_rng(0)
    lora = tt.LoraConfig(rank=4, alpha=8.0)
    flooders = [flood_client.create_session(lora=lora) for _ in range(7)]
    small = small_client.create_session(lora=lora)
    batch = samples(rng, 2, 128, vocab)  # 256 tokens per operation
    a_futs = [s.forward_backward(batch) for _ in range(3) for s in flooders]
    b_fb = small.forward_backward(samples(rng, 1, 32, vocab))
    b_opt = small.optim_step(tt.AdamParams(learning_rate=1e-3))
    placed = small.operation_status(b_fb.operation_id)
    last_a = flooders[-1].operation_status(a_futs[-1].operation_id)
    b_fb.result(timeout=300)
    b_opt.result(timeout=300)
    for f in a_futs:
        f.result(timeout=300)

    a = [flooders[i % 7].operation_status(f.operation_id) for i, f in enumerate(a_futs)]
    b = small.operation_status(b_fb.operation_id)
    opt = small.operation_status(b_opt.operation_id)
    # A's operations still queued when B's arrived: started after B's was accepted.
    pending = [op for op in a if op.started_at > b.created_at]
    ahead = [op for op in pending if op.started_at < b.started_at]
    between = [op for op in a if b.started_at < op.started_at < opt.started_at]
    print(f"A operations queued when B arrived: {len(pending)}; run before B's forward_backward: {len(ahead)}; "
          f"between B's forward_backward and optim_step: {len(between)}; B's queue position when read: "
          f"{placed.queue_position} ({placed.status}); A's last: {last_a.queue_position} ({last_a.status})")
    assert len(pending) >= 8, "the flood had drained before B's step arrived: the test measured nothing"
    assert len(ahead) <= 1, [(op.session_id, op.seq_id) for op in ahead]
    assert len(between) <= 1
    if placed.status == "queued":
        assert 1 <= placed.queue_position <= 2
        if last_a.status == "queued":
            assert last_a.queue_position > placed.queue_position
    for s in flooders + [small]:
        s.stop()
