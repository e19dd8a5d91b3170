"""A new RL task in one class, trained by the existing loop: guess a number from 1 to 10 in up
to 3 turns, told "Higher." or "Lower." after each miss (reward 1 when found).

    python -m together_train_cookbook.examples.guess_number --steps 10 --batch-size 4 --num-samples 4
"""

import random
import sys

from together_train_cookbook.cli import cli
from together_train_cookbook.recipes import rl
from together_train_cookbook.rl import ChatEnv, ChatStep, SeededEnvDataset
from together_train_cookbook.tasks import parse_answer
from together_train_cookbook.tokenizer import load_codec


class GuessNumber(ChatEnv):
    def __init__(self, codec, rng: random.Random):
        super().__init__(codec, [{"role": "user", "content": "I picked a number from 1 to 10. Guess it: reply with the number only."}])
        self.secret, self.turns = rng.randint(1, 10), 0

    def reply(self, text: str) -> ChatStep:
        guess, self.turns = parse_answer(text), self.turns + 1
        if guess == self.secret or self.turns == 3:
            return ChatStep(float(guess == self.secret), True, metrics={"correct": float(guess == self.secret)})
        hint = "Higher." if guess is None or guess < self.secret else "Lower."
        return ChatStep(0.0, False, [{"role": "user", "content": hint}])


def run(cfg: rl.Config) -> dict:
    codec = load_codec(cfg.model)
    return rl.run(cfg, dataset=SeededEnvDataset(lambda rng: GuessNumber(codec, rng), cfg.batch_size, cfg.num_samples, cfg.seed))


if __name__ == "__main__":
    sys.exit(cli(run, rl.parse_args(sys.argv[1:]), "guess_number"))  # a bad flag: one line, no traceback
