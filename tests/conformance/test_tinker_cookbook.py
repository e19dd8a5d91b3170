"""tinker-cookbook 0.6.1's recipes, unchanged, against a real resource's Tinker-compatible HTTP port.

One real `together-train serve` process (tiny random Llama with the SmolLM2
tokenizer, one generator replica) serves `--http-port`; each recipe's CLI runs
in its own Python process exactly as a Tinker user runs it, with only
`base_url` and a `tml-` key (TINKER_API_KEY) changed. `model_name` is the model
directory (the resource accepts it as base_model and the cookbook loads its
tokenizer offline); `qwen3_instruct` is SmolLM2's ChatML template.

tinker-cookbook is installed by scripts/setup.sh with --no-deps (its
tml-renderers dependency is not on the package index); the module skips when
it is absent.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("tinker_cookbook.recipes.chat_sl.train")
pytest.importorskip("tinker_cookbook.recipes.math_rl.train")

KEY = "k-cookbook-test"  # the key file line; the recipes send TINKER_API_KEY = "tml-" + KEY
RENDERER = "qwen3_instruct"


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    """(gRPC ResourceClient, HTTP base url) of one resource with an API key and the HTTP port on."""
    import together_train as tt

    with tt.launch_local(
        model=str(tiny_model_dir),
        generators=1,
        storage_dir=tmp_path_factory.mktemp("cookbook-storage"),
        api_key=KEY,
        http_port=0,
        extra_args=["--max-sessions", "16", "--trainer-threads", "1", "--generator-threads", "1"],
    ) as client:
        yield client, client.http_url


def _run_recipe(module: str, args: list[str], url: str, cwd) -> None:
    """Run `python -m module key=value ...` the way a Tinker user does; fail with its output's tail."""
    env = dict(os.environ, TINKER_API_KEY="tml-" + KEY, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", module, *args, f"base_url={url}", "behavior_if_log_dir_exists=delete"],
                       env=env, cwd=cwd, capture_output=True, text=True, timeout=420)
    assert r.returncode == 0, f"{module} exited {r.returncode}:\n{(r.stdout + r.stderr)[-6000:]}"


def _metrics(log_dir) -> list[dict]:
    with open(log_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def _final_checkpoint(log_dir) -> dict:
    with open(log_dir / "checkpoints.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows[-1]


def _write_conversations(path, n: int = 16) -> None:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {i} plus one?"},
                                             {"role": "assistant", "content": f"{i} plus one is {i + 1}."}]}) + "\n")


def _reference_first_batch_nll(model_dir: str, data_path: str, batch_size: int, max_length: int) -> float:
    """The cookbook's own first batch (same builder, epoch 0), scored by plain transformers.

    -sum(w * log p(target)) / sum(w) over the batch: the recipe's step-0 train_mean_nll, taken before any
    optimizer step, so the LoRA adapter (B = 0 at init) leaves the base model unchanged.
    """
    import torch
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
    from transformers import AutoModelForCausalLM

    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=model_dir, renderer_name=RENDERER,
                                            max_length=max_length, batch_size=batch_size)
    train_ds, _ = FromConversationFileBuilder(common_config=common, file_path=data_path)()
    train_ds.set_epoch(seed=0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    num = den = 0.0
    with torch.no_grad():
        for d in train_ds.get_batch(0):
            tokens = torch.tensor(d.model_input.to_ints())
            targets = torch.tensor(d.loss_fn_inputs["target_tokens"].to_numpy()).long()
            w = torch.tensor(d.loss_fn_inputs["weights"].to_numpy()).double()
            lp = torch.log_softmax(model(tokens[None]).logits[0].double(), -1).gather(-1, targets[:, None])[:, 0]
            num += float(-(w * lp).sum())
            den += float(w.sum())
    return num / den


def test_chat_sl_recipe_runs_unchanged(served, tiny_model_dir, tmp_path):
    """chat_sl on a local JSONL: 3 steps; step 0's NLL equals plain torch on the cookbook's own first batch,
    the loss falls, and its final checkpoints exist on the resource (listed by tinker's RestClient)."""
    data, log_dir = tmp_path / "conversations.jsonl", tmp_path / "log-sl"
    _write_conversations(data)
    _run_recipe("tinker_cookbook.recipes.chat_sl.train",
                [f"model_name={tiny_model_dir}", f"dataset={data}", f"renderer_name={RENDERER}",
                 "batch_size=4", "max_length=128", "lora_rank=4", "learning_rate=1e-2", "lr_schedule=constant",
                 "max_steps=3", "save_every=0", "eval_every=0", "infrequent_eval_every=0", f"log_path={log_dir}"],
                served[1], tmp_path)
    rows = [m for m in _metrics(log_dir) if "train_mean_nll" in m]
    assert len(rows) == 3 and all(m["num_sequences"] == 4 and m["num_loss_tokens"] > 0 for m in rows)
    ref = _reference_first_batch_nll(str(tiny_model_dir), str(data), 4, 128)
    assert rows[0]["train_mean_nll"] == pytest.approx(ref, rel=1e-4)
    # lr 1e-2 on 16 near-identical conversations: later batches (other rows, same template) score lower.
    assert rows[-1]["train_mean_nll"] < rows[0]["train_mean_nll"]

    final = _final_checkpoint(log_dir)
    rest = tinker.RestClient(base_url=served[1], api_key="tml-" + KEY)
    run_id = final["state_path"].split("/")[2]
    listed = {c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints}
    assert {final["state_path"], final["sampler_path"]} <= listed


def test_math_rl_recipe_runs_unchanged(served, tiny_model_dir, tmp_path):
    """math_rl, env=arithmetic, loss_fn=importance_sampling: 2 steps of sample (snapshot sampling clients),
    grade, train; every step logs a reward in the env's range and tokens trained, and the run's final
    checkpoints exist on the resource."""
    log_dir = tmp_path / "log-rl"
    _run_recipe("tinker_cookbook.recipes.math_rl.train",
                [f"model_name={tiny_model_dir}", "env=arithmetic", f"renderer_name={RENDERER}",
                 "group_size=2", "groups_per_batch=2", "lora_rank=4", "learning_rate=1e-3",
                 "loss_fn=importance_sampling", "max_steps=2", "save_every=0", "eval_every=0",
                 f"log_path={log_dir}"],
                served[1], tmp_path)
    rows = [m for m in _metrics(log_dir) if "env/all/reward/total" in m]
    assert len(rows) == 2
    for m in rows:
        # arithmetic: 1 for a correct answer, -0.1 for a badly formatted one (a random model: mostly the latter).
        assert -0.1 - 1e-9 <= m["env/all/reward/total"] <= 1.0 and math.isfinite(m["env/all/reward/total"])
    final = _final_checkpoint(log_dir)
    rest = tinker.RestClient(base_url=served[1], api_key="tml-" + KEY)
    listed = {c.tinker_path for c in rest.list_checkpoints(final["state_path"].split("/")[2]).result().checkpoints}
    assert {final["state_path"], final["sampler_path"]} <= listed


def test_ephemeral_save_resubmitted_with_next_sampling_session_seq_id(served, tiny_model_dir):
    """The SDK's retry of save_weights_and_get_sampling_client (after a timeout) re-sends the same seq_id with
    the next sampling_session_seq_id: it finds the first save (same future, same sampling session), not a 409
    that the SDK would retry for 5 minutes (what broke math_rl once under load). A different kind is still 409."""
    import httpx

    url, hdr = served[1] + "/api/v1", {"X-API-Key": "tml-" + KEY}
    sc = tinker.ServiceClient(base_url=served[1], api_key="tml-" + KEY)
    try:
        tc = sc.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=0).result()
        model_id = tc.get_info().model_id
        body = {"model_id": model_id, "seq_id": 1, "kind": "snapshot", "type": "save_weights_for_sampler"}
        first = httpx.post(url + "/save_weights_for_sampler", headers=hdr, json={**body, "sampling_session_seq_id": 0})
        again = httpx.post(url + "/save_weights_for_sampler", headers=hdr, json={**body, "sampling_session_seq_id": 1})
        assert first.status_code == again.status_code == 200, (first.text, again.text)
        assert again.json()["request_id"] == first.json()["request_id"]
        results = [httpx.post(url + "/retrieve_future", headers=hdr, timeout=60,
                              json={"request_id": r.json()["request_id"]}).json() for r in (first, again)]
        assert results[0] == results[1] and results[0]["sampling_session_id"].endswith(":sample:0")
        other = httpx.post(url + "/save_weights_for_sampler", headers=hdr,
                           json={**body, "kind": "inflight", "sampling_session_seq_id": 2})
        assert other.status_code == 409 and other.json()["key"] == "seq_id"
    finally:
        sc.close("success").result()
