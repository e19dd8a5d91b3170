"""The cookbook's langgraph agent (examples/langgraph_agent.py: a forced tool call, the tool, a typed answer),
unchanged, trained by `recipes.agent_rl` through rollout URLs on a real resource.

The tiny random Llama with 1024 positions (the embedded template's tools system turn is ~330 tokens). Two
sync steps of 2 tasks x 2 runs. Each run is wrapped only to read its rollout before agent_rl frees it; the
independent reference is the Hermes ``<tool_call>`` format parsed with ``re`` / ``json`` and pydantic's
validation of the recorded answer: the reward recomputed from the recorded sampled tokens must equal the
one the agent computed from what langgraph handed it. The step trains: a finite loss, and step 1 samples
from the policy version step 0's optimizer step made. A random model rarely earns any reward, so the
harness adds a distinct 1e-3 * k to the k-th run's reward: every group has signal, every step trains.
"""

from __future__ import annotations

import json
import math
import re
import threading

import pytest
from _served import launch_with_http

pytest.importorskip("langgraph")
pytest.importorskip("langchain_openai")

KEY = "sk-langgraph-rl"
CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)


def _reward_from_record(tok, rollout, task) -> float:
    """The example's reward, recomputed from the two recorded calls' sampled tokens."""
    from together_train_cookbook.examples.langgraph_agent import Answer

    first, second = (tok.decode(c.choices[0].tokens, skip_special_tokens=True) for c in rollout.calls)
    calls = [json.loads(c) for c in CALL.findall(first)]
    assert len(calls) == 1 and calls[0]["name"] == "add", first  # forced: always one complete call
    called = sorted(calls[0]["arguments"].values()) == sorted([task["a"], task["b"]])
    try:
        answer = Answer.model_validate_json(second).value
    except ValueError:  # cut by max_tokens
        answer = None
    return float(called) + float(answer == task["a"] + task["b"])


def test_langgraph_agent_trains_through_agent_rl(tiny_model_dir_1k, tokenizer_1k, tmp_path):
    from together_train_cookbook import agents
    from together_train_cookbook.examples.langgraph_agent import agent as langgraph_agent
    from together_train_cookbook.examples.langgraph_agent import tasks
    from together_train_cookbook.recipes import agent_rl

    runs: list[tuple[float, float, int]] = []
    lock = threading.Lock()
    with launch_with_http(tiny_model_dir_1k, tmp_path / "storage", KEY) as client:

        def recorded(base_url: str, api_key: str, model: str, task: dict) -> float:
            reward = langgraph_agent(base_url, api_key, model, task)  # the example, unchanged
            rollout = client.get_rollout(base_url.rsplit("/", 1)[1])
            with lock:
                runs.append((reward, _reward_from_record(tokenizer_1k, rollout, task), len(rollout.calls)))
                return reward + 1e-3 * len(runs)

        cfg = agent_rl.Config(model=str(tiny_model_dir_1k), api_key=KEY, steps=2, batch_size=2, num_samples=2,
                              learning_rate=1e-2, lora_rank=4, lora_alpha=8.0, eval_every=0, save_every=0,
                              out_dir=str(tmp_path / "run"))
        agent_rl.run(cfg, client=client, agent=agents.function_agent(recorded),
                     tasks=[{**t, "max_tokens": 60} for t in tasks(8)])
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r["step"] >= 0]
    assert [r["step"] for r in recs] == [0, 1]
    assert len(runs) == 8 and all(n == 2 for _, _, n in runs), runs  # every call recorded
    assert all(got == want for got, want, _ in runs), runs
    assert all(r["agent_failed"] == 0 and r["env/calls"] == 2.0 for r in recs), recs
    assert all(r["trained_samples"] > 0 and r["grad_norm"] > 0 for r in recs), recs
    assert all(math.isfinite(r["loss"]) for r in recs), [r["loss"] for r in recs]
    assert [r["sampler_version"] for r in recs] == [0, 1], recs  # step 1 sampled step 0's trained weights
