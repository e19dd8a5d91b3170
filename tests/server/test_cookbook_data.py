"""Datasets users already have: our JSONL, and Hugging Face ``datasets`` on local disk (JSON,
Parquet, ``save_to_disk`` dirs) through `data.load_rows`, the chat / preference loaders, and the
SFT recipe on the tiny model; a hub name or a missing path is refused with one clear line."""

from __future__ import annotations

import json

import datasets
import pytest

from together_train_cookbook.data import load_rows
from together_train_cookbook.recipes import dpo, sft
from together_train_cookbook.supervised.chat import load_chats
from together_train_cookbook.supervised.preference import load_pairs


def _chats(n, start=0):
    return [{"messages": [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": str(i)}],
             "id": i} for i in range(start, start + n)]


def test_every_local_format_gives_the_same_rows(tmp_path):
    rows = _chats(5)
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    (tmp_path / "c.json").write_text(json.dumps(rows))  # a JSON array
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "c.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(_chats(2, 100))}).save_to_disk(str(tmp_path / "dd"))
    for name in ("c.jsonl", "c.json", "c.parquet", "saved", "dd"):
        assert load_rows(tmp_path / name) == rows, name
    assert [r["id"] for r in load_rows(tmp_path / "dd", split="test")] == [100, 101]
    assert [r["id"] for r in load_rows(tmp_path / "c.parquet", split="train[:2]")] == [0, 1]
    assert load_chats(tmp_path / "c.parquet") == [r["messages"] for r in rows]
    with pytest.raises(ValueError, match=r"no split 'valid' \(splits: \['train', 'test'\]\)"):
        load_rows(tmp_path / "dd", split="valid")


def test_missing_paths_and_hub_names_are_refused(tmp_path):
    with pytest.raises(ValueError, match="no such file or directory.*never downloaded"):
        load_rows("HuggingFaceH4/ultrachat_200k")
    with pytest.raises(ValueError, match=f"{tmp_path / 'nope.parquet'}: no such file or directory"):
        load_rows(tmp_path / "nope.parquet")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        load_rows(tmp_path / "x.csv")
    (tmp_path / "list.jsonl").write_text('{"messages": []}\n[1, 2]\n')
    with pytest.raises(ValueError, match="list.jsonl:2: expected a JSON object"):
        load_rows(tmp_path / "list.jsonl")
    datasets.Dataset.from_list([{"text": "no messages"}]).to_parquet(str(tmp_path / "bad.parquet"))
    with pytest.raises(ValueError, match=r"bad.parquet row 0: expected \{\"messages\""):
        load_chats(tmp_path / "bad.parquet")


@pytest.mark.parametrize("argv,expect", [
    (["--data", "HuggingFaceH4/ultrachat_200k"], "--data HuggingFaceH4/ultrachat_200k: no such file or directory"),
    (["--eval-data", "org/held-out"], "--eval-data org/held-out: no such file or directory"),
])
def test_recipe_refuses_a_hub_name_with_one_line(argv, expect, tmp_path):
    with pytest.raises(SystemExit) as e:
        sft.main(argv + ["--out-dir", str(tmp_path / "run")])
    msg = str(e.value.code)
    assert expect in msg and "never downloaded" in msg and "\n" not in msg, msg
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("recipe,content,expect", [
    ("sft", "not json\n", "bad.jsonl:1: not JSON"),
    ("sft", '{"messages": [{"role": "user", "content": "hi"}]}\n', "bad.jsonl:1: no assistant message to train on"),
    ("dpo", '{"prompt": "hi"}\n', "bad.jsonl:1: expected"),
    ("rl", '{"messages": []}\n', "bad.jsonl:1: expected"),
])
def test_recipe_refuses_bad_data_content_with_one_line(recipe, content, expect, tmp_path, monkeypatch):
    """A data file whose rows are wrong ends the recipe with one line naming the file and line, no traceback,
    before any resource is started (launch_local is made to fail loudly if it is reached)."""
    import importlib

    import together_train as tt

    def no_resource(*a, **k):
        raise AssertionError("a resource was started before the data was checked")

    monkeypatch.setattr(tt, "launch_local", no_resource)
    (tmp_path / "bad.jsonl").write_text(content)
    mod = importlib.import_module(f"together_train_cookbook.recipes.{recipe}")
    with pytest.raises(SystemExit) as e:
        mod.main(["--data", str(tmp_path / "bad.jsonl"), "--steps", "1", "--out-dir", str(tmp_path / "run")])
    msg = str(e.value.code)
    assert msg.startswith(f"{recipe}: ") and expect in msg and "\n" not in msg, msg


def test_preference_rows_from_parquet_and_whole_conversations(tmp_path):
    rows = [{"prompt": "2+2?", "chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
             "rejected": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5"}]},
            {"chosen": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}],
             "rejected": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "3"}]}]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "p.parquet"))
    pairs = load_pairs(tmp_path / "p.parquet")
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [
        ([{"role": "user", "content": "2+2?"}], "4", "5"), ([{"role": "user", "content": "1+1?"}], "2", "3")]
    train, test, _ = dpo.make_pairs(dpo.Config(data=str(tmp_path / "p.parquet"), eval_data=str(tmp_path / "p.parquet"),
                                               eval_examples=1))
    assert len(train) == 2 and len(test) == 1


def test_sft_trains_on_parquet_and_evaluates_on_a_saved_dataset(resource, tiny_model_dir, tmp_path):
    """The SFT recipe's command line with --data a Parquet file and --eval-data a save_to_disk
    dir (a DatasetDict's split dir), on the tiny model: every step logged (and TensorBoard event
    files written), every held-out chat evaluated before and after."""
    datasets.Dataset.from_list(_chats(12)).to_parquet(str(tmp_path / "train.parquet"))
    datasets.DatasetDict({"test": datasets.Dataset.from_list(_chats(3, 50))}).save_to_disk(str(tmp_path / "held"))
    out = tmp_path / "run"
    assert sft.main(["--model", str(tiny_model_dir), "--address", resource.address, "--data",
                     str(tmp_path / "train.parquet"), "--eval-data", str(tmp_path / "held" / "test"),
                     "--steps", "2", "--batch-size", "4", "--lora-rank", "4", "--eval-max-tokens", "2",
                     "--tensorboard", "--out-dir", str(out)]) == 0
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, 1] and all(r["weight_sum"] > 0 for r in recs)
    evals = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["when"] for e in evals] == ["before"] * 3 + ["after"] * 3
    assert [e["reference"] for e in evals[:3]] == ["50", "51", "52"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_examples"] == 3 and summary["steps"] == 2
    assert list((out / "tensorboard").glob("events.out.tfevents*"))  # --tensorboard: the loop's logger wrote events


def test_supervised_modules_import_neither_torch_nor_datasets():
    """JSONL users need no `datasets`; nothing here imports torch or the server."""
    import subprocess
    import sys

    code = (
        "import sys, together_train_cookbook.data, together_train_cookbook.supervised, "
        "together_train_cookbook.supervised.chat, together_train_cookbook.supervised.preference, "
        "together_train_cookbook.recipes.sft, together_train_cookbook.recipes.dpo\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'together_train_server', 'transformers', 'matplotlib', 'datasets', 'pyarrow'))\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
