"""A number-guessing game written as a TRL environment class, for `environment_factory` (TRL's `GRPOTrainer`, or
`GiGPOTrainer` with step credit): the recipe `recipes/train_trl_environment.py` trains it.

The game draws a secret number from 1 to `HIGHEST` at reset (from Python's global generator, which GiGPOTrainer
seeds alike for the copies of a task). Each `guess` answers with a hint; the right guess ends the game (`done`,
`won`); a guess after the end raises, which TRL and GiGPO return to the model as an error result. The state is the
secret and the interval the hints leave (`low`, `high`): guesses that reveal nothing new leave it as it was, so the
copies of a task that reach the same interval by different guesses share GiGPO's step groups.
"""

from __future__ import annotations

import random
from typing import Any

HIGHEST = 16


class GuessTheNumber:
    """Find the secret number from 1 to `HIGHEST` with the `guess` tool's hints."""

    def reset(self, **kwargs: Any) -> str:
        self.secret = random.randint(1, HIGHEST)
        self.low, self.high = 1, HIGHEST  # the interval the hints so far leave
        self.done = self.won = False
        return f" I am thinking of a whole number from 1 to {HIGHEST}: guess it."

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: The guess, a whole number from 1 to 16.

        Returns:
            Whether the guess is right, too low or too high.
        """
        if self.done:
            raise ValueError("Game over.")
        if number == self.secret:
            self.done = self.won = True
            return f"{number} is right!"
        if number < self.secret:
            self.low = max(self.low, number + 1)
            return f"{number} is too low."
        self.high = min(self.high, number - 1)
        return f"{number} is too high."


def won(environments: list[GuessTheNumber], **kwargs: Any) -> list[float]:
    """The reward: 1 for a game won, else 0 (a reward function as TRL calls them, reading the environments)."""
    return [1.0 if environment.won else 0.0 for environment in environments]
