"""A small real OpenEnv environment (a corridor), for the adapter's tests and the environment contract test."""

from __future__ import annotations

import itertools
from typing import Any, Literal
from uuid import uuid4

from openenv.core import Action, Environment, Observation, State
from pydantic import Field

EXIT = 6
TASK = "Walk to the exit of the corridor."


class MoveAction(Action):
    direction: Literal["left", "right"]


class CorridorObservation(Observation):
    position: int
    exit: int = EXIT
    step_count: int = 0
    legal_actions: list[str] = Field(default_factory=list)


class CorridorState(State):
    position: int = 0


class Corridor(Environment):
    """Cells 0..EXIT, a wall west of 0. The seed picks the start cell, 1 + seed % 4. A move gives no reward
    (None), reaching the exit 1.0 and ends the episode. The metadata carries the episode id, won and the task."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = CorridorState()
        self.closed = False

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> CorridorObservation:
        self._state = CorridorState(episode_id=episode_id or str(uuid4()), position=self._start(seed))
        return self._observation(reward=None)

    def step(self, action: MoveAction, timeout_s: float | None = None, **kwargs: Any) -> CorridorObservation:
        self._state.step_count += 1
        self._state.position = max(self._state.position + (1 if action.direction == "right" else -1), 0)
        return self._observation(reward=1.0 if self._state.position == EXIT else None)

    @property
    def state(self) -> CorridorState:
        return self._state

    def close(self) -> None:
        self.closed = True

    def _start(self, seed: int | None) -> int:
        return 1 + (seed or 0) % 4

    def _observation(self, reward: float | None) -> CorridorObservation:
        position, won = self._state.position, self._state.position == EXIT
        return CorridorObservation(
            position=position,
            step_count=self._state.step_count,
            legal_actions=[] if won else ["right"] if position == 0 else ["left", "right"],
            done=won,
            reward=reward,
            metadata={"episode_id": self._state.episode_id, "won": won, "instruction": TASK},
        )


class UnseededCorridor(Corridor):
    """Ignores the seed: every reset in the process starts one cell further on."""

    _starts = itertools.count()

    def _start(self, seed: int | None) -> int:
        return 1 + next(self._starts) % 4
