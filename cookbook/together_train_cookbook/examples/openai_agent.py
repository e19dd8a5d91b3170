"""A two-turn agent that uses only `openai`: the second question depends on the first answer."""
import random
import re

import openai


def reward(text: str, target: int) -> float:
    """1 for the right bare number, 0.5 for a wrong bare number, 0 for anything else."""
    m = re.fullmatch(r"\s*(-?\d+)\s*", text or "")
    return 0.0 if m is None else 1.0 if int(m.group(1)) == target else 0.5


def agent(base_url: str, api_key: str, model: str, task: dict) -> float:
    client = openai.OpenAI(base_url=base_url, api_key=api_key)
    messages = [{"role": "user", "content": f"What is {task['a']} + {task['b']}?"}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=task.get("max_tokens", 8))
    answer = first.choices[0].message.content
    r1 = reward(answer, task["a"] + task["b"])
    got = re.fullmatch(r"\s*(-?\d+)\s*", answer or "")  # turn 2 builds on the model's own answer
    base = int(got.group(1)) if got else task["a"] + task["b"]
    messages += [{"role": "assistant", "content": answer},
                 {"role": "user", "content": f"Add {task['c']} to your answer."}]
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=task.get("max_tokens", 8))
    return r1 + reward(second.choices[0].message.content, base + task["c"])


def tasks(n: int = 200, max_operand: int = 9) -> list[dict]:
    rng = random.Random(0)
    return [{"a": rng.randint(0, max_operand), "b": rng.randint(0, max_operand),
             "c": rng.randint(1, max_operand)} for _ in range(n)]


if __name__ == "__main__":  # as a command: `agent_rl --agent "python -m together_train_cookbook.examples.openai_agent"`
    import json
    import os

    print(agent(os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"], os.environ["OPENAI_MODEL"],
                json.loads(os.environ["AGENT_TASK"])))
