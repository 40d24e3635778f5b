"""Rooms: a small environment where credit assignment matters, for CPU learning experiments.

A line of `num_rooms` rooms; the agent starts in the middle one. The seed hides the treasure at the
west or the east end, and every observation says which way the draught blows (towards the treasure).
Actions: "go west", "go east", and optionally `idle_actions` actions that waste a step without
moving ("wait", "look around", ...), like the many harmless but useless commands of a text game. The
only reward is 1 on reaching the treasure (the episode then terminates); walking into the far wall does
nothing. So the reward is sparse and delayed (at least `num_rooms // 2` steps away), and copies of a
task revisit the same rooms, whose anchors repeat across trajectories: exactly where GiGPO's step
groups can tell a good step from a bad one that happened in a winning episode. An idle step in a
winning episode is such a bad step: the episode's credit rewards it, its step group (the same room,
where moving on reaches the treasure one discount factor sooner) does not.

With `hint=False` the observation names the room only ("Room 3."), not the draught: nothing in one observation
says which end holds the treasure or which way the agent already went. The good policy then needs memory ("keep
going the way you went; turn at the wall"), which only a prompt with history can give it. A deterministic policy of the
observation alone never reaches both ends (to reach the second it would have to leave a room the other way than it
did on the way to the first), so it wins at most the tasks on one side; walking always one way wins exactly those.
The anchor is still the exact state (the treasure's end and the room), never the history.
"""

from __future__ import annotations

from typing import Any

from gigpo_trl.env_base import BaseTextEnv
from gigpo_trl.envs import INFO_ADMISSIBLE_ACTIONS, INFO_ANCHOR, INFO_TASK, INFO_WON

MOVES = ("go west", "go east")
IDLE_ACTIONS = ("wait", "look around", "listen", "rest")
TASK = "Find the treasure at one end of the corridor of rooms. The draught blows towards it."
TASK_WITHOUT_HINT = "Find the treasure at one end of the corridor of rooms."


class RoomsEnv(BaseTextEnv):
    """See the module docstring. `num_rooms` must be odd and at least 3 (the start is the middle room);
    `idle_actions` is how many of IDLE_ACTIONS are admissible besides the two moves (0 to 4); `treasure` is
    "seed" (the seed's parity picks the end: even west, odd east) or a fixed "west" or "east" for every task;
    `hint` whether observations say which way the draught blows (towards the treasure); `max_steps` as in
    `BaseTextEnv`. `walkthrough` is the shortest way to the treasure."""

    def __init__(self, num_rooms: int = 9, idle_actions: int = 0, treasure: str = "seed", hint: bool = True, *,
                 max_steps: int | None = None):
        super().__init__(max_steps=max_steps)
        if not isinstance(num_rooms, int) or num_rooms < 3 or num_rooms % 2 == 0:
            raise ValueError(f"num_rooms must be an odd int >= 3, got {num_rooms!r}")
        if not isinstance(idle_actions, int) or not 0 <= idle_actions <= len(IDLE_ACTIONS):
            raise ValueError(f"idle_actions must be an int from 0 to {len(IDLE_ACTIONS)}, got {idle_actions!r}")
        if treasure not in ("seed", "west", "east"):
            raise ValueError(f"treasure must be 'seed', 'west' or 'east', got {treasure!r}")
        if not isinstance(hint, bool):
            raise ValueError(f"hint must be True or False, got {hint!r}")
        self.num_rooms = num_rooms
        self.hint = hint
        self.treasure = treasure
        self.actions = MOVES + IDLE_ACTIONS[:idle_actions]
        self._room = self._treasure = 0

    @property
    def walkthrough(self) -> list[str]:
        """The moves from the middle room to the treasure."""
        self.require_reset("the walkthrough")
        return ["go west" if self._treasure == 0 else "go east"] * (self.num_rooms // 2)

    def _reset(self, seed: int | None, options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
        if options:
            raise ValueError(f"RoomsEnv takes no options, got {sorted(options)}")
        west = (seed or 0) % 2 == 0 if self.treasure == "seed" else self.treasure == "west"
        self._treasure = 0 if west else self.num_rooms - 1
        self._room = self.num_rooms // 2
        return self._observation(), self._info()

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        move = {"go west": -1, "go east": 1}.get(action.strip().lower(), 0)
        self._room = min(max(self._room + move, 0), self.num_rooms - 1)
        won = self._room == self._treasure
        return self._observation(), 1.0 if won else 0.0, won, self._info()

    def _observation(self) -> str:
        if self._room == self._treasure:
            return f"Room {self._room}: you found the treasure!"
        if not self.hint:
            return f"Room {self._room}."
        direction = "west" if self._treasure < self._room else "east"
        return f"Room {self._room}. The draught blows {direction}."

    def _info(self) -> dict[str, Any]:
        return {
            INFO_ANCHOR: (self._treasure, self._room),
            INFO_ADMISSIBLE_ACTIONS: list(self.actions),
            INFO_WON: self._room == self._treasure,
            INFO_TASK: TASK if self.hint else TASK_WITHOUT_HINT,
        }
