"""A two-turn arithmetic dialogue: the second question builds on the model's own first answer.

    user: What is 3 + 4?          assistant: 7
    user: Add 2 to your answer.   assistant: 9

Turn 1 earns 1 when the reply is ``a + b``; turn 2 earns 1 when it is the model's turn-1 answer
plus ``c`` (so a wrong first answer carried on correctly still earns turn 2; with no number in
turn 1, ``a + b + c``). The env must read the model's first action to judge the second, which a
(prompt, answer, checker) problem cannot express. Replies are parsed strictly (`tasks.parse_answer`:
the bare integer); ``format_reward`` (default 0) is paid instead of 0 for a wrong bare integer,
to give a policy that writes no numbers yet something to climb. Metrics: ``turn1_correct``,
``turn2_correct``, ``correct`` (both; `rl.RolloutEvaluator` reports it as ``held_out_accuracy``).
"""

from __future__ import annotations

import random

from together_train_cookbook.codec import Codec
from together_train_cookbook.rl import ChatEnv, ChatStep, RepeatedEnv, SeededEnvDataset
from together_train_cookbook.tasks import parse_answer


class ArithmeticDialogue(ChatEnv):
    """One dialogue about ``a + b``, then ``+ c``."""

    def __init__(self, codec: Codec, a: int, b: int, c: int, format_reward: float = 0.0) -> None:
        super().__init__(codec, [{"role": "user", "content": f"What is {a} + {b}?"}])
        self.a, self.b, self.c, self.format_reward = a, b, c, format_reward
        self.first: tuple[int | None, bool] | None = None  # (turn-1 value, correct) once answered

    def _reward(self, value: int | None, target: int) -> float:
        return 1.0 if value == target else (self.format_reward if value is not None else 0.0)

    def reply(self, text: str) -> ChatStep:
        value = parse_answer(text)
        if self.first is None:
            self.first = (value, value == self.a + self.b)
            return ChatStep(self._reward(value, self.a + self.b), False,
                            [{"role": "user", "content": f"Add {self.c} to your answer."}],
                            {"turn1_correct": float(self.first[1])})
        target = (self.first[0] if self.first[0] is not None else self.a + self.b) + self.c
        ok = value == target
        return ChatStep(self._reward(value, target), True, (),
                        {"turn2_correct": float(ok), "correct": float(ok and self.first[1])})


def draw(rng: random.Random, max_operand: int) -> tuple[int, int, int]:
    """(a, b, c): a, b in [0, max_operand], c in [1, max_operand]."""
    return rng.randint(0, max_operand), rng.randint(0, max_operand), rng.randint(1, max_operand)


def dataset(codec: Codec, batch_size: int, group_size: int, seed: int = 0, max_operand: int = 9,
            format_reward: float = 0.0) -> SeededEnvDataset:
    """Training dialogues: ``batch_size`` per step, ``group_size`` episodes each (drawn from (seed, step))."""
    return SeededEnvDataset(lambda rng: ArithmeticDialogue(codec, *draw(rng, max_operand), format_reward),
                            batch_size, group_size, seed)


def held_out(codec: Codec, n: int, seed: int = 0, max_operand: int = 9) -> list[RepeatedEnv]:
    """``n`` evaluation dialogues (groups of one, for `rl.RolloutEvaluator`), from their own seed."""
    rng = random.Random(f"dialogue-eval-{seed}")
    return [RepeatedEnv(lambda abc=draw(rng, max_operand): ArithmeticDialogue(codec, *abc), 1) for _ in range(n)]  # noqa: B008 - one draw per env, bound as it is built
