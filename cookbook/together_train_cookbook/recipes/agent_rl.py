"""RL-train an agent written against the ``openai`` client, unmodified, through a together-train resource.

    python -m together_train_cookbook.recipes.agent_rl \\
        --agent together_train_cookbook.examples.openai_agent:agent \\
        --tasks together_train_cookbook.examples.openai_agent:tasks [--steps 20] [--async-mode] ...

``--agent``: ``module:function`` / ``file.py:function`` called as ``agent(base_url=, api_key=,
model=, task=)`` returning the reward, or a command line run once per rollout with
``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` / ``OPENAI_MODEL`` / ``AGENT_TASK`` set, printing the
reward last (`agents.runner`). ``--tasks``: a JSONL file of tasks or ``module:function``.
Each step runs ``batch_size`` tasks ``num_samples`` times, each run with its own
``/v1/rollouts/{id}`` base URL and ``model`` = the training session (its latest published
weights); the recorded prompt and sampled tokens, sampler logprobs and versions become the RL
samples (`agents.rollouts`), trained by the RL loop (`rl.train.run`: ``--loss``, ``--async-mode``,
group-centred advantages, checkpoints, ``--resume``). A local resource is launched with its HTTP
port; with ``--address`` give ``--openai-base-url`` (a resource started with ``--http-port``).
The agent chooses its own sampling fields: keep temperature 1 (the default) so the sampler's
logprobs and the trainer's describe the same distribution.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import together_train as tt

from together_train_cookbook import agents, rl
from together_train_cookbook.cli import ConfigError, cli, parse_config, validate
from together_train_cookbook.display import fmt_or_dash
from together_train_cookbook.rl import train
from together_train_cookbook.tokenizer import codec_for


@dataclass
class Config(rl.Config):
    """Agent RL settings; every field is also a command-line flag."""

    agent: str = field(default="", metadata={"help": "module:function, file.py:function, or a command line"})
    tasks: str = field(default="", metadata={"help": "JSONL of tasks, or module:function returning them"})
    batch_size: int = field(default=8, metadata={"help": "tasks per step"})
    num_samples: int = field(default=4, metadata={"help": "runs per task (group size)"})
    scale_by_std: bool = field(default=False, metadata={"help": "divide advantages by the group std (GRPO)"})
    max_concurrency: int = field(default=32, metadata={"help": "agent runs at once"})
    agent_timeout: float = field(default=600.0, metadata={"help": "seconds one command-line agent run may take"})
    openai_base_url: str | None = field(default=None, metadata={
        "help": "HTTP root of the resource's OpenAI endpoint (http://HOST:PORT); default: the local resource's"})
    http_port: int = field(default=0, metadata={"help": "HTTP port of a launched local resource (0 = any free)",
                                               "hidden": True})

    def check(self) -> None:
        super().check()
        if not self.agent:
            raise ConfigError("--agent is required: module:function, file.py:function, or a command line")
        if not self.tasks:
            raise ConfigError("--tasks is required: a JSONL file of tasks, or module:function returning them")
        if self.batch_size < 1 or self.num_samples < 1 or self.max_concurrency < 1:
            raise ConfigError("--batch-size, --num-samples and --max-concurrency must be >= 1")


def parse_args(argv: list[str] | None = None) -> Config:
    return parse_config(Config, argv, "python -m together_train_cookbook.recipes.agent_rl", __doc__)


def run(cfg: Config, client: tt.ResourceClient | None = None, agent: agents.Agent | None = None,
        tasks: list[Any] | None = None, reward_fn: agents.rollouts.RewardFn | None = None) -> dict[str, Any]:
    """Train the agent as configured; returns the summary (also summary.json).

    Args:
        client: a connected resource (left open); default ``--address`` or a local one.
        agent / tasks: instead of ``--agent`` / ``--tasks`` (an `agents.Agent`, a list of tasks).
        reward_fn: the reward of runs that return none: ``reward_fn(task, rollout)``.
    """
    if agent is not None:
        cfg.agent = cfg.agent or "<given>"
    if tasks is not None:
        cfg.tasks = cfg.tasks or "<given>"
    validate(cfg)
    try:
        agent = agent or agents.load_agent(cfg.agent, cfg.agent_timeout)
        tasks = tasks if tasks is not None else agents.read_tasks(cfg.tasks)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    codec = codec_for(cfg, client)
    runner = agents.AgentRollouts(agent, cfg.openai_base_url, cfg.api_key, reward_fn, cfg.max_concurrency)
    print(f"agent {cfg.agent}: {len(tasks)} tasks; {cfg.steps} steps x {cfg.batch_size} tasks x {cfg.num_samples} "
          f"runs ({'async' if cfg.async_mode else 'sync'}, loss {cfg.loss})", flush=True)
    s = train.run(cfg, agents.AgentDataset(tasks, cfg.batch_size, cfg.num_samples, cfg.seed), codec=codec,
                  advantages=rl.GroupCentered(cfg.scale_by_std), client=client, name="agent_rl",
                  title=f"agent RL ({cfg.loss}, {'async' if cfg.async_mode else 'sync'})", rollouts=runner.submit)
    if "stopped_at" not in s:
        print(f"\nagent RL: reward {fmt_or_dash(s['mean_reward_first'], '.2f')} -> "
              f"{fmt_or_dash(s['mean_reward_last'], '.2f')}; loop {s['seconds']['loop']:.0f}s")
        print(f"plot: {s['plot']}; adapter: {s['adapter_path']}; run dir: {s['metrics'].rsplit('/', 1)[0]}")
    return s


def main(argv: list[str] | None = None) -> int:
    return cli(run, parse_args(argv), "agent_rl")


if __name__ == "__main__":
    sys.exit(main())
