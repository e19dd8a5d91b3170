"""min_p through all four APIs (our SDK over gRPC, Tinker, Together, OpenAI) on one real resource.

Independent reference: plain transformers over the same tiny model. For each sampled token
the reference computes ``log_softmax(logits / T)`` over prompt + the tokens before it; the token
must lie in the min_p set ``{i: p_i >= min_p * max_j p_j}`` (vLLM's semantics), and its reported
logprob (the temperature-scaled distribution, before truncation: docs/design.md §7) must match.
With min_p = 1 only the most likely token survives, so the output equals greedy decoding.

Tolerances: 1e-4 nats (float32 on CPU; the replica's KV-cached decode and the reference's full
forward sum in different orders), both for the logprobs and at the min_p boundary.

Tinker: tinker 0.38's ``SamplingParams`` ignores unknown fields, so its client cannot send
``min_p``; the Tinker test posts the Tinker wire JSON with ``sampling_params.min_p`` as an extra
and decodes the answer with tinker's own decoder (``tinker.proto.response_conv``).
"""

from __future__ import annotations

import math
import time

import httpx
import pytest
import torch

import together_train as tt

KEY = "k-min-p-test"
PROMPT = [1, 420, 1003, 77, 9120, 15]
ATOL = 1e-4
# On the tiny random model min_p 0.5 at T = 1 keeps ~3,000 of 49,152 tokens at the first step
# (~6%), so a token drawn without the filter falls outside the set nearly always.
MIN_P, TEMP, MAX_TOKENS, N = 0.5, 1.0, 6, 4


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    """(ResourceClient, HTTP base url) of one resource with an API key and the HTTP port."""
    storage = tmp_path_factory.mktemp("min-p-storage")
    with tt.launch_local(model=str(tiny_model_dir), generators=1, storage_dir=storage, api_key=KEY, http_port=0,
                         extra_args=["--trainer-threads", "1", "--generator-threads", "1"]) as client:
        yield client, client.http_url


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _check(model, prompt: list[int], tokens: list[int], logprobs: list[float] | None, *, temp: float,
           min_p: float) -> int:
    """Assert every token lies in the reference's min_p set (and its logprob matches); returns how many
    tokens the set excluded at the first step (so a test can show the filter is not vacuous)."""
    assert tokens, "no tokens sampled"
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: len(prompt) - 1 + len(tokens)]
    logp = torch.log_softmax(logits.double() / temp, dim=-1)
    floor = logp.max(dim=-1).values + math.log(min_p)
    for i, t in enumerate(tokens):
        got = float(logp[i, t])
        assert got >= float(floor[i]) - ATOL, (i, t, got, float(floor[i]), "outside the min_p set")
        if logprobs is not None:
            assert abs(logprobs[i] - got) <= ATOL, (i, t, logprobs[i], got)
    return int((logp[0] < floor[0]).sum())


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_sdk_grpc(served, reference):
    client = served[0]
    params = tt.SamplingParams(max_tokens=MAX_TOKENS, temperature=TEMP, min_p=MIN_P, seed=7, ignore_eos=True)
    res = client.sample(PROMPT, params, num_samples=N).result(timeout=120)
    excluded = [_check(reference, PROMPT, q.tokens, q.logprobs, temp=TEMP, min_p=MIN_P) for q in res.sequences]
    assert min(excluded) > 40_000, excluded
    # without the filter the same seeds draw tokens outside the set
    free = client.sample(PROMPT, tt.SamplingParams(max_tokens=MAX_TOKENS, temperature=TEMP, seed=7, ignore_eos=True),
                         num_samples=N).result(timeout=120)
    with pytest.raises(AssertionError, match="outside the min_p set"):
        for q in free.sequences:
            _check(reference, PROMPT, q.tokens, None, temp=TEMP, min_p=MIN_P)
    one = client.sample(PROMPT, tt.SamplingParams(max_tokens=MAX_TOKENS, temperature=TEMP, min_p=1.0, seed=3,
                                                  ignore_eos=True)).result(timeout=120)
    assert one.sequences[0].tokens == _greedy(reference, PROMPT, MAX_TOKENS)


def test_sdk_grpc_bad_min_p(served):
    client = served[0]
    with pytest.raises(tt.InvalidArgumentError, match="min_p") as ei:  # the SDK's own check
        client.sample(PROMPT, tt.SamplingParams(max_tokens=2, min_p=1.5))
    assert ei.value.key == "min_p"
    with pytest.raises(tt.InvalidArgumentError, match=r"min_p must be a number in \[0.0, 1.0\], got -0.25") as ei:
        client.sample(PROMPT, tt.SamplingParams(max_tokens=2, min_p=-0.25), validate=False).result(timeout=60)
    assert ei.value.key == "min_p"


def _tinker_sample(url: str, sampling_params: dict) -> httpx.Response:
    h = {"X-API-Key": "tml-" + KEY}
    body = {"base_model": "", "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
            "num_samples": N, "sampling_params": sampling_params}
    r = httpx.post(f"{url}/api/v1/asample", json=body, headers=h, timeout=60)
    if r.status_code != 200:
        return r
    rid = r.json()["request_id"]
    for _ in range(60):
        r = httpx.post(f"{url}/api/v1/retrieve_future", json={"request_id": rid}, headers=h, timeout=60)
        if r.status_code != 408:
            return r
        time.sleep(0.2)
    raise AssertionError("the Tinker sample did not finish")


def test_tinker(served, reference):
    from tinker.proto.response_conv import deserialize_sample_response

    r = _tinker_sample(served[1], {"max_tokens": MAX_TOKENS, "temperature": TEMP, "seed": 11, "min_p": MIN_P,
                                   "stop": []})
    assert r.status_code == 200, r.text
    res = deserialize_sample_response(r.content)
    for q in res.sequences:
        _check(reference, PROMPT, list(q.tokens), list(q.logprobs), temp=TEMP, min_p=MIN_P)
    bad = _tinker_sample(served[1], {"max_tokens": 2, "min_p": 2.0})
    assert bad.status_code == 400 and "min_p must be a number in [0.0, 1.0], got 2.0" in bad.text, bad.text
    bad = _tinker_sample(served[1], {"max_tokens": 2, "min_p": "high"})
    assert bad.status_code == 400 and "sampling_params.min_p must be a finite number" in bad.text, bad.text


def test_together(served, tiny_model_dir, reference):
    from together import post_training as pt

    mr = pt.ModelResourcesClient.create(api_key=KEY, base_url=served[1], base_model=str(tiny_model_dir), interval=0.1)
    sess = mr.create_session(lora_config={"rank": 4, "alpha": 32, "seed": 0}, interval=0.1)
    try:
        mi = {"chunks": [{"encoded_text": {"tokens": PROMPT}}]}
        out = sess.generator.sample(mi, num_samples=N, sampling_params={
            "max_tokens": MAX_TOKENS, "temperature": TEMP, "seed": 13, "min_p": MIN_P})
        assert len(out.sequences) == N
        for q in out.sequences:  # a session before its first weights_sync samples the base model
            _check(reference, PROMPT, [int(t) for t in q.tokens], list(q.logprobs), temp=TEMP, min_p=MIN_P)
        with pytest.raises(Exception, match=r"min_p must be a number in \[0.0, 1.0\], got 1.01"):
            sess.generator.sample(mi, num_samples=1, sampling_params={"max_tokens": 2, "min_p": 1.01})
    finally:
        sess.stop()
        mr.detach()


def test_openai(served, reference):
    openai = pytest.importorskip("openai")
    client, url = served
    oai = openai.OpenAI(base_url=f"{url}/v1/rollouts/min-p", api_key=KEY, max_retries=0, timeout=120)
    model = oai.models.list().data[0].id
    oai.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=TEMP, seed=17, n=N,
                           extra_body={"min_p": MIN_P})
    call = client.get_rollout("min-p").calls[0]  # the recorded token ids and sampler logprobs
    assert len(call.choices) == N
    for ch in call.choices:
        if ch.tokens:  # a choice may end at EOS at once
            _check(reference, PROMPT, ch.tokens, ch.logprobs, temp=TEMP, min_p=MIN_P)
    greedy = oai.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=TEMP, seed=2,
                                    extra_body={"min_p": 1.0})
    assert client.get_rollout("min-p").calls[1].choices[0].tokens == _greedy(reference, PROMPT, MAX_TOKENS)[
        :len(client.get_rollout("min-p").calls[1].choices[0].tokens)], greedy
    with pytest.raises(openai.BadRequestError) as ei:
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                    extra_body={"min_p": 3})
    err = ei.value.body
    assert err["param"] == "min_p" and "min_p must be a number in [0.0, 1.0], got 3.0" in err["message"], err
