"""The distill recipe: reverse-KL advantages against independent numbers, and short runs
(plain, and stopped + resumed) against the shared tiny-model resource with a checkpoint teacher."""

from __future__ import annotations

import json

import numpy as np
import pytest

import together_train as tt
from together_train_cookbook.recipes import distill
from together_train_cookbook.rl import Trajectory, TrajectoryGroup, Transition, build_samples
from together_train_cookbook.samples import build_cross_entropy_sample


def test_reverse_kl_advantages():
    groups = [TrajectoryGroup([Trajectory([Transition([1, 2], [5, 6], [-1.0, -2.0], [0, 0], 0.0, True)]),
                               Trajectory([Transition([1, 2], [7], [-0.5], [0], 1.0, True)])], [0.0, 0.0])]
    # teacher: one logprob per position of prompt+completion (tokens 1..): [p(2), p(5), p(6)], [p(2), p(7)]
    teacher = [np.array([-9.0, -0.25, -3.0]), np.array([-9.0, -0.75])]
    samples, masks = build_samples(groups, distill.teacher_advantages(groups, teacher))
    s0, s1 = samples
    np.testing.assert_array_equal(s0.loss_fn_inputs["target_tokens"], [2, 5, 6])
    # advantages = teacher - q on sampled tokens: -0.25 - -1 = 0.75, -3 - -2 = -1; prompt 0
    np.testing.assert_allclose(s0.loss_fn_inputs["advantages"], [0.0, 0.75, -1.0])
    np.testing.assert_allclose(s0.loss_fn_inputs["logprobs"], [0.0, -1.0, -2.0])
    np.testing.assert_array_equal(masks[0], [0, 1, 1])
    np.testing.assert_allclose(s1.loss_fn_inputs["advantages"], [0.0, -0.25])
    with pytest.raises(ValueError, match="teacher gave"):
        distill.teacher_advantages(groups, [np.zeros(2), np.zeros(2)])


def _teacher_uri(resource, name="teacher"):
    """A teacher unlike the base model: a LoRA session trained 3 steps on one sequence."""
    teacher = resource.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=3))
    s = build_cross_entropy_sample(list(range(3, 40)), [0.0] + [1.0] * 36)
    for _ in range(3):
        teacher.forward_backward([s]).result()
        teacher.optim_step(tt.AdamParams(learning_rate=5e-2)).result()
    uri = teacher.save_state(name).result().uri
    teacher.stop()
    return uri


def test_run_with_a_checkpoint_teacher(resource, tiny_model_dir, tmp_path):
    uri = _teacher_uri(resource)
    out = tmp_path / "run"
    cfg = distill.Config(model=str(tiny_model_dir), address=resource.address, teacher_checkpoint=uri, steps=3,
                         batch_size=2, num_samples=2, max_tokens=4, eval_examples=3, eval_every=0,
                         eval_max_tokens=3, lora_rank=4, lora_alpha=8.0, learning_rate=1e-2, out_dir=str(out))
    summary = distill.run(cfg)
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [-1, 0, 1, 2]
    assert abs(recs[1]["reverse_kl"]) > 1e-3  # the trained teacher differs from the fresh student
    assert all(np.isfinite(r["loss"]) and abs(r["kl_sampler"]) < 0.5 for r in recs[1:])
    assert (out / "distill.png").read_bytes()[:4] == b"\x89PNG"
    assert summary["state_uri"] and "checkpoint" in summary["teacher"]


def test_base_teacher_of_a_fresh_student_gives_zero_advantages(resource, tiny_model_dir, tmp_path):
    """Student version 0 (B = 0) is the base model: teacher - q ~ 0 (trainer/sampler gap only)."""
    out = tmp_path / "run"
    cfg = distill.Config(model=str(tiny_model_dir), address=resource.address, steps=1, batch_size=2,
                         num_samples=2, max_tokens=4, eval_examples=2, eval_every=0, eval_max_tokens=2,
                         lora_rank=4, lora_alpha=8.0, out_dir=str(out))
    distill.run(cfg)
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert abs(recs[1]["reverse_kl"]) < 1e-4


def test_stopped_and_resumed_run_matches_uninterrupted(resource, tiny_model_dir, tmp_path):
    """save_state every 2 steps; a run stopped after 2 steps and resumed from that checkpoint (with
    its optimizer; prompts and sampler seeds are functions of (seed, step)) logs the same numbers
    as an uninterrupted run: same samples (rewards, reverse KL), same updates (loss, grad norm),
    same held-out accuracy."""
    uri = _teacher_uri(resource, "teacher-resume")

    def cfg(out, **kw):
        return distill.Config(model=str(tiny_model_dir), address=resource.address, teacher_checkpoint=uri, steps=4,
                              batch_size=2, num_samples=2, max_tokens=4, eval_examples=3, eval_every=2,
                              eval_max_tokens=3, save_every=2, lora_rank=4, lora_alpha=8.0, learning_rate=1e-2,
                              out_dir=str(out), **kw)

    def recs(out):
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    full = distill.run(cfg(tmp_path / "full"))
    a = recs(tmp_path / "full")
    assert [r["step"] for r in a] == [-1, 0, 1, 2, 3]
    assert len({round(r["reverse_kl"], 6) for r in a[1:]}) > 1  # the student moves
    assert distill.run(cfg(tmp_path / "part", stop_after=2))["stopped_at"] == 2
    states = [json.loads(line) for line in (tmp_path / "part" / "states.jsonl").read_text().splitlines()]
    assert [s["step"] for s in states] == [2]
    again = distill.run(cfg(tmp_path / "part", resume=True))
    b = recs(tmp_path / "part")
    assert [r["step"] for r in b] == [r["step"] for r in a]
    for x, y in zip(a, b):
        assert x.get("held_out_accuracy") == y.get("held_out_accuracy"), (x, y)
        assert x.get("reward") == y.get("reward"), (x, y)  # the student's sampled reward
        for key in ("reverse_kl", "kl_sampler", "entropy", "loss", "grad_norm"):
            if key in x:
                assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-5), (key, x, y)
    assert again["accuracy_start"] == full["accuracy_start"] and again["accuracy_end"] == full["accuracy_end"]
    assert again["reverse_kl_last"] == pytest.approx(full["reverse_kl_last"], rel=1e-4, abs=1e-5)
