"""The rl recipe: advantages and diagnostics against hand-computed numbers, sample layout, and
short runs (sync, async, stopped + resumed) against the shared tiny-model resource."""

from __future__ import annotations

import json

import numpy as np
import pytest

from together_train_cookbook.problems import Problem, load_prompt_jsonl, make_problems
from together_train_cookbook.recipes import rl
from together_train_cookbook.rl import (GroupCentered, ProblemDataset, Trajectory, TrajectoryGroup, Transition,
                                        build_samples, group_stats, sampler_seed)
from together_train_cookbook.rl_math import group_advantages, kl_and_entropy


def test_group_advantages_hand_computed():
    # rewards 1, 0, 0, 1: mean 0.5 -> +-0.5; population std 0.5 -> +-1 (up to eps)
    np.testing.assert_allclose(group_advantages([1, 0, 0, 1]), [0.5, -0.5, -0.5, 0.5])
    np.testing.assert_allclose(group_advantages([1, 0, 0, 1], scale_by_std=True, eps=0.0), [1, -1, -1, 1])
    # rewards 3, 1, 2: mean 2, std sqrt(2/3)
    a = group_advantages([3.0, 1.0, 2.0], scale_by_std=True, eps=0.0)
    np.testing.assert_allclose(a, [1 / np.sqrt(2 / 3), -1 / np.sqrt(2 / 3), 0.0])
    # one right out of four: 1 - 1/4 = 0.75, others -0.25; std = sqrt(3)/4
    np.testing.assert_allclose(group_advantages([0, 1, 0, 0]), [-0.25, 0.75, -0.25, -0.25])
    np.testing.assert_allclose(group_advantages([0, 1, 0, 0], True, 0.0), np.array([-1, 3, -1, -1]) / np.sqrt(3))
    # constant group: no signal, finite with the default eps
    np.testing.assert_array_equal(group_advantages([1, 1, 1], scale_by_std=True), [0, 0, 0])
    with pytest.raises(ValueError):
        group_advantages([])


def test_kl_and_entropy_hand_computed():
    q = [np.array([0.0, -1.0, -2.0], np.float32), np.array([0.0, -0.5], np.float32)]
    p = [np.array([9.0, -1.5, -1.0], np.float32), np.array([9.0, -0.25], np.float32)]
    m = [np.array([0, 1, 1], np.float32), np.array([0, 1], np.float32)]
    kl, ent = kl_and_entropy(q, p, m)
    # q - p on masked: 0.5, -1.0, -0.25 -> mean -0.25; -mean q = (1 + 2 + 0.5) / 3
    assert kl == pytest.approx(-0.25) and ent == pytest.approx(3.5 / 3)


def _group(prompt, tokens, logprobs, rewards):
    """A single-turn group: one episode per completion of `prompt`."""
    return TrajectoryGroup([Trajectory([Transition(list(prompt), list(t), list(lp), [0] * len(t), float(r), True)])
                            for t, lp, r in zip(tokens, logprobs, rewards)], [0.0] * len(rewards))


def test_build_samples_layout():
    groups = [
        _group([1, 2, 3], [[7, 8], [9]], [[-0.1, -0.2], [-0.3]], [1.0, 0.0]),
        _group([4, 5], [[7], [8]], [[-1.0], [-2.0]], [1.0, 1.0]),  # no signal: skipped
    ]
    samples, masks = build_samples(groups, GroupCentered()(groups)[0])
    assert len(samples) == 2
    s0, s1 = samples
    np.testing.assert_array_equal(s0.model_input, [1, 2, 3, 7])
    np.testing.assert_array_equal(s0.loss_fn_inputs["target_tokens"], [2, 3, 7, 8])
    np.testing.assert_allclose(s0.loss_fn_inputs["logprobs"], [0, 0, -0.1, -0.2], atol=1e-7)
    np.testing.assert_array_equal(s0.loss_fn_inputs["mask"], [0, 0, 1, 1])
    np.testing.assert_allclose(s0.loss_fn_inputs["advantages"], [0, 0, 0.5, 0.5])  # action tokens only
    np.testing.assert_array_equal(s1.loss_fn_inputs["target_tokens"], [2, 3, 9])
    np.testing.assert_allclose(s1.loss_fn_inputs["advantages"], [0, 0, -0.5])
    np.testing.assert_array_equal(masks[1], [0, 0, 1])


def test_multi_turn_layout():
    """Turn 2's observation extends turn 1's observation + action: one sequence, the env's reply
    masked; a turn whose observation rewrites the history starts a new sample."""
    t1 = Transition([1, 2], [3, 4], [-0.5, -0.25], [0, 0], 0.0, False)
    t2 = Transition([1, 2, 3, 4, 5, 6], [7], [-1.0], [1], 1.0, False)
    t3 = Transition([9, 9], [8], [-2.0], [1], 0.0, True)  # not a prefix: new sample
    g = TrajectoryGroup([Trajectory([t1, t2, t3]), Trajectory([Transition([1, 2], [3], [-0.1], [0], 0.0, True)])],
                        [0.0, 0.0])
    samples, masks = build_samples([g], GroupCentered()([g])[0])  # returns 1 and 0: A = +0.5, -0.5
    assert len(samples) == 3
    a, b, c = samples
    np.testing.assert_array_equal(a.model_input, [1, 2, 3, 4, 5, 6])
    np.testing.assert_array_equal(a.loss_fn_inputs["target_tokens"], [2, 3, 4, 5, 6, 7])
    np.testing.assert_array_equal(a.loss_fn_inputs["mask"], [0, 1, 1, 0, 0, 1])
    np.testing.assert_allclose(a.loss_fn_inputs["logprobs"], [0, -0.5, -0.25, 0, 0, -1.0])
    np.testing.assert_allclose(a.loss_fn_inputs["advantages"], [0, 0.5, 0.5, 0, 0, 0.5])
    np.testing.assert_array_equal(b.loss_fn_inputs["target_tokens"], [9, 8])
    np.testing.assert_allclose(b.loss_fn_inputs["advantages"], [0, 0.5])
    np.testing.assert_allclose(c.loss_fn_inputs["advantages"], [0, -0.5])


def test_group_stats_counts_groups_with_signal():
    # 4 groups: mixed (signal), all right, all wrong, mixed
    rewards = [[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 1, 1]]
    groups = [_group([1, 2], [[3]] * 4, [[-1.0]] * 4, r) for r in rewards]
    assert group_stats(groups) == {"groups_with_signal": 2, "frac_groups_with_signal": 0.5,
                                   "frac_groups_solved": 0.25, "frac_groups_unsolved": 0.25}
    # only the groups with signal are trained: 2 groups x 4 samples
    samples, _ = build_samples(groups, GroupCentered()(groups)[0])
    assert len(samples) == 8


def test_step_prompts_and_seeds_are_functions_of_the_step():
    train = ProblemDataset(_parity_problems(50)[0], None, batch_size=5, group_size=2, seed=3)
    assert train.indices(7) == train.indices(7)
    assert train.indices(7) != train.indices(8)
    assert sampler_seed(3, 7, 0) != sampler_seed(3, 7, 1) != sampler_seed(3, 8, 1)
    assert len({sampler_seed(3, 7, 0, turn, env) for turn in range(3) for env in range(4)}) == 12


def test_prompt_jsonl(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"say {i}", "answer": str(i)}) for i in range(10)) + "\n")
    probs = load_prompt_jsonl(path)
    assert probs[3].messages == [{"role": "user", "content": "say 3"}]
    assert probs[3].reward(" 3\n") == 1.0 and probs[3].reward("3.") == 0.0
    train, test, _ = make_problems(str(path), 0, 5, seed=0)
    assert len(test) == 2 and len(train) == 8
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_prompt_jsonl(bad)


def test_prompts_from_parquet_and_a_saved_dataset(tmp_path):
    """``--data`` also reads local Hugging Face datasets (`data.load_rows`): Parquet and save_to_disk."""
    import datasets

    ds = datasets.Dataset.from_list([{"prompt": f"say {i}", "answer": str(i)} for i in range(5)])
    ds.to_parquet(str(tmp_path / "p.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    for path in (tmp_path / "p.parquet", tmp_path / "saved"):
        probs = load_prompt_jsonl(path)
        assert [p.messages[0]["content"] for p in probs] == [f"say {i}" for i in range(5)]
        assert probs[2].reward("2") == 1.0 and probs[2].reward("3") == 0.0
    datasets.Dataset.from_list([{"question": "x"}]).to_parquet(str(tmp_path / "bad.parquet"))
    with pytest.raises(ValueError, match="bad.parquet row 0"):
        load_prompt_jsonl(tmp_path / "bad.parquet")


def _parity_problems(n_train=40, n_test=4):
    """Prompts for the tiny random model with a reward it earns about half the time
    (even-length response), so groups carry signal."""
    def mk(i):
        return Problem([{"role": "user", "content": f"Say something {i}."}], "", lambda r: len(r) % 2 == 0)
    return [mk(i) for i in range(n_train)], [mk(1000 + i) for i in range(n_test)]


def _cfg(tiny_model_dir, resource, out, **kw):
    base = dict(model=str(tiny_model_dir), address=resource.address, steps=4, batch_size=2, num_samples=4,
                max_tokens=4, eval_examples=4, eval_every=2, eval_max_tokens=3, save_every=2,
                lora_rank=4, lora_alpha=8.0, learning_rate=1e-2, out_dir=str(out))
    base.update(kw)
    return rl.Config(**base)


def _steps(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("loss", ["ppo", "grpo"])
def test_sync_run(resource, tiny_model_dir, tmp_path, loss):
    out = tmp_path / "run"
    summary = rl.run(_cfg(tiny_model_dir, resource, out, loss=loss, tensorboard=loss == "grpo"), problems=_parity_problems())
    recs = _steps(out)
    assert [r["step"] for r in recs] == [-1, 0, 1, 2, 3]
    trained = [r for r in recs if r.get("trained_samples")]
    assert trained, "the parity reward should give some group a signal"
    for r in trained:
        assert r["staleness"] == 0 and abs(r["kl_sampler"]) < 1e-3 and r["entropy"] > 0
    assert "held_out_accuracy" in recs[2] and "held_out_accuracy" in recs[4]
    assert (out / "rl.png").read_bytes()[:4] == b"\x89PNG"
    if loss == "grpo":  # --tensorboard: the same records as event files (ml_log)
        assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert summary["adapter_uri"].startswith("together-train://")
    assert summary["state_uri"].startswith("together-train://")


def _same(a, b):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        for key in ("reward", "trained_samples", "held_out_accuracy", "sampler_version", "staleness"):
            assert x.get(key) == y.get(key), (key, x, y)
        for key in ("loss", "kl_sampler", "entropy", "grad_norm"):
            if key in x:
                assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-5), (key, x, y)


@pytest.fixture(scope="module")
def resource64(tiny_model_dir, tmp_path_factory):
    """A float64 resource: the resume comparison below must not depend on which requests the
    generator happens to batch together. On the near-uniform tiny random model a float32 change
    in the last bit (another batch shape) flips sampled tokens about 1 % of the time, and the
    async loop overlaps requests by design; float64 makes those flips vanishingly rare."""
    import together_train as tt

    with tt.launch_local(model=str(tiny_model_dir), generators=1, storage_dir=tmp_path_factory.mktemp("storage64"),
                         extra_args=["--dtype", "float64", "--trainer-threads", "1", "--generator-threads", "1"]) as c:
        yield c


def test_async_run_stopped_and_resumed_matches_uninterrupted(resource64, tiny_model_dir, tmp_path):
    resource = resource64
    probs = _parity_problems()
    full = tmp_path / "full"
    rl.run(_cfg(tiny_model_dir, resource, full, async_mode=True), problems=probs)
    recs = _steps(full)
    trained = [r for r in recs if r.get("trained_samples")]
    assert trained and all(r["staleness"] == (0 if r["step"] == 0 else 1) for r in trained)

    part = tmp_path / "part"
    stopped = rl.run(_cfg(tiny_model_dir, resource, part, async_mode=True, stop_after=2), problems=probs)
    assert stopped["stopped_at"] == 2
    states = [json.loads(line) for line in (part / "states.jsonl").read_text().splitlines()]
    assert [s["step"] for s in states] == [2] and states[0]["extra"]["rollouts"]["step"] == 2
    rl.run(_cfg(tiny_model_dir, resource, part, async_mode=True, resume=True), problems=probs)
    _same(recs, _steps(part))


def test_init_from_a_checkpoint(resource, tiny_model_dir, tmp_path):
    import together_train as tt

    s = resource.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=1))
    uri = s.save_state("init").result().uri
    s.stop()
    out = tmp_path / "run"
    rl.run(_cfg(tiny_model_dir, resource, out, steps=1, init_from=uri, eval_at_start=False), problems=_parity_problems())
    assert [r["step"] for r in _steps(out)] == [0]


def test_flags():
    cfg = rl.parse_args(["--loss", "cispo", "--async-mode", "--num-samples", "8", "--scale-by-std"])
    assert (cfg.loss, cfg.async_mode, cfg.num_samples, cfg.scale_by_std) == ("cispo", True, 8, True)
    with pytest.raises(SystemExit):
        rl.parse_args(["--loss", "nope"])


def test_new_cookbook_modules_import_neither_torch_nor_server():
    import subprocess
    import sys

    mods = ("cli", "connection", "evaluation", "run_state", "checkpoint_refs", "jsonl", "display", "tokenizer",
            "problems", "rl_math", "recipes.rl", "recipes.main", "recipes.dpo", "recipes.distill",
            "rl", "rl.train", "envs.arithmetic_dialogue", "examples.guess_number", "agents", "recipes.agent_rl",
            "examples.openai_agent")
    code = (
        "import importlib, sys\n"
        f"for m in {mods!r}:\n"
        "    try:\n"
        "        importlib.import_module('together_train_cookbook.' + m)\n"
        "    except ModuleNotFoundError as e:\n"
        "        if 'together_train_cookbook' not in str(e): raise\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'together_train_server', 'transformers', 'matplotlib'))\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_init_from_a_run_dir(resource, tiny_model_dir, tmp_path):
    """``--init-from <run dir>`` (its summary.json ``state_uri``), as `sft --out-dir A` then `rl --init-from A`."""
    import together_train as tt

    s = resource.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=1))
    uri = s.save_state("init").result().uri
    s.stop()
    run_dir = tmp_path / "sft"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"state_uri": uri}))
    out = tmp_path / "run"
    rl.run(_cfg(tiny_model_dir, resource, out, steps=1, init_from=str(run_dir), eval_at_start=False),
           problems=_parity_problems())
    assert [r["step"] for r in _steps(out)] == [0]
