"""Training checkpoints through a real resource: exact resume, weights-only load, merged export.

- Exact resume: train N steps, save_state, train M more; a new session from the
  checkpoint (create_session with optimizer, and load_state_with_optimizer in an
  existing session) trains the same M steps to bit-identical losses, weights
  and AdamW moments (fp32, CPU, LoRA dropout on: the RNG stream is restored too).
- load_state (weights only) gives bit-identical weights and an empty optimizer:
  its first update equals a fresh torch.optim.AdamW step computed independently
  with plain peft (atol 1e-6: same fp32 math, different batch layout; Adam eps
  1e-2 so the first step does not amplify that noise, see ADAM), and
  differs from the with-optimizer continuation.
- Merged export: plain transformers logits of the merged directory equal plain
  peft logits of the adapter directory within atol 1e-5 (fp32; the merge
  rounds W + s*B@A once, measured ~1e-6); the adapter directory's peft
  logprobs equal the server's (rtol/atol 1e-5, as tests/server/test_e2e_training.py).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import together_train as tt
from _checkpoint_helpers import assert_bit_equal, make_batch, params_of, state_tensors, train

N, M = 2, 2
# The first step of a fresh Adam is lr * g / (|g| + eps) (v-hat = g^2 exactly), which
# amplifies fp32 noise in a near-zero gradient element by lr * eps / (|g| + eps)^2:
# eps = 1e-2 keeps that factor <= lr / eps = 1, so atol 1e-6 holds.
ADAM = tt.AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.95, eps=1e-2, weight_decay=0.1)


@pytest.fixture(scope="module")
def resumed(resource):
    """Session A: N steps, save_state, M more steps (losses recorded), save_state at the end."""
    vocab = resource.get_capabilities().vocab_size
    a = resource.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, dropout=0.1, seed=0), name="resume-a")
    train(a, range(N), vocab)
    mid = a.save_state("mid").result(timeout=120)
    losses = train(a, range(N, N + M), vocab)
    end = a.save_state("end").result(timeout=120)
    a.stop()
    return {"vocab": vocab, "mid": mid, "end": end, "losses": losses, "session_id": a.session_id}


def test_save_state_records_step_config_and_base(resumed, tiny_model_dir):
    mid = resumed["mid"]
    assert mid.kind == "state" and mid.step == N and mid.uri == f"together-train://{resumed['session_id']}/state/mid"
    meta = json.loads((mid.path / "trainer_state.json").read_text())
    assert meta["step"] == N
    assert meta["lora"]["rank"] == 4 and meta["lora"]["dropout"] == 0.1
    assert meta["base"]["model_id"] == tiny_model_dir.name and len(meta["base"]["config_sha256"]) == 64
    tensors = state_tensors(mid.path)
    assert any(k.endswith("::exp_avg_sq") for k in tensors) and "rng::torch_cpu" in tensors
    manifest = json.loads((mid.path / "manifest.json").read_text())
    assert set(manifest["files"]) >= {"adapter_model.safetensors", "adapter_config.json", "trainer_state.safetensors"}


def test_create_session_with_optimizer_resumes_bit_for_bit(resource, resumed):
    b = resource.create_session(checkpoint_uri=resumed["mid"].uri, with_optimizer=True)
    try:
        info = b.info()
        assert info.step == N and info.lora.rank == 4 and info.lora.dropout == 0.1  # config from the checkpoint
        losses = train(b, range(N, N + M), resumed["vocab"])
        assert losses == resumed["losses"]  # exact float equality
        end = b.save_state("end").result(timeout=120)
        assert_bit_equal(state_tensors(end.path), state_tensors(resumed["end"].path))  # weights, moments, RNG
    finally:
        b.stop()


def test_load_state_with_optimizer_in_existing_session_resumes_bit_for_bit(resource, resumed):
    c = resource.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, dropout=0.1, seed=7))
    try:
        train(c, [99], resumed["vocab"])  # state that must be replaced entirely
        res = c.load_state_with_optimizer(resumed["mid"].uri).result(timeout=120)
        assert res.step == N and res.with_optimizer is True
        assert train(c, range(N, N + M), resumed["vocab"]) == resumed["losses"]
        end = c.save_state("end").result(timeout=120)
        assert_bit_equal(state_tensors(end.path), state_tensors(resumed["end"].path))
    finally:
        c.stop()


def _fresh_adam_reference(tiny_model_dir, ckpt_dir, batch) -> dict[str, torch.Tensor]:
    """Plain peft + torch.optim.AdamW: one step from the checkpoint's weights with a new optimizer."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, ckpt_dir, is_trainable=True)
    model.eval()  # no dropout: the receiving session has dropout 0
    named = {n.replace(".default.", "."): p for n, p in model.named_parameters() if p.requires_grad}
    loss = 0.0
    for s in batch:
        inp = torch.as_tensor(np.asarray(s.model_input))[None]
        tgt = torch.as_tensor(np.asarray(s.loss_fn_inputs["target_tokens"]))[None]
        lp = torch.log_softmax(model(input_ids=inp).logits.float(), -1).gather(-1, tgt[..., None])[0, :, 0]
        loss = loss - (torch.as_tensor(np.asarray(s.loss_fn_inputs["weights"])) * lp).sum()
    loss.backward()
    opt = torch.optim.AdamW(
        list(named.values()), lr=ADAM.learning_rate, betas=(ADAM.beta1, ADAM.beta2), eps=ADAM.eps,
        weight_decay=ADAM.weight_decay,
    )
    opt.step()
    return {n: p.detach().clone() for n, p in named.items()}


def test_load_state_weights_only_gives_same_weights_and_a_fresh_adam(resource, resumed, tiny_model_dir):
    vocab = resumed["vocab"]
    d = resource.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=5))  # dropout 0: deterministic
    try:
        res = d.load_state(resumed["mid"].uri).result(timeout=120)
        assert res.step == N and res.with_optimizer is False
        loaded = d.save_state("loaded").result(timeout=120)
        assert_bit_equal(params_of(loaded.path), params_of(resumed["mid"].path))
        assert not [k for k in state_tensors(loaded.path) if k.startswith("opt::")]  # empty AdamW state

        batch = make_batch(1000, vocab)
        d.forward_backward(batch, loss_fn="cross_entropy")
        assert d.optim_step(ADAM).result(timeout=120).step == N + 1
        after = params_of(d.save_state("after").result(timeout=120).path)
        expect = _fresh_adam_reference(tiny_model_dir, resumed["mid"].path, batch)
        assert after.keys() == expect.keys()
        for k in after:
            torch.testing.assert_close(after[k], expect[k], rtol=0, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")

        # The same batch after load_state_with_optimizer moves the weights differently
        # (the restored moments and bias correction), far beyond that tolerance.
        e = resource.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=5))
        try:
            e.load_state_with_optimizer(resumed["mid"].uri).result(timeout=120)
            e.forward_backward(batch, loss_fn="cross_entropy")
            e.optim_step(ADAM).result(timeout=120)
            cont = params_of(e.save_state("after").result(timeout=120).path)
            assert max(float((cont[k] - after[k]).abs().max()) for k in after) > 1e-4
        finally:
            e.stop()
    finally:
        d.stop()


@pytest.mark.parametrize("train_unembed", [False, True])
def test_merged_export_loads_in_plain_transformers_with_the_adapter_logits(resource, tiny_model_dir, train_unembed):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    vocab = resource.get_capabilities().vocab_size
    s = resource.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=2, train_unembed=train_unembed))
    try:
        train(s, [11, 12], vocab, tt.AdamParams(learning_rate=5e-2))
        probe = make_batch(77, vocab, lengths=(15,))
        served = s.forward(probe, loss_fn="cross_entropy", return_logprobs=True).result(timeout=120).logprobs[0]
        merged = s.save_weights("merged", merged=True).result(timeout=300)
        adapter = s.save_weights("adapter").result(timeout=120)
    finally:
        s.stop()
    assert merged.merged and merged.kind == "weights" and not adapter.merged
    names = {p.name for p in merged.path.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= names
    assert AutoTokenizer.from_pretrained(merged.path).chat_template

    ids = torch.as_tensor(np.asarray(probe[0].model_input))[None]
    tgt = torch.as_tensor(np.asarray(probe[0].loss_fn_inputs["target_tokens"]))
    plain = AutoModelForCausalLM.from_pretrained(merged.path, dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), adapter.path
    ).eval()
    with torch.no_grad():
        merged_logits = plain(input_ids=ids).logits[0]
        peft_logits = peft_model(input_ids=ids).logits[0]
    with torch.no_grad():
        base_logits = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)(input_ids=ids).logits[0]
    assert float((peft_logits - base_logits).abs().max()) > 1e-3  # the adapter really changes the model
    torch.testing.assert_close(merged_logits, peft_logits, rtol=0, atol=1e-5)
    peft_lp = torch.log_softmax(peft_logits, -1).gather(-1, tgt[:, None])[:, 0].numpy()
    np.testing.assert_allclose(peft_lp, served, rtol=1e-5, atol=1e-5)
    assert plain.config.tie_word_embeddings is (not train_unembed)
