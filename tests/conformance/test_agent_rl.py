"""An agent written only against the ``openai`` package learns through `recipes.agent_rl`.

The agent is the README's `examples/openai_agent.py` (two turns: "What is a + b?", then "Add c to
your answer.", judged against its own first answer; 1 per right bare number, 0.5 per wrong bare
number). `agent_rl` runs in a process of its own and launches its own resource (HTTP port on);
every agent run calls ``/v1/rollouts/{id}/chat/completions`` with ``model`` = the training
session, and the loop trains on the recorded tokens. The model and the schedule are
tests/server/test_cookbook_rl_multiturn.py's (the same tiny Llama over 35 characters, 24 steps of 8 tasks
x 4 runs, one token per turn, LoRA r8) but for the learning rate, 5e-3, and so is the check: the
mean return of the last 6 steps exceeds the first 6's by more than 4 standard errors (two-sample z
from the episodes' own variance; without learning z ~ N(0, 1)). At lr 1e-2 the policy collapsed to
uniform in 1 of 13 runs (2026-12-03: entropy ln 35 = 3.56 from one step on, return 0.83 -> 0.12 and
never back, z -6.9, while kl_sampler stayed ~1e-7: the sampler served the trained weights, one Adam
step flattened the policy); at 5e-3 five runs gave z 8.3-11.1 (at 1e-2: 5.4-9.5 when not collapsed).

The command-line form of ``--agent`` (one process per run, the reward printed last) is checked on
2 steps.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys

import pytest

pytest.importorskip("openai")

CHARS = "0123456789 +?.\nWhat is Add to your answer user assistant system"  # test_cookbook_rl_multiturn's


@pytest.fixture(scope="module")
def char_model(tmp_path_factory):
    from _models import build_char_model

    return build_char_model(tmp_path_factory.mktemp("agent-char-llama"), CHARS)


def _tasks(path, n=400, max_operand=3):
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"a": rng.randint(0, max_operand), "b": rng.randint(0, max_operand),
                                "c": rng.randint(1, max_operand), "max_tokens": 1}) + "\n")
    return path


def _agent_rl(model, tmp_path, agent, steps, batch, group, *extra):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "together_train_cookbook.recipes.agent_rl", "--model", str(model), "--agent", agent,
           "--tasks", str(_tasks(tmp_path / "tasks.jsonl")), "--steps", str(steps), "--batch-size", str(batch),
           "--num-samples", str(group), "--learning-rate", "5e-3", "--lora-rank", "8", "--lora-alpha", "16",
           "--eval-every", "0", "--save-every", "0", "--out-dir", str(out), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "TQDM_DISABLE": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["step"] >= 0], p.stdout


def test_openai_agent_learns_through_agent_rl(char_model, tmp_path):
    steps, window, batch, group = 24, 6, 8, 4
    recs, out = _agent_rl(char_model, tmp_path, "together_train_cookbook.examples.openai_agent:agent",
                          steps, batch, group)
    assert [r["step"] for r in recs] == list(range(steps))
    bad = [r for r in recs if not (r["agent_failed"] == 0 and r["turns"] == 2.0 and r["env/calls"] == 2.0)]
    assert not bad, bad
    # turn 2's prompt extends turn 1's prompt + completion token for token (one sample per run), except
    # after a sampled special token the template re-renders otherwise (e.g. <|endoftext|> shown as ""):
    # then the run's calls are two samples
    split = sum(r["prefix_split_calls"] for r in recs) / sum(r["later_calls"] for r in recs)
    assert all(r["env/prefix_split"] == r["prefix_split_calls"] / r["later_calls"] for r in recs)
    full = [r for r in recs if r["frac_groups_with_signal"] == 1.0]
    assert full and all(r["trained_samples"] == r["agent_runs"] + r["prefix_split_calls"] for r in full), full[0]
    assert all(r["trained_samples"] > 0 for r in recs[:3]), recs[:3]
    assert all(r["staleness"] == 0 for r in recs if "staleness" in r), [r.get("staleness") for r in recs]

    def window_stats(rs):
        means = [r["reward"] for r in rs]
        m = sum(means) / len(means)
        var = sum(r["reward_std"] ** 2 for r in rs) / len(rs) + sum((x - m) ** 2 for x in means) / len(means)
        return m, var, len(rs) * batch * group

    m0, v0, n0 = window_stats(recs[:window])
    m1, v1, n1 = window_stats(recs[-window:])
    se = math.sqrt(v0 / n0 + v1 / n1)
    print(f"agent RL learning: reward {m0:.3f} (first {window} steps) -> {m1:.3f} (last {window}); se {se:.3f}; "
          f"z {(m1 - m0) / se:.1f}; per-step {[round(r['reward'], 2) for r in recs]}; split calls {split:.3f}; "
          f"loop {sum(r['seconds'] for r in recs):.0f}s")
    assert (m1 - m0) / se > 4, (m0, m1, se)


def test_command_line_agent_runs_as_its_own_process(char_model, tmp_path):
    cmd = f"{sys.executable} -m together_train_cookbook.examples.openai_agent"
    recs, _ = _agent_rl(char_model, tmp_path, cmd, 2, 2, 2, "--async-mode")
    assert [r["step"] for r in recs] == [0, 1]
    assert all(r["agent_failed"] == 0 and r["agent_runs"] == 4 and r["turns"] == 2.0 for r in recs), recs
