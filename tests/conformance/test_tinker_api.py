"""The official tinker SDK (0.38) against a real resource's HTTP port (`--http-port`).

One real `together-train serve` process (tiny random Llama, one generator
replica) serves gRPC and the Tinker-compatible HTTP API at once; the tinker
SDK talks to it exactly as it talks to Tinker, with only `base_url` and a
`tml-` key changed. Numbers are checked against our gRPC path on the same
batch and against a plain-torch computation.
"""

from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types as T  # noqa: E402

KEY = "k-tinker-test"  # the key file line; the tinker SDK sends "tml-" + KEY


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    """(gRPC ResourceClient, HTTP base url) of one resource with an API key."""
    import together_train as tt

    with tt.launch_local(
        model=str(tiny_model_dir),
        generators=1,
        storage_dir=tmp_path_factory.mktemp("tinker-storage"),
        api_key=KEY,
        http_port=0,
        extra_args=["--max-sessions", "64", "--trainer-threads", "1", "--generator-threads", "1"],
    ) as client:
        yield client, client.http_url


@pytest.fixture(scope="module")
def service(served):
    sc = tinker.ServiceClient(base_url=served[1], api_key="tml-" + KEY)
    yield sc
    sc.close("success").result()


def _batch(tokenizer, n: int = 3, seed: int = 0):
    """n (full sequence, weights) pairs of different lengths, prompt positions weighted 0."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        full = rng.integers(0, tokenizer.vocab_size, size=9 + 3 * i)
        w = np.ones(len(full) - 1, np.float32)
        w[:2] = 0.0
        out.append((full.astype(np.int64), w))
    return out


def _datums(batch):
    return [
        T.Datum(
            model_input=T.ModelInput.from_ints(full[:-1].tolist()),
            loss_fn_inputs={"target_tokens": full[1:].astype(np.int64), "weights": w},
        )
        for full, w in batch
    ]


def _torch_reference(model_dir, batch) -> tuple[float, list[np.ndarray]]:
    """-sum(w * log p(target)) and per-token logprobs with plain transformers (LoRA B = 0 at init)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    loss, lps = 0.0, []
    with torch.no_grad():
        for full, w in batch:
            logits = model(torch.tensor(full[:-1])[None]).logits[0].double()
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(full[1:])[:, None])[:, 0].numpy()
            lps.append(lp)
            loss += float(-(w * lp).sum())
    return loss, lps


def test_server_endpoints_and_auth(served, service):
    """healthz, capabilities (model name = the directory, context length) and the key check."""
    import httpx

    url = served[1]
    assert httpx.get(url + "/api/v1/healthz").json() == {"status": "ok"}
    caps = tinker.RestClient(base_url=url, api_key="tml-" + KEY).get_server_capabilities().result()
    m = caps.supported_models[0]
    assert m.trainable and m.sampleable and m.max_context_length == served[0].capabilities.max_seq_len
    r = httpx.post(url + "/api/v1/create_session", headers={"X-API-Key": "tml-wrong"},
                   json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"})
    assert r.status_code == 401 and "API key" in r.json()["detail"]
    r = httpx.post(url + "/api/v1/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "x"})
    assert r.status_code == 401


def test_forward_backward_matches_grpc_and_torch(served, service, tiny_model_dir, tokenizer):
    """Same batch: tinker SDK over HTTP == our SDK over gRPC == plain torch (loss and per-token logprobs)."""
    import together_train as tt

    client, _ = served
    batch = _batch(tokenizer)
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=0).result()
    info = tc.get_info()
    assert info.model_id.endswith(":train:0") and info.lora_rank == 4 and info.model_data.tokenizer_id
    tok = tc.get_tokenizer()  # AutoTokenizer.from_pretrained(tokenizer_id), offline
    assert tok.vocab_size == tokenizer.vocab_size

    out = tc.forward_backward(_datums(batch), "cross_entropy").result()
    ref_loss, ref_lps = _torch_reference(tiny_model_dir, batch)
    assert set(out.metrics) >= {"loss:sum"} and all(k.count(":") == 1 for k in out.metrics)
    assert out.metrics["loss:sum"] == pytest.approx(ref_loss, rel=1e-5)
    assert len(out.loss_fn_outputs) == len(batch)
    for o, lp, (_, w) in zip(out.loss_fn_outputs, ref_lps, batch):
        np.testing.assert_allclose(o["logprobs"].to_numpy(), lp, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(o["elementwise_loss"].to_numpy(), -w * lp, rtol=1e-4, atol=1e-5)

    s = client.create_session(lora=tt.LoraConfig(rank=4, alpha=32.0, seed=0,
                                                 target_modules=("q_proj", "k_proj", "v_proj", "o_proj",
                                                                 "gate_proj", "up_proj", "down_proj"),
                                                 train_unembed=True))
    try:
        samples = [tt.Sample(model_input=full[:-1], loss_fn_inputs={"target_tokens": full[1:], "weights": w})
                   for full, w in batch]
        g = s.forward_backward(samples, "cross_entropy").result(60)
        assert out.metrics["loss:sum"] == pytest.approx(g.loss, rel=1e-6)
        # One optimizer step each way: same grad norm (same gradients), and the next losses agree.
        adam = dict(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0)
        o_http = tc.optim_step(T.AdamParams(**adam)).result()
        o_grpc = s.optim_step(tt.AdamParams(**adam)).result(60)
        assert o_http.metrics["grad_norm:mean"] == pytest.approx(o_grpc.grad_norm, rel=1e-5)
        after_http = tc.forward(_datums(batch), "cross_entropy").result()
        after_grpc = s.forward(samples, "cross_entropy").result(60)
        assert after_http.metrics["loss:sum"] < out.metrics["loss:sum"]
        assert after_http.metrics["loss:sum"] == pytest.approx(after_grpc.loss, rel=1e-5)
    finally:
        s.stop()


def test_bad_input_is_a_user_error_naming_sample_and_key(service, tiny_model_dir, tokenizer):
    """Weights one short in sample 1: RequestFailedError, category user, message names sample 1 and 'weights'."""
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=0).result()
    batch = _batch(tokenizer)
    datums = _datums(batch)
    full, w = batch[1]
    datums[1] = T.Datum(model_input=T.ModelInput.from_ints(full[:-1].tolist()),
                        loss_fn_inputs={"target_tokens": full[1:], "weights": w[:-1]})
    with pytest.raises(tinker.RequestFailedError) as e:
        tc.forward_backward(datums, "cross_entropy").result()
    assert e.value.category == T.RequestErrorCategory.User
    assert "sample 1" in str(e.value) and "'weights'" in str(e.value)


def test_unknown_loss_is_refused_by_name(service, tiny_model_dir, tokenizer):
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=0).result()
    with pytest.raises(tinker.RequestFailedError) as e:
        tc.forward_backward(_datums(_batch(tokenizer)), "stable_reinforce").result()
    assert e.value.category == T.RequestErrorCategory.User and "stable_reinforce" in str(e.value)
    assert "record_stability_info" in str(e.value)  # says why: it needs Tinker's sampler-side records


def test_wrong_base_model_is_refused(service):
    with pytest.raises(Exception) as e:
        service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()
    assert "Qwen/Qwen3-8B" in str(e.value) and "not served" in str(e.value)


ADAM = dict(learning_rate=5e-2, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0)


def _train_step(tc, batch):
    tc.forward_backward(_datums(batch), "cross_entropy")
    return tc.optim_step(T.AdamParams(**ADAM)).result()


def test_compute_logprobs_on_base_model_matches_torch(service, tiny_model_dir, tokenizer):
    """compute_logprobs: len(prompt) entries, the first None, the rest the base model's logprobs."""
    (full, _), = _batch(tokenizer, n=1, seed=3)
    sc = service.create_sampling_client(base_model=str(tiny_model_dir)).result()
    lps = sc.compute_logprobs(T.ModelInput.from_ints(full.tolist())).result()
    _, (ref,) = _torch_reference(tiny_model_dir, [(full, np.ones(len(full) - 1, np.float32))])
    assert len(lps) == len(full) and lps[0] is None
    np.testing.assert_allclose(np.array(lps[1:], dtype=np.float64), ref, rtol=1e-4, atol=1e-4)
    assert sc.get_tokenizer().vocab_size == tokenizer.vocab_size


def test_snapshot_sampling_is_unaffected_by_later_training(service, tiny_model_dir, tokenizer):
    """A sampling client samples the weights saved when it was made; training afterwards changes nothing
    for it (same seed: same tokens and logprobs) while a new client sees the new weights."""
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=1).result()
    batch = _batch(tokenizer, seed=5)
    _train_step(tc, batch)
    sc1 = tc.save_weights_and_get_sampling_client().result()
    (full, _), = _batch(tokenizer, n=1, seed=9)
    prompt = T.ModelInput.from_ints(full[:6].tolist())
    params = T.SamplingParams(max_tokens=8, temperature=1.0, seed=123)
    before = sc1.sample(prompt, num_samples=2, sampling_params=params).result()
    lp_before = sc1.compute_logprobs(T.ModelInput.from_ints(full.tolist())).result()
    assert len(before.sequences) == 2 and all(len(s.tokens) == 8 for s in before.sequences)
    assert all(s.sequence_id for s in before.sequences)
    # The snapshot's logprobs are the trainer's at that point (same weights, untempered).
    fwd = tc.forward([T.Datum(model_input=T.ModelInput.from_ints(full[:-1].tolist()),
                              loss_fn_inputs={"target_tokens": full[1:], "weights": np.ones(len(full) - 1, np.float32)})],
                     "cross_entropy").result()
    np.testing.assert_allclose(np.array(lp_before[1:]), fwd.loss_fn_outputs[0]["logprobs"].to_numpy(), atol=2e-4)

    for _ in range(3):
        _train_step(tc, batch)
    sc2 = tc.save_weights_and_get_sampling_client().result()  # newer weights on the replicas too
    lp_new = sc2.compute_logprobs(T.ModelInput.from_ints(full.tolist())).result()
    assert np.max(np.abs(np.array(lp_new[1:]) - np.array(lp_before[1:]))) > 1e-3
    after = sc1.sample(prompt, num_samples=2, sampling_params=params).result()
    lp_after = sc1.compute_logprobs(T.ModelInput.from_ints(full.tolist())).result()
    assert [s.tokens for s in after.sequences] == [s.tokens for s in before.sequences]
    assert [s.logprobs for s in after.sequences] == [s.logprobs for s in before.sequences]
    assert lp_after == lp_before


def test_named_sampler_checkpoint_and_listing(service, tiny_model_dir, tokenizer):
    """save_weights_for_sampler(name) -> tinker://.../sampler_weights/name; a sampling client on that path
    scores like a snapshot taken at the same point."""
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=2).result()
    _train_step(tc, _batch(tokenizer, seed=6))
    path = tc.save_weights_for_sampler("s1").result().path
    assert path.startswith("tinker://") and path.endswith("/sampler_weights/s1")
    snap = tc.save_weights_and_get_sampling_client().result()
    (full, _), = _batch(tokenizer, n=1, seed=11)
    mi = T.ModelInput.from_ints(full.tolist())
    from_path = service.create_sampling_client(model_path=path).result().compute_logprobs(mi).result()
    np.testing.assert_allclose(np.array(from_path[1:]), np.array(snap.compute_logprobs(mi).result()[1:]), atol=1e-5)


def test_resume_from_state_with_and_without_optimizer(service, tiny_model_dir, tokenizer):
    """save_state -> create_training_client_from_state[_with_optimizer] (create-via-load, model id
    "{session}:train:{n}"): with the optimizer, the next step equals the original's next step exactly;
    without it (fresh AdamW), the first step differs."""
    batch = _batch(tokenizer, seed=7)
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=3).result()
    _train_step(tc, batch)
    path = tc.save_state("ckpt1").result().path
    assert path.endswith("/weights/ckpt1")
    _train_step(tc, batch)
    want = tc.forward(_datums(batch), "cross_entropy").result().metrics["loss:sum"]

    with_opt = service.create_training_client_from_state_with_optimizer(path).result()
    assert with_opt.model_id.split(":")[1:-1] == ["train"]
    _train_step(with_opt, batch)
    assert with_opt.forward(_datums(batch), "cross_entropy").result().metrics["loss:sum"] == pytest.approx(want, rel=1e-6)

    fresh = service.create_training_client_from_state(path).result()
    _train_step(fresh, batch)
    got = fresh.forward(_datums(batch), "cross_entropy").result().metrics["loss:sum"]
    assert abs(got - want) > 1e-4


def test_resubmitted_optim_step_applies_once(served, service, tiny_model_dir, tokenizer):
    """The SDK re-sends a request with the same seq_id and a new idempotency key: one operation, one step;
    the same seq_id with another body is a 409."""
    import httpx

    url, headers = served[1] + "/api/v1", {"X-API-Key": "tml-" + KEY}
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=4).result()
    tc.forward_backward(_datums(_batch(tokenizer)), "cross_entropy").result()  # seq_id 1
    body = {"model_id": tc.model_id, "seq_id": 2, "adam_params": ADAM, "type": "optim_step"}
    ids = []
    for key in ("a", "b"):
        r = httpx.post(url + "/optim_step", json=body, headers={**headers, "Idempotency-Key": key})
        assert r.status_code == 200, r.text
        ids.append(r.json()["request_id"])
    assert ids[0] == ids[1]
    res = httpx.post(url + "/retrieve_future", json={"request_id": ids[0]}, headers=headers, timeout=60).json()
    assert res["metrics"]["step:max"] == 1.0
    other = dict(body, adam_params=dict(ADAM, learning_rate=1.0))
    r = httpx.post(url + "/optim_step", json=other, headers=headers)
    assert r.status_code == 409 and "seq_id" in r.json()["detail"]
    # The next step (seq_id 3) is step 2: the re-send did not step twice.
    body3 = dict(body, seq_id=3)
    rid = httpx.post(url + "/optim_step", json=body3, headers=headers).json()["request_id"]
    res = httpx.post(url + "/retrieve_future", json={"request_id": rid}, headers=headers, timeout=60).json()
    assert res["metrics"]["step:max"] == 2.0


def _policy_batch(tokenizer, seed: int = 12):
    """Sequences with sampler logprobs q (= true logprobs + noise) and advantages, plus the true logprobs p."""
    rng = np.random.default_rng(seed)
    return [(full, rng.normal(size=len(full) - 1).astype(np.float32), rng.normal(scale=0.3, size=len(full) - 1))
            for full, _ in _batch(tokenizer, n=3, seed=seed)]


@pytest.mark.parametrize(
    "loss_fn, config",
    [("importance_sampling", None), ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
     ("cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 1.05}), ("dro", {"beta": 0.5})],
)
def test_policy_losses_match_tinker_math_and_grpc(served, service, tiny_model_dir, tokenizer, loss_fn, config):
    """Tinker's policy losses over HTTP: value = the documented formula on plain-torch logprobs, and equal
    to our gRPC path's loss on the same batch."""
    import together_train as tt

    data = _policy_batch(tokenizer)
    _, ps = _torch_reference(tiny_model_dir, [(full, np.ones(len(full) - 1, np.float32)) for full, _, _ in data])
    qs = [p + noise for p, (_, _, noise) in zip(ps, data)]
    datums = [T.Datum(model_input=T.ModelInput.from_ints(full[:-1].tolist()),
                      loss_fn_inputs={"target_tokens": full[1:], "logprobs": q.astype(np.float32), "advantages": a})
              for (full, a, _), q in zip(data, qs)]
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=0).result()
    out = tc.forward_backward(datums, loss_fn, loss_fn_config=config).result()

    want = 0.0
    for p, q, (_, a, _) in zip(ps, qs, data):
        r = np.exp(p - q)
        if loss_fn == "importance_sampling":
            want += -(r * a).sum()
        elif loss_fn == "ppo":
            want += -np.minimum(r * a, np.clip(r, 0.9, 1.1) * a).sum()
        elif loss_fn == "cispo":
            want += -(np.clip(r, 0.0, 1.05) * a * p).sum()
        else:
            want += -(p * a - 0.5 * 0.5 * (p - q) ** 2).sum()
    assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-4, abs=1e-4)

    s = served[0].create_session(lora=tt.LoraConfig(rank=4, alpha=32.0, seed=0))
    try:
        samples = [tt.Sample(model_input=full[:-1], loss_fn_inputs={"target_tokens": full[1:],
                                                                     "logprobs": q.astype(np.float32), "advantages": a})
                   for (full, a, _), q in zip(data, qs)]
        g = s.forward(samples, loss_fn, config or {}).result(60)
        assert out.metrics["loss:sum"] == pytest.approx(g.loss, rel=1e-6, abs=1e-6)
    finally:
        s.stop()


def test_gspo_with_per_token_clips_matches_tinker_math_and_grpc(served, service, tiny_model_dir, tokenizer):
    """loss_fn="gspo" with sequence_ratio_mask and per-token clip_low/high_threshold in loss_fn_inputs (the keys
    the tinker SDK types) over HTTP: the loss and each token's elementwise loss are Tinker's documented
    GSPO-token formula on plain-torch logprobs, the loss equals our gRPC path's, and one optimizer step each
    way gives the same gradient norm (same gradients)."""
    import together_train as tt

    data = _policy_batch(tokenizer)
    _, ps = _torch_reference(tiny_model_dir, [(full, np.ones(len(full) - 1, np.float32)) for full, _, _ in data])
    qs = [(p + noise).astype(np.float32) for p, (_, _, noise) in zip(ps, data)]
    rng = np.random.default_rng(4)
    inputs = []
    for (full, a, _), q in zip(data, qs):
        n = len(full) - 1
        srm = np.ones(n, np.float32)
        srm[:2] = 0.0  # the "prompt" positions stay out of the sequence ratio
        inputs.append({"target_tokens": full[1:], "logprobs": q, "advantages": a, "sequence_ratio_mask": srm,
                       "clip_low_threshold": rng.choice([0.9, 0.95, 0.99], n).astype(np.float32),
                       "clip_high_threshold": rng.choice([1.01, 1.05, 1.1], n).astype(np.float32)})
    config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}  # overridden at every position

    def tinker_gspo(lo_hi_from_inputs: bool) -> list[np.ndarray]:
        out = []
        for p, inp in zip(ps, inputs):
            s = np.exp((p - inp["logprobs"])[inp["sequence_ratio_mask"] != 0].mean())
            lo, hi = (inp["clip_low_threshold"], inp["clip_high_threshold"]) if lo_hi_from_inputs else (0.8, 1.2)
            out.append(-np.minimum(s * inp["advantages"], np.clip(s, lo, hi) * inp["advantages"]))
        return out

    want = tinker_gspo(True)
    assert abs(sum(w.sum() for w in want) - sum(w.sum() for w in tinker_gspo(False))) > 1e-2  # the bounds matter

    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=0).result()
    datums = [T.Datum(model_input=T.ModelInput.from_ints(full[:-1].tolist()), loss_fn_inputs=inp)
              for (full, _, _), inp in zip(data, inputs)]
    out = tc.forward_backward(datums, "gspo", loss_fn_config=config).result()
    assert out.metrics["loss:sum"] == pytest.approx(sum(float(w.sum()) for w in want), rel=1e-4, abs=1e-4)
    for o, w in zip(out.loss_fn_outputs, want):
        np.testing.assert_allclose(o["elementwise_loss"].to_numpy(), w, rtol=1e-4, atol=1e-5)

    s = served[0].create_session(lora=tt.LoraConfig(rank=4, alpha=32.0, seed=0,
                                                     target_modules=("q_proj", "k_proj", "v_proj", "o_proj",
                                                                     "gate_proj", "up_proj", "down_proj"),
                                                     train_unembed=True))
    try:
        samples = [tt.Sample(model_input=full[:-1], loss_fn_inputs=inp) for (full, _, _), inp in zip(data, inputs)]
        g = s.forward_backward(samples, "gspo", config).result(60)
        assert out.metrics["loss:sum"] == pytest.approx(g.loss, rel=1e-6, abs=1e-6)
        adam = dict(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0)
        o_http = tc.optim_step(T.AdamParams(**adam)).result()
        o_grpc = s.optim_step(tt.AdamParams(**adam)).result(60)
        assert o_grpc.grad_norm > 0
        assert o_http.metrics["grad_norm:mean"] == pytest.approx(o_grpc.grad_norm, rel=1e-5)
    finally:
        s.stop()


def test_forward_backward_custom_equals_cross_entropy(service, tiny_model_dir, tokenizer):
    """forward_backward_custom with loss -sum(w * logprobs): same loss and same gradient (grad norm of the
    next optim_step) as the built-in cross_entropy."""
    import torch

    batch = _batch(tokenizer, seed=13)

    def ce(data, logprobs_list):
        loss = sum(-(lp * torch.tensor(d.loss_fn_inputs["weights"].data)).sum() for d, lp in zip(data, logprobs_list))
        return loss, {"custom:sum": float(loss)}

    a = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=0).result()
    b = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=0).result()
    out_a = a.forward_backward_custom(_datums(batch), ce).result()
    out_b = b.forward_backward(_datums(batch), "cross_entropy").result()
    assert out_a.metrics["loss:sum"] == pytest.approx(out_b.metrics["loss:sum"], rel=1e-5)
    ga = a.optim_step(T.AdamParams(**ADAM)).result().metrics["grad_norm:mean"]
    gb = b.optim_step(T.AdamParams(**ADAM)).result().metrics["grad_norm:mean"]
    assert ga == pytest.approx(gb, rel=1e-4) and gb > 0


def test_rest_client_listings(served, service, tiny_model_dir, tokenizer):
    """RestClient: a run's checkpoints (training + sampler, as tinker:// paths), weights_info, the run in
    list_training_runs, delete; the same checkpoints in our gRPC list_checkpoints."""
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=5).result()
    _train_step(tc, _batch(tokenizer))
    state = tc.save_state("r1").result().path
    sampler = tc.save_weights_for_sampler("r1s").result().path
    rest = service.create_rest_client()
    listed = {c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert {state, sampler} <= set(listed)
    assert listed[state].checkpoint_type == "training" and listed[sampler].checkpoint_type == "sampler"
    run_id = state.split("/")[2]
    assert rest.get_training_run_by_tinker_path(state).result().training_run_id == run_id
    assert run_id in {r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs}
    info = rest.get_weights_info_by_tinker_path(sampler).result()
    assert info.lora_rank == 4 and info.train_attn and info.train_mlp and info.train_unembed
    ours = {c.uri for c in served[0].list_checkpoints(run_id)}
    assert {f"together-train://{run_id}/state/r1", f"together-train://{run_id}/weights/r1s"} <= ours
    rest.delete_checkpoint_from_tinker_path(sampler).result()
    assert sampler not in {c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints}


def test_rest_client_pages_runs_and_checkpoints_newest_first(service, tiny_model_dir, tokenizer):
    """list_training_runs / list_user_checkpoints page by offset over the model registry, newest first
    (more than one page), and a run shows the user_metadata it was created with."""
    runs = [service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=i,
                                                user_metadata={"run": str(i)}).result() for i in range(3)]
    ids = [tc.save_state(f"page{i}").result().path.split("/")[2] for i, tc in enumerate(runs)]  # tinker://<run>/...
    rest = service.create_rest_client()
    everything = rest.list_training_runs(limit=100).result()
    assert everything.cursor.total_count == len(everything.training_runs) >= 3
    order = [r.training_run_id for r in everything.training_runs]
    assert order[:3] == ids[::-1]  # newest first
    paged = [r.training_run_id for off in range(0, len(order), 2)
             for r in rest.list_training_runs(limit=2, offset=off).result().training_runs]
    assert paged == order
    assert {r.training_run_id: (r.user_metadata or {}).get("run") for r in everything.training_runs[:3]} == \
        {ids[i]: str(i) for i in range(3)}
    ckpts = rest.list_user_checkpoints(limit=100).result()
    names = [c.checkpoint_id for c in ckpts.checkpoints]
    assert names[:3] == ["weights/page2", "weights/page1", "weights/page0"]
    assert ckpts.cursor.total_count == len(names)
    assert [c.checkpoint_id for off in range(0, len(names), 2)
            for c in rest.list_user_checkpoints(limit=2, offset=off).result().checkpoints] == names


def test_seed_reproducibility(service, tiny_model_dir, tokenizer):
    """Same LoRA seed: identical losses after a step; another seed: different (A is random, B = 0)."""
    batch = _batch(tokenizer, seed=14)

    def after_step(seed):
        tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=seed).result()
        _train_step(tc, batch)
        return tc.forward(_datums(batch), "cross_entropy").result().metrics["loss:sum"]

    a, b, c = after_step(7), after_step(7), after_step(8)
    assert a == b and abs(a - c) > 1e-6


def test_out_of_order_seq_ids_run_in_order(served, service, tiny_model_dir, tokenizer):
    """optim_step (seq_id 2) sent before its forward_backward (seq_id 1) waits for it: a non-zero grad norm."""
    import httpx
    from tinker.proto.request_conv import forward_backward_request_to_proto

    url, headers = served[1] + "/api/v1", {"X-API-Key": "tml-" + KEY}
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=0).result()
    opt = httpx.post(url + "/optim_step", headers=headers,
                     json={"model_id": tc.model_id, "seq_id": 2, "adam_params": ADAM, "type": "optim_step"})
    assert opt.status_code == 200, opt.text
    fb = forward_backward_request_to_proto(T.ForwardBackwardRequest(
        forward_backward_input=T.ForwardBackwardInput(data=_datums(_batch(tokenizer)), loss_fn="cross_entropy"),
        model_id=tc.model_id, seq_id=1))
    r = httpx.post(url + "/forward_backward", content=fb.SerializeToString(),
                   headers={**headers, "Content-Type": "application/x-protobuf"})
    assert r.status_code == 200, r.text
    res = httpx.post(url + "/retrieve_future", json={"request_id": opt.json()["request_id"]}, headers=headers,
                     timeout=60).json()
    assert res["metrics"]["step:max"] == 1.0 and res["metrics"]["grad_norm:mean"] > 0


def test_finished_session_stops_its_models(served, tiny_model_dir, tokenizer):
    """ServiceClient.close() finishes the client session: its models are stopped (a later call is refused
    naming why) and its heartbeat answers 410."""
    import httpx

    sc = tinker.ServiceClient(base_url=served[1], api_key="tml-" + KEY)
    tc = sc.create_lora_training_client(base_model=str(tiny_model_dir), rank=4).result()
    session_id = tc.model_id.split(":")[0]
    ours = tc.save_state("before-stop").result().path.split("/")[2]
    sc.close("success").result()
    assert served[0].get_session(ours).state.lower() == "stopped"
    headers = {"X-API-Key": "tml-" + KEY}
    r = httpx.post(served[1] + "/api/v1/session_heartbeat", json={"session_id": session_id}, headers=headers)
    assert r.status_code == 410
    r = httpx.post(served[1] + "/api/v1/optim_step", headers=headers,
                   json={"model_id": tc.model_id, "seq_id": 2, "adam_params": ADAM})
    assert r.status_code == 400 and "stopped" in r.json()["detail"]


def test_inflight_sampling_client_follows_later_saves(service, tiny_model_dir, tokenizer):
    """kind="inflight": a client scores with the weights of the latest inflight save, also ones after it was made."""
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=6).result()
    batch = _batch(tokenizer, seed=15)
    _train_step(tc, batch)
    sc = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    (full, _), = _batch(tokenizer, n=1, seed=16)
    mi = T.ModelInput.from_ints(full.tolist())
    first = sc.compute_logprobs(mi).result()
    _train_step(tc, batch)
    assert sc.compute_logprobs(mi).result() == first  # no save yet: same weights
    tc.save_weights_and_get_sampling_client(kind="inflight").result()
    later = np.array(sc.compute_logprobs(mi).result()[1:])
    fwd = tc.forward([T.Datum(model_input=T.ModelInput.from_ints(full[:-1].tolist()),
                              loss_fn_inputs={"target_tokens": full[1:], "weights": np.ones(len(full) - 1, np.float32)})],
                     "cross_entropy").result()
    np.testing.assert_allclose(later, fwd.loss_fn_outputs[0]["logprobs"].to_numpy(), atol=2e-4)
    assert np.max(np.abs(later - np.array(first[1:]))) > 1e-3


def test_resubmitted_sample_is_one_request(served, tiny_model_dir):
    """asample re-sent with the same (sampling_session_id, seq_id) and body: the first future (same sequence
    ids); another body with that seq_id: 409."""
    import httpx

    url, headers = served[1] + "/api/v1", {"X-API-Key": "tml-" + KEY}
    sid = httpx.post(url + "/create_session", headers=headers,
                     json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"}).json()["session_id"]
    ss = httpx.post(url + "/create_sampling_session", headers=headers,
                    json={"session_id": sid, "sampling_session_seq_id": 0, "base_model": str(tiny_model_dir)}).json()
    body = {"sampling_session_id": ss["sampling_session_id"], "seq_id": 0, "num_samples": 2,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
            "sampling_params": {"max_tokens": 4, "seed": 1}}
    a = httpx.post(url + "/asample", json=body, headers=headers).json()
    b = httpx.post(url + "/asample", json=body, headers=headers).json()
    assert a == b and len(a["sample_sequence_ids"]) == 2
    r = httpx.post(url + "/asample", json=dict(body, num_samples=1), headers=headers)
    assert r.status_code == 409
    r = httpx.post(url + "/asample", json=dict(body, seq_id=1, sampling_params={"max_tokens": 0}), headers=headers)
    assert r.status_code == 400 and r.json()["key"] == "max_tokens"
