"""lm-eval's ``local-completions`` runs a loglikelihood (multiple-choice) task against ``/v1/completions``
and gets what plain transformers gives on the same model.

A small local task (JSONL, ``dataset_path: json``, the task YAML written here) of 24 questions with
4 choices each; lm-eval scores every (question, choice) pair with ``echo=true, logprobs=1,
max_tokens=1`` requests (token ids, its own tokenizer: ``tokenizer=<model dir>``) against a real
resource on the tiny model, and the same task through lm-eval's ``hf`` model (plain transformers,
float32, CPU). Equal: the accuracy, and each pair's loglikelihood within 2e-4 (the replica's and
transformers' float32 forwards differ in kernel shapes; tests/conformance/test_openai_api.py's logprob bound).
"""

from __future__ import annotations

import json
import random

import pytest

import together_train as tt

lm_eval = pytest.importorskip("lm_eval")

WORDS = ["red", "blue", "green", "cat", "dog", "house", "river", "tree", "stone", "light", "cloud", "music"]


def _task(tmp_path):
    rng = random.Random(0)
    with open(tmp_path / "mc.jsonl", "w") as f:
        for i in range(24):
            choices = rng.sample(WORDS, 4)
            f.write(json.dumps({"question": f"Question {i}: which word comes next after {rng.choice(WORDS)}?",
                                "choices": choices, "answer": rng.randrange(4)}) + "\n")
    (tmp_path / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp_path / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""")
    return tmp_path


def _evaluate(model: str, model_args: str, include_path) -> tuple[float, list[float]]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(model=model, model_args=model_args, tasks=["tiny_mc"], batch_size=1, log_samples=True,
                          task_manager=TaskManager(include_path=str(include_path)))
    samples = sorted(out["samples"]["tiny_mc"], key=lambda s: s["doc_id"])
    lls = [float(r[0]) for s in samples for r in s["filtered_resps"]]
    return out["results"]["tiny_mc"]["acc,none"], lls


def test_local_completions_multiple_choice_equals_plain_transformers(tiny_model_dir, tmp_path):
    include = _task(tmp_path)
    with tt.launch_local(model=str(tiny_model_dir), generators=1, storage_dir=tmp_path / "storage", http_port=0,
                         extra_args=["--trainer-threads", "1", "--generator-threads", "1"]) as client:
        url = f"{client.local_resource.http_url}/v1/completions"
        served_acc, served = _evaluate("local-completions", f"model={tiny_model_dir.name},base_url={url},"
                                       f"tokenizer={tiny_model_dir},tokenizer_backend=huggingface,num_concurrent=1,"
                                       "max_retries=1", include)
    plain_acc, plain = _evaluate("hf", f"pretrained={tiny_model_dir},dtype=float32,device=cpu", include)
    print(f"lm-eval tiny_mc: local-completions acc {served_acc:.4f}, hf acc {plain_acc:.4f} ({len(served)} pairs)")
    assert len(served) == len(plain) == 24 * 4
    worst = max(abs(a - b) for a, b in zip(served, plain))
    assert worst <= 2e-4, (worst, served[:8], plain[:8])
    assert served_acc == plain_acc
