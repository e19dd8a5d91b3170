"""The dpo recipe: the DPO loss against hand-computed numbers, pairs, and short runs (plain and
stopped + resumed) against the shared tiny-model resource."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import together_train as tt
from together_train_cookbook.custom_loss import dpo_loss
from together_train_cookbook.recipes import dpo
from together_train_cookbook.supervised.dpo import preference_stats
from together_train_cookbook.tasks import ArithmeticExample


def _sample(n):
    return tt.Sample(model_input=np.zeros(n, np.int64),
                     loss_fn_inputs={"target_tokens": np.zeros(n, np.int64), "weights": np.array([0] + [1] * (n - 1), np.float32)})


def test_dpo_loss_hand_computed():
    # one pair, beta 0.1: policy sums pi_c = -3, pi_r = -6 (weights drop position 0), ref_c = -5, ref_r = -5
    # z = 0.1 * ((-3 + 5) - (-6 + 5)) = 0.3; L = log(1 + e^-0.3) = 0.554355...; dL/dp = -+0.1 * sigmoid(-0.3)
    fn = dpo_loss([-5.0], [-5.0], beta=0.1)
    samples = [_sample(3), _sample(4)]
    lp = [np.array([9.0, -1.0, -2.0]), np.array([9.0, -1.0, -2.0, -3.0])]
    loss, grads, m = fn(samples, lp)
    assert loss == pytest.approx(math.log1p(math.exp(-0.3)), rel=1e-12)
    assert loss == pytest.approx(0.5543552444685271, rel=1e-12)
    g = 0.1 / (1 + math.exp(0.3))
    np.testing.assert_allclose(grads[0], [0, -g, -g])
    np.testing.assert_allclose(grads[1], [0, g, g, g])
    assert m["dpo_accuracy:mean"] == 1.0 and m["dpo_margin:mean"] == pytest.approx(3.0)
    # two pairs sum; finite differences of the loss match the gradient
    fn2 = dpo_loss([-5.0, -1.0], [-5.0, -2.0], beta=0.5)
    s2 = [_sample(3), _sample(3), _sample(2), _sample(2)]
    lp2 = [np.array([0.0, -1.0, -2.0]), np.array([0.0, -3.0, -1.0]), np.array([0.0, -0.5]), np.array([0.0, -0.7])]
    loss2, grads2, _ = fn2(s2, lp2)
    z = np.array([0.5 * ((-3 + 5) - (-4 + 5)), 0.5 * ((-0.5 + 1) - (-0.7 + 2))])
    assert loss2 == pytest.approx(float(np.sum(np.log1p(np.exp(-z)))), rel=1e-12)
    eps = 1e-6
    for i in range(4):
        for t in range(len(lp2[i])):
            up = [x.copy() for x in lp2]
            up[i][t] += eps
            fd = (fn2(s2, up)[0] - loss2) / eps
            assert fd == pytest.approx(grads2[i][t], abs=1e-5)


def test_preference_stats_and_pairs():
    st = preference_stats(np.array([-1.0, -3.0, -2.0, -1.0]), np.array([-2.0, -2.0, -2.0, -2.0]), beta=0.1)
    # d = [1, -1, 0, 1]; margins: 2, -1
    assert st == pytest.approx({"accuracy": 0.5, "margin": 0.5, "chosen_reward": 0.05, "rejected_reward": 0.0})
    ex = ArithmeticExample(47, 85)
    w = dpo.wrong_answer(ex, 0)
    assert w != "132" and int(w) - 132 in (-10, -2, -1, 1, 2, 10) and w == dpo.wrong_answer(ex, 0)
    train, test, _ = dpo.make_pairs(dpo.Config(train_examples=20, eval_examples=5))
    assert len(train) == 20 and len(test) == 5 and train[0].chosen != train[0].rejected


def test_pairs_jsonl(tmp_path):
    p = tmp_path / "pairs.jsonl"
    p.write_text("\n".join(json.dumps({"prompt": f"q{i}", "chosen": "yes", "rejected": "no"}) for i in range(10)))
    pairs = dpo.load_pairs(p)
    assert pairs[0].prompt == [{"role": "user", "content": "q0"}]
    train, test, _ = dpo.make_pairs(dpo.Config(data=str(p), eval_examples=5))
    assert len(test) == 2 and len(train) == 8
    p.write_text('{"prompt": "q"}\n')
    with pytest.raises(ValueError, match="pairs.jsonl:1"):
        dpo.load_pairs(p)


def _cfg(tiny_model_dir, resource, out, **kw):
    base = dict(model=str(tiny_model_dir), address=resource.address, steps=4, batch_size=2, eval_examples=4,
                eval_every=2, eval_max_tokens=3, save_every=2, lora_rank=4, lora_alpha=8.0, learning_rate=1e-2,
                beta=0.5, rejected="given", out_dir=str(out))
    base.update(kw)
    return dpo.Config(**base)


def _recs(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_run_learns_and_resumes_exactly(resource, tiny_model_dir, tmp_path):
    full = tmp_path / "full"
    summary = dpo.run(_cfg(tiny_model_dir, resource, full))
    recs = _recs(full)
    assert [r["step"] for r in recs] == [-1, 0, 1, 2, 3]
    steps = recs[1:]
    assert steps[0]["margin"] == pytest.approx(0.0, abs=1e-4)  # policy == reference before the first update
    # held-out readouts at the start: implicit rewards all 0 (ties count as wrong), the policy's
    # own ranking pi_c > pi_r is whatever the start model does
    assert recs[0]["held_out_margin"] == pytest.approx(0.0, abs=1e-4)
    assert recs[0]["held_out_pref_accuracy"] <= 0.5
    assert 0.0 <= recs[0]["held_out_likelihood_accuracy"] <= 1.0
    assert summary["held_out_margin_end"] == steps[-1]["held_out_margin"]
    assert summary["held_out_likelihood_accuracy_start"] == recs[0]["held_out_likelihood_accuracy"]
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert (full / "dpo.png").read_bytes()[:4] == b"\x89PNG"
    assert summary["held_out_answer_accuracy_end"] is not None and summary["state_uri"]

    part = tmp_path / "part"
    assert dpo.run(_cfg(tiny_model_dir, resource, part, stop_after=2))["stopped_at"] == 2
    dpo.run(_cfg(tiny_model_dir, resource, part, resume=True))
    again = _recs(part)
    assert [r["step"] for r in again] == [r["step"] for r in recs]
    for a, b in zip(recs, again):
        for key, v in a.items():
            if key == "seconds":
                continue
            assert b[key] == pytest.approx(v, rel=1e-4, abs=1e-5), (key, a, b)


def test_init_from_a_run_dir_copies_its_checkpoint_into_local_storage(tmp_path):
    """`sft --out-dir A` then `dpo --init-from A` on two separate local resources: A's checkpoint
    (in A/storage) is copied into the new run's storage under the same session/kind/name."""
    from together_train_cookbook.checkpoint_refs import resolve_init_from
    from together_train_cookbook.connection import local_storage

    run_dir = tmp_path / "sft"
    ck = run_dir / "storage" / "sessions" / "s-abc" / "state" / "sft-step000010-s-abc"
    ck.mkdir(parents=True)
    (ck / "manifest.json").write_text("{}")
    (ck / "adapter.safetensors").write_bytes(b"12345")
    uri = "together-train://s-abc/state/sft-step000010-s-abc"
    (run_dir / "summary.json").write_text(json.dumps({"state_uri": uri}))
    dst = tmp_path / "dpo" / "storage"
    assert resolve_init_from(str(run_dir), dst) == uri
    copied = dst / "sessions" / "s-abc" / "state" / "sft-step000010-s-abc"
    assert (copied / "adapter.safetensors").read_bytes() == b"12345" and (copied / "manifest.json").is_file()
    assert not [p for p in copied.parent.iterdir() if p.name.startswith(".tmp-")]
    assert resolve_init_from(str(run_dir), dst) == uri  # already there: left as is
    assert resolve_init_from(uri, dst) == uri  # a URI is taken as is
    cfg = dpo.Config(out_dir=str(tmp_path / "o"))
    assert local_storage(cfg, tmp_path / "o", None) == tmp_path / "o" / "storage"
    assert local_storage(dpo.Config(address="h:1"), tmp_path / "o", None) is None
    with pytest.raises(SystemExit, match="not a checkpoint URI"):
        resolve_init_from(str(tmp_path / "nothing"), dst)


def test_online_rejected_replies_and_resume(resource, tiny_model_dir, tmp_path):
    """--rejected sampled: rejected replies are the policy's own wrong samples (the tiny random
    model never answers right, so every pair gets one); a stopped + resumed run samples the same
    replies from the restored weights and logs the same numbers as an uninterrupted one. The
    uninterrupted run uses the default (auto = sampled for the arithmetic task)."""
    assert dpo.Config().rejected == "auto"
    full = tmp_path / "full"
    dpo.run(_cfg(tiny_model_dir, resource, full, rejected="auto", num_samples=2, max_tokens=4))
    recs = _recs(full)
    steps = recs[1:]
    assert [r["step"] for r in steps] == [0, 1, 2, 3]
    assert all(r["sampled_rejected"] == 1.0 and r["sample_accuracy"] == 0.0 for r in steps)
    assert steps[0]["margin"] == pytest.approx(0.0, abs=1e-4)
    part = tmp_path / "part"
    assert dpo.run(_cfg(tiny_model_dir, resource, part, rejected="sampled", num_samples=2, max_tokens=4,
                        stop_after=2))["stopped_at"] == 2
    dpo.run(_cfg(tiny_model_dir, resource, part, rejected="sampled", num_samples=2, max_tokens=4, resume=True))
    again = _recs(part)
    assert [r["step"] for r in again] == [r["step"] for r in recs]
    for a, b in zip(recs, again):
        for key, v in a.items():
            if key != "seconds":
                assert b[key] == pytest.approx(v, rel=1e-4, abs=1e-5), (key, a, b)
    with pytest.raises(ValueError, match="needs a checker"):
        dpo.run(dpo.Config(data="pairs.jsonl", rejected="sampled", out_dir=str(tmp_path / "x")))
