"""The two-turn sum agent of `openai_agent`, written with openai-agents and its default model (the Responses API).

Nothing here knows about training: `agent_rl --agent together_train_cookbook.examples.agents_sdk_agent:agent`
points it at a rollout URL, where every ``/responses`` call is recorded token for token like a chat call.
The answer is a typed output (``output_type``: the server constrains decoding to its JSON schema, so even
an untrained model answers a parseable number), and the second turn chains on the first with
``previous_response_id``. A turn the SDK refuses (e.g. cut by ``max_tokens``) scores 0.
"""
import asyncio

import openai
from pydantic import BaseModel, Field

from together_train_cookbook.examples.openai_agent import tasks  # noqa: F401 - the same tasks

try:
    import agents
except ImportError:  # pip install openai-agents (in the dev extra)
    agents = None


class Answer(BaseModel):
    value: int = Field(ge=0, le=99)


def agent(base_url: str, api_key: str, model: str, task: dict) -> float:
    """1 per turn answered right (turn 2: the model's own first answer + c), 0 otherwise."""
    if agents is None:
        raise RuntimeError("this example needs openai-agents: pip install openai-agents")
    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
    bot = agents.Agent(name="adder", instructions="Answer with the number.", output_type=Answer,
                       model=agents.OpenAIResponsesModel(model, client),
                       model_settings=agents.ModelSettings(max_tokens=task.get("max_tokens", 16)))

    async def run() -> float:
        try:
            first = await agents.Runner.run(bot, f"What is {task['a']} + {task['b']}?", max_turns=1)
            second = await agents.Runner.run(bot, f"Add {task['c']} to your answer.", max_turns=1,
                                             previous_response_id=first.last_response_id)
        except agents.exceptions.AgentsException:
            return 0.0
        a, b = first.final_output.value, second.final_output.value
        return float(a == task["a"] + task["b"]) + float(b == a + task["c"])

    return asyncio.run(run())
