"""Prefix-cache hits reported exactly through every API: SDK, Tinker, Together, OpenAI, Prometheus.

One real resource (tiny random Llama, one torch replica with the default
``--prefix-cache-mb``) serves gRPC and HTTP. Each API sends a prompt of 40
tokens twice (a prompt no other test sends): the first call prefills it all
(0 hits), the second reuses its whole cached blocks: ``(40 - 1) // 16 * 16 =
32`` tokens (the last prompt token is always prefilled, hits are whole
16-token blocks). A weights_sync makes the session's next request start
from 0 again: its blocks came from other weights. A chat's next turn also
reuses the previous answer (the tokens the replica fed forward).
"""

from __future__ import annotations

import re
import urllib.request

import numpy as np
import pytest

import together_train as tt
from _served import launch_with_http

KEY = "k-prefix-cache-test"
PROMPT_LEN, HIT = 40, 32


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    with launch_with_http(tiny_model_dir, tmp_path_factory.mktemp("pc-storage"), KEY) as client:
        yield client


def _prompt(seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 2000, PROMPT_LEN).tolist()


def test_sdk_reports_hits_and_a_weights_sync_starts_from_zero(served):
    p = tt.SamplingParams(max_tokens=4, temperature=0.0)
    prompt = _prompt(1)
    assert [served.sample(prompt, p).result(timeout=120).prompt_cache_hit_tokens for _ in range(2)] == [0, HIT]
    s = served.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
    try:
        s.weights_sync().result(timeout=120)
        # version 0 (LoRA B = 0) is served by the base model: its blocks are the same weights' and reused
        assert s.sample(prompt, p).result(timeout=120).prompt_cache_hit_tokens == HIT
        full = prompt + [7, 8, 9]
        sample = tt.Sample(model_input=np.asarray(full[:-1]), loss_fn_inputs={
            "target_tokens": np.asarray(full[1:]), "weights": np.ones(len(full) - 1, np.float32)})
        s.forward_backward([sample], "cross_entropy").result(timeout=120)
        s.optim_step(tt.AdamParams(learning_rate=1e-2)).result(timeout=120)
        s.weights_sync().result(timeout=120)
        after = [s.sample(prompt, p).result(timeout=120) for _ in range(2)]
        assert [r.prompt_cache_hit_tokens for r in after] == [0, HIT]
        assert after[0].policy_version == 1
        # the base model's blocks are untouched by the session's sync
        assert served.sample(prompt, p).result(timeout=120).prompt_cache_hit_tokens == HIT
    finally:
        s.stop()


def _train_and_sync(s, tokens: list[int]) -> None:
    """One cross-entropy step on ``tokens`` and a weights_sync: the session serves new weights."""
    sample = tt.Sample(model_input=np.asarray(tokens[:-1]), loss_fn_inputs={
        "target_tokens": np.asarray(tokens[1:]), "weights": np.ones(len(tokens) - 1, np.float32)})
    s.forward_backward([sample], "cross_entropy").result(timeout=120)
    s.optim_step(tt.AdamParams(learning_rate=1e-2)).result(timeout=120)
    s.weights_sync().result(timeout=120)


def test_sdk_next_turn_hits_the_previous_answer(served):
    """Turn 2 of a chat (turn 1's 40-token prompt + its 30-token answer + 3 new tokens, 73 tokens) reuses turn
    1's prompt and answer: the fed tokens are 40 + 29 (the last sampled token never went through the model),
    so min(69, 73 - 1) // 16 * 16 = 64 (the prompt alone gave 32). A session's answers are its weights': the
    base model never hits them, and a weights_sync drops them."""
    p = tt.SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompt = _prompt(6)
    answer = list(served.sample(prompt, p).result(timeout=120).sequences[0].tokens)
    assert len(answer) == 30
    assert served.sample(prompt + answer + [11, 12, 13], p).result(timeout=120).prompt_cache_hit_tokens == 64
    s = served.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
    try:
        _train_and_sync(s, prompt + [7, 8, 9])           # version 1: weights of its own, not the base model's
        prompt2 = _prompt(7)
        first = s.sample(prompt2, p).result(timeout=120)
        assert first.prompt_cache_hit_tokens == 0 and first.policy_version == 1
        turn2 = prompt2 + list(first.sequences[0].tokens) + [11, 12, 13]
        assert s.sample(turn2, p).result(timeout=120).prompt_cache_hit_tokens == 64
        assert served.sample(turn2, p).result(timeout=120).prompt_cache_hit_tokens == 0
        _train_and_sync(s, prompt2 + [7, 8, 9])
        again = s.sample(turn2, p).result(timeout=120)
        assert again.prompt_cache_hit_tokens == 0 and again.policy_version == 2
    finally:
        s.stop()


def test_tinker_reports_prompt_cache_hit_tokens(served, tiny_model_dir):
    tinker = pytest.importorskip("tinker")
    from tinker import types as T

    sc = tinker.ServiceClient(base_url=served.http_url, api_key="tml-" + KEY)
    try:
        sampler = sc.create_sampling_client(base_model=str(tiny_model_dir)).result()
        mi = T.ModelInput.from_ints(_prompt(2))
        params = T.SamplingParams(max_tokens=4, temperature=0.0)
        hits = [sampler.sample(mi, num_samples=1, sampling_params=params).result().prompt_cache_hit_tokens
                for _ in range(2)]
        assert hits == [0, HIT]
    finally:
        sc.close("success").result()


def test_together_reports_prompt_cache_hit_tokens(served, tiny_model_dir):
    pytest.importorskip("together")
    from together import post_training as pt

    mr = pt.ModelResourcesClient.create(api_key=KEY, base_url=served.http_url, base_model=str(tiny_model_dir),
                                        interval=0.1)
    try:
        sess = mr.create_session(lora_config={"rank": 4, "alpha": 8, "seed": 0}, interval=0.1)
        try:
            mi = {"chunks": [{"encoded_text": {"tokens": _prompt(3)}}]}
            params = {"max_tokens": 4, "temperature": 0.0}
            hits = [[q.prompt_cache_hit_tokens for q in sess.generator.sample(mi, num_samples=2,
                                                                              sampling_params=params).sequences]
                    for _ in range(2)]
            assert hits == [[0, 0], [HIT, HIT]]          # per sequence: the request's shared prompt
        finally:
            sess.stop()
    finally:
        mr.detach()


def _scrape(served) -> dict[str, float]:
    """The resource's prompt-token counters from /metrics."""
    req = urllib.request.Request(f"{served.http_url}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    text = urllib.request.urlopen(req, timeout=30).read().decode()
    return {m: float(re.search(rf"^{m} (\S+)$", text, re.M).group(1))
            for m in ("together_train_prompt_tokens_total", "together_train_prompt_cache_hit_tokens_total")}


def test_openai_reports_cached_tokens(served):
    openai = pytest.importorskip("openai")
    oai = openai.OpenAI(base_url=f"{served.http_url}/v1", api_key=KEY, max_retries=0, timeout=120)
    model = oai.models.list().data[0].id
    prompt = _prompt(4)
    before = _scrape(served)
    usage = [oai.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0).usage for _ in range(2)]
    assert [u.prompt_tokens for u in usage] == [PROMPT_LEN, PROMPT_LEN]
    assert [u.prompt_tokens_details.cached_tokens for u in usage] == [0, HIT]
    # streamed, with include_usage: the final usage chunk carries it too
    chunks = list(oai.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == HIT
    # the Prometheus counters see the OpenAI calls too: 3 prompts sent, 0 + HIT + HIT from the cache
    after = _scrape(served)
    moved = {m: after[m] - before[m] for m in after}
    assert moved == {"together_train_prompt_tokens_total": 3 * PROMPT_LEN,
                     "together_train_prompt_cache_hit_tokens_total": 2 * HIT}, moved


def test_prometheus_counts_prompt_cache_hit_tokens(served):
    p = tt.SamplingParams(max_tokens=2, temperature=0.0)

    before = _scrape(served)
    prompt = _prompt(5)
    for _ in range(2):
        served.sample(prompt, p).result(timeout=120)
    after = _scrape(served)
    assert after["together_train_prompt_tokens_total"] - before["together_train_prompt_tokens_total"] == 2 * PROMPT_LEN
    assert after["together_train_prompt_cache_hit_tokens_total"] - before[
        "together_train_prompt_cache_hit_tokens_total"] == HIT
