"""`BaseTextEnv`: the episode bookkeeping every shipped environment shares, written once.

What gymnasium spreads over wrappers (`OrderEnforcing`, `TimeLimit`, `PassiveEnvChecker`) lives here in one small
base class, so that an environment holds only its game:

    class MyEnv(BaseTextEnv):
        def _reset(self, seed, options):     # seed: an int or None (checked); options: a dict or None (checked)
            ...
            return observation, info
        def _step(self, action):             # action: a str; never called before reset or after the episode ended
            ...
            return observation, reward, terminated, info

`reset` checks the seed and options, `step` refuses to run before `reset`, after the episode ended or with an
action that is not a str, counts the steps and truncates at `max_steps` (with `terminated` too when that step
ends the episode, as gymnasium's TimeLimit does). The contract itself is structural (`gigpo_trl.envs.TextEnv`):
an environment need not derive from this class, and a `gymnasium.Env` plugs in as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def is_int(value: Any) -> bool:
    """An int that is not a bool (`True` is an int to Python, never a seed or a count here)."""
    return isinstance(value, int) and not isinstance(value, bool)


class BaseTextEnv:
    """Base of the shipped environments: the bookkeeping of the module docstring around `_reset` and `_step`.

    Args:
        max_steps: None: the environment never truncates; an int n >= 1: `truncated` is True at the n-th step.

    A subclass whose episode can be over right at its start (an OpenEnv environment that reports `done` on reset)
    calls `end_episode()` in its `_reset`. One whose seeds are bounded overrides `seed_in_range` and says so in
    `seed_description`.
    """

    seed_description = "an int"

    def __init__(self, *, max_steps: int | None = None) -> None:
        if max_steps is not None and (not is_int(max_steps) or max_steps < 1):
            raise ValueError(f"max_steps must be None or an int >= 1, got {max_steps!r}")
        self.max_steps = max_steps
        self.elapsed_steps = 0
        self._reset_done = False
        self._episode_over = False

    @property
    def episode_over(self) -> bool:
        """The current episode has ended (terminated or truncated); `step` raises until the next `reset`."""
        return self._episode_over

    def seed_in_range(self, seed: int) -> bool:
        """Whether `reset` accepts this int seed (every int, unless a subclass says otherwise)."""
        return True

    def require_reset(self, what: str) -> None:
        """Raise a RuntimeError naming `what` (e.g. "the walkthrough") before the first `reset`."""
        if not self._reset_done:
            raise RuntimeError(f"call reset() first: {what} is the current episode's")

    def end_episode(self) -> None:
        """Mark the current episode as over (see the class docstring)."""
        self._episode_over = True

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode; returns `(observation, info)`."""
        if seed is not None and not (is_int(seed) and self.seed_in_range(seed)):
            raise ValueError(f"seed must be None or {self.seed_description}, got {seed!r}")
        if options is not None and not isinstance(options, Mapping):
            raise ValueError(f"options must be None or a dict, got {type(options).__name__}")
        self.elapsed_steps, self._reset_done, self._episode_over = 0, False, False
        observation, info = self._reset(seed, dict(options) if options is not None else None)
        self._reset_done = True
        return observation, info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Take one action; returns `(observation, reward, terminated, truncated, info)`."""
        if not self._reset_done:
            raise RuntimeError("call reset() before step()")
        if self._episode_over:
            raise RuntimeError("the episode has ended (terminated or truncated); call reset() before step()")
        if not isinstance(action, str):
            raise TypeError(f"action must be a str, got {type(action).__name__}")
        observation, reward, terminated, info = self._step(action)
        self.elapsed_steps += 1
        truncated = self.max_steps is not None and self.elapsed_steps >= self.max_steps
        self._episode_over = bool(terminated) or truncated
        return observation, float(reward), bool(terminated), truncated, info

    def close(self) -> None:
        """End the episode (`step` raises until the next `reset`). A subclass that holds resources releases them
        in its own `close` and calls this one."""
        self._reset_done = False

    def _reset(self, seed: int | None, options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        raise NotImplementedError
