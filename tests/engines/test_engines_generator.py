"""TorchGeneratorEngine: sampling semantics, stop conditions, logprobs, adapters.

What both engines must do (seeds, refused requests, concurrency, refused
pushes, on_token, cancel) is tested once for both in test_engines_generator_contract.py.

References are independent: HF ``model.generate`` for greedy decoding, a plain
transformers forward for tempered distributions, the trainer engine's logprobs
after ``load_adapter``. Tolerance for logprobs computed by different code
paths (KV-cache decode vs full forward, padded batch): 1e-4 absolute (fp32).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from _models import random_samples, tiny_model
from together_train_server.engines.types import AdamParams, SamplingParams, LoraConfig

PROMPT = [1, 504, 3458, 314, 260, 3575, 282, 4649, 47, 2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def gen(model_dir):
    from together_train_server.engines.torch_generator import TorchGeneratorEngine

    return TorchGeneratorEngine(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def test_greedy_equals_hf_generate(gen, hf_model):
    out = gen.generate(PROMPT, SamplingParams(max_tokens=25, temperature=0.0), num_samples=2)
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                                max_new_tokens=25, do_sample=False)[0, len(PROMPT):].tolist()
    for s in out.sequences:
        assert s.tokens == ref
        assert s.stop_reason == ("stop" if ref[-1] in gen.eos_token_ids else "length")
    # greedy logprobs are of the T=1 distribution
    lp = gen.compute_logprobs([PROMPT + ref])[0][len(PROMPT) - 1:]
    np.testing.assert_allclose(out.sequences[0].logprobs, lp, atol=1e-4)


def test_sampled_logprobs_equal_compute_logprobs_at_t1(gen):
    out = gen.generate(PROMPT, SamplingParams(max_tokens=20, seed=7, ignore_eos=True), num_samples=3)
    seqs = [PROMPT + s.tokens for s in out.sequences]
    scored = gen.compute_logprobs(seqs)
    for s, lp in zip(out.sequences, scored):
        assert len(s.logprobs) == len(s.tokens) == 20 and s.stop_reason == "length"
        np.testing.assert_allclose(s.logprobs, lp[len(PROMPT) - 1:], atol=1e-4)


def test_tempered_and_truncated_logprobs(gen, hf_model):
    T = 0.7
    out = gen.generate(PROMPT, SamplingParams(max_tokens=8, temperature=T, top_k=5, top_p=0.9, seed=3,
                                         ignore_eos=True), num_samples=2)
    for s in out.sequences:
        with torch.no_grad():
            logits = hf_model(input_ids=torch.tensor([PROMPT + s.tokens])).logits[0].float()
        steps = logits[len(PROMPT) - 1: -1]
        ref = torch.log_softmax(steps / T, -1)  # before top-k/top-p truncation
        idx = torch.tensor(s.tokens)
        np.testing.assert_allclose(s.logprobs, ref[torch.arange(len(idx)), idx].numpy(), atol=1e-4)
        top5 = torch.topk(steps, 5, dim=-1).indices
        assert all(int(t) in top5[i].tolist() for i, t in enumerate(idx))


def test_top_logprobs_are_untempered_and_unmasked(gen, hf_model):
    """``top_logprobs`` reports, per sampled token, log_softmax of the model's own logits (plain transformers
    forward) and its k most likely tokens: not the temperature, the filters nor the grammar mask that drew it;
    a request without it, batched beside (one decode step for both), reports none."""
    from together_train_server.engines.types import Constraint

    schema = Constraint("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}')
    asked = gen.submit(PROMPT, SamplingParams(max_tokens=6, temperature=0.7, top_k=20, seed=4, constraint=schema,
                                              top_logprobs=3), num_samples=2)
    plain = gen.submit(PROMPT, SamplingParams(max_tokens=6, temperature=0.7, seed=4))
    assert all(q.untempered_logprobs is None and q.top_logprobs is None for q in plain.result().sequences)
    for s in asked.result().sequences:
        with torch.no_grad():
            lsm = torch.log_softmax(hf_model(input_ids=torch.tensor([PROMPT + s.tokens])).logits[0].float(), -1)
        steps = lsm[len(PROMPT) - 1: -1]
        idx = torch.tensor(s.tokens)
        np.testing.assert_allclose(s.untempered_logprobs, steps[torch.arange(len(idx)), idx].numpy(), atol=1e-4)
        top = torch.topk(steps, 3, dim=-1)
        assert [ids for ids, _ in s.top_logprobs] == top.indices.tolist()
        np.testing.assert_allclose([v for _, v in s.top_logprobs], top.values.numpy(), atol=1e-4)
    assert gen.tokenizer.decode(s.tokens).startswith('{"a"'), gen.tokenizer.decode(s.tokens)  # the grammar drew it


def test_stop_token_ids_max_tokens_and_context(gen):
    free = gen.generate(PROMPT, SamplingParams(max_tokens=15, temperature=0, ignore_eos=True), 1).sequences[0]
    assert free.stop_reason == "length" and len(free.tokens) == 15
    stop_tok = free.tokens[6]
    first = free.tokens.index(stop_tok)
    out = gen.generate(PROMPT, SamplingParams(max_tokens=15, temperature=0, ignore_eos=True,
                                         stop_token_ids=(stop_tok,)), 1).sequences[0]
    assert out.stop_reason == "stop" and out.tokens == free.tokens[: first + 1]
    # EOS (from generation_config) stops too, unless ignore_eos
    saved = gen.eos_token_ids
    gen.eos_token_ids = (stop_tok,)
    try:
        eos = gen.generate(PROMPT, SamplingParams(max_tokens=15, temperature=0), 1).sequences[0]
        ign = gen.generate(PROMPT, SamplingParams(max_tokens=15, temperature=0, ignore_eos=True), 1).sequences[0]
    finally:
        gen.eos_token_ids = saved
    assert eos.stop_reason == "stop" and eos.tokens == free.tokens[: first + 1]
    assert ign.tokens == free.tokens
    # context limit: prompt + completion never exceeds max_seq_len
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


def test_prompt_logprobs(gen):
    out = gen.generate(PROMPT, SamplingParams(max_tokens=1, seed=0), 1, prompt_logprobs=True,
                       top_k_prompt_logprobs=3)
    ref = gen.compute_logprobs([PROMPT])[0]
    assert len(out.prompt_logprobs) == len(PROMPT) - 1
    np.testing.assert_allclose(out.prompt_logprobs, ref, atol=1e-5)
    assert len(out.top_k_prompt_logprobs) == len(PROMPT) - 1
    for (ids, lps), actual in zip(out.top_k_prompt_logprobs, out.prompt_logprobs):
        assert len(ids) == len(lps) == 3
        assert lps == sorted(lps, reverse=True) and lps[0] >= actual - 1e-6
    none = gen.generate(PROMPT, SamplingParams(max_tokens=1, seed=0), 1)
    assert none.prompt_logprobs is None and none.top_k_prompt_logprobs is None


@pytest.mark.parametrize("train_unembed", [False, True])
def test_adapter_from_trainer_matches_trainer_logprobs(gen, model_dir, train_unembed):
    from together_train_server.engines.torch_trainer import TorchTrainerEngine

    trainer = TorchTrainerEngine(model_dir)
    spec = LoraConfig(rank=4, alpha=8.0, train_unembed=train_unembed)
    trainer.create_adapter("s", spec)
    samples = random_samples([9, 14], trainer.vocab_size, seed=2)
    base_lp = gen.compute_logprobs([PROMPT])[0]

    key = f"sess{int(train_unembed)}"
    for _ in range(2):
        trainer.forward("s", samples, "cross_entropy", backward=True)
        trainer.optim_step("s", AdamParams(learning_rate=0.05))
        gen.load_adapter(key, spec, trainer.adapter_tensors("s"))  # second time: in place
        tr = trainer.forward("s", samples, "cross_entropy", return_logprobs=True).logprobs
        seqs = [list(s.model_input) + [int(s.inputs["target_tokens"][-1])] for s in samples]
        for a, b in zip(gen.compute_logprobs(seqs, key), tr):
            np.testing.assert_allclose(a, b, atol=1e-4)
    # sampled logprobs under the adapter equal its compute_logprobs
    out = gen.generate(PROMPT, SamplingParams(max_tokens=6, seed=1, ignore_eos=True), 2, adapter=key)
    for s in out.sequences:
        np.testing.assert_allclose(s.logprobs, gen.compute_logprobs([PROMPT + s.tokens], key)[0][len(PROMPT) - 1:],
                                   atol=1e-4)
    # base model unaffected by loaded adapters
    np.testing.assert_allclose(gen.compute_logprobs([PROMPT])[0], base_lp, atol=0)
    assert not np.allclose(gen.compute_logprobs([PROMPT], key)[0], base_lp, atol=1e-3)
    gen.drop_adapter(key)
    with pytest.raises(KeyError):
        gen.compute_logprobs([PROMPT], key)


def test_load_adapter_replaces_with_a_new_shape(gen, model_dir):
    from together_train_server.engines.torch_trainer import TorchTrainerEngine

    trainer = TorchTrainerEngine(model_dir)
    trainer.create_adapter("r4", LoraConfig(rank=4, seed=1))
    trainer.create_adapter("r2", LoraConfig(rank=2, seed=2, target_modules=("q_proj",)))
    samples = random_samples([7], trainer.vocab_size, seed=4)
    for a in ("r4", "r2"):
        trainer.forward(a, samples, "cross_entropy", backward=True)
        trainer.optim_step(a, AdamParams(learning_rate=0.05))
    t4, t2 = trainer.adapter_tensors("r4"), trainer.adapter_tensors("r2")
    gen.load_adapter("k", LoraConfig(rank=4, seed=1), t4)
    lp4 = gen.compute_logprobs([PROMPT], "k")[0]
    gen.load_adapter("k", LoraConfig(rank=2, target_modules=("q_proj",)), t2)  # new shape: replaced
    lp2 = gen.compute_logprobs([PROMPT], "k")[0]
    assert not np.allclose(lp4, lp2, atol=1e-4)
    # refused pushes: test_engines_generator_contract.py
    gen.drop_adapter("k")
    assert "k" not in gen.adapter_keys
