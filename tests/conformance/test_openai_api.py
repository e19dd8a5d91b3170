"""OpenAI-compatible inference (/v1/models, /v1/completions, /v1/chat/completions) with the official client.

A real resource (``launch_local(http_port=0)``, API key on) on the tiny model,
driven by the ``openai`` package. Independent references: the SDK's gRPC
``sample`` (same replicas, token ids), plain transformers (logprobs), the
tokenizer's own ``apply_chat_template`` (chat prompt). ``together-train
deploy`` is checked in a process of its own against the resource's answers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

import together_train as tt

openai = pytest.importorskip("openai")

KEY = "sk-openai-test"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    """(ResourceClient, base_url, storage dir) of a resource with an API key and the HTTP port."""
    storage = tmp_path_factory.mktemp("openai-storage")
    with tt.launch_local(model=str(tiny_model_dir), generators=1, storage_dir=storage, api_key=KEY, http_port=0,
                         extra_args=["--trainer-threads", "1", "--generator-threads", "1"]) as client:
        yield client, f"{client.local_resource.http_url}/v1", storage


@pytest.fixture(scope="module")
def oai(served):
    return openai.OpenAI(base_url=served[1], api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def base_id(oai):
    return oai.models.list().data[0].id


@pytest.fixture(scope="module")
def trained(served, tokenizer):
    """A session trained 10 steps (lr 2e-2) to continue PROMPT with a fixed text, synced, with 3 checkpoints."""
    client = served[0]
    s = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
    full = tokenizer(PROMPT + " jumps over the lazy dog and runs far away", add_special_tokens=False)["input_ids"]
    sample = tt.Sample(model_input=np.asarray(full[:-1]),
                       loss_fn_inputs={"target_tokens": np.asarray(full[1:]),
                                       "weights": np.ones(len(full) - 1, np.float32)})
    for _ in range(10):
        s.forward_backward([sample], "cross_entropy")
        s.optim_step(tt.AdamParams(learning_rate=2e-2))
    s.weights_sync().result(timeout=300)
    adapter = s.save_weights("oai-adapter").result(timeout=300)
    merged = s.save_weights("oai-merged", merged=True).result(timeout=300)
    state = s.save_state("oai-state").result(timeout=300)
    yield s, adapter.uri, merged.uri, state.uri
    s.stop()


def _prompt_ids(tokenizer) -> list[int]:
    return tokenizer(PROMPT, add_special_tokens=False)["input_ids"]


def test_models_list_base_and_checkpoints(oai, base_id, trained, tiny_model_dir):
    ids = [m.id for m in oai.models.list().data]
    assert ids[0] == base_id == tiny_model_dir.name
    assert trained[1] in ids  # the adapter checkpoint is servable
    assert trained[2] not in ids and trained[3] not in ids  # merged and training checkpoints are not
    assert oai.models.retrieve(trained[1]).parent == base_id


def test_greedy_completion_equals_grpc_sample(oai, base_id, served, tokenizer):
    """The endpoint's greedy text is the decoded tokens of the SDK's gRPC sample on the base model."""
    ids = _prompt_ids(tokenizer)
    r = oai.completions.create(model=base_id, prompt=PROMPT, max_tokens=12, temperature=0)
    s = served[0].create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))  # step 0 = the base model
    try:
        seq = s.sample(ids, tt.SamplingParams(max_tokens=12, temperature=0.0)).result(timeout=120).sequences[0]
    finally:
        s.stop()
    assert r.choices[0].text == tokenizer.decode(seq.tokens, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(seq.tokens)
    assert r.usage.total_tokens == len(ids) + len(seq.tokens)
    assert r.choices[0].finish_reason == ("length" if seq.stop_reason == "length" else "stop")
    # the same prompt as token ids gives the same answer
    assert oai.completions.create(model=base_id, prompt=ids, max_tokens=12, temperature=0).choices[0].text \
        == r.choices[0].text


def test_streaming_equals_non_streaming(oai, base_id):
    kw = dict(model=base_id, max_tokens=16, temperature=0)
    msgs = [{"role": "user", "content": "Say something."}]
    whole = oai.chat.completions.create(messages=msgs, **kw)
    chunks = list(oai.chat.completions.create(messages=msgs, stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # token by token
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    plain = oai.completions.create(prompt=PROMPT, **kw)
    streamed = "".join(c.choices[0].text for c in oai.completions.create(prompt=PROMPT, stream=True, **kw))
    assert streamed == plain.choices[0].text
    # n choices, interleaved by index, each equal to its non-streamed twin (seeded sampling)
    kw = dict(model=base_id, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=5, n=3)
    want = [c.text for c in oai.completions.create(**kw).choices]
    got = ["", "", ""]
    for c in oai.completions.create(stream=True, **kw):
        got[c.choices[0].index] += c.choices[0].text
    assert got == want
    # a stop string is cut from the streamed text exactly as from the whole one
    stop = next(want[0][i:i + 2] for i in range(2, len(want[0]) - 2) if want[0][i:i + 2].strip()
                and "\ufffd" not in want[0][i:i + 2])
    kw.update(n=1, stop=[stop])
    assert "".join(c.choices[0].text for c in oai.completions.create(stream=True, **kw)) \
        == oai.completions.create(**kw).choices[0].text == want[0][: want[0].find(stop)]


def _completion_event(served, rid: str) -> dict[str, str]:
    """The server's ``openai completion`` log event of request `rid` (key=value fields)."""
    import re

    deadline = time.monotonic() + 30
    while True:
        log = served[0].local_resource.log_path.read_text(errors="replace")
        for line in log.splitlines():
            if "openai completion" in line and f"id={rid} " in line:
                return dict(re.findall(r"(\w+)=(\S+)", line.split("openai completion", 1)[1]))
        assert time.monotonic() < deadline, f"no 'openai completion' event for {rid} in {log[-2000:]}"
        time.sleep(0.2)


def test_streaming_sends_tokens_as_they_are_sampled(oai, base_id, served):
    """The first streamed text reaches the client before the replica samples the last token.

    Ordering from event timestamps on one clock (this machine's): the client's
    arrival time of the first chunk with text vs ``last_sampled_at`` in the
    server's log event (the replica's time when it sampled the request's last token).
    """
    msgs = [{"role": "user", "content": "Tell me a long story."}]
    t0 = time.time()
    arrivals, texts, rid = [], [], None
    for c in oai.chat.completions.create(model=base_id, messages=msgs, max_tokens=200, temperature=0, stream=True):
        rid = c.id
        if c.choices and c.choices[0].delta.content:
            arrivals.append(time.time())
            texts.append(c.choices[0].delta.content)
    whole = oai.chat.completions.create(model=base_id, messages=msgs, max_tokens=200, temperature=0)
    assert "".join(texts) == whole.choices[0].message.content
    ev = _completion_event(served, rid)
    last_sampled = float(ev["last_sampled_at"])
    print(f"completion_tokens={whole.usage.completion_tokens} ttft_s={arrivals[0] - t0:.3f} "
          f"total_s={arrivals[-1] - t0:.3f} first_arrival_to_last_sampled_s={last_sampled - arrivals[0]:.3f} "
          f"server first_token_s={ev['first_token_s']} seconds={ev['seconds']}")
    assert whole.usage.completion_tokens > 20, "too short a completion to show anything"
    assert arrivals[0] < last_sampled, (arrivals[0], last_sampled)
    assert float(ev["first_token_s"]) < float(ev["seconds"]) and ev["stream"] == "True"


def test_chat_uses_the_models_template(oai, base_id, tokenizer):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}]
    expected = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)
    r = oai.chat.completions.create(model=base_id, messages=msgs, max_tokens=8, temperature=0)
    assert r.usage.prompt_tokens == len(expected["input_ids"])
    assert r.choices[0].message.role == "assistant"
    # the same tokens sent as a raw prompt give the same reply: the chat was rendered exactly so
    raw = oai.completions.create(model=base_id, prompt=list(expected["input_ids"]), max_tokens=8, temperature=0)
    assert raw.choices[0].text == r.choices[0].message.content
    # text parts are joined like a plain string
    parts = [{"role": "system", "content": "You are terse."},
             {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]
    assert oai.chat.completions.create(model=base_id, messages=parts, max_tokens=8, temperature=0) \
        .usage.prompt_tokens == len(expected["input_ids"])


def test_n_choices_with_seed(oai, base_id):
    kw = dict(model=base_id, prompt=PROMPT, max_tokens=10, temperature=1.0, n=3)
    first = [c.text for c in oai.completions.create(seed=7, **kw).choices]
    again = [c.text for c in oai.completions.create(seed=7, **kw).choices]
    other = [c.text for c in oai.completions.create(seed=8, **kw).choices]
    assert len(first) == 3 and len(set(first)) == 3  # each choice its own stream
    assert again == first  # the same seed repeats
    assert other != first


def test_stop_string_is_cut(oai, base_id):
    kw = dict(model=base_id, prompt=PROMPT, max_tokens=16, temperature=0)
    text = oai.completions.create(**kw).choices[0].text
    # a stop string from the middle of the greedy text (plain characters only)
    start = next(i for i in range(3, len(text) - 3) if "\ufffd" not in text[i:i + 3] and text[i:i + 3].strip())
    stop = text[start:start + 3]
    r = oai.completions.create(stop=[stop], **kw).choices[0]
    assert r.text == text[: text.find(stop)] and r.finish_reason == "stop"


def test_logprobs_match_transformers(oai, base_id, served, tokenizer, tiny_model_dir):
    """Reported logprobs and top alternatives are the model's own (plain transformers on the same tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = _prompt_ids(tokenizer)
    r = oai.completions.create(model=base_id, prompt=ids, max_tokens=6, temperature=1.0, seed=3, logprobs=3)
    s = served[0].create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
    try:
        toks = s.sample(ids, tt.SamplingParams(max_tokens=6, temperature=1.0, seed=3)).result(timeout=120) \
            .sequences[0].tokens
    finally:
        s.stop()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids + list(toks)])).logits[0].double()
    lsm = torch.log_softmax(logits, -1)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(toks)
    for i, t in enumerate(toks):
        pos = len(ids) - 1 + i
        assert lp.token_logprobs[i] == pytest.approx(float(lsm[pos, t]), abs=2e-4)
        assert lp.tokens[i] == tokenizer.decode([t])
        top = torch.topk(lsm[pos], 3)
        want = {tokenizer.decode([int(j)]): float(v) for v, j in zip(top.values, top.indices)}
        assert set(lp.top_logprobs[i]) == set(want)
        for k, v in want.items():
            assert lp.top_logprobs[i][k] == pytest.approx(v, abs=2e-4)
    # chat form: logprobs with top_logprobs, greedy: the chosen token is the top alternative
    c = oai.chat.completions.create(model=base_id, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                    temperature=0, logprobs=True, top_logprobs=2)
    for item in c.choices[0].logprobs.content:
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-5)


def test_checkpoint_differs_from_base_and_matches_session(oai, base_id, trained, tokenizer):
    """A save_weights checkpoint, served as an adapter, answers like its session's synced weights."""
    s, adapter_uri, _, _ = trained
    kw = dict(prompt=PROMPT, max_tokens=10, temperature=0)
    base = oai.completions.create(model=base_id, **kw).choices[0].text
    tuned = oai.completions.create(model=adapter_uri, **kw).choices[0].text
    assert tuned != base
    seq = s.sample(_prompt_ids(tokenizer), tt.SamplingParams(max_tokens=10, temperature=0.0)).result(timeout=120)
    assert tuned == tokenizer.decode(seq.sequences[0].tokens, skip_special_tokens=True)
    # it says words of its training text, which the random base model does not
    assert " dog" in tuned and " dog" not in base


def test_echo_scores_the_prompt_as_transformers_does(oai, base_id, tokenizer, tiny_model_dir):
    """echo=true (lm-eval's loglikelihood requests): the prompt's tokens come back with their logprobs
    (the first null) and top alternatives, then the completion's; strings, token ids and batches."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def lsm(ids):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)

    texts = [PROMPT, "Hello there, friend"]
    r = oai.completions.create(model=base_id, prompt=texts, max_tokens=0, echo=True, logprobs=2, temperature=0)
    assert r.usage.completion_tokens == 0 and len(r.choices) == 2
    for ch, text in zip(r.choices, texts):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        lp, want = ch.logprobs, lsm(ids)
        assert ch.text == text and lp.tokens == [tokenizer.decode([t]) for t in ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for i in range(1, len(ids)):
            assert lp.token_logprobs[i] == pytest.approx(float(want[i - 1, ids[i]]), abs=2e-4), i
            top = torch.topk(want[i - 1], 2)
            assert set(lp.top_logprobs[i]) == {tokenizer.decode([int(j)]) for j in top.indices}
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # token ids (one prompt and a batch), with a completion after the echoed prompt
    ids = _prompt_ids(tokenizer)
    one = oai.completions.create(model=base_id, prompt=ids, max_tokens=3, echo=True, logprobs=1, temperature=0)
    batch = oai.completions.create(model=base_id, prompt=[ids, ids[:2]], max_tokens=3, echo=True, logprobs=1,
                                   temperature=0)
    plain = oai.completions.create(model=base_id, prompt=ids, max_tokens=3, temperature=0, logprobs=1)
    assert one.choices[0].text == PROMPT + plain.choices[0].text == batch.choices[0].text
    lp, want = one.choices[0].logprobs, lsm(ids)
    assert len(lp.tokens) == len(ids) + one.usage.completion_tokens and lp.token_logprobs[0] is None
    assert lp.tokens[len(ids):] == plain.choices[0].logprobs.tokens
    np.testing.assert_allclose(lp.token_logprobs[len(ids):], plain.choices[0].logprobs.token_logprobs, atol=1e-5)
    np.testing.assert_allclose(lp.token_logprobs[1:len(ids)], [float(want[i - 1, ids[i]]) for i in range(1, len(ids))],
                               atol=2e-4)
    assert batch.choices[1].logprobs.token_logprobs[0] is None and len(batch.choices[1].logprobs.tokens) == 2 + 3
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=base_id, prompt=PROMPT, max_tokens=0)
    assert _error(e)["param"] == "max_tokens"


def _replica_sample_calls(served) -> float:
    """``together_train_replica_sample_calls_total`` from the resource's /metrics: sample calls replicas answered."""
    text = httpx.get(f"{served[0].local_resource.http_url}/metrics", headers={"Authorization": f"Bearer {KEY}"},
                     timeout=30).text
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith("together_train_replica_sample_calls_total ")))


def test_logprobs_cost_one_replica_call(oai, base_id, served):
    """A chat completion with logprobs and top_logprobs (n=2 choices), and an echoed completion with logprobs,
    are each answered by one replica call (the replicas' answered-call counter on /metrics moves by 1)."""
    before = _replica_sample_calls(served)
    c = oai.chat.completions.create(model=base_id, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                    temperature=0.8, seed=1, n=2, logprobs=True, top_logprobs=3)
    after_chat = _replica_sample_calls(served)
    assert all(len(item.top_logprobs) == 3 for ch in c.choices for item in ch.logprobs.content)
    r = oai.completions.create(model=base_id, prompt=PROMPT, max_tokens=4, echo=True, logprobs=2, temperature=0)
    after_echo = _replica_sample_calls(served)
    assert r.choices[0].logprobs.token_logprobs[0] is None and len(r.choices[0].logprobs.top_logprobs[1]) == 2
    assert (after_chat - before, after_echo - after_chat) == (1, 1), (before, after_chat, after_echo)


def test_chat_top_logprobs_match_torch_reference(oai, base_id, served, tokenizer, tiny_model_dir):
    """Tempered, filtered sampling still reports the model's own (untempered) logprob of each sampled token and
    its 5 most likely alternatives: plain torch (log_softmax of the tiny model's logits, float64) on the
    prompt + the tokens the SDK samples with the same seed. Tolerance 1e-4: the server's logits are float32
    (|z| < 10, each a sum of 64 products: rounding ~1e-6; measured ~1e-6)."""
    import torch
    from transformers import AutoModelForCausalLM

    msgs = [{"role": "user", "content": "Tell me about foxes."}]
    ids = list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"])
    kw = dict(max_tokens=8, temperature=0.7, top_p=0.9, seed=11)
    c = oai.chat.completions.create(model=base_id, messages=msgs, logprobs=True, top_logprobs=5, **kw)
    s = served[0].create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))  # step 0 = the base model
    try:
        toks = s.sample(ids, tt.SamplingParams(**kw)).result(timeout=120).sequences[0].tokens
    finally:
        s.stop()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        lsm = torch.log_softmax(model(torch.tensor([ids + list(toks)])).logits[0].double(), -1)
    content = c.choices[0].logprobs.content
    assert [item.token for item in content] == [tokenizer.decode([t]) for t in toks]
    for i, (t, item) in enumerate(zip(toks, content)):
        pos = len(ids) - 1 + i
        want = float(lsm[pos, t])
        assert abs(item.logprob - want) < 1e-4, (i, item.logprob, want)
        top = torch.topk(lsm[pos], 5)
        got = [(a.token, a.logprob) for a in item.top_logprobs]
        ref = [(tokenizer.decode([int(j)]), float(v)) for v, j in zip(top.values, top.indices)]
        assert [g[0] for g in got] == [r[0] for r in ref], (i, got, ref)
        assert max(abs(g[1] - r[1]) for g, r in zip(got, ref)) < 1e-4, (i, got, ref)


def _error(exc_info) -> dict:
    return exc_info.value.response.json()["error"]


def test_bad_requests_get_openai_errors(oai, base_id, trained):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=base_id, prompt=PROMPT, max_tokens=-1)
    err = _error(e)
    assert err["param"] == "max_tokens" and "max_tokens must be at least 1, got -1" in err["message"]
    assert err["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    err = _error(e)
    assert err["code"] == "model_not_found" and "no-such-model" in err["message"] and err["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=base_id, messages=[{"role": "robot", "content": "x"}])
    assert _error(e)["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=base_id, prompt=PROMPT, temperature=3.5)
    assert _error(e)["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=base_id, prompt=PROMPT, max_tokens=4, frequency_penalty=0.5)
    assert "frequency_penalty is not supported" in _error(e)["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=trained[2], prompt=PROMPT, max_tokens=4)
    assert "merged model" in _error(e)["message"] and "together-train deploy" in _error(e)["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=trained[3], prompt=PROMPT, max_tokens=4)
    assert "training checkpoint" in _error(e)["message"]
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="together-train://s-000000000000/weights/nope", prompt=PROMPT, max_tokens=4)


def test_api_keys_enforced(served, base_id):
    url = served[1]
    bad = openai.OpenAI(base_url=url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert _error(e)["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=base_id, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    r = httpx.post(f"{url}/completions", json={"model": base_id, "prompt": "x", "max_tokens": 2})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def _start_deploy(target: str, storage, tmp_path, *extra: str) -> tuple[subprocess.Popen, str]:
    port_file = tmp_path / "deploy.port"
    keys = tmp_path / "keys"
    keys.write_text(KEY + "\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "together_train_server.cli", "deploy", target, "--storage", str(storage), "--port", "0",
         "--port-file", str(port_file), "--generator-threads", "1", "--api-key-file", str(keys), *extra],
        env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while not port_file.exists():
        if proc.poll() is not None:
            raise AssertionError(f"deploy exited with {proc.returncode}: {proc.stdout.read()}")
        assert time.monotonic() < deadline, "deploy did not start"
        time.sleep(0.2)
    return proc, f"http://127.0.0.1:{port_file.read_text().strip()}/v1"


def test_deploy_serves_a_checkpoint_without_trainer(served, oai, trained, tmp_path):
    """`together-train deploy URI`: replicas only; the checkpoint answers as on the resource."""
    _, adapter_uri, merged_uri, _ = trained
    kw = dict(prompt=PROMPT, max_tokens=10, temperature=0)
    want = oai.completions.create(model=adapter_uri, **kw).choices[0].text
    proc, url = _start_deploy(adapter_uri, served[2], tmp_path)
    try:
        d = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=120)
        ids = [m.id for m in d.models.list().data]
        assert ids[1:] == [adapter_uri] and ids[0] == oai.models.list().data[0].id  # base, then the checkpoint
        assert d.completions.create(model=adapter_uri, **kw).choices[0].text == want
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="sk-wrong", max_retries=0).models.list()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert proc.returncode == 0


def test_deploy_refuses_a_training_checkpoint(served, trained, tmp_path):
    r = subprocess.run([sys.executable, "-m", "together_train_server.cli", "deploy", trained[3], "--storage",
                        str(served[2]), "--port", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "training checkpoint" in r.stderr


def test_deploy_serves_a_merged_directory(served, oai, trained, tmp_path):
    """A merged checkpoint's directory is served as a model of its own and answers like the adapter."""
    s, adapter_uri, merged_uri, _ = trained
    merged_dir = served[2] / "sessions" / s.session_id / "weights" / "oai-merged"
    assert (merged_dir / "config.json").exists()
    kw = dict(prompt=PROMPT, max_tokens=10, temperature=0, logprobs=1)
    want = oai.completions.create(model=adapter_uri, **kw).choices[0]
    proc, url = _start_deploy(str(merged_dir), served[2], tmp_path, "--served-model-name", "merged")
    try:
        d = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=120)
        assert d.models.list().data[0].id == "merged"
        got = d.completions.create(model="merged", **kw).choices[0]
        assert got.text == want.text
        # W + s·B·A merged vs the adapter applied on the fly: the same model up to float32 rounding
        np.testing.assert_allclose(got.logprobs.token_logprobs, want.logprobs.token_logprobs, atol=1e-4)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_resource_routes_sample_stream(served, tokenizer):
    """GeneratorService.SampleStream on the resource's one address: token chunks, then the whole answer,
    whose tokens are the streamed ones and equal unary Sample's (greedy); bad input is INVALID_ARGUMENT."""
    import grpc

    from together_train._proto import common_pb2, generator_pb2, generator_pb2_grpc

    client = served[0]
    stub = generator_pb2_grpc.GeneratorServiceStub(grpc.insecure_channel(client.address))
    auth = (("authorization", f"Bearer {KEY}"),)
    params = common_pb2.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    req = generator_pb2.SampleRequest(prompt=_prompt_ids(tokenizer), params=params, num_samples=2)
    chunks = list(stub.SampleStream(req, metadata=auth, timeout=120))
    assert all(c.HasField("tokens") for c in chunks[:-1]) and chunks[-1].HasField("done") and len(chunks) > 2
    streamed = [[], []]
    for c in chunks[:-1]:
        for j, t in zip(c.tokens.sequence, c.tokens.token_ids):
            streamed[j].append(t)
    done = chunks[-1].done
    assert streamed == [list(s.tokens) for s in done.sequences] and len(streamed[0]) == 24
    assert streamed == [list(s.tokens) for s in stub.Sample(req, metadata=auth, timeout=120).sequences]
    bad = generator_pb2.SampleRequest(prompt=[], params=params)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.SampleStream(bad, metadata=auth, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in e.value.details()


def test_grpc_sample_reports_top_logprobs(served, tokenizer):
    """GeneratorService.Sample with ``SamplingParams.top_logprobs`` (the field the OpenAI routes set): each
    sequence carries one untempered logprob and k alternatives per token; greedy, those are the sampler's own
    (T = 1) logprobs and the chosen token ranks first. Out of [0, 20] is INVALID_ARGUMENT naming the field."""
    import grpc

    from together_train._proto import common_pb2, generator_pb2, generator_pb2_grpc

    stub = generator_pb2_grpc.GeneratorServiceStub(grpc.insecure_channel(served[0].address))
    auth = (("authorization", f"Bearer {KEY}"),)
    params = common_pb2.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, top_logprobs=2)
    out = stub.Sample(generator_pb2.SampleRequest(prompt=_prompt_ids(tokenizer), params=params, num_samples=2),
                      metadata=auth, timeout=120)
    for seq in out.sequences:
        assert len(seq.untempered_logprobs) == len(seq.top_logprobs) == len(seq.tokens) == 5
        np.testing.assert_allclose(seq.untempered_logprobs, seq.logprobs, atol=1e-6)
        for t, top in zip(seq.tokens, seq.top_logprobs):
            assert len(top.token_ids) == 2 and top.token_ids[0] == t and top.logprobs[0] >= top.logprobs[1]
    plain = stub.Sample(generator_pb2.SampleRequest(prompt=_prompt_ids(tokenizer), params=common_pb2.SamplingParams(
        max_tokens=5, temperature=0.0, ignore_eos=True)), metadata=auth, timeout=120)
    assert not plain.sequences[0].untempered_logprobs and not plain.sequences[0].top_logprobs
    for k in (21, -1):
        bad = common_pb2.SamplingParams(max_tokens=5, top_logprobs=k)
        with pytest.raises(grpc.RpcError) as e:
            stub.Sample(generator_pb2.SampleRequest(prompt=_prompt_ids(tokenizer), params=bad), metadata=auth,
                        timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_logprobs must be in [0, 20]" in \
            e.value.details(), e.value.details()
