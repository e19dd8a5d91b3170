"""Prompts with a programmatic checker, for the RL, DPO and distillation recipes.

A `Problem` is a prompt (chat messages up to the assistant turn), a reference answer and a
checker ``is_correct(response) -> bool``. Sources:

- the generated arithmetic task (`tasks.ArithmeticTask`, strict checker: the bare number);
- rows ``{"prompt": str | [messages], "answer": str}`` of a JSONL file or a local Hugging Face
  dataset (`load_prompts`, `data.load_rows`); the checker is exact
  match after stripping whitespace (``response.strip() == answer.strip()``).

`make_problems(...)` returns (train, held-out) with the held-out split disjoint from train and
identical to the SFT recipe's evaluation set for the same seed, sizes and digits (the test
split of `ArithmeticTask.splits` is drawn first), so accuracies of chained recipes compare.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any, Callable

from together_train_cookbook.jsonl import DataError
from together_train_cookbook.evaluation import EvalItem
from together_train_cookbook.data import iter_rows
from together_train_cookbook.jsonl import prompt_messages
from together_train_cookbook.tasks import ArithmeticExample, ArithmeticTask, check


@dataclass
class Problem:
    """One prompt with a checkable answer.

    Attributes:
        messages: the conversation up to the assistant turn to generate.
        answer: the reference response (what a correct answer looks like).
        is_correct: grades a parsed response.
        example: the `ArithmeticExample` behind it (None for JSONL prompts).
    """

    messages: list[dict[str, Any]]
    answer: str
    is_correct: Callable[[str], bool]
    example: ArithmeticExample | None = None

    def reward(self, response: str) -> float:
        """1.0 when the checker accepts `response`, else 0.0."""
        return 1.0 if self.is_correct(response) else 0.0

    def eval_item(self) -> EvalItem:
        return EvalItem(self.messages, self.answer, self.is_correct)


def arithmetic_problem(ex: ArithmeticExample) -> Problem:
    return Problem(ex.prompt_messages(), ex.reference_response(), (lambda r, ex=ex: check(r, ex)), ex)


def load_prompts(path: str | os.PathLike) -> list[Problem]:
    """Read ``{"prompt": str | [messages], "answer": str}`` rows (exact-match checker) from a JSONL
    file or a local Hugging Face dataset (``.json`` / ``.parquet`` / a ``save_to_disk`` dir;
    `data.load_rows`).

    Raises:
        ValueError: a row that is not an object or lacks prompt/answer (names the line / row),
            no rows, or as `data.iter_rows`.
    """
    out = []
    for where, rec in iter_rows(path):
        if "prompt" not in rec or "answer" not in rec:
            raise DataError(f'{where}: expected {{"prompt": ..., "answer": ...}}, got keys {sorted(rec)}')
        ans = str(rec["answer"]).strip()
        out.append(Problem(prompt_messages(rec["prompt"]), ans, (lambda r, ans=ans: r.strip() == ans)))
    if not out:
        raise DataError(f"{path}: no prompts")
    return out


load_prompt_jsonl = load_prompts  # the name before other formats were read


def make_problems(
    data: str | None, n_train: int, n_eval: int, seed: int, min_digits: int = 2, max_digits: int = 2
) -> tuple[list[Problem], list[Problem], str]:
    """(train, held-out, description). For a prompt file `data`, a seeded shuffle holds out
    ``min(n_eval, len // 5)`` prompts."""
    if data is None:
        task = ArithmeticTask(min_digits, max_digits)
        n_train = min(n_train, task.num_problems - n_eval)
        train, test = task.splits(n_train, n_eval, seed=seed)
        desc = f"arithmetic: {min_digits}-{max_digits} digit a + b, {len(train)} train / {len(test)} test"
        return [arithmetic_problem(e) for e in train], [arithmetic_problem(e) for e in test], desc
    probs = load_prompts(data)
    n_eval = min(n_eval, len(probs) // 5)
    order = list(range(len(probs)))
    random.Random(seed).shuffle(order)
    test = [probs[i] for i in order[:n_eval]]
    train = [probs[i] for i in order[n_eval:]]
    return train, test, f"{data}: {len(train)} train / {len(test)} held-out prompts"
