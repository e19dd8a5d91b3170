"""TorchTrainerEngine against an independent plain torch + peft computation.

The reference code below uses transformers, peft and torch.optim directly
(none of the engine's helpers). Tolerances: logprobs/loss 1e-5 absolute
(fp32; the engine pads the batch, the reference scores each sample alone),
weights after AdamW 1e-6.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from _models import random_samples, tiny_model
from together_train_server.engines.types import AdamParams, LoraConfig, Sample

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def engine(model_dir):
    from together_train_server.engines.torch_trainer import TorchTrainerEngine

    return TorchTrainerEngine(model_dir)



def test_engine_satisfies_the_trainer_protocol(engine):
    """What the service types against (engines/interfaces.py): every attribute and method is there."""
    from together_train_server.engines.interfaces import TRAINER_METHODS, TrainerEngine

    assert isinstance(engine, TrainerEngine)
    assert engine.mode == "lora" and engine.backend_name == "TorchTrainerEngine"
    assert all(callable(getattr(engine, m)) for m in TRAINER_METHODS)

def _ref_peft(model_dir, rank, alpha, seed, train_unembed=False):
    from peft import LoraConfig as PeftLoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    base.requires_grad_(False)
    torch.manual_seed(seed)
    cfg = PeftLoraConfig(r=rank, lora_alpha=alpha, target_modules=ALL_LINEAR, lora_dropout=0.0,
                     modules_to_save=["lm_head"] if train_unembed else None)
    pm = get_peft_model(base, cfg)
    pm.eval()
    return pm


def _ref_logprobs(pm, sample: Sample) -> torch.Tensor:
    ids = torch.as_tensor(sample.model_input)[None]
    logits = pm(input_ids=ids).logits[0].float()
    tgt = torch.as_tensor(sample.inputs["target_tokens"])
    return torch.log_softmax(logits, -1)[torch.arange(len(tgt)), tgt]


def _ref_loss(pm, samples):
    total = 0.0
    for s in samples:
        total = total + (-torch.as_tensor(s.inputs["weights"]) * _ref_logprobs(pm, s)).sum()
    return total


def _trainable(pm):
    return {n: p for n, p in pm.named_parameters() if p.requires_grad}


def _ref_state(pm):
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(pm).items()}


def test_forward_matches_plain_peft(engine, model_dir):
    engine.create_adapter("fwd", LoraConfig(rank=4, alpha=8.0, seed=3))
    samples = random_samples([7, 3, 12], engine.vocab_size, seed=1)
    out = engine.forward("fwd", samples, "cross_entropy", backward=False,
                         return_logprobs=True, return_elementwise=True)
    pm = _ref_peft(model_dir, 4, 8.0, 3)
    # adapters start with B = 0; give B random values so the LoRA path matters
    g = torch.Generator().manual_seed(0)
    for n, p in _trainable(pm).items():
        if "lora_B" in n:
            p.data.normal_(0, 0.05, generator=g)
    with torch.no_grad():
        ref_lp0 = [_ref_logprobs(pm, s) for s in samples]
    # with B = 0 the reference equals the base; compare the engine to the base path first
    pm0 = _ref_peft(model_dir, 4, 8.0, 3)
    with torch.no_grad():
        base_lp = [_ref_logprobs(pm0, s) for s in samples]
        ref_loss = float(_ref_loss(pm0, samples))
    for a, b in zip(out.logprobs, base_lp):
        assert a.dtype == np.float32 and a.shape == b.shape
        np.testing.assert_allclose(a, b.numpy(), atol=1e-5, rtol=0)
    assert abs(out.loss - ref_loss) < 1e-4
    assert out.metrics["loss:sum"] == pytest.approx(out.loss)
    w = np.concatenate([s.inputs["weights"] for s in samples])
    assert out.metrics["num_tokens:sum"] == np.count_nonzero(w)
    assert out.metrics["weight:sum"] == pytest.approx(float(w.sum()), abs=1e-4)
    for el, lp, s in zip(out.elementwise_loss, out.logprobs, samples):
        np.testing.assert_allclose(el, -s.inputs["weights"] * lp, atol=1e-6)
    # now with nonzero B: copy the reference's adapter weights into the engine's parameters
    ref_named = _trainable(pm)
    with torch.no_grad():
        for n, p in engine.trainable_parameters("fwd").items():
            p.copy_(ref_named[_to_default(n)])
    out2 = engine.forward("fwd", samples, "cross_entropy", return_logprobs=True)
    for a, b in zip(out2.logprobs, ref_lp0):
        np.testing.assert_allclose(a, b.numpy(), atol=1e-5, rtol=0)
    assert not np.allclose(out2.logprobs[0], base_lp[0].numpy(), atol=1e-4)
    engine.drop_adapter("fwd")


def _to_default(name: str) -> str:
    # engine parameter "...lora_A.ad7.weight" -> reference "...lora_A.default.weight"
    parts = name.split(".")
    parts[-2] = "default"
    return ".".join(parts)


@pytest.mark.parametrize("train_unembed", [False, True])
def test_grads_and_adamw_match_reference(engine, model_dir, train_unembed):
    aid = f"opt{int(train_unembed)}"
    spec = LoraConfig(rank=4, alpha=16.0, seed=5, train_unembed=train_unembed)
    engine.create_adapter(aid, spec)
    pm = _ref_peft(model_dir, 4, 16.0, 5, train_unembed)
    # identical initialisation from the same seed
    ref0 = _ref_state(pm)
    eng0 = engine.adapter_tensors(aid)
    assert set(ref0) == set(eng0)
    for k in ref0:
        torch.testing.assert_close(eng0[k], ref0[k], atol=0, rtol=0)

    ref_params = _trainable(pm)
    group_a = [p for n, p in ref_params.items() if "lora_B" not in n]
    group_b = [p for n, p in ref_params.items() if "lora_B" in n]
    opt = torch.optim.AdamW([{"params": group_a}, {"params": group_b}], lr=1.0)
    cfgs = [
        AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1,
                   grad_clip_norm=0.5, lora_plus_ratio=4.0),
        AdamParams(learning_rate=5e-3, weight_decay=0.0, grad_clip_norm=0.0, lora_plus_ratio=4.0),
    ]
    for step, cfg in enumerate(cfgs, start=1):
        b1 = random_samples([6, 11], engine.vocab_size, seed=10 * step)
        b2 = random_samples([4], engine.vocab_size, seed=10 * step + 1)
        # two forward_backward calls accumulate before one step
        o1 = engine.forward(aid, b1, "cross_entropy", backward=True)
        o2 = engine.forward(aid, b2, "cross_entropy", backward=True)
        eng_grads = {_to_default(n): p.grad.clone()
                     for n, p in engine.trainable_parameters(aid).items()}

        l1 = _ref_loss(pm, b1)
        l1.backward()
        l2 = _ref_loss(pm, b2)
        l2.backward()
        assert abs(o1.loss - l1.item()) < 1e-4 and abs(o2.loss - l2.item()) < 1e-4
        # the gradient the engine accumulated equals plain peft's (padding changes
        # float rounding only)
        assert set(eng_grads) == set(ref_params)
        for n, p in ref_params.items():
            torch.testing.assert_close(eng_grads[n], p.grad, atol=2e-5, rtol=1e-4)
            p.grad = eng_grads[n].clone()  # the optimizer is compared on the same gradients
        out = engine.optim_step(aid, cfg)

        params = list(ref_params.values())
        if cfg.grad_clip_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip_norm)
            assert float(norm) > cfg.grad_clip_norm  # clipping really happened
        else:
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
        for grp, lr in zip(opt.param_groups, (cfg.learning_rate, cfg.learning_rate * cfg.lora_plus_ratio)):
            grp.update(lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
        opt.step()
        opt.zero_grad(set_to_none=True)

        assert out.step == step == engine.step(aid)
        assert out.learning_rate == cfg.learning_rate
        assert out.grad_norm == pytest.approx(float(norm), rel=1e-5)
        ref_sd, eng_sd = _ref_state(pm), engine.adapter_tensors(aid)
        for k in ref_sd:
            torch.testing.assert_close(eng_sd[k], ref_sd[k], atol=1e-6, rtol=0)
        # gradients were zeroed after the step
        assert all(p.grad is None for p in engine.trainable_parameters(aid).values())
    assert any("lm_head" in k for k in eng_sd) == train_unembed
    engine.drop_adapter(aid)


def test_adapters_do_not_affect_each_other(engine):
    engine.create_adapter("a", LoraConfig(rank=4, alpha=8.0, seed=1))
    engine.create_adapter("b", LoraConfig(rank=2, alpha=4.0, seed=2, train_unembed=True))
    samples = random_samples([5, 9], engine.vocab_size, seed=7)
    engine.forward("a", samples, "cross_entropy", backward=True)
    grads_a = {n: p.grad.clone() for n, p in engine.trainable_parameters("a").items()}
    weights_a = engine.adapter_tensors("a")
    lp_a = engine.forward("a", samples, "cross_entropy", return_logprobs=True).logprobs

    for _ in range(2):  # train b (including its lm_head copy)
        engine.forward("b", samples, "cross_entropy", backward=True)
        engine.optim_step("b", AdamParams(learning_rate=0.05))
    assert all(p.grad is None for p in engine.trainable_parameters("b").values())
    # a's accumulated gradient and weights survived b's training
    for n, p in engine.trainable_parameters("a").items():
        torch.testing.assert_close(p.grad, grads_a[n], atol=0, rtol=0)
    for k, v in engine.adapter_tensors("a").items():
        torch.testing.assert_close(v, weights_a[k], atol=0, rtol=0)
    lp_a2 = engine.forward("a", samples, "cross_entropy", return_logprobs=True).logprobs
    for x, y in zip(lp_a, lp_a2):
        np.testing.assert_array_equal(x, y)
    lp_b = engine.forward("b", samples, "cross_entropy", return_logprobs=True).logprobs
    assert not np.allclose(lp_b[0], lp_a2[0], atol=1e-3)
    assert engine.step("a") == 0 and engine.step("b") == 2
    engine.drop_adapter("a")
    engine.drop_adapter("b")


def test_seeded_init_and_drop_recreate(engine):
    engine.create_adapter("s1", LoraConfig(rank=4, seed=11))
    engine.create_adapter("s2", LoraConfig(rank=4, seed=11))
    engine.create_adapter("s3", LoraConfig(rank=4, seed=12))
    t1, t2, t3 = (engine.adapter_tensors(x) for x in ("s1", "s2", "s3"))
    k = next(k for k in t1 if "lora_A" in k)
    torch.testing.assert_close(t1[k], t2[k], atol=0, rtol=0)
    assert not torch.equal(t1[k], t3[k])
    for x in ("s1", "s2", "s3"):
        engine.drop_adapter(x)
    assert engine.adapter_ids == []
    with pytest.raises(KeyError):
        engine.step("s1")
    n = engine.create_adapter("s1", LoraConfig(rank=2, target_modules=("q_proj", "v_proj")))
    # 2 layers x (q: 64->64, v: 64->32) with r=2: A [2,64] + B [out,2]
    assert n == 2 * ((2 * 64 + 64 * 2) + (2 * 64 + 32 * 2))
    out = engine.optim_step("s1", AdamParams(learning_rate=1e-3))  # no gradient: a no-op step
    assert out.step == 1 and out.grad_norm == 0.0
    engine.drop_adapter("s1")


def test_save_adapter_loads_with_peft(engine, model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    engine.create_adapter("sv", LoraConfig(rank=4, alpha=8.0, train_unembed=True))
    samples = random_samples([8], engine.vocab_size, seed=3)
    engine.forward("sv", samples, "cross_entropy", backward=True)
    engine.optim_step("sv", AdamParams(learning_rate=0.05))
    out = engine.forward("sv", samples, "cross_entropy", return_logprobs=True)
    engine.save_adapter("sv", tmp_path / "ad")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(tmp_path / "ad"))
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    pm = PeftModel.from_pretrained(base, str(tmp_path / "ad"))
    pm.eval()
    with torch.no_grad():
        ref = _ref_logprobs(pm, samples[0])
    np.testing.assert_allclose(out.logprobs[0], ref.numpy(), atol=1e-5)
    engine.drop_adapter("sv")


def test_bad_inputs_raise_and_leave_state(engine):
    engine.create_adapter("bad", LoraConfig(rank=2))
    good = random_samples([4], engine.vocab_size)
    engine.forward("bad", good, "cross_entropy", backward=True)
    grads = {n: p.grad.clone() for n, p in engine.trainable_parameters("bad").items()}
    too_long = random_samples([engine.max_seq_len + 1], engine.vocab_size)
    mism = random_samples([4], engine.vocab_size)
    mism[0].inputs["weights"] = mism[0].inputs["weights"][:3]
    with pytest.raises(KeyError):
        engine.forward("nope", good, "cross_entropy")
    with pytest.raises(KeyError):
        engine.forward("bad", good, "no_such_loss")
    with pytest.raises(ValueError, match="missing loss input"):
        engine.forward("bad", good, "ppo", backward=True)  # cross-entropy samples lack ppo's inputs
    for bad in ([], too_long, mism):
        with pytest.raises(ValueError):
            engine.forward("bad", bad, "cross_entropy", backward=True)
    with pytest.raises(ValueError):
        engine.create_adapter("bad", LoraConfig(rank=2))
    with pytest.raises(ValueError):
        engine.create_adapter("x", LoraConfig(rank=2, target_modules=("nope_proj",)))
    with pytest.raises(ValueError):
        engine.create_adapter("x", LoraConfig(rank=0))
    assert "x" not in engine.adapter_ids
    for n, p in engine.trainable_parameters("bad").items():
        torch.testing.assert_close(p.grad, grads[n], atol=0, rtol=0)
    # a sample of exactly max_seq_len tokens is accepted
    engine.forward("bad", random_samples([engine.max_seq_len], engine.vocab_size), "cross_entropy")
    engine.drop_adapter("bad")


def test_qwen2_arch_trains(tmp_path):
    from together_train_server.engines.torch_trainer import TorchTrainerEngine

    eng = TorchTrainerEngine(tiny_model(tmp_path / "qwen2", arch="qwen2"))
    assert eng.max_seq_len == 256
    eng.create_adapter("q", LoraConfig(rank=2, dropout=0.1))
    samples = random_samples([6, 3], eng.vocab_size, weights="ones")
    before = eng.forward("q", samples, "cross_entropy").loss
    for _ in range(3):
        eng.forward("q", samples, "cross_entropy", backward=True)
        eng.optim_step("q", AdamParams(learning_rate=0.05))
    assert eng.forward("q", samples, "cross_entropy").loss < before
