"""Agent rollouts for the RL loop: run agents against rollout URLs, read back what they sampled.

`AgentRollouts.submit` has the signature of `rl.rollouts.submit_rollouts`, so `rl.train.run` trains
agents with its own losses, async mode, off-policy metrics and checkpoints (``rollouts=`` argument).
For each `AgentGroup` of the step (one task, ``group_size`` runs) every run gets a fresh rollout
id and calls the server through ``/v1/rollouts/{id}`` with ``model`` = the training session's id;
when the runs end, each rollout's calls are fetched (`ResourceClient.get_rollout`) and freed.

A rollout becomes one `rl.Trajectory`: one `Transition` per call, its observation the prompt
tokens as the server rendered them and its action the sampled tokens of choice 0 (the stop token
included), with the sampler's logprobs and per-token policy versions. The agent's reward is the
trajectory's group reward (so a rollout that made no call still counts in its group's mean), and
`rl.GroupCentered` centres it over the group. `rl.training_data` lays each trajectory out as one
sequence while every call's prompt extends the previous prompt + completion token for token;
a call that does not (a template that re-renders history, an agent that edits it) starts a new
sample instead of a wrong merge. Metrics (per step): ``env/prefix_split`` (fraction of non-first
calls that started a new sample), ``env/calls`` (per rollout), ``agent_failed`` (runs that raised
or gave no reward: left out of training), and the agents' own numbers as ``env/<name>``.

Ordering: a run's first call must see the weights the loop published before it (sync mode: the
last step's; async: the one before), as `rl.rollouts` samples do. The agents are started when a
1-token ``session.sample`` (queued behind the session's earlier weights_sync) has been served.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import together_train as tt

from together_train_cookbook.agents.runner import Agent, AgentError, AgentOutcome
from together_train_cookbook.rl.dataset import RLDataset
from together_train_cookbook.rl.env_group import EnvGroupBuilder
from together_train_cookbook.rl.trajectory import RolloutBatch, Trajectory, TrajectoryGroup, Transition

RewardFn = Callable[[Any, tt.Rollout], float]  # (task, the recorded rollout) -> reward


class AgentGroup(EnvGroupBuilder):
    """One task run ``group_size`` times by the agent (the unit advantages are centred over)."""

    def __init__(self, task: Any, group_size: int) -> None:
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.task, self.group_size = task, group_size

    def make_envs(self) -> Sequence[Any]:
        raise TypeError("an AgentGroup runs an agent (agents.AgentRollouts), it has no envs")


class AgentDataset(RLDataset):
    """``batch_size`` tasks per step drawn (without replacement within a step) from `tasks` by
    (seed, step), each run ``group_size`` times."""

    def __init__(self, tasks: Sequence[Any], batch_size: int, group_size: int, seed: int = 0) -> None:
        if not tasks:
            raise ValueError("no tasks")
        self.tasks, self.batch_size, self.group_size, self.seed = list(tasks), batch_size, group_size, seed

    def get_batch(self, step: int) -> list[AgentGroup]:
        rng = random.Random(f"agent-tasks-{self.seed}-{step}")
        picks = rng.sample(range(len(self.tasks)), self.batch_size) if self.batch_size <= len(self.tasks) \
            else [rng.randrange(len(self.tasks)) for _ in range(self.batch_size)]
        return [AgentGroup(self.tasks[i], self.group_size) for i in picks]


def trajectory_of(rollout: tt.Rollout) -> tuple[Trajectory, int]:
    """(one transition per call: prompt tokens -> choice 0's tokens, logprobs, versions; the number of
    non-first calls whose prompt does not extend the previous prompt + completion)."""
    transitions, splits, prev = [], 0, None
    for k, call in enumerate(rollout.calls):
        if not call.choices:
            continue
        ch = call.choices[0]
        metrics: dict[str, float] = {}
        if prev is not None:
            split = call.prompt_tokens[:len(prev)] != prev
            splits += split
            metrics["prefix_split"] = float(split)
        last = k == len(rollout.calls) - 1
        if last:
            metrics["calls"] = float(len(rollout.calls))
        transitions.append(Transition(list(call.prompt_tokens), list(ch.tokens), [float(x) for x in ch.logprobs],
                                      [int(v) for v in ch.policy_versions], 0.0, last, metrics))
        prev = list(call.prompt_tokens) + list(ch.tokens)
    return Trajectory(transitions), splits


class AgentRollouts:
    """Runs an `Agent` for the RL loop (pass ``AgentRollouts(...).submit`` as ``rl.train.run(rollouts=)``).

    Args:
        agent: `runner.function_agent` / `runner.command_agent` / `runner.load_agent`.
        base_url: the server's HTTP root (``http://HOST:PORT``); None = the local resource's
            (``session.client.local_resource.http_url``, launched with an HTTP port).
        api_key: sent by the agents (the session's key; any string without keys).
        reward_fn: gives the reward of runs that return none (e.g. a command printing nothing).
        max_concurrency: agent runs at once.
    """

    def __init__(self, agent: Agent, base_url: str | None = None, api_key: str | None = None,
                 reward_fn: RewardFn | None = None, max_concurrency: int = 32) -> None:
        self.agent, self.base_url, self.api_key, self.reward_fn = agent, base_url, api_key, reward_fn
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_concurrency,
                                                          thread_name_prefix="agent")

    def root(self, session: tt.Session) -> str:
        """The HTTP root the agents call."""
        if self.base_url:
            return self.base_url.rstrip("/")
        local = getattr(session.client, "local_resource", None)
        url = getattr(local, "http_url", None)
        if not url:
            raise ValueError("the agents need the server's HTTP address: give --openai-base-url (a resource "
                             "started with --http-port), or let the recipe launch one")
        return url

    def submit(self, session: tt.Session, builders: Sequence[EnvGroupBuilder], sampling: Any, step: int,
               seed: int) -> "PendingAgentRollouts":
        """Start the runs of `builders` (`AgentGroup`s) once the session's published weights are current;
        returns at once. `sampling` is unused: an agent sets its own sampling fields."""
        return PendingAgentRollouts(self, session, [b for b in builders], step)


class PendingAgentRollouts:
    """A step's agent runs in flight; `collect` waits for them and reads their rollouts."""

    def __init__(self, owner: AgentRollouts, session: tt.Session, groups: list[EnvGroupBuilder], step: int) -> None:
        for g in groups:
            if not isinstance(g, AgentGroup):
                raise TypeError(f"agent rollouts need AgentGroup builders, got {type(g).__name__}")
        self.owner, self.session, self.groups, self.step = owner, session, groups, step
        self.submitted_at = time.time()
        self.ids = [[f"agent-{step}-{j}-{i}-{uuid.uuid4().hex[:8]}" for i in range(g.group_size)]
                    for j, g in enumerate(groups)]
        self.runs: list[list[concurrent.futures.Future]] = [[concurrent.futures.Future() for _ in g] for g in self.ids]
        self.done_at: list[float] = []
        self._lock = threading.Lock()
        root, key, model = owner.root(session), owner.api_key or "none", session.session_id
        barrier = session.sample([0], tt.SamplingParams(max_tokens=1, temperature=0.0))

        def start(_f: Any) -> None:
            for j, g in enumerate(groups):
                for i, rid in enumerate(self.ids[j]):
                    fut = owner.pool.submit(self._run, f"{root}/v1/rollouts/{rid}", key, model, g.task)
                    fut.add_done_callback(lambda f, out=self.runs[j][i]: _chain(f, out))

        barrier.add_done_callback(start)

    def _run(self, url: str, key: str, model: str, task: Any) -> AgentOutcome:
        try:
            return self.owner.agent(url, key, model, task)
        finally:
            with self._lock:
                self.done_at.append(time.time())

    def collect(self) -> RolloutBatch:
        """Wait for every run; returns the batch (failed runs left out, counted in ``agent_failed``)."""
        client = self.session.client
        groups, failed, splits, later_calls = [], 0, 0, 0
        for g, ids, runs in zip(self.groups, self.ids, self.runs):
            trajs, rewards = [], []
            for rid, fut in zip(ids, runs):
                try:
                    out = fut.result()
                    rollout = client.get_rollout(rid)
                except AgentError as e:
                    failed += 1
                    print(f"agent run {rid} failed: {e}", file=sys.stderr, flush=True)
                    _free(client, rid)
                    continue
                except tt.NotFoundError:
                    rollout = tt.Rollout(rid)  # the agent made no call
                _free(client, rid)
                reward = out.reward
                if reward is None and self.owner.reward_fn is not None:
                    reward = float(self.owner.reward_fn(g.task, rollout))
                if reward is None:
                    failed += 1
                    print(f"agent run {rid} gave no reward (return one, print one, or give a reward_fn)",
                          file=sys.stderr, flush=True)
                    continue
                traj, s = trajectory_of(rollout)
                splits, later_calls = splits + s, later_calls + max(0, len(traj.transitions) - 1)
                if traj.transitions and out.metrics:
                    traj.transitions[-1].metrics.update(out.metrics)
                trajs.append(traj)
                rewards.append(reward)
            if trajs:
                groups.append(TrajectoryGroup(trajs, rewards))
        if not groups:
            raise RuntimeError(f"every agent run of step {self.step} failed ({failed} runs); see the errors above")
        span = max(self.done_at, default=time.time()) - self.submitted_at
        return RolloutBatch(self.step, groups, span, metrics={"agent_failed": float(failed), "agent_runs": float(
            sum(len(ids) for ids in self.ids)), "prefix_split_calls": float(splits), "later_calls": float(later_calls)})


def _chain(src: concurrent.futures.Future, dst: concurrent.futures.Future) -> None:
    if src.exception() is not None:
        dst.set_exception(src.exception())
    else:
        dst.set_result(src.result())


def _free(client: tt.ResourceClient, rollout_id: str) -> None:
    try:
        client.delete_rollout(rollout_id)
    except tt.NotFoundError:
        pass


def read_tasks(spec: str) -> list[Any]:
    """``--tasks``: a JSONL file (one task per line) or ``module:function`` returning a list of tasks.

    Raises:
        ValueError: a missing file, a bad line (naming file and line), or an empty list.
    """
    from pathlib import Path

    from together_train_cookbook.agents.runner import load_object

    path = Path(spec)
    if path.suffix in (".jsonl", ".json") or path.is_file():
        if not path.is_file():
            raise ValueError(f"--tasks {spec}: no such file")
        tasks = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    tasks.append(json.loads(line))
                except ValueError as e:
                    raise ValueError(f"--tasks {spec}: line {n} is not JSON: {e}") from None
    else:
        obj = load_object(spec, "--tasks")
        tasks = list(obj() if callable(obj) else obj)
    if not tasks:
        raise ValueError(f"--tasks {spec}: no tasks")
    return tasks
