"""Long sequences in bounded memory (issue 21), engine level on a tiny long-context model.

Every loss is computed three ways on the same adapter weights (a first AdamW
step makes LoRA B non-zero; ``train_unembed`` so the chunked head must send
its gradient into the session's ``lm_head`` copy):

* ``on``: activation checkpointing of every decoder layer and the head applied
  in chunks of 37 positions (every sample spans several chunks);
* ``off``: no checkpointing, one chunk (the head over all positions at once);
* ``plain``: transformers + peft as a user would write it: ``model(ids).logits``
  per sample, ``log_softmax``, gather; the loss value and ``dL/dp`` from the
  independent float64 reference (tests/_loss_reference.py; cross_entropy
  ``-w``, custom ``g``), backpropagated as ``sum_t dL/dp_t * p_t``.

Tolerances (float32): logprobs 2e-5 absolute: each is ``z_y - logsumexp(z)``
over 49,152 logits of magnitude ~11; a blocked float32 sum of V terms errs by
about ``log2(V) * eps32 * |lse|`` = 16 * 1.2e-7 * 11 = 2e-5. Losses rtol 1e-5.
Gradients: per tensor, ``max |a - b| <= 1e-4 * max |b|``, the float32 bound
``n * eps32`` for the ~1e3 products behind each LoRA gradient element (260
tokens in the batch, hidden 64), summed in another order (Higham §4.2).
Checkpointing vs not: the recomputation is the same float program, so
those two agree to rounding of the chunked head only.
"""

from __future__ import annotations

import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from _loss_reference import policy_inputs, reference
from _models import random_samples, tiny_model
from together_train_server.engines.length_batching import padding_fraction
from together_train_server.engines.trainer_batching import micro_batches
from together_train_server.engines.types import AdamParams, LoraConfig, Sample

LENGTHS = (150, 30, 80)
ROWS = 37


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from together_train_server.engines.torch_trainer import TorchTrainerEngine

    d = tiny_model(tmp_path_factory.mktemp("tiny") / "llama_long", max_positions=4096)
    eng = TorchTrainerEngine(d)
    assert eng.max_seq_len == 4096
    eng.create_adapter("s", LoraConfig(rank=4, alpha=8.0, seed=0, train_unembed=True))
    warm = random_samples(LENGTHS, eng.vocab_size, seed=3)
    eng.forward("s", warm, "cross_entropy", backward=True)
    eng.optim_step("s", AdamParams(learning_rate=1e-2))
    return eng


def _grads(eng):
    out = {re.sub(r"\.ad\d+\.", ".", n): p.grad.clone()
           for n, p in eng.trainable_parameters("s").items() if p.grad is not None}
    eng.zero_grad("s")
    return out


def _set(eng, mode, rows):
    eng.checkpointing.mode = mode
    eng.logprob_chunk_rows = rows


def _plain(eng, samples):
    """Per-sample transformers + peft forward with full logits; returns (logprobs, grad fn)."""
    eng.checkpointing.enabled = False
    eng._activate(eng._get("s"))
    lps = []
    for s in samples:
        ids = torch.as_tensor(np.asarray(s.model_input))[None]
        logits = eng.table.peft(input_ids=ids, use_cache=False).logits.float()[0]
        tgt = torch.as_tensor(np.asarray(s.inputs["target_tokens"]))
        lps.append(torch.log_softmax(logits, -1).gather(-1, tgt[:, None]).squeeze(-1))
    return lps


def _reference(loss_fn, params, samples, p):
    if loss_fn == "cross_entropy":
        w = [np.asarray(s.inputs["weights"], np.float64) for s in samples]
        return -sum(float((wi * pi).sum()) for wi, pi in zip(w, p)), [-wi for wi in w]
    if loss_fn == "custom":
        g = [np.asarray(s.inputs["gradients"], np.float64) for s in samples]
        return sum(float((gi * pi).sum()) for gi, pi in zip(g, p)), g
    return reference(loss_fn, params, [s.inputs for s in samples], p)


CASES = [
    ("cross_entropy", {}, None),
    ("importance_sampling", {}, {}),
    ("ppo", {}, {}),
    ("cispo", {}, {}),
    ("dro", {"beta": 0.1}, {}),
    ("grpo", {"aggregation": "sequence_mean", "ratio_type": "sequence", "beta": 0.1},
     {"reference_logprobs": True}),
    ("gspo", {}, {"sequence_ratio_mask": True}),
    ("custom", {}, None),
]


def _close_grads(a, b, what):
    assert a.keys() == b.keys() and a, (what, sorted(a), sorted(b))
    assert any("lm_head" in k for k in a), f"{what}: no gradient reached the lm_head copy"
    for k in a:
        err, scale = float((a[k] - b[k]).abs().max()), float(b[k].abs().max())
        assert err <= 1e-4 * scale + 1e-9, f"{what} {k}: max |diff| {err:.3g} > 1e-4 * max|ref| {scale:.3g}"


@pytest.mark.parametrize("loss_fn, params, opts", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_every_loss_chunked_and_checkpointed_equals_plain(engine, loss_fn, params, opts):
    eng = engine
    base = random_samples(LENGTHS, eng.vocab_size, seed=11)
    with torch.no_grad():
        p0 = [lp.numpy().astype(np.float64) for lp in _plain(eng, base)]
    if opts is None:
        samples = base
        if loss_fn == "custom":
            rng = np.random.default_rng(5)
            samples = [Sample(s.model_input, {"target_tokens": s.inputs["target_tokens"],
                                              "gradients": rng.normal(size=len(s.model_input)).astype(np.float32)})
                       for s in base]
    else:
        inputs = policy_inputs(p0, 7, **opts)
        samples = [Sample(s.model_input, {"target_tokens": s.inputs["target_tokens"], **inp})
                   for s, inp in zip(base, inputs)]
    out, grads = {}, {}
    for name, mode, rows in (("on", "on", ROWS), ("off", "off", 10 ** 9)):
        _set(eng, mode, rows)
        out[name] = eng.forward("s", samples, loss_fn, params, backward=True, return_logprobs=True,
                                return_elementwise=True)
        grads[name] = _grads(eng)
    _set(eng, "auto", ROWS)
    a, b = out["on"], out["off"]
    np.testing.assert_allclose(a.loss, b.loss, rtol=1e-5, err_msg="loss on vs off")
    assert a.metrics.keys() == b.metrics.keys()
    for k in a.metrics:
        np.testing.assert_allclose(a.metrics[k], b.metrics[k], rtol=1e-5, atol=1e-6, err_msg=k)
    for x, y in zip(a.logprobs + a.elementwise_loss, b.logprobs + b.elementwise_loss):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=2e-5)
    _close_grads(grads["on"], grads["off"], "on vs off")
    # plain transformers + peft, reference loss math
    lps = _plain(eng, samples)
    value, dldp = _reference(loss_fn, params, samples, [lp.detach().numpy().astype(np.float64) for lp in lps])
    torch.stack([(lp * torch.as_tensor(g, dtype=torch.float32)).sum() for lp, g in zip(lps, dldp)]).sum().backward()
    plain_grads = _grads(eng)
    for x, lp in zip(a.logprobs, lps):
        np.testing.assert_allclose(x, lp.detach().numpy(), rtol=0, atol=2e-5, err_msg="logprobs vs plain")
    np.testing.assert_allclose(a.loss, value, rtol=1e-5, atol=1e-5, err_msg="loss vs reference")
    _close_grads(grads["on"], plain_grads, "on vs plain")


def test_checkpointing_is_used_and_auto_follows_the_threshold(engine):
    eng = engine
    calls = []
    layer = eng.checkpointing.layers[0]
    orig = layer.forward
    layer.forward = lambda *a, **k: (calls.append(eng.checkpointing.enabled), orig(*a, **k))[1]
    try:
        s = random_samples([50], eng.vocab_size, seed=1)
        eng.checkpointing.auto_min_tokens = 40
        eng.forward("s", s, "cross_entropy", backward=True)
        eng.forward("s", s, "cross_entropy", backward=False)
        eng.checkpointing.auto_min_tokens = 60
        eng.forward("s", s, "cross_entropy", backward=True)
    finally:
        layer.forward = orig
        eng.checkpointing.auto_min_tokens = 2048
        eng.zero_grad("s")
    assert calls == [True, False, False], calls
    assert len(eng.checkpointing.layers) == 2


def test_length_grouping_pads_little_and_keeps_order(engine):
    eng = engine
    lengths = [17, 300, 22, 150, 31, 290, 9, 160, 140, 25, 305, 12]
    groups = micro_batches(lengths, eng.micro_batch_tokens, eng.max_padding_fraction)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    frac = padding_fraction(lengths, groups)
    # in request order (the old grouping) the 300-token samples pad the short ones
    old = padding_fraction(lengths, [list(range(len(lengths)))])
    assert frac <= 0.10, (frac, groups)
    assert old > 0.4, old
    samples = random_samples(lengths, eng.vocab_size, seed=2)
    whole = eng.forward("s", samples, "cross_entropy", return_logprobs=True, return_elementwise=True)
    for i, s in enumerate(samples):
        one = eng.forward("s", [s], "cross_entropy", return_logprobs=True)
        assert len(whole.logprobs[i]) == lengths[i]
        np.testing.assert_allclose(whole.logprobs[i], one.logprobs[0], rtol=0, atol=2e-5, err_msg=f"sample {i}")


def test_generator_logprobs_in_chunks_equal_plain(engine):
    """compute_logprobs and prompt logprobs (+ top-k) of a 400-token sequence, head in chunks of 37,
    against plain full-logits log_softmax on the same base model (tolerance as above)."""
    from together_train_server.engines import torch_generator
    from together_train_server.engines.types import SamplingParams

    gen = torch_generator.TorchGeneratorEngine(engine.model_dir)
    orig = torch_generator.chunk_rows
    torch_generator.chunk_rows = lambda vocab: ROWS
    try:
        rng = np.random.default_rng(9)
        seq = [int(t) for t in rng.integers(0, gen.vocab_size, 400)]
        got = gen.compute_logprobs([seq, seq[:90]])
        out = gen.generate(seq, SamplingParams(max_tokens=1, seed=0), 1, prompt_logprobs=True,
                           top_k_prompt_logprobs=3)
    finally:
        torch_generator.chunk_rows = orig
        gen.close()
    base = gen._base
    with torch.no_grad():
        logp = torch.log_softmax(base(input_ids=torch.tensor([seq])).logits.float()[0, :-1], -1)
    ref = logp.gather(-1, torch.tensor(seq[1:])[:, None]).squeeze(-1).numpy()
    np.testing.assert_allclose(got[0], ref, rtol=0, atol=2e-5)
    np.testing.assert_allclose(got[1], ref[:89], rtol=0, atol=2e-5)
    np.testing.assert_allclose(out.prompt_logprobs, ref, rtol=0, atol=2e-5)
    v, i = torch.topk(logp, 3, dim=-1)
    for t, (ids, lps) in enumerate(out.top_k_prompt_logprobs):
        assert list(ids) == i[t].tolist(), t
        np.testing.assert_allclose(lps, v[t].numpy(), rtol=0, atol=2e-5)
