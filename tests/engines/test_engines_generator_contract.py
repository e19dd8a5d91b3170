"""The `GeneratorEngine` contract, once for both engines (torch; vLLM when installed).

What the replica servicer relies on whatever engine it drives: seeds (same
seed -> same tokens, streams differ, stream i independent of num_samples),
refused requests (ValueError / KeyError raised at submission), concurrent
callers getting what they would alone, adapter pushes checked before they
change anything, the per-token hook (``submit(..., on_token=)``) reporting
exactly the request's tokens before its future resolves, and cancellation.
Engine-specific numerics (against HF ``generate``, plain torch forwards, the
trainer) stay in test_engines_generator.py / test_vllm_engine.py.

The model is the tiny Llama with head_dim 32 (`_models.vllm_tiny_model`),
which both engines serve. The vLLM parameter skips when vllm is not
installed (on CPU: ``bash scripts/setup_vllm.sh``, then run this file with
``.venv-vllm/bin/python -m pytest``).
"""

from __future__ import annotations

import os
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

from together_train_server.engines.interfaces import GeneratorEngine
from together_train_server.engines.types import LoraConfig, SamplingParams

PROMPT = [1, 504, 3458, 314, 260, 3575, 282, 4649, 47, 2]
# Same seed, same request: sampled logprobs equal exactly (torch: same code path and shapes); vLLM's
# batched kernels vary in the last bits with what shares the step.
SAME_SEED_ATOL = {"torch": 0.0, "vllm": 1e-5}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from _models import vllm_tiny_model

    return vllm_tiny_model(tmp_path_factory.mktemp("contract") / "llama")


@pytest.fixture(scope="module", params=["torch", pytest.param("vllm", marks=pytest.mark.vllm)])
def engine(request, model_dir):
    """(name, engine) for each generator engine."""
    if request.param == "torch":
        from together_train_server.engines.torch_generator import TorchGeneratorEngine

        gen = TorchGeneratorEngine(model_dir)
    else:
        pytest.importorskip("vllm")
        from together_train_server.engines.vllm_generator import VllmGeneratorEngine

        gen = VllmGeneratorEngine(model_dir, dtype="float32", max_loras=2, max_lora_rank=8, max_num_seqs=16)
    yield request.param, gen
    gen.close()


@pytest.fixture()
def gen(engine):
    return engine[1]


def test_implements_the_protocol(gen):
    assert isinstance(gen, GeneratorEngine)


def same_stream(x: list[int], y: list[int]) -> bool:
    """The same stream's draws: equal, or equal up to a first difference between neighbouring token ids.

    A decode row computed in a batch of 1 and in a batch of 3 differs in its last float32 bits (the
    matmul's blocking depends on the batch). The torch engine draws by inverse CDF over the float32
    cumulative sum of the vocabulary in id order; on a random tiny model that distribution is nearly
    uniform (p ~ 1/V each), so boundaries lie ~2e-5 apart while the cumsum's rounding is ~1e-7 x sqrt(V):
    the same uniform can land one boundary over, giving the neighbouring id, and after it the contexts
    differ. A draw from another stream (the bug this checks) gives a neighbour with probability ~2/V.
    """
    k = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), None)
    return len(x) == len(y) and (k is None or abs(x[k] - y[k]) == 1)


def test_seed_reproducible_and_streams_differ(engine):
    name, gen = engine
    p = SamplingParams(max_tokens=12, temperature=1.0, seed=123, ignore_eos=True)
    a = gen.generate(PROMPT, p, num_samples=3)
    b = gen.generate(PROMPT, p, num_samples=3)
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    np.testing.assert_allclose([s.logprobs for s in a.sequences], [s.logprobs for s in b.sequences],
                               atol=SAME_SEED_ATOL[name], rtol=0)
    assert len({tuple(s.tokens) for s in a.sequences}) == 3
    c = gen.generate(PROMPT, SamplingParams(max_tokens=12, seed=124, ignore_eos=True), num_samples=3)
    assert [s.tokens for s in c.sequences] != [s.tokens for s in a.sequences]
    one = gen.generate(PROMPT, p, num_samples=1)   # stream i does not depend on num_samples
    x, y = one.sequences[0].tokens, a.sequences[0].tokens
    assert (same_stream(x, y) if name == "torch" else x == y), (x, y)
    r1 = gen.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True), 1)
    r2 = gen.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True), 1)
    assert r1.sequences[0].tokens != r2.sequences[0].tokens  # seed None: random


def test_bad_requests(gen):
    bad = [
        (ValueError, dict(prompt=PROMPT, params=SamplingParams(max_tokens=0))),
        (ValueError, dict(prompt=[], params=SamplingParams(max_tokens=1))),
        (ValueError, dict(prompt=[gen.vocab_size], params=SamplingParams(max_tokens=1))),
        (ValueError, dict(prompt=PROMPT, params=SamplingParams(max_tokens=1, top_p=0.0))),
        (ValueError, dict(prompt=PROMPT, params=SamplingParams(max_tokens=1, temperature=1e-9))),
        (ValueError, dict(prompt=PROMPT, params=SamplingParams(max_tokens=1, stop=("",)))),
        (ValueError, dict(prompt=PROMPT, params=SamplingParams(max_tokens=1), num_samples=0)),
        (KeyError, dict(prompt=PROMPT, params=SamplingParams(max_tokens=1), adapter="nope")),
    ]
    for err, kw in bad:
        with pytest.raises(err):
            gen.generate(**kw)
        with pytest.raises(err):  # submit refuses at submission, not through the future
            gen.submit(**kw)
    with pytest.raises(ValueError):
        gen.compute_logprobs([])
    with pytest.raises(KeyError):
        gen.compute_logprobs([PROMPT], "nope")
    assert gen.compute_logprobs([[5]])[0].shape == (0,)


def test_concurrent_callers_get_what_they_would_alone(gen):
    p = SamplingParams(max_tokens=10, seed=9, ignore_eos=True)
    expected = gen.generate(PROMPT, p, 2).sequences
    expected_lp = gen.compute_logprobs([PROMPT, PROMPT[:5]])
    results, scores, errors = [], [], []

    def work():
        try:
            results.append(gen.generate(PROMPT, p, 2).sequences)
            scores.append(gen.compute_logprobs([PROMPT, PROMPT[:5]]))
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for r in results:
        assert [s.tokens for s in r] == [s.tokens for s in expected]
    for s in scores:  # padded batch vs alone: float32 summation order only
        for a, b in zip(s, expected_lp):
            np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)


def test_load_adapter_rejects_bad_tensors_and_keeps_the_old_version(gen, model_dir):
    from together_train_server.engines.torch_trainer import TorchTrainerEngine

    trainer = TorchTrainerEngine(model_dir)
    spec = LoraConfig(rank=2, seed=2, target_modules=("q_proj",))
    trainer.create_adapter("r2", spec)
    t2 = trainer.adapter_tensors("r2")
    gen.load_adapter("k", spec, t2, version=7)
    lp = gen.compute_logprobs([PROMPT], "k")[0]
    bad_shape = {k: v[:1] if "lora_A" in k else v for k, v in t2.items()}
    missing = dict(list(t2.items())[1:])
    extra = {**t2, "base_model.model.nope.lora_A.weight": next(iter(t2.values()))}
    nan = {k: v * float("nan") for k, v in t2.items()}
    for bad, bad_spec in ((bad_shape, spec), (missing, spec), (extra, spec), (nan, spec), (t2, LoraConfig(rank=4))):
        with pytest.raises(ValueError):
            gen.load_adapter("k", bad_spec, bad, version=8)
    assert gen.adapter_version("k") == 7
    np.testing.assert_array_equal(gen.compute_logprobs([PROMPT], "k")[0], lp)
    out = gen.generate(PROMPT, SamplingParams(max_tokens=2, seed=0), 1, adapter="k")
    assert out.adapter_version == 7
    gen.drop_adapter("k")
    assert "k" not in gen.adapter_keys
    with pytest.raises(KeyError):
        gen.drop_adapter("k")
    with pytest.raises(KeyError):
        gen.adapter_version("k")


def test_on_token_reports_each_token_before_the_request_ends(gen):
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True)
    events: list[tuple[int, int, float, bool]] = []
    holder: dict = {}

    def on_token(stream: int, token: int, logprob: float) -> None:
        events.append((stream, token, logprob, holder["fut"].done()))

    holder["fut"] = fut = gen.submit(PROMPT, params, 3, on_token=on_token)
    out = fut.result(timeout=120)
    for s, seq in enumerate(out.sequences):
        mine = [(t, lp) for (st, t, lp, _) in events if st == s]
        assert [t for t, _ in mine] == list(seq.tokens), f"stream {s}"
        assert [lp for _, lp in mine] == list(seq.logprobs), f"stream {s}"
    # every token was reported while the request was still running (before its future resolved)
    assert len(events) == 3 * 24 and not any(done for *_, done in events)
    # the hook changes nothing: the same seed without it samples the same tokens
    plain = gen.generate(PROMPT, params, 3)
    assert [list(s.tokens) for s in plain.sequences] == [list(s.tokens) for s in out.sequences]


def test_a_failing_hook_does_not_fail_the_request(gen):
    calls = []

    def broken(stream: int, token: int, logprob: float) -> None:
        calls.append(token)
        raise RuntimeError("listener gone")

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = gen.submit(PROMPT, params, 1, on_token=broken).result(timeout=120)
    assert len(out.sequences[0].tokens) == 8 and len(calls) == 1  # called once, then dropped
    assert list(out.sequences[0].tokens) == list(gen.generate(PROMPT, params, 1).sequences[0].tokens)


def test_cancelled_request_is_dropped_and_the_engine_keeps_serving(gen):
    from concurrent.futures import CancelledError

    long = SamplingParams(max_tokens=200, temperature=1.0, seed=3, ignore_eos=True)
    started = threading.Event()
    fut = gen.submit(PROMPT, long, 2, on_token=lambda *_: started.set())
    started.wait(timeout=0.5)  # torch reports tokens as they come; vLLM only at the end
    assert fut.cancel()
    with pytest.raises(CancelledError):
        fut.result(timeout=1)
    p = SamplingParams(max_tokens=4, seed=1, ignore_eos=True)
    t0 = time.time()
    out = gen.generate(PROMPT, p, 1)
    assert len(out.sequences[0].tokens) == 4, f"after a cancel: {out} in {time.time() - t0:.1f} s"
