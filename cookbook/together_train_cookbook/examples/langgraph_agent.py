"""A langgraph agent with a tool and a typed answer: "What is a + b?", the model calls ``add``, then answers.

Nothing here knows about training: `agent_rl --agent together_train_cookbook.examples.langgraph_agent:agent`
points its ``ChatOpenAI`` at a rollout URL, where both of its calls are recorded token for token. The graph
is plain langgraph (``StateGraph``, ``ToolNode``): a forced ``add`` call (``tool_choice``: the server
constrains the call to the tool's schema, so even an untrained model writes a valid one), the tool, then
``with_structured_output(Answer)`` (``response_format`` json_schema, constrained likewise). The reward is 1
for calling ``add`` with the task's numbers (either order) plus 1 for an answer equal to a + b; a call or an
answer cut by ``max_tokens`` scores 0 for its part.
"""
import random
from typing import Annotated, Any, TypedDict

from pydantic import BaseModel, Field

try:
    from langchain_core.messages import AnyMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, StateGraph, add_messages
    from langgraph.prebuilt import ToolNode
except ImportError:  # pip install langgraph langchain-openai (in the dev extra)
    StateGraph = None

Digit = Annotated[int, Field(ge=0, le=9)]  # bounded arguments: a small model's call ends well within max_tokens


class Answer(BaseModel):
    value: int = Field(ge=0, le=18)


if StateGraph is not None:
    @tool
    def add(a: Digit, b: Digit) -> int:
        """Add two numbers."""
        return a + b

    class State(TypedDict):
        messages: Annotated[list[AnyMessage], add_messages]
        answer: Any


def graph(llm: Any) -> Any:
    """The compiled graph: ``call`` (the forced tool call) -> ``tools`` -> ``answer`` (the typed answer)."""
    caller = llm.bind_tools([add], tool_choice="add", parallel_tool_calls=False)
    typed = llm.with_structured_output(Answer, include_raw=True)  # a cut answer: parsed None, no exception
    g = StateGraph(State)
    g.add_node("call", lambda s: {"messages": [caller.invoke(s["messages"])]})
    g.add_node("tools", ToolNode([add]))
    g.add_node("answer", lambda s: {"answer": typed.invoke(s["messages"])["parsed"]})
    g.add_edge(START, "call")
    g.add_conditional_edges("call", lambda s: "tools" if s["messages"][-1].tool_calls else "answer")
    g.add_edge("tools", "answer")
    g.add_edge("answer", END)
    return g.compile()


def agent(base_url: str, api_key: str, model: str, task: dict) -> float:
    """1 for ``add`` called with {a, b}, + 1 for the typed answer a + b."""
    if StateGraph is None:
        raise RuntimeError("this example needs langgraph and langchain-openai: pip install langgraph langchain-openai")
    llm = ChatOpenAI(model=model, base_url=base_url, api_key=api_key, max_retries=0,
                     max_tokens=task.get("max_tokens", 48))
    out = graph(llm).invoke({"messages": [("user", f"What is {task['a']} + {task['b']}? Use the add tool.")]})
    calls = [c for m in out["messages"] for c in getattr(m, "tool_calls", [])]
    called = len(calls) == 1 and sorted(calls[0]["args"].values()) == sorted([task["a"], task["b"]])
    answer = out.get("answer")
    return float(called) + float(answer is not None and answer.value == task["a"] + task["b"])


def tasks(n: int = 200) -> list[dict]:
    rng = random.Random(0)
    return [{"a": rng.randint(0, 9), "b": rng.randint(0, 9)} for _ in range(n)]
