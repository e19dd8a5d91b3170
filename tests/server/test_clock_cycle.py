"""The clock cycle (issue 31): several sessions' forwards in one pass over the base, each as if alone.

Engine level (TorchTrainerEngine in-process, tiny random Llama): each op of a
``forward_many`` call is compared with the same op run alone by ``forward`` on
a twin adapter (same LoraConfig and seed, so identical weights and dropout
stream), over two steps with an AdamW step between (so B != 0 and LoRA
changes the forward). A plain torch + peft check of one cross_entropy op is
the independent reference. Through a real server: sessions' pipelined
forward_backwards run as one cycle (the server log says so) and give the
losses of twin sessions run one at a time.

Tolerance, from float32 summation order: a pass differs from alone only in
how sums are ordered (the base GEMMs see more rows, LoRA goes through grouped products or ``bmm``,
the head's chunks fall elsewhere). A reordered float32 sum of ``K`` products
differs by at most ``gamma_K = K * u`` (``u = 2^-24``) of the sum of the
terms' magnitudes; the longest reduction of the tiny model is ``K = 128``
(the MLP width), ``gamma_128 = 7.6e-6``, and a logprob goes through at most
five reductions in series (two layers' attention and MLP, the head), so
``5 * 7.6e-6 = 3.8e-5`` of the magnitudes involved. Hence: logprobs within
``4e-5 * |p|`` (``|p|`` about ``log 49152 = 10.8``), a loss within
``4e-5 * sum_t |l_t|``, each gradient tensor within ``4e-5 * max |g|`` plus one
more reduction over at most ``64`` positions (``64 u = 3.8e-6``): ``5e-5 * max |g|``.
Measured differences are ~1e-6 relative.
"""

from __future__ import annotations

import os
import re
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from _loss_reference import policy_inputs
from _models import random_samples, tiny_model
from together_train_server.engines.types import AdamParams, LoraConfig, Sample

REL = 4e-5        # logprobs and losses (module docstring)
GRAD_REL = 5e-5   # gradients
ADAM = AdamParams(learning_rate=1e-2, eps=1e-4)   # eps >> a near-zero gradient's float noise
LOSSES = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {},
    "cispo": {},
    "dro": {"beta": 0.1},
    "grpo": {"aggregation": "sequence_mean", "ratio_type": "sequence", "beta": 0.1},
    "custom": {},
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from together_train_server.engines.torch_trainer import TorchTrainerEngine

    return TorchTrainerEngine(tiny_model(tmp_path_factory.mktemp("tiny") / "llama"))


_count = [0]


def _pair(eng, spec: LoraConfig) -> tuple[str, str]:
    """An adapter and its twin (same spec and seed)."""
    _count[0] += 1
    a, b = f"s{_count[0]}", f"s{_count[0]}-twin"
    eng.create_adapter(a, spec)
    eng.create_adapter(b, spec)
    return a, b


def _samples(eng, loss_fn: str, lengths, seed: int) -> list[Sample]:
    """Samples for ``loss_fn`` (policy inputs around a probe adapter's true logprobs)."""
    ce = random_samples(lengths, eng.vocab_size, seed=seed)
    if loss_fn == "cross_entropy":
        return ce
    if loss_fn == "custom":
        rng = np.random.default_rng(seed)
        return [Sample(s.model_input, {"target_tokens": s.inputs["target_tokens"],
                                       "gradients": rng.normal(size=len(s.model_input)).astype(np.float32)})
                for s in ce]
    eng.create_adapter("probe", LoraConfig(rank=2, alpha=4.0, seed=0))
    p = eng.forward("probe", ce, "cross_entropy", return_logprobs=True).logprobs
    eng.drop_adapter("probe")
    inputs = policy_inputs(p, seed, reference_logprobs=loss_fn == "grpo")
    return [Sample(s.model_input, {"target_tokens": s.inputs["target_tokens"], **inp}) for s, inp in zip(ce, inputs)]


def _grads(eng, aid):
    return {re.sub(r"\.ad\d+\.", ".", n): None if p.grad is None else p.grad.clone()
            for n, p in eng.trainable_parameters(aid).items()}


def _close_grads(g1, g2, what):
    assert g1.keys() == g2.keys()
    for n in g1:
        a, b = g1[n], g2[n]
        assert (a is None) == (b is None), (what, n)
        if a is None:
            continue
        bound = GRAD_REL * float(b.abs().max()) + 1e-12
        diff = float((a - b).abs().max())
        assert diff <= bound, f"{what} {n}: gradient differs by {diff:.3g} > {bound:.3g}"


def _close_outputs(out, ref, what):
    assert not isinstance(out, BaseException), f"{what}: {out!r}"
    mags = sum(float(np.abs(e).sum()) for e in ref.elementwise_loss)
    assert abs(out.loss - ref.loss) <= REL * mags + 1e-9, f"{what}: loss {out.loss} vs alone {ref.loss}"
    for i, (x, y) in enumerate(zip(out.logprobs, ref.logprobs)):
        d = float(np.abs(x - y).max())
        assert d <= REL * float(np.abs(y).max()) + 1e-9, f"{what} sample {i}: logprobs differ by {d:.3g}"
    assert out.metrics.keys() == ref.metrics.keys(), what


def _cycle_vs_alone(eng, ops, steps: int = 2, plan_check: bool = True):
    """Run ``ops`` [(adapter, twin, ForwardItem kwargs)] as a cycle and alone on the twins; compare."""
    from together_train_server.engines import cross_session
    from together_train_server.engines.cross_session import ForwardItem

    for step in range(steps):
        items = [ForwardItem(a, return_logprobs=True, return_elementwise=True, **kw) for a, _, kw in ops]
        if plan_check:
            passes, alone, _ = cross_session._plan(eng, items)
            assert len(passes) == 1 and not alone, ("not one pass", [[o.index for o in p] for p in passes], alone)
        outs = eng.forward_many(items)
        for (a, twin, kw), out in zip(ops, outs):
            ref = eng.forward(twin, kw["samples"], kw["loss_fn"], kw.get("loss_params"), backward=kw["backward"],
                              return_logprobs=True, return_elementwise=True)
            _close_outputs(out, ref, f"step {step} {a} {kw['loss_fn']}")
            _close_grads(_grads(eng, a), _grads(eng, twin), f"step {step} {a}")
            if kw["backward"]:
                eng.optim_step(a, ADAM)
                eng.optim_step(twin, ADAM)
    for a, twin, _ in ops:
        eng.drop_adapter(a)
        eng.drop_adapter(twin)


SPECS = [
    LoraConfig(rank=4, alpha=8.0, seed=1),
    LoraConfig(rank=8, alpha=8.0, seed=2, dropout=0.2),                            # own dropout stream
    LoraConfig(rank=2, alpha=4.0, seed=3, target_modules=("q_proj", "v_proj")),    # other rank and targets
]


@pytest.mark.parametrize("loss_fn", sorted(LOSSES))
def test_each_loss_in_a_cycle_equals_its_op_alone(engine, loss_fn):
    """Three sessions (ranks 4, 8 with dropout, 2 on two targets), the same loss kind, different lengths."""
    lens = [[12, 10, 11], [14, 13], [12, 12, 9, 11]]
    ops = []
    for k, spec in enumerate(SPECS):
        a, twin = _pair(engine, spec)
        ops.append((a, twin, dict(samples=_samples(engine, loss_fn, lens[k], seed=10 + k), loss_fn=loss_fn,
                                  loss_params=LOSSES[loss_fn], backward=True)))
    _cycle_vs_alone(engine, ops)


@pytest.mark.parametrize("matmul", ["grouped", "bmm"])
def test_mixed_losses_lengths_ranks_and_forward_only(engine, matmul, monkeypatch):
    """Four kinds of loss, lengths 3..16, ranks 2..16, and a forward without backward in one pass;
    the LoRA terms by grouped products (torch._grouped_mm over each session's block of rows) and
    by per-row bmm (the fallback where grouped products are missing)."""
    from together_train_server.engines import cross_session

    monkeypatch.setattr(cross_session, "ROW_LORA_MATMUL", matmul)
    kinds = [("cross_entropy", True), ("ppo", True), ("grpo", True), ("importance_sampling", False)]
    lens = [[16, 9], [14, 13, 15], [3, 14], [10]]   # a dropout op: one micro-batch alone (joins_pass)
    ranks = [16, 2, 8, 4]
    ops = []
    for k, ((loss_fn, backward), n, r) in enumerate(zip(kinds, lens, ranks)):
        a, twin = _pair(engine, LoraConfig(rank=r, alpha=2.0 * r, seed=20 + k, dropout=0.1 * (k % 2)))
        ops.append((a, twin, dict(samples=_samples(engine, loss_fn, n, seed=30 + k), loss_fn=loss_fn,
                                  loss_params=LOSSES[loss_fn], backward=backward)))
    _cycle_vs_alone(engine, ops)


def test_a_cycle_matches_plain_torch(engine):
    """The independent reference: one cross_entropy op of a pass vs peft's own forward and autograd."""
    from together_train_server.engines.cross_session import ForwardItem

    a, _ = _pair(engine, LoraConfig(rank=4, alpha=8.0, seed=5))
    b, _ = _pair(engine, LoraConfig(rank=8, alpha=16.0, seed=6))
    for aid in (a, b):   # B != 0: LoRA changes the forward
        engine.forward(aid, random_samples([8], engine.vocab_size, seed=1), "cross_entropy", backward=True)
        engine.optim_step(aid, ADAM)
    sa, sb = random_samples([11, 9], engine.vocab_size, seed=2), random_samples([10], engine.vocab_size, seed=3)
    out = engine.forward_many([ForwardItem(a, sa, "cross_entropy", backward=True),
                               ForwardItem(b, sb, "cross_entropy", backward=True)])[0]
    got = _grads(engine, a)
    peft_model = engine.table.peft
    peft_model.set_adapter(engine.table.get(a).name)
    params = dict(engine.trainable_parameters(a))
    for p in params.values():
        p.grad = None
    loss = torch.zeros((), dtype=torch.float32)
    for s in sa:   # one unpadded forward per sample
        logits = peft_model(input_ids=torch.as_tensor(s.model_input)[None]).logits.float()
        lp = torch.log_softmax(logits, -1)[0].gather(-1, torch.as_tensor(s.inputs["target_tokens"])[:, None])[:, 0]
        loss = loss - (torch.as_tensor(s.inputs["weights"]) * lp).sum()
    loss.backward()
    want = float(loss.detach())
    assert abs(out.loss - want) <= REL * abs(want) + 1e-6, (out.loss, want)
    _close_grads(got, _grads(engine, a), "plain torch")


def test_a_bad_row_fails_only_its_op(engine):
    """A non-finite loss (q = -1e30: r = exp(p - q) overflows) and a target token past the vocabulary (found
    only in the pass) each fail their own op with the engine's error and leave its accumulated
    gradient exactly as it was; the others equal their ops alone."""
    from together_train_server.engines.cross_session import ForwardItem

    good = [_pair(engine, SPECS[0]), _pair(engine, SPECS[2])]
    bad, _ = _pair(engine, LoraConfig(rank=4, alpha=8.0, seed=9))
    engine.forward(bad, random_samples([6], engine.vocab_size, seed=4), "cross_entropy", backward=True)
    before = _grads(engine, bad)
    overflow = _samples(engine, "importance_sampling", [10, 11], seed=7)
    overflow[1].inputs["logprobs"] = np.full(11, -1e30, np.float32)
    past_vocab = random_samples([10], engine.vocab_size, seed=8)
    past_vocab[0].inputs["target_tokens"][3] = engine.vocab_size + 5
    for bad_samples, loss_fn, kind in ((overflow, "importance_sampling", FloatingPointError),
                                       (past_vocab, "cross_entropy", (IndexError, RuntimeError))):
        gs = [random_samples([12, 11], engine.vocab_size, seed=20), random_samples([10], engine.vocab_size, seed=21)]
        items = [ForwardItem(good[0][0], gs[0], "cross_entropy", backward=True, return_logprobs=True,
                             return_elementwise=True),
                 ForwardItem(bad, bad_samples, loss_fn, backward=True),
                 ForwardItem(good[1][0], gs[1], "cross_entropy", backward=True, return_logprobs=True,
                             return_elementwise=True)]
        outs = engine.forward_many(items)
        assert isinstance(outs[1], kind), outs[1]
        after = _grads(engine, bad)
        assert all(torch.equal(before[n], after[n]) for n in before if before[n] is not None), "bad op changed grads"
        for (a, twin), s, out in zip(good, gs, (outs[0], outs[2])):
            ref = engine.forward(twin, s, "cross_entropy", backward=True, return_logprobs=True,
                                 return_elementwise=True)
            _close_outputs(out, ref, f"{a} beside a bad op")
            _close_grads(_grads(engine, a), _grads(engine, twin), f"{a} beside a bad op")


def test_sessions_cycle_through_a_real_server(tmp_path):
    """Four sessions' pipelined steps (forward_backward then optim_step each, in that order) run their
    forwards as cycles (the server logs them) and equal twin sessions run one at a time, loss by loss
    over two steps."""
    import together_train as tt

    d = tiny_model(tmp_path / "llama")
    log_file = tmp_path / "server.log"
    with tt.launch_local(model=str(d), generators=0, storage_dir=tmp_path / "storage", log_file=log_file,
                         extra_args=["--trainer-threads", "1", "--batching", "on"]) as client:
        vocab = client.get_capabilities().vocab_size
        specs = [tt.LoraConfig(rank=r, alpha=2.0 * r, seed=40 + r) for r in (2, 4, 8, 4)]
        batched = [client.create_session(lora=s) for s in specs]
        alone = [client.create_session(lora=s) for s in specs]
        adam = tt.AdamParams(learning_rate=1e-2, eps=1e-4)
        got, want = [], []
        for step in range(2):
            data = [_sdk_batch(vocab, seed=100 * step + k) for k in range(len(specs))]
            futs, opt = [], []
            for s, b in zip(batched, data):   # each session's step in order: forwards overtake optim_steps
                futs.append(s.forward_backward(b, "cross_entropy"))
                opt.append(s.optim_step(adam))
            got.append([f.result(timeout=120).loss for f in futs])
            [f.result(timeout=120) for f in opt]
            row = []
            for s, b in zip(alone, data):   # one at a time: nothing else is ready
                row.append(s.forward_backward(b, "cross_entropy").result(timeout=120).loss)
                s.optim_step(adam).result(timeout=120)
            want.append(row)
        time.sleep(0.2)
    assert "clock cycle:" in log_file.read_text(), "no cycle ran"
    for step, (g, w) in enumerate(zip(got, want)):
        for k, (x, y) in enumerate(zip(g, w)):
            assert abs(x - y) <= REL * abs(y) + 1e-6, f"step {step} session {k}: {x} vs alone {y}"


def _sdk_batch(vocab: int, seed: int):
    import together_train as tt

    return [tt.Sample(model_input=s.model_input, loss_fn_inputs={"target_tokens": s.inputs["target_tokens"],
                                                                 "weights": np.abs(s.inputs["weights"])})
            for s in random_samples([9, 8], vocab, seed=seed)]


def test_a_lone_session_never_waits_the_window():
    """With a window, a lone session's forward is taken at once; one of two active sessions waits for the other."""
    import threading
    from dataclasses import dataclass as _dc

    from together_train_server.engines.cross_session import ForwardItem
    from together_train_server.service.core.scheduler import ReadyQueue
    from together_train_server.service.training.cycle import ClockCycle, CycleRun

    @_dc
    class Rec:
        operation_id: str
        session_id: str
        run: CycleRun
        tenant: str = ""
        tokens: int = 8
        terminal: bool = False

    def rec(op: str, sid: str) -> Rec:
        return Rec(op, sid, CycleRun(lambda: None, ForwardItem(sid, [], "cross_entropy")))

    cyc = ClockCycle(runtime=None, admission=None, window_s=60.0)  # type: ignore[arg-type]
    q: ReadyQueue = ReadyQueue("fifo")
    for i in range(3):   # a pipelined lone session: never the 60 s window
        q.put(rec(f"a{i}", "a"))
        t0 = time.monotonic()
        assert [r.operation_id for r in cyc.take(q)] == [f"a{i}"]
        assert time.monotonic() - t0 < 30, "a lone session's forward waited for the window"
    threading.Timer(0.2, lambda: q.put(rec("a3", "a"))).start()
    q.put(rec("b0", "b"))   # a second session: a is active, so b's lone forward waits for a partner
    assert [r.operation_id for r in cyc.take(q)] == ["b0", "a3"]
