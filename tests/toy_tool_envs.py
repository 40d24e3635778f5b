"""Environment classes written the way TRL's documentation writes them for `GRPOTrainer(environment_factory=...)`:
a counter with `get_reward`, and a guessing game with a `done` flag that raises at game over, scored by a reward
function taking `environments=`."""

from __future__ import annotations

import random


class IncrementEnv:
    """Bring a counter from 0 to a target drawn at reset."""

    def reset(self, **kwargs) -> str:
        self.counter = 0
        self.target = random.randint(2, 5)
        return f" Bring the counter to {self.target}."

    def increment(self, step: int) -> str:
        """Add to the counter.

        Args:
            step: How much to add.

        Returns:
            The counter's new value.
        """
        self.counter += step
        return f"Counter is {self.counter}."

    def get_reward(self) -> float:
        return 1.0 if self.counter == self.target else 0.0


class GuessTheNumber:
    """Guess a secret number from 1 to 8; the game ends with the right guess."""

    def reset(self, **kwargs) -> str:
        self.secret = random.randint(1, 8)
        self.done = False
        self.won = False
        self.reward = 0.0
        return " Guess the secret number, from 1 to 8."

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: The guess, from 1 to 8.
        """
        if self.done:
            raise ValueError("Game over.")
        if number == self.secret:
            self.done = self.won = True
            self.reward = 1.0
            return "Correct!"
        return "Too low." if number < self.secret else "Too high."

    @property
    def anchor(self) -> tuple[int, bool]:
        """What the next guess depends on: TRL does not list a property as a tool."""
        return self.secret, self.done


def guess_reward(environments, **kwargs) -> list[float]:
    """TRL's style of reward function: read the environments the completions were played in."""
    return [environment.reward for environment in environments]
