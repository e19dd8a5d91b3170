"""The sft recipe: config flags, data, batching and schedule (no server), plus one
short run against the shared tiny-model resource of conftest."""

from __future__ import annotations

import json

import pytest

from together_train_cookbook.supervised import ShuffledDataset
from together_train_cookbook.recipes.sft import (
    Config,
    learning_rate_at,
    load_chats,
    make_data,
    parse_args,
    run,
)


def test_flags_come_from_the_dataclass():
    cfg = parse_args([])
    assert cfg == Config()
    cfg = parse_args(
        ["--data", "x.jsonl", "--lora-rank", "8", "--learning-rate", "3e-4", "--steps", "7",
         "--out-dir", "o", "--address", "h:1"]
    )
    assert (cfg.data, cfg.lora_rank, cfg.learning_rate, cfg.steps, cfg.out_dir, cfg.address) == (
        "x.jsonl", 8, 3e-4, 7, "o", "h:1"
    )
    assert cfg.model is None
    with pytest.raises(SystemExit):
        parse_args(["--no-such-flag"])


def test_default_data_is_the_arithmetic_task():
    cfg = Config(steps=5, batch_size=4, eval_examples=10)
    chats, items, desc = make_data(cfg)
    assert len(chats) == 20 and len(items) == 10
    assert "arithmetic" in desc
    assert chats[0][-1]["role"] == "assistant"
    it = items[0]
    assert it.is_correct(it.reference) and not it.is_correct(it.reference + ".")
    prompts = {json.dumps(c[:-1]) for c in chats}
    assert not any(json.dumps(i.prompt) in prompts for i in items)  # disjoint


def test_jsonl_data(tmp_path):
    path = tmp_path / "chats.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(20)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    chats, items, _ = make_data(Config(data=str(path), eval_examples=3))
    assert len(chats) == 17 and len(items) == 3
    assert items[0].is_correct(" " + items[0].reference + "\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "q"}]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: no assistant"):
        load_chats(bad)
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match="not JSON"):
        load_chats(bad)


def test_batches_steps_and_epochs():
    """Seeded per-epoch permutations read as one stream; a step's batch does not depend on
    which batches were asked for before (what exact --resume needs)."""
    data = list(range(10))
    ds = ShuffledDataset(data, batch_size=3, seed=1)
    plan = [ds.get_batch(k) for k in range(7)]
    assert len(plan) == 7 and all(len(b) == 3 for b in plan) and 7 * 3 / len(ds) == pytest.approx(2.1)
    assert sorted(sum(plan[:4], [])[:10]) == data  # first epoch is a permutation
    assert sorted(sum(plan[3:], [])[1:11]) == data  # so is the second (stream items 10..19)
    assert ShuffledDataset(data, 3, seed=1).get_batch(6) == plan[6]  # asked first, same batch
    assert ShuffledDataset(data, 3, seed=2).get_batch(0) != plan[0]
    assert ShuffledDataset(data, batch_size=4).steps_for_epochs(2) == 5
    with pytest.raises(ValueError, match="batch_size"):
        ShuffledDataset(data, 0)


def test_learning_rate_schedule():
    cfg = Config(learning_rate=1.0, lr_schedule="linear", warmup_steps=2)
    lrs = [learning_rate_at(s, 10, cfg) for s in range(10)]
    assert lrs[:2] == [0.5, 1.0] and lrs[2] == 1.0 and lrs[-1] == pytest.approx(1 / 8)
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))
    const = Config(learning_rate=0.1, lr_schedule="constant")
    assert {learning_rate_at(s, 5, const) for s in range(5)} == {0.1}
    with pytest.raises(ValueError):
        learning_rate_at(0, 5, Config(lr_schedule="cosine"))


def test_short_run_against_a_resource(resource, tiny_model_dir, tmp_path):
    """Through a real resource (tiny random model): files written, steps logged."""
    cfg = Config(
        model=str(tiny_model_dir), address=resource.address, steps=3, batch_size=2,
        eval_examples=3, eval_max_tokens=3, out_dir=str(tmp_path / "run"), lora_rank=4,
    )
    summary = run(cfg)
    out = tmp_path / "run"
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, 1, 2]
    for r in recs:
        assert r["loss"] == pytest.approx(r["loss_sum"] / r["weight_sum"])
        assert r["grad_norm"] > 0 and r["seconds"] >= 0
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert summary["policy_version"] == 3
    assert 0.0 <= summary["accuracy_after"] <= 1.0
    assert summary["adapter_uri"].startswith("together-train://")
    assert len((out / "eval.jsonl").read_text().splitlines()) == 6


def test_cookbook_imports_neither_torch_nor_server():
    import subprocess
    import sys

    code = (
        "import sys, together_train_cookbook, together_train_cookbook.recipes.sft, "
        "together_train_cookbook.tasks, together_train_cookbook.plotting, together_train_cookbook.metrics\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'together_train_server', 'transformers', 'matplotlib'))\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_stopped_and_resumed_run_matches_uninterrupted(resource, tiny_model_dir, tmp_path):
    """save_state every 2 steps; a run stopped after 2 steps and resumed (session recreated from
    its checkpoint with the optimizer) logs the same per-step numbers and reaches the same
    final accuracy and policy version as an uninterrupted run with the same seeds."""

    def cfg(out, **kw):
        return Config(model=str(tiny_model_dir), address=resource.address, steps=5, batch_size=2,
                      eval_examples=3, eval_max_tokens=3, lora_rank=4, learning_rate=1e-2, save_every=2,
                      out_dir=str(out), **kw)

    def recs(out):
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    full = run(cfg(tmp_path / "full"))
    states = [json.loads(line) for line in (tmp_path / "full" / "states.jsonl").read_text().splitlines()]
    assert [s["step"] for s in states] == [2, 4, 5]
    assert full["state_uri"] == states[-1]["uri"]

    stopped = run(cfg(tmp_path / "part", stop_after=3))
    assert stopped["stopped_at"] == 3
    assert [r["step"] for r in recs(tmp_path / "part")] == [0, 1, 2]
    resumed = run(cfg(tmp_path / "part", resume=True))
    a, b = recs(tmp_path / "full"), recs(tmp_path / "part")
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]
    for x, y in zip(a, b):
        assert y["weight_sum"] == x["weight_sum"] and y["lr"] == pytest.approx(x["lr"], rel=1e-12)
        for key in ("loss", "loss_sum", "grad_norm"):
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-5), (key, x, y)
    assert resumed["accuracy_before"] == full["accuracy_before"]
    assert resumed["accuracy_after"] == full["accuracy_after"]
    assert resumed["policy_version"] == full["policy_version"]
    after = lambda out: [r["response"] for r in map(json.loads, (out / "eval.jsonl").read_text().splitlines())]  # noqa: E731
    assert after(tmp_path / "part") == after(tmp_path / "full")
