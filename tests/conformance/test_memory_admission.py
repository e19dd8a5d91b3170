"""Memory admission and long samples through the real server (issue 21), on a tiny long-context model.

The resource runs with ``--memory-budget-mb 450`` and ``--micro-batch-tokens 16384``
on a tiny Llama with ``max_position_embeddings = 4096``. Its estimates
(engines/memory_estimate.py): a single 4,096-token sample about 390 MB (the
chunked head dominates on this model), four of them in one 16,384-position
micro-batch about 640 MB. So the whole context is accepted and the four-sample
request is refused before it runs. On the generator replica
(``scoring_estimate``): ``compute_logprobs`` of one 4,096-token sequence about
350 MB, of 4,096 + 100 tokens in one padded batch about 660 MB (the padding
mask is quadratic in the length); a 4,000-token prompt with prompt logprobs
about 360 MB for one stream, 540 MB for 64 streams of 16 new tokens.

Scheduling: one trainer worker runs the ready operations of every session in
arrival order (FIFO, one at a time, no preemption). A small session's
operation that arrives while a long one runs waits for it to finish, then
runs: its latency is at most the long operation's own time plus its own.
"""

from __future__ import annotations

import os
import statistics
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

import together_train as tt
from _models import build_tiny_model, random_samples
from together_train import errors

CONTEXT = 4096
KEY = "k-long-context"   # the tinker SDK sends "tml-" + KEY
BUDGET_MB = 450


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-long"), max_positions=CONTEXT)


@pytest.fixture(scope="module")
def client(long_model, tmp_path_factory):
    with tt.launch_local(
        model=str(long_model), generators=1, storage_dir=tmp_path_factory.mktemp("storage"),
        api_key=KEY, http_port=0, extra_args=["--memory-budget-mb", str(BUDGET_MB), "--micro-batch-tokens", "16384",
                    "--trainer-threads", "1", "--generator-threads", "1"],
    ) as c:
        yield c


def _sdk(samples):
    return [tt.Sample(model_input=s.model_input, loss_fn_inputs=dict(s.inputs)) for s in samples]


def _small():
    return _sdk(random_samples([12, 9], 49152, seed=4))


def test_over_budget_is_refused_naming_sample_and_budget_and_changes_nothing(client):
    ref = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
    s = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
    try:
        ref.forward_backward(_small(), "cross_entropy").result(timeout=300)
        want = ref.optim_step(tt.AdamParams(learning_rate=1e-3)).result(timeout=300).grad_norm
        s.forward_backward(_small(), "cross_entropy").result(timeout=300)
        big = _sdk(random_samples([100, CONTEXT, CONTEXT, CONTEXT, CONTEXT], 49152, seed=5))
        with pytest.raises(errors.ResourceExhaustedError) as info:
            s.forward_backward(big, "cross_entropy").result(timeout=300)
        err = info.value
        print(err)
        assert err.code == "RESOURCE_EXHAUSTED" and not err.retryable
        assert err.sample_index == 1
        assert f"sample 1 ({CONTEXT} tokens)" in str(err) and f"budget of {BUDGET_MB} MB" in str(err)
        # the refused request touched nothing: the session's next step is the reference's
        got = s.optim_step(tt.AdamParams(learning_rate=1e-3)).result(timeout=300)
        assert got.step == 1 and got.grad_norm == pytest.approx(want, rel=1e-6), (got.grad_norm, want)
        assert s.forward(_small(), "cross_entropy").result(timeout=300).loss > 0
    finally:
        s.stop()
        ref.stop()


def test_a_long_sample_beside_a_small_session_does_not_stall_it(client):
    """A small session training while another trains a long sample waits at most for that
    operation (FIFO worker), never longer."""
    small = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=1))
    long = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=2))
    try:
        lat: list[float] = []
        stop = threading.Event()

        def steady() -> None:
            while not stop.is_set():
                t = time.monotonic()
                small.forward_backward(_small(), "cross_entropy").result(timeout=300)
                lat.append(time.monotonic() - t)

        small.forward_backward(_small(), "cross_entropy").result(timeout=300)   # warm
        worker = threading.Thread(target=steady)
        worker.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        out = long.forward_backward(_sdk(random_samples([1024], 49152, seed=6)), "cross_entropy").result(timeout=600)
        long_s = time.monotonic() - t0
        time.sleep(0.5)
        stop.set()
        worker.join(timeout=300)
        assert np.isfinite(out.loss)
        med = statistics.median(lat)
        print(f"long op {long_s:.2f} s; small ops: {len(lat)}, median {med:.3f} s, max {max(lat):.2f} s")
        assert len(lat) >= 3
        assert max(lat) <= long_s + 3 * med + 1.0, (max(lat), long_s, med)
    finally:
        small.stop()
        long.stop()


def test_the_whole_context_is_accepted(client):
    """A sample of max_position_embeddings tokens is scored through the gRPC SDK (one more is refused)."""
    s = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=3))
    try:
        out = s.forward(_sdk(random_samples([CONTEXT], 49152, seed=8)), "cross_entropy",
                        return_logprobs=True).result(timeout=600)
        assert len(out.logprobs[0]) == CONTEXT and np.isfinite(out.logprobs[0]).all()
        with pytest.raises(errors.InvalidArgumentError) as info:
            s.forward(_sdk(random_samples([CONTEXT + 1], 49152, seed=8)), "cross_entropy",
                      validate=False).result(timeout=300)
        assert info.value.sample_index == 0 and "context length" in str(info.value)
    finally:
        s.stop()


def test_the_whole_context_is_accepted_through_tinker(client, long_model):
    tinker = pytest.importorskip("tinker")
    from tinker import types as T

    sc = tinker.ServiceClient(base_url=client.http_url, api_key="tml-" + KEY)
    try:
        tc = sc.create_lora_training_client(base_model=str(long_model), rank=4, seed=0).result()
        (s,) = random_samples([CONTEXT], 49152, seed=10)
        datum = T.Datum(model_input=T.ModelInput.from_ints(s.model_input.tolist()),
                        loss_fn_inputs={"target_tokens": s.inputs["target_tokens"], "weights": s.inputs["weights"]})
        out = tc.forward([datum], "cross_entropy").result()
        lp = out.loss_fn_outputs[0]["logprobs"].to_numpy()
        assert lp.shape == (CONTEXT,) and np.isfinite(lp).all()
    finally:
        sc.close("success").result()


def test_the_whole_context_is_accepted_through_together(client, long_model):
    """Together's post-training path (official together SDK): a sample of exactly max_position_embeddings
    tokens is scored, its logprobs equal the gRPC SDK's on the same sample (same engine and program, so
    float32 rounding of the serialisation only: rtol 1e-6); one token more is a 400 naming sample 0 and the
    context length, and the session still works after it."""
    together = pytest.importorskip("together")
    from together import post_training as pt

    def body(s):
        return [{"model_input": {"chunks": [{"encoded_text": {"tokens": s.model_input.tolist()}}]},
                 "loss_fn_inputs": {k: {"data": v.tolist(), "dtype": str(v.dtype)} for k, v in s.inputs.items()}}]

    ce = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
    mr = pt.ModelResourcesClient.create(api_key=KEY, base_url=client.http_url, base_model=str(long_model),
                                        interval=0.1)
    sess = mr.create_session(lora_config={"rank": 4, "alpha": 8, "seed": 0}, interval=0.1)
    g = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
    try:
        (s,) = random_samples([CONTEXT], 49152, seed=12, weights="ones")
        out = sess.trainer.forward(samples=body(s), loss=ce)
        lp = np.asarray(out.loss_fn_outputs[0].tensors["logprobs"].data, np.float64)
        ref = g.forward(_sdk([s]), "cross_entropy", return_logprobs=True).result(timeout=600)
        assert lp.shape == (CONTEXT,) and np.isfinite(lp).all()
        np.testing.assert_allclose(lp, ref.logprobs[0], rtol=1e-6, atol=1e-6)
        assert out.loss == pytest.approx(ref.loss, rel=1e-6)
        (over,) = random_samples([CONTEXT + 1], 49152, seed=12, weights="ones")
        with pytest.raises(together.BadRequestError) as info:
            sess.trainer.forward(samples=body(over), loss=ce)
        print(info.value)
        assert info.value.status_code == 400
        assert "sample 0" in str(info.value) and f"context length {CONTEXT}" in str(info.value)
        assert sess.trainer.forward(samples=body(s), loss=ce).loss == pytest.approx(out.loss, rel=1e-6)
    finally:
        g.stop()
        sess.stop()
        mr.detach()


def test_generator_scoring_over_budget_is_refused_naming_sample_and_budget(client):
    """compute_logprobs and prompt logprobs through the gRPC SDK: over the budget RESOURCE_EXHAUSTED naming the
    sample, its length and the budget, before a replica is asked; the same session's next call is served."""
    s = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=4))
    rng = np.random.default_rng(13)
    long_seq, short = rng.integers(0, 49152, CONTEXT), rng.integers(0, 49152, 100)
    try:
        with pytest.raises(errors.ResourceExhaustedError) as info:
            s.compute_logprobs([short, long_seq]).result(timeout=300)
        err = info.value
        print(err)
        assert err.code == "RESOURCE_EXHAUSTED" and not err.retryable and err.sample_index == 1
        assert f"sample 1 ({CONTEXT} tokens)" in str(err) and "compute_logprobs" in str(err)
        assert f"budget of {BUDGET_MB} MB" in str(err)
        out = s.compute_logprobs([long_seq]).result(timeout=600)
        assert out.logprobs[0].shape == (CONTEXT - 1,) and np.isfinite(out.logprobs[0]).all()

        prompt = long_seq[:4000]
        with pytest.raises(errors.ResourceExhaustedError) as info:
            s.sample(prompt, tt.SamplingParams(max_tokens=16, seed=0), num_samples=64,
                     prompt_logprobs=True).result(timeout=300)
        err = info.value
        print(err)
        assert err.sample_index == 0 and "sample 0 (4000 tokens)" in str(err) and "prompt logprobs" in str(err)
        assert "64 streams" in str(err) and f"budget of {BUDGET_MB} MB" in str(err)
        res = s.sample(prompt, tt.SamplingParams(max_tokens=1, seed=0), prompt_logprobs=True).result(timeout=600)
        # the prompt's logprobs are the scored sequence's first 3,999 (same replica, same base weights)
        np.testing.assert_allclose(res.prompt_logprobs, out.logprobs[0][:3999], rtol=1e-5, atol=2e-5)
    finally:
        s.stop()


def test_scoring_estimate_is_not_exceeded(long_model):
    """The generator's peak RSS above its RSS before a scoring call <= ``scoring_estimate`` (compute_logprobs of
    one and of padded sequences; prompt logprobs, top-k too, with several streams)."""
    check_scoring_peaks(long_model)


def check_scoring_peaks(long_model) -> None:
    """`test_scoring_estimate_is_not_exceeded`'s body (also run in a tcmalloc process)."""
    from together_train_server.engines.memory import set_mmap_threshold, trim_allocator
    from together_train_server.engines.memory_estimate import dims_of, scoring_estimate
    from together_train_server.engines.torch_generator import TorchGeneratorEngine
    from together_train_server.engines.types import SamplingParams

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    set_mmap_threshold()
    g = TorchGeneratorEngine(long_model, prefix_cache_mb=0)
    d = dims_of(g._base.config, g.dtype)
    rng = np.random.default_rng(2)
    g.compute_logprobs([rng.integers(0, 49152, 30).tolist()])
    try:
        for lens, n, k in (([1500], 0, 0), ([4096, 100, 100, 100], 0, 0), ([2000], 4, 0), ([2000], 2, 20)):
            seqs = [rng.integers(0, 49152, m).tolist() for m in lens]
            est = scoring_estimate(d, lens, num_samples=n, max_tokens=8 if n else 0)
            trim_allocator()
            before = status("VmRSS:")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")   # reset VmHWM (peak RSS) to the current RSS
            if n:
                g.generate(seqs[0], SamplingParams(max_tokens=8, seed=0), num_samples=n, prompt_logprobs=True,
                           top_k_prompt_logprobs=k)
            else:
                g.compute_logprobs(seqs)
            peak = status("VmHWM:") - before
            print(f"lens {lens} streams {n} top-k {k}: peak {peak >> 20} MB, estimate {est.bytes >> 20} MB")
            assert peak <= est.bytes, (lens, n, k, peak >> 20, est.bytes >> 20)
    finally:
        g.close()


def test_estimate_is_not_exceeded(long_model):
    """Peak RSS above the engine's RSS before the operation <= the estimate (forward and forward_backward;
    2,500 tokens: a checkpointed layer stack that keeps each attention output)."""
    check_trainer_peaks(long_model)


def check_trainer_peaks(long_model) -> None:
    """`test_estimate_is_not_exceeded`'s body (also run in a tcmalloc process)."""
    from together_train_server.engines.memory import set_mmap_threshold, trim_allocator
    from together_train_server.engines.torch_trainer import TorchTrainerEngine
    from together_train_server.engines.types import LoraConfig

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    set_mmap_threshold()
    eng = TorchTrainerEngine(long_model)
    eng.create_adapter("m", LoraConfig(rank=4, alpha=8.0, seed=0, train_unembed=True))
    eng.forward("m", random_samples([64], eng.vocab_size), "cross_entropy", backward=True)
    eng.zero_grad("m")
    for lens, backward in (([1500], True), ([1500], False), ([700, 650, 690], True), ([2500], True)):
        samples = random_samples(lens, eng.vocab_size, seed=1)
        est = eng.memory_estimate(lens, backward, "m")
        trim_allocator()
        before = status("VmRSS:")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")   # reset VmHWM (peak RSS) to the current RSS
        eng.forward("m", samples, "cross_entropy", backward=backward)
        peak = status("VmHWM:") - before
        eng.zero_grad("m")
        print(f"lens {lens} backward {backward}: peak {peak >> 20} MB, estimate {est.bytes >> 20} MB")
        assert peak <= est.bytes, (lens, backward, peak >> 20, est.bytes >> 20)


def test_estimates_hold_on_tcmalloc(long_model):
    """The same two peak checks in a process whose malloc is tcmalloc (what ``serve --allocator auto`` re-executes
    itself on when the library is installed): its free spans must not push a peak over the estimate."""
    import subprocess
    import sys
    from pathlib import Path

    from together_train_server.engines.allocator import tcmalloc_library

    lib = tcmalloc_library()
    if lib is None:
        pytest.skip("libtcmalloc_minimal is not installed (apt-get install libtcmalloc-minimal4)")
    here = Path(__file__).resolve().parent
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from together_train_server.engines.allocator import "
            "tcmalloc_active; assert tcmalloc_active(); import test_memory_admission as t; "
            "t.check_trainer_peaks(sys.argv[2]); t.check_scoring_peaks(sys.argv[2])")
    paths = [str(here), str(here.parent), os.environ.get("PYTHONPATH")]   # this tier and tests/ (_models)
    env = {**os.environ, "LD_PRELOAD": lib, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
    out = subprocess.run([sys.executable, "-c", code, str(here), str(long_model)], env=env, capture_output=True,
                         text=True, timeout=600)
    print(out.stdout)
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]


def test_openai_and_anthropic_requests_take_the_grpc_admission(client, long_model):
    """Chat and completions sample through the resource's one `Sampling` road (issue 40): an OpenAI
    ``/v1/completions`` request with echo + logprobs over the budget (official ``openai`` client) is refused
    with gRPC's RESOURCE_EXHAUSTED and the very same message as the same request through the gRPC SDK, before
    any replica is asked; an Anthropic Messages request (which cannot ask for prompt logprobs, so carries no
    scoring estimate on any road) of the same long prompt is admitted as the gRPC sample of its tokens is."""
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    from transformers import AutoTokenizer

    s = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=5))
    prompt = np.random.default_rng(17).integers(0, 49152, 4000)
    try:
        with pytest.raises(errors.ResourceExhaustedError) as info:
            s.sample(prompt, tt.SamplingParams(max_tokens=16, seed=0), num_samples=64,
                     prompt_logprobs=True).result(timeout=300)
        grpc_message = info.value.message
        oai = openai.OpenAI(base_url=client.http_url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        with pytest.raises(openai.RateLimitError) as oinfo:
            oai.completions.create(model=str(long_model), prompt=prompt.tolist(), max_tokens=16, n=64, echo=True,
                                   logprobs=0, seed=0)
        body = oinfo.value.body
        body = body.get("error", body) if isinstance(body, dict) else {}
        print(grpc_message, "\n", body)
        assert oinfo.value.status_code == 429 and body.get("code") == "resource_exhausted"
        assert body.get("message") == grpc_message, (body, grpc_message)

        tok = AutoTokenizer.from_pretrained(long_model)
        text = " ".join(["hello"] * 3950)
        rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]
        assert 3900 < len(rendered) < CONTEXT - 16, len(rendered)
        ant = anthropic.Anthropic(base_url=client.http_url, api_key=KEY, max_retries=0, timeout=300)
        m = ant.messages.create(model=str(long_model), max_tokens=4, messages=[{"role": "user", "content": text}])
        assert m.usage.input_tokens == len(rendered) and 1 <= m.usage.output_tokens <= 4
        res = s.sample(np.asarray(rendered), tt.SamplingParams(max_tokens=4, seed=0)).result(timeout=600)
        assert 1 <= len(res.sequences[0].tokens) <= 4
    finally:
        s.stop()
