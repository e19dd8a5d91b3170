"""Training logprobs are never tempered; GetCapabilities lists exactly what the server accepts;
the cookbook's policy-sample builder and client-side loss helper (DPO via custom_forward_backward).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import together_train as tt
from together_train_cookbook import build_policy_sample
from together_train_cookbook.custom_loss import dpo_loss, forward_backward_custom, sequence_logprobs

VOCAB = 49152


def test_training_logprobs_are_untempered(resource, session, tiny_model_dir):
    """Sample at T=0.5 (sampler logprobs are tempered), then train on those tokens:
    the trainer's logprobs equal a plain torch log_softmax of the model at T=1, and
    differ from the tempered ones. Fails if the trainer divides logits by any temperature."""
    from transformers import AutoModelForCausalLM

    prompt = [1, 504, 3120, 28, 9, 77, 301]
    res = session.sample(prompt, tt.SamplingParams(max_tokens=12, temperature=0.5, seed=3)).result(timeout=120)
    seq = res.sequences[0]
    full = np.array(prompt + list(seq.tokens))
    n_new = len(seq.tokens)
    sample = build_policy_sample(full, np.concatenate([np.zeros(len(prompt)), seq.logprobs]), 1.0,
                                 mask=np.r_[np.zeros(len(prompt)), np.ones(n_new)])
    out = session.forward([sample], "importance_sampling", return_logprobs=True).result(timeout=120)
    p = out.logprobs[0].astype(np.float64)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.as_tensor(full[:-1])[None]).logits[0].double()
    tgt = torch.as_tensor(full[1:])
    plain = torch.log_softmax(logits, -1)[torch.arange(len(tgt)), tgt].numpy()
    tempered = torch.log_softmax(logits / 0.5, -1)[torch.arange(len(tgt)), tgt].numpy()

    np.testing.assert_allclose(p, plain, rtol=0, atol=1e-5)
    assert np.abs(p - tempered).max() > 1e-2
    # the sampler's logprobs are the tempered ones (so q != p is expected)
    np.testing.assert_allclose(np.asarray(seq.logprobs), tempered[-n_new:], rtol=0, atol=1e-4)
    # and the replica's untempered scoring agrees with the trainer
    cl = session.compute_logprobs([full.tolist()]).result(timeout=120).logprobs[0]
    np.testing.assert_allclose(cl, p, rtol=0, atol=1e-4)
    # ratio metric uses untempered p against the tempered q
    sel = np.r_[np.zeros(len(prompt) - 1), np.ones(n_new)] != 0
    assert out.metrics["ratio:mean"] == pytest.approx(np.exp(plain[sel] - np.asarray(seq.logprobs)).mean(), rel=1e-4)


def _value(p, text):
    if p.type == "float":
        return float(text)
    if p.type == "int":
        return int(float(text))
    return text


def test_capabilities_list_what_the_server_accepts(resource, session):
    from together_train_server.engines.loss_specs import LOSS_SPECS

    caps = resource.get_capabilities(refresh=True)
    assert "custom_forward_backward" in caps.operations
    assert set(caps.losses) == set(LOSS_SPECS)
    for name, spec in LOSS_SPECS.items():
        got = caps.losses[name]
        assert got.available == spec.available, name  # stable_reinforce: listed, refused with its reason
        assert [(i.name, i.dtype, i.required) for i in got.inputs] == [(i.name, i.dtype, i.required) for i in spec.inputs]
        assert [(p.name, p.type, p.required, tuple(p.choices)) for p in got.params] == [
            (p.name, p.type, p.required, tuple(p.choices)) for p in spec.params]
    # every listed input (optional ones too) and every parameter at its listed default is accepted
    rng = np.random.default_rng(0)
    n = 5
    # value ranges of the inputs that have one (absolute ratio bounds; a non-empty mask)
    ranges = {"clip_low_threshold": (0.5, 1.0), "clip_high_threshold": (1.0, 2.0), "sequence_ratio_mask": (0.5, 1.0)}
    for name, spec in caps.losses.items():
        toks = rng.integers(0, VOCAB, n + 1)
        if not spec.available:
            with pytest.raises(tt.errors.UnimplementedError, match=name):
                session.forward([tt.Sample(model_input=toks[:-1], loss_fn_inputs={"target_tokens": toks[1:]})],
                                name, {}).result(timeout=120)
            continue
        inputs = {}
        for i in spec.inputs:
            if i.name == "target_tokens":
                inputs[i.name] = toks[1:]
            else:
                inputs[i.name] = rng.uniform(*ranges.get(i.name, (-2, 0)), n).astype(np.float32)
        params = {p.name: _value(p, p.default) for p in spec.params if p.default not in ("", None)}
        if name == "dro":
            params["beta"] = 0.1
        if params.get("aggregation") == "token_mean":
            params.update(aggregation="fixed_horizon", horizon=8, beta=0.05)
        out = session.forward([tt.Sample(model_input=toks[:-1], loss_fn_inputs=inputs)], name, params).result(timeout=120)
        assert math.isfinite(out.loss), name


def test_loss_table_imports_no_torch():
    """Validation and capabilities read the loss table (engines/loss_specs.py) without importing torch."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from together_train_server.engines.loss_specs import LOSS_SPECS, complete_params\n"
            "import together_train_server.service.validation\n"
            "assert complete_params(LOSS_SPECS['ppo'], {})['clip_high_threshold'] == 1.2\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_build_policy_sample_shifts_and_validates():
    s = build_policy_sample([5, 6, 7, 8], [0.0, -1.0, -2.0, -3.0], [0, 1, 2, 3], mask=[0, 0, 1, 1],
                            reference_logprobs=[0, -1.5, -2.5, -3.5])
    assert s.model_input.tolist() == [5, 6, 7]
    li = s.loss_fn_inputs
    assert li["target_tokens"].tolist() == [6, 7, 8] and li["target_tokens"].dtype == np.int64
    assert li["logprobs"].tolist() == [-1, -2, -3] and li["logprobs"].dtype == np.float32
    assert li["advantages"].tolist() == [1, 2, 3] and li["mask"].tolist() == [0, 1, 1]
    assert li["reference_logprobs"].tolist() == [-1.5, -2.5, -3.5] and "weights" not in li
    assert build_policy_sample([5, 6, 7], [0, -1, -2], -0.5).loss_fn_inputs["advantages"].tolist() == [-0.5, -0.5]
    with pytest.raises(ValueError, match="3 values but tokens has 4"):
        build_policy_sample([5, 6, 7, 8], [0, -1, -2], 1.0)
    with pytest.raises(ValueError, match="NaN"):
        build_policy_sample([5, 6, 7], [0, -1, -2], [0, np.nan, 1])
    with pytest.raises(ValueError, match="at least 2 tokens"):
        build_policy_sample([5], [0], 1.0)


def test_dpo_through_custom_forward_backward(resource):
    s = resource.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=1))
    try:
        rng = np.random.default_rng(7)
        samples = []
        for _ in range(2):  # two pairs: chosen, rejected
            prompt = rng.integers(0, VOCAB, 5)
            for _ in range(2):
                comp = rng.integers(0, VOCAB, int(rng.integers(3, 7)))
                toks = np.r_[prompt, comp]
                w = np.r_[np.zeros(len(prompt)), np.ones(len(comp))]
                inputs = {"target_tokens": toks[1:], "weights": w[1:].astype(np.float32)}
                samples.append(tt.Sample(model_input=toks[:-1], loss_fn_inputs=inputs))
        ref = sequence_logprobs(s, samples, timeout=120)
        beta = 0.5
        fn = dpo_loss(ref[0::2], ref[1::2], beta=beta)
        first = forward_backward_custom(s, samples, fn, timeout=120)
        assert first.loss == pytest.approx(2 * math.log(2), rel=1e-5)  # policy == reference: z = 0
        # gradient: -beta*sigmoid(0)*w on chosen, +beta*sigmoid(0)*w on rejected
        for i, (g, smp) in enumerate(zip(first.gradients, samples)):
            np.testing.assert_allclose(g, (-1 if i % 2 == 0 else 1) * beta * 0.5 * smp.loss_fn_inputs["weights"], atol=1e-7)
        np.testing.assert_allclose(first.surrogate, sum(float(np.dot(g, lp)) for g, lp in zip(first.gradients, first.logprobs)),
                                   rtol=1e-5, atol=1e-5)
        s.optim_step(tt.AdamParams(learning_rate=2e-2)).result(timeout=120)
        second = forward_backward_custom(s, samples, fn, timeout=120)
        assert second.loss < first.loss - 1e-3
        assert second.metrics["dpo_accuracy:mean"] == 1.0
    finally:
        s.stop()
