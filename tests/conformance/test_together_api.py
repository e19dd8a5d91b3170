"""The official together SDK (3.1.1, ``together.post_training``) against a real resource's HTTP port.

One real `together-train serve` process (tiny random Llama, one generator
replica, an API key) serves gRPC and the Together RL REST API at once; the
SDK talks to it as it talks to Together, with only ``base_url`` and the key
changed. Numbers are checked against our gRPC path on the same batch and
against plain torch / peft / transformers.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

together = pytest.importorskip("together")
from together import Together  # noqa: E402
from together import post_training as pt  # noqa: E402

KEY = "k-together-test"
MAX_SESSIONS = 5
ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    """(gRPC ResourceClient, HTTP base url, storage dir) of one resource with an API key."""
    import together_train as tt

    storage = tmp_path_factory.mktemp("together-storage")
    with tt.launch_local(
        model=str(tiny_model_dir),
        generators=1,
        storage_dir=storage,
        api_key=KEY,
        http_port=0,
        extra_args=["--max-sessions", str(MAX_SESSIONS), "--trainer-threads", "1", "--generator-threads", "1"],
    ) as client:
        yield client, client.http_url, storage


@pytest.fixture(scope="module")
def mr(served, tiny_model_dir):
    """The model resource, through ModelResourcesClient.create (READY at once: the server is one resource)."""
    handle = pt.ModelResourcesClient.create(api_key=KEY, base_url=served[1], base_model=str(tiny_model_dir),
                                            interval=0.1)
    yield handle
    handle.detach()


@pytest.fixture()
def sess(mr):
    """A fresh Together session (rank 4, alpha 32, seed 0), stopped after the test."""
    s = mr.create_session(lora_config={"rank": 4, "alpha": 32, "seed": 0}, interval=0.1)
    yield s
    try:
        s.stop()
    except Exception:
        pass


def _grpc_session(client):
    import together_train as tt

    return client.create_session(lora=tt.LoraConfig(rank=4, alpha=32.0, seed=0))


def _batch(vocab: int, n: int = 3, seed: int = 0, length: int = 9, grow: int = 3):
    """n (full sequence, weights) pairs of different lengths, the first two positions weighted 0."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        full = rng.integers(0, vocab, size=length + grow * i).astype(np.int64)
        w = np.ones(len(full) - 1, np.float32)
        w[:2] = 0.0
        out.append((full, w))
    return out


def _mi(tokens) -> dict:
    return {"chunks": [{"encoded_text": {"tokens": [int(t) for t in tokens]}}]}


def _samples(batch) -> list[dict]:
    return [{"model_input": _mi(full[:-1]),
             "loss_fn_inputs": {"target_tokens": {"data": full[1:].tolist(), "dtype": "int64"},
                                "weights": {"data": w.tolist(), "dtype": "float32"}}} for full, w in batch]


def _grpc_samples(batch):
    import together_train as tt

    return [tt.Sample(model_input=full[:-1], loss_fn_inputs={"target_tokens": full[1:], "weights": w})
            for full, w in batch]


CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}


def _torch_logprobs(model, batch) -> list[np.ndarray]:
    import torch

    out = []
    with torch.no_grad():
        for full, _ in batch:
            logits = model(torch.tensor(full[:-1])[None]).logits[0].double()
            out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(full[1:])[:, None])[:, 0].numpy())
    return out


# ----- model resource and sessions ------------------------------------------------------------------
def test_model_resource_and_session_lifecycle(served, mr, tiny_model_dir):
    """create returns this server's READY resource; another base model is a 400 naming ours; sessions are
    RUNNING at once, listed, renamed, stopped; stop without force is refused while a session is active."""
    client = Together(api_key=KEY, base_url=served[1], max_retries=0)
    r = mr.retrieve()
    assert r.status == "MODEL_RESOURCES_STATUS_READY" and r.compute_config.num_generator_replicas == 1
    assert r.base_model == str(tiny_model_dir) and r.status_details is not None and r.lora_enabled
    again = pt.ModelResourcesClient.create(api_key=KEY, base_url=served[1], base_model=str(tiny_model_dir))
    assert again.model_resources_id == mr.model_resources_id
    again.detach()
    with pytest.raises(together.BadRequestError) as e:
        client.post_training.model_resources.create(base_model="meta-llama/Llama-3-8B")
    assert str(tiny_model_dir) in str(e.value) and "base_model" in str(e.value)
    models = client.post_training.supported_models.get()
    assert [m.base_model for m in models.data] == [str(tiny_model_dir)]

    s = mr.create_session(display_name="first", lora_config={"rank": 4, "alpha": 32, "seed": 0}, interval=0.1)
    info = s.retrieve()
    assert info.status == "TRAINING_SESSION_STATUS_RUNNING" and info.display_name == "first"
    assert info.resources_id == mr.model_resources_id and int(info.step) == 0 and info.lora_config.rank == 4
    assert s.has_generator
    listed = client.post_training.sessions.list(model_resources_id=mr.model_resources_id)
    assert listed.data[0].id == s.session_id  # newest first
    renamed = client.post_training.sessions.update(s.session_id, display_name="renamed",
                                                   metadata={"wandb": {"project": "p"}})
    assert renamed.display_name == "renamed" and renamed.metadata.wandb.project == "p"
    with pytest.raises(together.BadRequestError) as e:
        client.post_training.model_resources.stop(mr.model_resources_id)
    assert s.session_id in str(e.value) and "force" in str(e.value)
    stopped = s.stop()
    assert stopped.status == "TRAINING_SESSION_STATUS_STOPPED"
    assert client.post_training.sessions.retrieve(s.session_id).status == "TRAINING_SESSION_STATUS_STOPPED"


def test_wrong_key_is_401(served):
    client = Together(api_key="nope", base_url=served[1], max_retries=0)
    with pytest.raises(together.AuthenticationError) as e:
        client.post_training.model_resources.list()
    assert e.value.status_code == 401 and "API key" in str(e.value)


# ----- training -----------------------------------------------------------------------------------
def test_sft_loop_matches_grpc_and_torch(served, sess, tiny_model_dir, tokenizer):
    """forward_backward + optim_step through the SDK == our gRPC SDK on the same batch == plain torch."""
    import torch
    from transformers import AutoModelForCausalLM

    client = served[0]
    batch = _batch(tokenizer.vocab_size)
    t0 = time.monotonic()
    out = sess.trainer.forward_backward(samples=_samples(batch), loss=CE, return_loss_fn_outputs=True)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ref = _torch_logprobs(base, batch)
    assert out.loss == pytest.approx(sum(float(-(w * lp).sum()) for (_, w), lp in zip(batch, ref)), rel=1e-5)
    for o, lp, (_, w) in zip(out.loss_fn_outputs, ref, batch):
        # Together's contract: positions the loss excludes (weight 0) read 0.
        np.testing.assert_allclose(o.tensors["logprobs"].data, np.where(w == 0, 0.0, lp), rtol=1e-4, atol=1e-5)
    step = sess.trainer.optim_step(adam_params=ADAM)
    assert int(step.step) == 1
    after = sess.trainer.forward(samples=_samples(batch), loss=CE)
    # A short operation finishes within the POST: no 0.5 s polls in the loop.
    assert time.monotonic() - t0 < 20

    g = _grpc_session(client)
    try:
        gb = g.forward_backward(_grpc_samples(batch), "cross_entropy").result(60)
        assert out.loss == pytest.approx(gb.loss, rel=1e-6)
        assert int(g.optim_step(__import__("together_train").AdamParams(**ADAM)).result(60).step) == 1
        g_after = g.forward(_grpc_samples(batch), "cross_entropy").result(60)
    finally:
        g.stop()
    assert after.loss < out.loss
    assert after.loss == pytest.approx(g_after.loss, rel=1e-5)
    assert int(sess.retrieve().step) == 1


def test_rl_step_samples_from_the_synced_version(sess, tokenizer):
    """sample (version 0) -> importance_sampling forward_backward -> optim_step -> weights_sync (version 1) ->
    sample names version 1 and its logprobs are the trained policy's (the trainer's forward agrees)."""
    prompt = [5, 17, 42, 7]
    params = {"max_tokens": 6, "temperature": 1.0, "seed": "3"}  # int64 fields may arrive as strings
    first = sess.generator.sample(_mi(prompt), num_samples=2, sampling_params=params)
    assert [(p.start_token, p.version) for p in first.policy_segments] == [(0, 0)]
    assert len(first.sequences) == 2
    samples = []
    for k, q in enumerate(first.sequences):
        toks = [int(t) for t in q.tokens]
        full = prompt + toks
        n = len(full) - 1
        lps = [0.0] * (len(prompt) - 1) + list(q.logprobs)
        adv = [0.0] * (len(prompt) - 1) + [1.0 if k == 0 else -1.0] * len(toks)
        samples.append({"model_input": _mi(full[:-1]), "loss_fn_inputs": {
            "target_tokens": {"data": full[1:], "dtype": "int64"},
            "logprobs": {"data": lps[:n], "dtype": "float32"},
            "advantages": {"data": adv[:n], "dtype": "float32"}}})
    fb = sess.trainer.forward_backward(samples=samples, loss={"type": "LOSS_TYPE_IMPORTANCE_SAMPLING"})
    assert np.isfinite(fb.loss)
    assert int(sess.trainer.optim_step(adam_params={"learning_rate": 5e-2}).step) == 1
    synced = sess.trainer.weights_sync()
    assert int(synced.weights_version) == 1
    second = sess.generator.sample(_mi(prompt), num_samples=1, sampling_params={"max_tokens": 6, "temperature": 1.0,
                                                                                 "seed": 4})
    assert [(p.start_token, p.version) for p in second.policy_segments] == [(0, 1)]
    q = second.sequences[0]
    full = prompt + [int(t) for t in q.tokens]
    n = len(full) - 1
    scored = sess.trainer.forward(samples=[{"model_input": _mi(full[:-1]), "loss_fn_inputs": {
        "target_tokens": {"data": full[1:], "dtype": "int64"},
        "weights": {"data": [1.0] * n, "dtype": "float32"}}}], loss=CE)
    trained = scored.loss_fn_outputs[0].tensors["logprobs"].data[len(prompt) - 1:]
    np.testing.assert_allclose(q.logprobs, trained, rtol=1e-3, atol=1e-4)


def test_operations_run_in_arrival_order(served, sess, tokenizer):
    """forward_backward, optim_step, weights_sync and sample POSTed back to back without waiting (no seq_id on
    the wire): they run in arrival order, so the sample is served by the version the sync published."""
    client = Together(api_key=KEY, base_url=served[1], max_retries=0)
    ops = client.post_training.operations
    sid = sess.session_id
    from concurrent.futures import ThreadPoolExecutor

    batch = _batch(tokenizer.vocab_size, n=6, seed=7, length=150)
    posts = [
        lambda: ops.forward_backward(sid, idempotency_key="order-fb", loss=CE, samples=_samples(batch)),
        lambda: ops.optim_step(sid, idempotency_key="order-opt", adam_params=ADAM),
        lambda: ops.weights_sync(sid, idempotency_key="order-sync", weight_sync_type="WEIGHT_SYNC_TYPE_SYNCHRONOUS"),
        lambda: ops.sample(sid, idempotency_key="order-sample", model_inputs=[_mi([5, 17, 42])], num_samples=1,
                           sampling_params={"max_tokens": 4, "temperature": 0.0}),
    ]
    # Sent 50 ms apart from threads, so each arrives while the ones before it are still queued or running
    # (the server holds a POST up to 2 s for its result).
    with ThreadPoolExecutor(4) as pool:
        futures = []
        for post in posts:
            futures.append(pool.submit(post))
            time.sleep(0.05)
        fb, opt, sync, smp = (f.result() for f in futures)
    deadline = time.monotonic() + 120
    while smp.status not in ("TRAINING_OPERATION_STATUS_COMPLETED", "TRAINING_OPERATION_STATUS_FAILED"):
        assert time.monotonic() < deadline
        smp = ops.retrieve_sample(smp.id, session_id=sid)
    assert smp.status == "TRAINING_OPERATION_STATUS_COMPLETED", smp.error
    assert [(p.start_token, p.version) for p in smp.output.results[0].policy_segments] == [(0, 1)]
    assert ops.retrieve_forward_backward(fb.id, session_id=sid).status == "TRAINING_OPERATION_STATUS_COMPLETED"
    assert int(ops.retrieve_optim_step(opt.id, session_id=sid).output.step) == 1
    assert int(ops.retrieve_weights_sync(sync.id, session_id=sid).output.weights_version) == 1


def test_training_checkpoint_resume_with_and_without_optimizer(mr, sess, tokenizer):
    """Resume with the optimizer continues exactly like the original session; without it the weights are the
    checkpoint's but AdamW starts fresh (the next step differs)."""
    batch = _batch(tokenizer.vocab_size, seed=1)
    sess.trainer.forward_backward(samples=_samples(batch), loss=CE)
    sess.trainer.optim_step(adam_params=ADAM)
    ckpt = sess.create_training_checkpoint()
    assert int(ckpt.step) == 1
    at_ckpt = sess.trainer.forward(samples=_samples(batch), loss=CE).loss
    sess.trainer.forward_backward(samples=_samples(batch), loss=CE)
    sess.trainer.optim_step(adam_params=ADAM)
    original = sess.trainer.forward(samples=_samples(batch), loss=CE).loss
    info = sess.retrieve()
    assert [c.id for c in info.training_checkpoints] == [ckpt.id]
    listed = Together(api_key=KEY, base_url=str(mr._client.base_url)).post_training.checkpoints.list(
        session_id=sess.session_id, type="CHECKPOINT_TYPE_TRAINING")
    assert [c.id for c in listed.data] == [ckpt.id] and listed.data[0].type == "CHECKPOINT_TYPE_TRAINING"

    for load_optimizer in (True, False):
        r = mr.create_session(resume_from_checkpoint_id=ckpt.id, load_optimizer=load_optimizer, interval=0.1)
        try:
            assert r.retrieve().resume_from_checkpoint_id == ckpt.id
            assert r.trainer.forward(samples=_samples(batch), loss=CE).loss == pytest.approx(at_ckpt, rel=1e-6)
            r.trainer.forward_backward(samples=_samples(batch), loss=CE)
            r.trainer.optim_step(adam_params=ADAM)
            resumed = r.trainer.forward(samples=_samples(batch), loss=CE).loss
        finally:
            r.stop()
        if load_optimizer:
            assert resumed == pytest.approx(original, rel=1e-6)
        else:
            assert abs(resumed - original) > 1e-4 * abs(original)


def test_inference_checkpoint_downloads_and_loads(served, sess, tiny_model_dir, tokenizer, tmp_path):
    """An inference checkpoint downloads (adapter and merged) from signed URLs without the Authorization header;
    peft loads the adapter and transformers the merged model, both reproducing the trainer's logprobs. The URL
    serves only that checkpoint's files and only with its signature."""
    import httpx
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    batch = _batch(tokenizer.vocab_size, seed=2)
    sess.trainer.forward_backward(samples=_samples(batch), loss=CE)
    sess.trainer.optim_step(adam_params=ADAM)
    ck = sess.create_inference_checkpoint()
    assert int(ck.step) == 1
    trained = sess.trainer.forward(samples=_samples(batch), loss=CE, return_loss_fn_outputs=True)
    client = Together(api_key=KEY, base_url=served[1])
    listed = client.post_training.checkpoints.list(session_id=sess.session_id)
    assert [(c.id, c.type) for c in listed.data] == [(ck.id, "CHECKPOINT_TYPE_INFERENCE")]  # merged twin hidden
    assert client.post_training.checkpoints.retrieve(ck.id).lora_rank == 4

    adapter = pt.download_checkpoint(client, ck.id, variant="CHECKPOINT_VARIANT_ADAPTER", output_dir=tmp_path / "a")
    assert {p.name for p in adapter} >= {"adapter_config.json", "adapter_model.safetensors"}
    merged = pt.download_checkpoint(client, ck.id, output_dir=tmp_path / "m")  # default: MERGED
    assert "config.json" in {p.name for p in merged}

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with_adapter = PeftModel.from_pretrained(base, tmp_path / "a").eval()
    full_model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    for model in (with_adapter, full_model):
        for o, lp, (_, w) in zip(trained.loss_fn_outputs, _torch_logprobs(model, batch), batch):
            np.testing.assert_allclose(o.tensors["logprobs"].data, np.where(w == 0, 0.0, lp), rtol=1e-4, atol=1e-4)

    files = client.post_training.checkpoints.download(id=ck.id, variant="CHECKPOINT_VARIANT_ADAPTER").data
    url = files[0].url
    assert httpx.get(url).status_code == 200  # no Authorization header: the URL's own credential
    assert httpx.get(url.replace("sig=", "sig=0")).status_code == 403
    other = url.replace(f"/{files[0].filename}?", "/..%2F..%2F..%2Fmanifest.json?")
    assert httpx.get(other).status_code in (403, 404)
    training = sess.create_training_checkpoint()
    with pytest.raises(together.BadRequestError) as e:
        client.post_training.checkpoints.download(id=training.id, variant="CHECKPOINT_VARIANT_MERGED")
    assert "only inference checkpoints download" in str(e.value)


def test_idempotent_retry_returns_the_original_operation(served, sess, tokenizer):
    """The same Idempotency-Key twice: one operation id, applied once (the step is 1, not 2)."""
    client = Together(api_key=KEY, base_url=served[1], max_retries=0)
    ops = client.post_training.operations
    batch = _batch(tokenizer.vocab_size, seed=3)
    sess.trainer.forward_backward(samples=_samples(batch), loss=CE)
    first = ops.optim_step(sess.session_id, idempotency_key="retry-1", adam_params=ADAM)
    second = ops.optim_step(sess.session_id, idempotency_key="retry-1", adam_params=ADAM)
    assert first.id == second.id
    done = ops.retrieve_optim_step(first.id, session_id=sess.session_id)
    assert done.status == "TRAINING_OPERATION_STATUS_COMPLETED" and int(done.output.step) == 1
    third = ops.optim_step(sess.session_id, idempotency_key="retry-1", adam_params=ADAM)
    assert third.id == first.id and third.status == "TRAINING_OPERATION_STATUS_COMPLETED"
    assert third.output is not None and int(third.output.step) == 1
    cfb = ops.custom_forward_backward(sess.session_id, idempotency_key="cfb-1", samples=[
        {"model_input": _mi([1, 2, 3]), "loss_fn_inputs": {"target_tokens": {"data": [2, 3, 4], "dtype": "int64"}}}],
        gradients=[{"data": [0.1, 0.2, 0.3], "dtype": "float32"}])
    cfb = ops.retrieve_custom_forward_backward(cfb.id, session_id=sess.session_id)
    assert cfb.status == "TRAINING_OPERATION_STATUS_COMPLETED" and cfb.output is not None
    assert int(sess.retrieve().step) == 1


def test_large_payload_goes_through_the_upload_url(served, sess, tokenizer):
    """A >0.5 MiB forward body is PUT to the signed upload URL (stored under <storage>/.payloads) and the
    operation runs on the full uploaded body: its loss is the sum of the gRPC losses of its samples.

    Three distinct importance-sampling samples (four tensors per token, random floats whose JSON is long)
    repeated 28 times each: few tokens per byte, and the reference costs three samples' forward."""
    import json

    import together_train as tt

    rng = np.random.default_rng(4)
    distinct = []
    for full, _ in _batch(tokenizer.vocab_size, n=3, seed=4, length=100, grow=0):
        n = len(full) - 1
        distinct.append((full, {"logprobs": -rng.random(n).astype(np.float32) * 5,
                                "advantages": rng.standard_normal(n).astype(np.float32),
                                "weights": rng.random(n).astype(np.float32)}))

    def body(items):
        return [{"model_input": _mi(full[:-1]), "loss_fn_inputs": {
            "target_tokens": {"data": full[1:].tolist(), "dtype": "int64"},
            **{k: {"data": v.tolist(), "dtype": "float32"} for k, v in inp.items()}}} for full, inp in items]

    batch = distinct * 28
    assert len(json.dumps(body(batch))) > 540_000  # over the SDK's 0.5 MiB threshold
    out = sess.trainer.forward(samples=body(batch), loss={"type": "LOSS_TYPE_IMPORTANCE_SAMPLING"})
    # Uploaded there, and removed once its operation was queued.
    assert (served[2] / ".payloads").is_dir() and not list((served[2] / ".payloads").iterdir())
    g = _grpc_session(served[0])
    try:
        ref = g.forward([tt.Sample(model_input=full[:-1], loss_fn_inputs={"target_tokens": full[1:], **inp})
                         for full, inp in distinct], "importance_sampling").result(120)
    finally:
        g.stop()
    # The inline body the SDK also sends is truncated to 8 tokens per sample: a loss over the full
    # sequences shows the uploaded body was used.
    assert out.loss == pytest.approx(28 * ref.loss, rel=1e-5)


def test_bad_input_is_a_400_naming_sample_and_key_and_changes_nothing(served, sess, tokenizer):
    """weights one short in sample 1: BadRequestError whose text names sample 1 and 'weights'; the gradients
    of the good batch before it are untouched (the next step equals the gRPC session's)."""
    batch = _batch(tokenizer.vocab_size, seed=5)
    sess.trainer.forward_backward(samples=_samples(batch), loss=CE)
    bad = _samples(batch)
    bad[1]["loss_fn_inputs"]["weights"]["data"] = bad[1]["loss_fn_inputs"]["weights"]["data"][:-1]
    with pytest.raises(together.BadRequestError) as e:
        sess.trainer.forward_backward(samples=bad, loss=CE)
    assert "sample 1" in str(e.value) and "'weights'" in str(e.value)
    assert e.value.status_code == 400
    sess.trainer.optim_step(adam_params=ADAM)
    after = sess.trainer.forward(samples=_samples(batch), loss=CE).loss
    g = _grpc_session(served[0])
    try:
        g.forward_backward(_grpc_samples(batch), "cross_entropy").result(60)
        g.optim_step(__import__("together_train").AdamParams(**ADAM)).result(60)
        ref = g.forward(_grpc_samples(batch), "cross_entropy").result(60).loss
    finally:
        g.stop()
    assert after == pytest.approx(ref, rel=1e-6)
    assert int(sess.retrieve().step) == 1


def test_non_finite_loss_fails_the_operation_with_its_code(sess, tokenizer):
    """Sampler logprobs of -1000 make r = exp(p - q) overflow: the operation FAILS with NON_FINITE_LOSS (the SDK's
    OperationFailedError, whose text carries the code); the session's step is unchanged."""
    from together.post_training._operations import OperationFailedError

    full, _ = _batch(tokenizer.vocab_size, n=1, seed=6)[0]
    n = len(full) - 1
    bad = [{"model_input": _mi(full[:-1]), "loss_fn_inputs": {
        "target_tokens": {"data": full[1:].tolist(), "dtype": "int64"},
        "logprobs": {"data": [-1000.0] * n, "dtype": "float32"},
        "advantages": {"data": [1.0] * n, "dtype": "float32"}}}]
    with pytest.raises(OperationFailedError) as e:
        sess.trainer.forward_backward(samples=bad, loss={"type": "LOSS_TYPE_IMPORTANCE_SAMPLING"})
    assert "TRAINING_OPERATION_ERROR_CODE_NON_FINITE_LOSS" in str(e.value)
    assert int(sess.retrieve().step) == 0


def test_stopped_session_refuses_operations(served, sess, tokenizer):
    """A stopped session (seen through a second handle): operations are a 400 SESSION_NOT_ACTIVE, not retried."""
    other = pt.SessionClient.attach(session_id=sess.session_id, api_key=KEY, base_url=served[1])
    sess.stop()
    with pytest.raises(together.BadRequestError) as e:
        other.trainer.forward_backward(samples=_samples(_batch(tokenizer.vocab_size)), loss=CE)
    assert "SESSION_NOT_ACTIVE" in str(e.value) and sess.session_id in str(e.value)
    assert other.retrieve().status == "TRAINING_SESSION_STATUS_STOPPED"
    other.detach()


def test_session_cap_is_429_not_retried(served, mr):
    """Past --max-sessions: HTTP 429 with x-should-retry: false, sent once (the SDK retries 429s otherwise)."""
    import httpx

    sent = []
    http = httpx.Client(event_hooks={"request": [lambda r: sent.append(r.url.path)]})
    client = Together(api_key=KEY, base_url=served[1], max_retries=7, http_client=http)
    made = []
    try:
        with pytest.raises(together.RateLimitError) as e:
            for _ in range(MAX_SESSIONS + 1):
                made.append(client.post_training.sessions.create(model_resources_id=mr.model_resources_id,
                                                                 lora_config={"rank": 2}).id)
        assert e.value.response.headers["x-should-retry"] == "false"
        assert "max_sessions" in str(e.value)
        assert sent.count("/v1/rl/training-sessions") == len(made) + 1
    finally:
        for sid in made:
            client.post_training.sessions.stop(sid)


def test_readme_loop_runs_unchanged(served, tiny_model_dir, tmp_path, monkeypatch):
    """The README's "Coming from Together" script, run as written (only the model path and the env vars
    set): it trains, samples, saves and downloads the merged model, then stops its session and the resource."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Coming from Together", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.setenv("TOGETHER_BASE_URL", served[1])
    monkeypatch.setenv("TOGETHER_API_KEY", KEY)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code.replace("/path/to/hf-model-dir", str(tiny_model_dir)), "README.md", "exec"), scope)
    assert len(scope["res"].sequences) == 2 and scope["out"].loss > 0
    assert (tmp_path / "merged" / "config.json").is_file()
    client = Together(api_key=KEY, base_url=served[1])
    assert client.post_training.model_resources.retrieve(scope["mr"].model_resources_id).status == \
        "MODEL_RESOURCES_STATUS_STOPPED"
    assert client.post_training.model_resources.create(base_model=str(tiny_model_dir)).status == \
        "MODEL_RESOURCES_STATUS_READY"


def test_names_metadata_and_paging_survive_a_restart(tiny_model_dir, tmp_path):
    """PATCHed display_name / metadata live in the model registry: after a restart on the same storage the
    session is still retrieved and listed with them (STOPPED). Sessions and checkpoints page newest first with
    the SDK's ``after`` cursor (the last id of the previous page), across more than one page."""
    import together_train as tt

    args = ["--trainer-threads", "1", "--generator-threads", "1"]

    def launch():
        return tt.launch_local(model=str(tiny_model_dir), generators=1, storage_dir=tmp_path, api_key=KEY,
                               http_port=0, extra_args=args)

    def pages(fn, limit):
        out, after = [], None
        while True:
            page = fn(limit=limit, **({"after": after} if after else {}))
            out.append([x.id for x in page.data])
            if not page.meta.has_more:
                assert not page.meta.next_cursor
                return out
            after = page.meta.next_cursor
            assert after == page.data[-1].id

    with launch() as c:
        client = Together(api_key=KEY, base_url=c.http_url, max_retries=0)
        mr = client.post_training.model_resources.create(base_model=str(tiny_model_dir))
        ids = [client.post_training.sessions.create(model_resources_id=mr.id, display_name=f"s{i}",
                                                    lora_config={"rank": 4, "alpha": 8, "seed": 0}).id
               for i in range(3)]
        client.post_training.sessions.update(ids[1], display_name="middle", metadata={"wandb": {"project": "p"}})
        client.post_training.sessions.update(ids[1], metadata={"wandb": {"entity": "e"}})
        sess = c.session(ids[0])  # our gRPC SDK on the same session
        for i in range(3):
            sess.save_state(f"st{i}").result(timeout=120)
        newest_first = pages(client.post_training.sessions.list, 2)
        assert newest_first == [ids[::-1][:2], ids[::-1][2:]]
        cp = pages(client.post_training.checkpoints.list, 2)
        assert [len(p) for p in cp] == [2, 1] and [x.split(".")[-1] for p in cp for x in p] == ["st2", "st1", "st0"]
    with launch() as c:
        client = Together(api_key=KEY, base_url=c.http_url, max_retries=0)
        got = client.post_training.sessions.retrieve(ids[1])
        assert got.display_name == "middle" and got.status == "TRAINING_SESSION_STATUS_STOPPED"
        assert got.metadata.wandb.project == "p" and got.metadata.wandb.entity == "e"
        listed = client.post_training.sessions.list(limit=100).data
        assert [x.id for x in listed] == ids[::-1] and [x.display_name for x in listed] == ["s2", "middle", "s0"]
        assert [x.id.split(".")[-1] for x in client.post_training.checkpoints.list().data] == ["st2", "st1", "st0"]
        assert [x.id for x in client.post_training.sessions.retrieve(ids[0]).training_checkpoints] == \
            [x.id for x in client.post_training.checkpoints.list().data][::-1]
        # renaming a session of an earlier run works too, and a new session lists first
        assert client.post_training.sessions.update(ids[0], display_name="old").display_name == "old"
        mr = client.post_training.model_resources.create(base_model=str(tiny_model_dir))
        new = client.post_training.sessions.create(model_resources_id=mr.id, lora_config={"rank": 4}).id
        assert pages(client.post_training.sessions.list, 3) == [[new, *ids[::-1][:2]], [ids[0]]]
        assert client.post_training.sessions.list(status=["TRAINING_SESSION_STATUS_RUNNING"]).data[0].id == new
        with pytest.raises(together.BadRequestError, match="after"):
            client.post_training.sessions.list(after="no-such-session")
