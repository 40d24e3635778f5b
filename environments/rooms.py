"""Rooms: a small environment where credit assignment matters, for CPU learning experiments.

A line of `num_rooms` rooms; the agent starts in the middle one. The seed hides the treasure at the
west or the east end, and every observation says which way the draught blows (towards the treasure).
Actions: "go west", "go east". The only reward is 1 on reaching the treasure (the episode then
terminates); walking into the far wall does nothing. So the reward is sparse and delayed (at least
`num_rooms // 2` steps away), and copies of a task revisit the same rooms, whose anchors repeat
across trajectories: exactly where GiGPO's step groups can tell a good step from a bad one that
happened in a winning episode.
"""

from __future__ import annotations

from typing import Any

from gigpo_trl.envs import INFO_ADMISSIBLE_ACTIONS, INFO_ANCHOR, INFO_TASK, INFO_WON, check_step_call

ACTIONS = ("go west", "go east")
TASK = "Find the treasure at one end of the corridor of rooms. The draught blows towards it."


class RoomsEnv:
    """See the module docstring. `num_rooms` must be odd and at least 3 (the start is the middle room)."""

    def __init__(self, num_rooms: int = 9):
        if not isinstance(num_rooms, int) or num_rooms < 3 or num_rooms % 2 == 0:
            raise ValueError(f"num_rooms must be an odd int >= 3, got {num_rooms!r}")
        self.num_rooms = num_rooms
        self._room: int | None = None
        self._episode_over = False

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        if options:
            raise ValueError(f"RoomsEnv takes no options, got {sorted(options)}")
        self._treasure = 0 if (seed or 0) % 2 == 0 else self.num_rooms - 1
        self._room = self.num_rooms // 2
        self._episode_over = False
        return self._observation(), self._info()

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        check_step_call(reset_done=self._room is not None, episode_over=self._episode_over, action=action)
        move = {"go west": -1, "go east": 1}.get(action.strip().lower(), 0)
        self._room = min(max(self._room + move, 0), self.num_rooms - 1)
        won = self._room == self._treasure
        self._episode_over = won
        return self._observation(), 1.0 if won else 0.0, won, False, self._info()

    def close(self) -> None:
        pass

    def _observation(self) -> str:
        if self._room == self._treasure:
            return f"Room {self._room}: you found the treasure!"
        direction = "west" if self._treasure < self._room else "east"
        return f"Room {self._room}. The draught blows {direction}."

    def _info(self) -> dict[str, Any]:
        return {
            INFO_ANCHOR: (self._treasure, self._room),
            INFO_ADMISSIBLE_ACTIONS: list(ACTIONS),
            INFO_WON: self._room == self._treasure,
            INFO_TASK: TASK,
        }
