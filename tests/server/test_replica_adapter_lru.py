"""A generator replica holding a bounded set of adapters (``--max-adapters 3``) serves 20 sessions.

The trainer pages too (``--session-memory-mb 0.25``: two tiny sessions resident), so most of the
20 are paged out of the trainer when they sample, and the trainer's check below pages them back in.

Each of 20 sessions is trained one step on its own data and synced; then every session samples
(greedy) twice, in two different orders, so the replica evicts and reloads adapters on demand
(the resource re-pushes an evicted key's latest version when the replica answers "holds no
weights", service/replicas/pool.py). Each session's answer is the same both times, at its
version, and equals the answer of the trainer's own weights scored independently: the greedy
tokens' logprobs from the replica match `forward` on the trainer (same weights, float32).
"""

from __future__ import annotations

import numpy as np

import together_train as tt
from _checkpoint_helpers import make_batch

N = 20
GREEDY = tt.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
PROMPT = [1, 504, 3120, 28, 9]
T = 120


def test_twenty_sessions_on_a_three_adapter_replica(tiny_model_dir, tmp_path):
    log = tmp_path / "server.log"
    with tt.launch_local(model=str(tiny_model_dir), generators=1, storage_dir=tmp_path / "storage", log_file=log,
                         extra_args=["--max-adapters", "3", "--trainer-threads", "1", "--generator-threads", "1",
                                     "--dtype", "float32", "--session-memory-mb", "0.25",
                                     "--page-out-idle", "0"]) as client:
        vocab = client.get_capabilities().vocab_size
        sessions = [client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=k)) for k in range(N)]
        for k, s in enumerate(sessions):
            s.forward_backward(make_batch(k, vocab), loss_fn="cross_entropy")
            s.optim_step(tt.AdamParams(learning_rate=0.5))
            s.weights_sync().result(timeout=T)
        first = {k: s.sample(PROMPT, GREEDY).result(timeout=T) for k, s in enumerate(sessions)}
        again = {k: sessions[k].sample(PROMPT, GREEDY).result(timeout=T) for k in reversed(range(N))}
        for k in range(N):
            a, b = first[k].sequences[0], again[k].sequences[0]
            assert a.tokens == b.tokens and first[k].policy_version == again[k].policy_version == 1, k
        assert len({tuple(first[k].sequences[0].tokens) for k in range(N)}) > 1   # the adapters matter
        # independent check: the replica's logprobs of its greedy tokens = the trainer's forward on them
        for k in (0, 7, 19):
            toks = first[k].sequences[0].tokens
            seq = PROMPT + list(toks)
            sample = tt.Sample(model_input=np.asarray(seq[:-1]), loss_fn_inputs={
                "target_tokens": np.asarray(seq[1:]), "weights": np.ones(len(seq) - 1, np.float32)})
            lp = sessions[k].forward([sample], loss_fn="cross_entropy", return_logprobs=True).result(timeout=T)
            got = np.asarray(first[k].sequences[0].logprobs, dtype=np.float64)
            want = np.asarray(lp.logprobs[0][-len(toks):], dtype=np.float64)
            assert np.allclose(got, want, atol=1e-4), (k, got, want)
        text = log.read_text()
        assert text.count("re-pushing it before retrying") >= N, text[-3000:]
        assert text.count("paged in session") >= 3, text[-3000:]
        for s in sessions:
            s.stop()
