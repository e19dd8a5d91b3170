"""Usage metering on a real resource with two API keys and an admin key: exact against a known workload.

The test counts what it sends (model_input tokens trained and scored, prompt tokens, tokens sampled,
optimizer steps, checkpoint files on disk) and checks the server's sums through the SDK, GET /v1/usage
and /metrics, for the key that used them, the other key (sees none of it) and the admin key (sees
both), then again after the resource restarts on the same storage.
"""

from __future__ import annotations

import hashlib
import json
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import together_train as tt
from together_train import errors

ALICE, BOB, ADMIN = "key-alice", "key-bob", "key-admin"
TRAIN = [(12, 7, 20), (5,)]
FORWARD = (8, 9)
PROMPT = list(range(3, 43))  # 40 tokens: the second call finds whole 16-token blocks in the prefix cache
CALLS, NUM_SAMPLES, MAX_TOKENS = 2, 2, 6


def tag(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def batch(seed: int, vocab: int, lengths) -> list[tt.Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        t = rng.integers(0, vocab, size=n + 1)
        out.append(tt.Sample(model_input=t[:-1], loss_fn_inputs={"target_tokens": t[1:],
                                                                 "weights": np.ones(n, np.float32)}))
    return out


def http_get(url: str, key: str) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def launch(model_dir, tmp: Path, generators: int = 1) -> tt.LocalResource:
    return tt.launch_local(model=str(model_dir), generators=generators, storage_dir=tmp / "storage", api_key=ALICE,
                           http_port=0, extra_args=["--api-key-file", str(tmp / "keys"), "--admin-key-file",
                                                    str(tmp / "admins"), "--trainer-threads", "1",
                                                    "--generator-threads", "1"])


def workload(alice: tt.ResourceClient, bob: tt.ResourceClient) -> dict:
    """Alice trains, scores, samples and saves; Bob trains one batch. Returns what was sent, counted here."""
    vocab = alice.capabilities.vocab_size
    s = alice.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
    for i, lengths in enumerate(TRAIN):
        s.forward_backward(batch(i, vocab, lengths)).result(timeout=120)
        s.optim_step(tt.AdamParams(learning_rate=1e-2)).result(timeout=120)
    s.forward(batch(5, vocab, FORWARD)).result(timeout=120)
    bad = batch(6, vocab, (4,))
    bad[0].model_input[0] = vocab + 5  # refused at validation: counts nothing
    with pytest.raises(errors.InvalidArgumentError):
        s.forward_backward(bad).result(timeout=60)
    s.weights_sync().result(timeout=120)
    sampled = hits = 0
    for _ in range(CALLS):
        res = s.sample(PROMPT, tt.SamplingParams(max_tokens=MAX_TOKENS, seed=1, ignore_eos=True),
                       num_samples=NUM_SAMPLES).result(timeout=120)
        sampled += sum(len(q.tokens) for q in res.sequences)
        hits += res.prompt_cache_hit_tokens
    scored = [np.arange(2, 14), np.arange(5, 12)]  # compute_logprobs: every token is prefilled
    s.compute_logprobs(scored).result(timeout=120)
    ckpt = s.save_state("usage-ckpt").result(timeout=120)
    files = [p for p in Path(ckpt.path).rglob("*") if p.is_file() and p.name != "manifest.json"]
    b = bob.create_session(lora=tt.LoraConfig(rank=2, alpha=4.0))
    b.forward_backward(batch(7, vocab, (6,))).result(timeout=120)
    return {"session": s.session_id, "bob_session": b.session_id, "trained": sum(sum(x) for x in TRAIN),
            "forward": sum(FORWARD), "steps": len(TRAIN), "sampled": sampled,
            "prompt": CALLS * len(PROMPT) + sum(len(q) for q in scored),
            "hits": hits, "ckpt_bytes": sum(p.stat().st_size for p in files), "bob_trained": 6}


def check_alice(u, sent: dict, session_id: str = "") -> None:
    got = (u.key, u.session_id, u.trained_tokens, u.forward_tokens, u.optimizer_steps, u.sampled_tokens,
           u.prefill_tokens + u.prefix_cache_tokens, u.prefix_cache_tokens, u.checkpoint_bytes)
    want = (tag(ALICE), session_id, sent["trained"], sent["forward"], sent["steps"], sent["sampled"],
            sent["prompt"], sent["hits"], sent["ckpt_bytes"])
    assert got == want, f"got {got}, sent {want}"
    assert 0 < u.trainer_seconds < 600 and 0 < u.sampler_seconds < 600, (u.trainer_seconds, u.sampler_seconds)


def test_usage_is_exact_per_key_and_session_and_survives_a_restart(tiny_model_dir, tmp_path):
    (tmp_path / "keys").write_text(f"{ALICE}\n{BOB}\n{ADMIN}\n")  # an admin key is an API key too
    (tmp_path / "admins").write_text(f"{ADMIN}\n")
    for f in ("keys", "admins"):
        (tmp_path / f).chmod(0o600)
    with launch(tiny_model_dir, tmp_path) as alice:
        bob = tt.ResourceClient(alice.address, api_key=BOB)
        admin = tt.ResourceClient(alice.address, api_key=ADMIN)
        t0 = time.monotonic()
        sent = workload(alice, bob)
        wall = time.monotonic() - t0
        assert sent["hits"] >= 16, "the prefix cache served nothing: prefix_cache_tokens is not exercised"
        # SDK: a key sees its own sums and sessions.
        [mine] = alice.usage()
        check_alice(mine, sent)
        assert mine.trainer_seconds <= wall
        check_alice(alice.session(sent["session"]).usage(), sent, sent["session"])
        [bobs] = bob.usage()
        assert (bobs.key, bobs.trained_tokens, bobs.sampled_tokens) == (tag(BOB), sent["bob_trained"], 0)
        with pytest.raises(errors.NotFoundError):
            bob.session_usage(sent["session"])
        everyone = {u.key: u for u in admin.usage()}
        assert set(everyone) == {tag(ALICE), tag(BOB)}
        check_alice(everyone[tag(ALICE)], sent)
        assert {u.session_id for u in admin.usage(sessions=True)} == {sent["session"], sent["bob_session"]}
        # HTTP: the same sums, the same visibility.
        status, body = http_get(f"{alice.http_url}/v1/usage?session_id={sent['session']}", ALICE)
        assert status == 200, body
        doc = json.loads(body)
        assert doc["sessions"][0]["trained_tokens"] == sent["trained"]
        assert doc["keys"][0]["sampled_tokens"] == sent["sampled"]
        assert http_get(f"{alice.http_url}/v1/usage?session_id={sent['session']}", BOB)[0] == 404
        status, body = http_get(f"{alice.http_url}/v1/usage", ADMIN)
        assert {k["key"] for k in json.loads(body)["keys"]} == {tag(ALICE), tag(BOB)}
        # /metrics: counters labelled by the key's tag, a key's own only; the admin's scrape has both.
        def scrape(key: str) -> dict:
            text = http_get(f"{alice.http_url}/metrics", key)[1].decode()
            return {(s.name, s.labels.get("key")): s.value for fam in text_string_to_metric_families(text)
                    for s in fam.samples if s.name.startswith("together_train_usage_")}

        m = scrape(ALICE)
        a, b = tag(ALICE)[:12], tag(BOB)[:12]
        assert m[("together_train_usage_trained_tokens_total", a)] == sent["trained"]
        assert m[("together_train_usage_forward_tokens_total", a)] == sent["forward"]
        assert m[("together_train_usage_sampled_tokens_total", a)] == sent["sampled"]
        assert m[("together_train_usage_optimizer_steps_total", a)] == sent["steps"]
        assert m[("together_train_usage_checkpoint_bytes", a)] == sent["ckpt_bytes"]
        assert not any(k == b for _, k in m)
        assert scrape(ADMIN)[("together_train_usage_trained_tokens_total", b)] == sent["bob_trained"]
        bob.close()
        admin.close()
    # Restart on the same storage (no replica needed to read): the sums are the registry's.
    with launch(tiny_model_dir, tmp_path, generators=0) as alice:
        [mine] = alice.usage()
        check_alice(mine, sent)
        admin = tt.ResourceClient(alice.address, api_key=ADMIN)
        assert {u.key: u.trained_tokens for u in admin.usage()} == {tag(ALICE): sent["trained"],
                                                                  tag(BOB): sent["bob_trained"]}
        admin.close()
