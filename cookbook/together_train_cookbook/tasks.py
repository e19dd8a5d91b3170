"""Generated tasks whose answers a program can check.

`ArithmeticTask` makes integer addition problems ("What is 47 + 85?") whose
reference answer is a fixed, short format: the assistant replies with the
number and nothing else ("132"). Everything is deterministic given a seed, the
train and test splits never share a problem, and `check` parses strictly, so
accuracy measures exactly "right number in the right format".

The format is deliberately minimal: SmolLM2-135M-Instruct answers these
questions with a sentence of working before training (0 % under the strict
parser, and its sums are mostly wrong), and learns the format plus a good part
of the arithmetic from a few minutes of CPU LoRA training.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, Iterable

Message = dict[str, Any]

_ANSWER_RE = re.compile(r"-?(0|[1-9][0-9]*)")


@dataclass(frozen=True)
class ArithmeticExample:
    """One problem `a op b` with its integer answer."""

    a: int
    b: int
    op: str = "+"

    @property
    def answer(self) -> int:
        if self.op == "+":
            return self.a + self.b
        if self.op == "-":
            return self.a - self.b
        if self.op == "*":
            return self.a * self.b
        raise ValueError(f"unknown operator {self.op!r}")

    @property
    def question(self) -> str:
        return f"What is {self.a} {self.op} {self.b}?"

    def prompt_messages(self, system_prompt: str | None = None) -> list[Message]:
        """The conversation up to (not including) the assistant's answer."""
        msgs: list[Message] = []
        if system_prompt is not None:
            msgs.append({"role": "system", "content": system_prompt})
        msgs.append({"role": "user", "content": self.question})
        return msgs

    def reference_response(self) -> str:
        """The assistant content that `check` accepts: the answer in decimal, e.g. "132"."""
        return format_answer(self.answer)

    def messages(self, system_prompt: str | None = None) -> list[Message]:
        """The full training conversation: prompt messages + the reference assistant turn."""
        return self.prompt_messages(system_prompt) + [
            {"role": "assistant", "content": self.reference_response()}
        ]

    def to_json(self, system_prompt: str | None = None) -> dict[str, Any]:
        """A `{"messages": [...]}` record, the JSONL format the sft recipe reads."""
        return {"messages": self.messages(system_prompt)}


def format_answer(value: int) -> str:
    """The answer format: the integer in decimal, nothing else ("1234", "-7")."""
    return str(int(value))


def parse_answer(response: str) -> int | None:
    """Strict parser: the whole response (surrounding whitespace ignored) must be
    an integer in canonical decimal ("132", "-7", "0"); anything else ("132.",
    "The answer is 132", "1,032", "0132", "+132", "132\\n\\nbecause") gives None."""
    text = response.strip()
    if _ANSWER_RE.fullmatch(text) is None:
        return None
    return int(text)


def check(response: str, example: ArithmeticExample) -> bool:
    """True iff `response` parses strictly (see `parse_answer`) to the example's answer."""
    value = parse_answer(response)
    return value is not None and value == example.answer


@dataclass(frozen=True)
class ArithmeticTask:
    """Addition (or subtraction / multiplication) of integers with `min_digits`
    to `max_digits` digits each.

    `splits(n_train, n_test, seed)` draws distinct problems; the same arguments
    always give the same lists, and no (a, op, b) appears in both.
    """

    min_digits: int = 2
    max_digits: int = 2
    op: str = "+"
    system_prompt: str | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(
                f"need 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}"
            )
        if self.op not in ("+", "-", "*"):
            raise ValueError(f"op must be '+', '-' or '*', got {self.op!r}")

    @property
    def num_problems(self) -> int:
        """How many distinct problems exist (ordered pairs of operands)."""
        lo, hi = self._range()
        return (hi - lo + 1) ** 2

    def _range(self) -> tuple[int, int]:
        lo = 0 if self.min_digits == 1 else 10 ** (self.min_digits - 1)
        return lo, 10**self.max_digits - 1

    def _draw(self, rng: random.Random) -> ArithmeticExample:
        # Pick the digit count first so short and long operands are equally likely.
        def operand() -> int:
            d = rng.randint(self.min_digits, self.max_digits)
            lo = 0 if d == 1 else 10 ** (d - 1)
            return rng.randint(lo, 10**d - 1)

        return ArithmeticExample(operand(), operand(), self.op)

    def splits(
        self, n_train: int, n_test: int, seed: int = 0
    ) -> tuple[list[ArithmeticExample], list[ArithmeticExample]]:
        """Return (train, test): `n_train` + `n_test` distinct problems drawn with
        `random.Random(seed)`; test is drawn first, so changing `n_train` never
        changes the test set.

        Raises:
            ValueError: when more problems are asked for than exist.
        """
        if n_train < 0 or n_test < 0:
            raise ValueError(f"split sizes must be >= 0, got {n_train}, {n_test}")
        total = n_train + n_test
        if total > self.num_problems:
            raise ValueError(
                f"asked for {total} distinct problems, only {self.num_problems} exist "
                f"with {self.min_digits}-{self.max_digits} digits"
            )
        rng = random.Random(f"arithmetic-{seed}")
        seen: set[ArithmeticExample] = set()
        out: list[ArithmeticExample] = []
        while len(out) < total:
            ex = self._draw(rng)
            if ex not in seen:
                seen.add(ex)
                out.append(ex)
        test, train = out[:n_test], out[n_test:]
        return train, test

    def check(self, response: str, example: ArithmeticExample) -> bool:
        return check(response, example)


def accuracy(responses: Iterable[str], examples: Iterable[ArithmeticExample]) -> float:
    """Fraction of `responses` that `check` accepts (0.0 for empty input)."""
    flags = [check(r, e) for r, e in zip(responses, examples, strict=True)]
    return sum(flags) / len(flags) if flags else 0.0
