"""Train agents written against the ``openai`` client: each run gets a rollout URL, the server records
what it sampled token for token, and the RL loop trains on those tokens (`rl.train.run`).

`runner`: an agent as a Python function or a command line (`load_agent`); `rollouts`: the tasks
(`AgentDataset`, `AgentGroup`, `read_tasks`), the runs and the trajectories built from the
recorded calls (`AgentRollouts`, `trajectory_of`). The recipe: `recipes.agent_rl`.
"""

from together_train_cookbook.agents.rollouts import (
    AgentDataset,
    AgentGroup,
    AgentRollouts,
    PendingAgentRollouts,
    read_tasks,
    trajectory_of,
)
from together_train_cookbook.agents.runner import (
    Agent,
    AgentError,
    AgentOutcome,
    command_agent,
    function_agent,
    load_agent,
    load_object,
)

__all__ = [
    "Agent", "AgentDataset", "AgentError", "AgentGroup", "AgentOutcome", "AgentRollouts", "PendingAgentRollouts",
    "command_agent", "function_agent", "load_agent", "load_object", "read_tasks", "trajectory_of",
]
