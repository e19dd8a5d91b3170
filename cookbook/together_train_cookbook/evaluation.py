"""Greedy evaluation of a session on graded prompts (`EvalItem`), all requests in flight at once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import together_train as tt

from together_train_cookbook.codec import Codec


@dataclass
class EvalItem:
    """One evaluation prompt and how to grade the model's response."""

    prompt: list[dict[str, Any]]  # messages up to the assistant turn to generate
    reference: str
    is_correct: Callable[[str], bool]


def evaluate(
    session: tt.Session, codec: Codec, items: list[EvalItem], max_tokens: int
) -> tuple[float, list[dict[str, Any]]]:
    """Greedy-sample every item (all requests in flight at once), grade, return
    (accuracy in [0, 1], per-item records). Samples the session's last synced version."""
    if not items:
        return float("nan"), []
    params = tt.SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        stop_token_ids=codec.stop_token_ids,
        stop=codec.stop_strings,
    )
    futures = [session.sample(codec.build_generation_prompt(it.prompt), params) for it in items]
    records = []
    for it, fut in zip(items, futures):
        result = fut.result()
        response = codec.parse_response(result.sequences[0].tokens)
        records.append(
            {
                "prompt": it.prompt[-1]["content"],
                "reference": it.reference,
                "response": response,
                "correct": bool(it.is_correct(response)),
                "policy_version": result.policy_version,
            }
        )
    return sum(r["correct"] for r in records) / len(records), records

