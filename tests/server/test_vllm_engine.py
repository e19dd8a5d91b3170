"""VllmGeneratorEngine: the sampling behaviours of test_engines_generator.py, on real vLLM.

The contract both engines share is tested once in test_engines_generator_contract.py.

Needs vLLM (skipped cleanly without it): on CPU, ``bash scripts/setup_vllm.sh``
then ``.venv-vllm/bin/python -m pytest -m vllm tests/server/test_vllm_engine.py``.

The tiny model is ``build_tiny_model``'s Llama (hidden 64, 2 layers, the
SmolLM2 tokenizer) re-initialised with 2 heads x head_dim 32 and 2 KV heads:
vLLM's CPU attention supports head sizes 32, 64, 80, ... but not the default
tiny model's 16.

Tolerances (fp32, CPU). vLLM's CPU kernels (fused qkv / gate_up GEMMs,
its own attention, punica-style LoRA) differ from the torch/peft path, and
its prompt-logprob and decode paths differ from each other:
* vLLM against itself (sampled logprobs vs compute_logprobs): ``ATOL_SELF``.
* vLLM against the torch trainer / torch generator: ``ATOL_TORCH``.
The gaps measured on this machine are printed (``-s``) as ``max |diff|``.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

import torch  # noqa: E402

from _models import random_samples  # noqa: E402
from together_train_server.engines.types import AdamParams, SamplingParams, LoraConfig  # noqa: E402

PROMPT = [1, 504, 3458, 314, 260, 3575, 282, 4649, 47, 2]
ATOL_SELF = 1e-4
ATOL_TORCH = 1e-4


def _gap(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from _models import vllm_tiny_model

    return vllm_tiny_model(tmp_path_factory.mktemp("vtiny") / "llama")


@pytest.fixture(scope="module")
def gen(model_dir):
    from together_train_server.engines.vllm_generator import VllmGeneratorEngine

    engine = VllmGeneratorEngine(model_dir, dtype="float32", max_loras=2, max_lora_rank=8, max_num_seqs=16)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def torch_gen(model_dir):
    from together_train_server.engines.torch_generator import TorchGeneratorEngine

    return TorchGeneratorEngine(model_dir)


def test_module_import_does_not_import_vllm():
    import subprocess
    import sys

    code = ("import sys, together_train_server.engines.vllm_generator as m; "
            "assert 'vllm' not in sys.modules; print(m.vllm_available())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


def test_greedy_equals_hf_generate(gen, torch_gen, hf_model):
    out = gen.generate(PROMPT, SamplingParams(max_tokens=25, temperature=0.0), num_samples=2)
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                                max_new_tokens=25, do_sample=False)[0, len(PROMPT):].tolist()
    for s in out.sequences:
        assert s.tokens == ref
        assert s.stop_reason == ("stop" if ref[-1] in gen.eos_token_ids else "length")
    # greedy logprobs are of the T=1 distribution (scored by the torch engine)
    lp = torch_gen.compute_logprobs([PROMPT + ref])[0][len(PROMPT) - 1:]
    print(f"\ngreedy logprobs vLLM vs torch scoring: max |diff| = {_gap(out.sequences[0].logprobs, lp):.2e}")
    np.testing.assert_allclose(out.sequences[0].logprobs, lp, atol=ATOL_TORCH)


def test_sampled_logprobs_equal_compute_logprobs_at_t1(gen, torch_gen):
    out = gen.generate(PROMPT, SamplingParams(max_tokens=20, seed=7, ignore_eos=True), num_samples=3)
    seqs = [PROMPT + s.tokens for s in out.sequences]
    scored = gen.compute_logprobs(seqs)
    ref = torch_gen.compute_logprobs(seqs)
    gaps_self, gaps_torch = [], []
    for s, lp, r in zip(out.sequences, scored, ref):
        assert len(s.logprobs) == len(s.tokens) == 20 and s.stop_reason == "length"
        assert lp.dtype == np.float32 and lp.shape == (len(PROMPT) + 19,)
        gaps_self.append(_gap(s.logprobs, lp[len(PROMPT) - 1:]))
        gaps_torch.append(_gap(lp, r))
        np.testing.assert_allclose(s.logprobs, lp[len(PROMPT) - 1:], atol=ATOL_SELF)
        np.testing.assert_allclose(lp, r, atol=ATOL_TORCH)
    print(f"\nsampled vs compute_logprobs (vLLM): max |diff| = {max(gaps_self):.2e}; "
          f"vLLM vs torch compute_logprobs: {max(gaps_torch):.2e}")


def test_tempered_logprobs(gen, hf_model):
    T = 0.7
    out = gen.generate(PROMPT, SamplingParams(max_tokens=8, temperature=T, seed=3, ignore_eos=True), 2)
    for s in out.sequences:
        with torch.no_grad():
            logits = hf_model(input_ids=torch.tensor([PROMPT + s.tokens])).logits[0].float()
        steps = logits[len(PROMPT) - 1: -1]
        ref = torch.log_softmax(steps / T, -1)[torch.arange(len(s.tokens)), torch.tensor(s.tokens)]
        np.testing.assert_allclose(s.logprobs, ref.numpy(), atol=ATOL_TORCH)


def test_top_k_top_p_truncation(gen, hf_model):
    # vLLM reports the logprob under the truncated, renormalised tempered
    # distribution (module doc of vllm_generator); the sampled tokens lie in the top k.
    T, K = 0.7, 5
    out = gen.generate(PROMPT, SamplingParams(max_tokens=8, temperature=T, top_k=K, top_p=0.9, seed=3,
                                         ignore_eos=True), 2)
    for s in out.sequences:
        with torch.no_grad():
            logits = hf_model(input_ids=torch.tensor([PROMPT + s.tokens])).logits[0].float()
        steps = logits[len(PROMPT) - 1: -1] / T
        top = torch.topk(steps, K, dim=-1)
        for i, t in enumerate(s.tokens):
            assert t in top.indices[i].tolist()
            full = float(torch.log_softmax(steps[i], -1)[t])
            assert s.logprobs[i] >= full - 1e-4      # renormalised over fewer tokens: never lower
            assert s.logprobs[i] <= 1e-6


def test_stop_token_ids_eos_max_tokens_and_context(gen):
    free = gen.generate(PROMPT, SamplingParams(max_tokens=15, temperature=0, ignore_eos=True), 1).sequences[0]
    assert free.stop_reason == "length" and len(free.tokens) == 15
    stop_tok = free.tokens[6]
    first = free.tokens.index(stop_tok)
    out = gen.generate(PROMPT, SamplingParams(max_tokens=15, temperature=0, ignore_eos=True,
                                         stop_token_ids=(stop_tok,)), 1).sequences[0]
    assert out.stop_reason == "stop" and out.tokens == free.tokens[: first + 1]
    assert len(out.logprobs) == len(out.tokens)
    saved = gen.eos_token_ids
    gen.eos_token_ids = (stop_tok,)
    try:
        eos = gen.generate(PROMPT, SamplingParams(max_tokens=15, temperature=0), 1).sequences[0]
        ign = gen.generate(PROMPT, SamplingParams(max_tokens=15, temperature=0, ignore_eos=True), 1).sequences[0]
    finally:
        gen.eos_token_ids = saved
    assert eos.stop_reason == "stop" and eos.tokens == free.tokens[: first + 1]
    assert ign.tokens == free.tokens
    long_prompt = (PROMPT * 30)[: gen.max_seq_len - 4]
    out = gen.generate(long_prompt, SamplingParams(max_tokens=50, ignore_eos=True, seed=0), 2)
    for s in out.sequences:
        assert len(s.tokens) == 4 and s.stop_reason == "length"
    with pytest.raises(ValueError):
        gen.generate(PROMPT * 30, SamplingParams(max_tokens=5), 1)


def test_stop_strings(gen):
    tok = gen.tokenizer
    free = gen.generate(PROMPT, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), 1).sequences[0]
    text6 = tok.decode(free.tokens[:6], skip_special_tokens=False)
    stop = text6[-3:]
    assert stop.strip()
    k = next(k for k in range(1, 21) if stop in tok.decode(free.tokens[:k], skip_special_tokens=False))
    out = gen.generate(PROMPT, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                         stop=("zzzz-never", stop)), 2)
    for s in out.sequences:
        assert s.stop_reason == "stop"
        assert s.tokens == free.tokens[:k]  # includes the token that completed the stop string
        assert len(s.logprobs) == k


def test_prompt_logprobs(gen, torch_gen):
    out = gen.generate(PROMPT, SamplingParams(max_tokens=1, seed=0), 2, prompt_logprobs=True,
                       top_k_prompt_logprobs=3)
    ref = gen.compute_logprobs([PROMPT])[0]
    assert len(out.prompt_logprobs) == len(PROMPT) - 1 and len(out.sequences) == 2
    np.testing.assert_allclose(out.prompt_logprobs, ref, atol=1e-5)
    np.testing.assert_allclose(out.prompt_logprobs, torch_gen.compute_logprobs([PROMPT])[0], atol=ATOL_TORCH)
    tref = torch_gen.generate(PROMPT, SamplingParams(max_tokens=1, seed=0), 1, top_k_prompt_logprobs=3)
    assert len(out.top_k_prompt_logprobs) == len(PROMPT) - 1
    for (ids, lps), actual, (_, rlps) in zip(out.top_k_prompt_logprobs, out.prompt_logprobs,
                                               tref.top_k_prompt_logprobs):
        assert len(ids) == len(lps) == 3
        assert lps == sorted(lps, reverse=True) and lps[0] >= actual - 1e-6
        np.testing.assert_allclose(lps, rlps, atol=ATOL_TORCH)
    none = gen.generate(PROMPT, SamplingParams(max_tokens=1, seed=0), 1)
    assert none.prompt_logprobs is None and none.top_k_prompt_logprobs is None


def test_adapter_from_trainer_parity_and_version_switch(gen, torch_gen, model_dir):
    from together_train_server.engines.torch_trainer import TorchTrainerEngine

    trainer = TorchTrainerEngine(model_dir)
    spec = LoraConfig(rank=4, alpha=8.0)
    trainer.create_adapter("s", spec)
    samples = random_samples([9, 14], trainer.vocab_size, seed=2)
    seqs = [list(s.model_input) + [int(s.inputs["target_tokens"][-1])] for s in samples]
    base_lp = gen.compute_logprobs([PROMPT])[0]

    # base model: vLLM vs trainer
    tr0 = trainer.forward("s", samples, "cross_entropy", return_logprobs=True).logprobs  # B=0: base
    base_gap = max(_gap(a, b) for a, b in zip(gen.compute_logprobs(seqs), tr0))
    ids, gaps = [], []
    for _ in range(3):
        trainer.forward("s", samples, "cross_entropy", backward=True)
        trainer.optim_step("s", AdamParams(learning_rate=0.05))
        gen.load_adapter("sess", spec, trainer.adapter_tensors("s"))
        ids.append(gen.lora_id("sess"))
        tr = trainer.forward("s", samples, "cross_entropy", return_logprobs=True).logprobs
        got = gen.compute_logprobs(seqs, "sess")
        gaps.append(max(_gap(a, b) for a, b in zip(got, tr)))
        for a, b in zip(got, tr):
            np.testing.assert_allclose(a, b, atol=ATOL_TORCH)
        # old versions are dropped from vLLM: only the current id of this key is loaded
        loaded = gen.loaded_lora_ids()
        assert ids[-1] in loaded and not (set(ids[:-1]) & loaded)
    print(f"\ntrainer parity, max |diff|: base {base_gap:.2e}; after steps 1..3 "
          + ", ".join(f"{g:.2e}" for g in gaps))
    assert base_gap <= ATOL_TORCH
    assert len(set(ids)) == 3 and ids == sorted(ids)   # a new adapter id per version

    # sampled logprobs under the adapter equal its compute_logprobs; torch engine agrees
    torch_gen.load_adapter("sess", spec, trainer.adapter_tensors("s"))
    out = gen.generate(PROMPT, SamplingParams(max_tokens=6, seed=1, ignore_eos=True), 2, adapter="sess")
    for s in out.sequences:
        lp = gen.compute_logprobs([PROMPT + s.tokens], "sess")[0]
        np.testing.assert_allclose(s.logprobs, lp[len(PROMPT) - 1:], atol=ATOL_SELF)
        np.testing.assert_allclose(lp, torch_gen.compute_logprobs([PROMPT + s.tokens], "sess")[0],
                                   atol=ATOL_TORCH)
    # prompt logprobs with LoRA enabled and several streams (the crash docs/design.md §9 names)
    out = gen.generate(PROMPT, SamplingParams(max_tokens=4, seed=1, ignore_eos=True), 3, adapter="sess",
                       prompt_logprobs=True, top_k_prompt_logprobs=2)
    np.testing.assert_allclose(out.prompt_logprobs, gen.compute_logprobs([PROMPT], "sess")[0], atol=1e-5)
    # base model unaffected by loaded adapters; the adapter changes the numbers
    np.testing.assert_allclose(gen.compute_logprobs([PROMPT])[0], base_lp, atol=1e-6)
    assert not np.allclose(gen.compute_logprobs([PROMPT], "sess")[0], base_lp, atol=1e-3)
    gen.drop_adapter("sess")
    torch_gen.drop_adapter("sess")
    assert ids[-1] not in gen.loaded_lora_ids()
    with pytest.raises(KeyError):
        gen.compute_logprobs([PROMPT], "sess")


def test_load_adapter_rejects_what_vllm_cannot_serve(gen, model_dir):
    from together_train_server.engines.torch_trainer import TorchTrainerEngine

    trainer = TorchTrainerEngine(model_dir)
    trainer.create_adapter("r2", LoraConfig(rank=2, seed=2, target_modules=("q_proj",)))
    t2 = trainer.adapter_tensors("r2")
    spec2 = LoraConfig(rank=2, target_modules=("q_proj",))
    gen.load_adapter("k", spec2, t2)
    lp = gen.compute_logprobs([PROMPT], "k")[0]
    # what vLLM cannot serve (the common refusals: test_engines_generator_contract.py)
    for bad, spec in ((t2, LoraConfig(rank=16)), (t2, LoraConfig(rank=2, train_unembed=True))):
        with pytest.raises(ValueError):
            gen.load_adapter("k", spec, bad)
    np.testing.assert_array_equal(gen.compute_logprobs([PROMPT], "k")[0], lp)
    gen.drop_adapter("k")
    assert "k" not in gen.adapter_keys


# ---------------------------------------------------------------------- end to end
def test_serve_engine_vllm_end_to_end(model_dir, tmp_path):
    """`together-train serve --engine vllm`: sampling, versions and trainer parity over gRPC."""
    import together_train as tt

    prompt = PROMPT[:6]
    timeout = 300

    def trainer_lp(session, tokens):
        sample = tt.Sample(model_input=tokens[:-1], loss_fn_inputs={
            "target_tokens": tokens[1:], "weights": np.zeros(len(tokens) - 1, np.float32)})
        return np.asarray(session.forward([sample], "cross_entropy", return_logprobs=True)
                          .result(timeout=timeout).logprobs[0])

    with tt.launch_local(model=str(model_dir), generators=1, storage_dir=tmp_path / "storage",
                         extra_args=["--engine", "vllm", "--trainer-threads", "1", "--generator-threads", "1"],
                         startup_timeout=600) as client:
        assert client.get_capabilities().generator_engine == "vllm"
        session = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
        p = tt.SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
        a = session.sample(prompt, p, num_samples=2).result(timeout=timeout)
        b = session.sample(prompt, p, num_samples=2).result(timeout=timeout)
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert a.sequences[0].tokens != a.sequences[1].tokens and a.policy_version == 0
        gaps = []
        for step in (1, 2):
            rng = np.random.default_rng(step)
            toks = rng.integers(0, 49152, size=17)
            session.forward_backward([tt.Sample(model_input=toks[:-1], loss_fn_inputs={
                "target_tokens": toks[1:], "weights": np.ones(16, np.float32)})], "cross_entropy")
            session.optim_step(tt.AdamParams(learning_rate=5e-2))
            assert session.weights_sync().result(timeout=timeout).policy_version == step
            res = session.sample(prompt, p, num_samples=2).result(timeout=timeout)
            assert res.policy_version == step
            seqs = [prompt + s.tokens for s in res.sequences]
            scored = session.compute_logprobs(seqs).result(timeout=timeout)
            assert scored.policy_version == step
            for s, lp, tokens in zip(res.sequences, scored.logprobs, seqs):
                tl = trainer_lp(session, tokens)
                gaps.append(_gap(lp, tl))
                np.testing.assert_allclose(lp, tl, atol=ATOL_TORCH)
                np.testing.assert_allclose(s.logprobs, lp[len(prompt) - 1:], atol=ATOL_SELF)
        print(f"\ne2e trainer vs vLLM replica: max |diff| = {max(gaps):.2e}")
        session.stop()
