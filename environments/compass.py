"""Compass: a grid of rooms whose every observation says where the exit lies; mistakes waste turns, never end a game.

A `size` x `size` grid. The seed places the start and the exit `distance` moves apart (Manhattan distance: the
shortest path is `distance` moves). Every observation says where the exit lies from the current room ("The exit is
2 rooms north and 1 room east."), or, with `phrasing="orders"`, names the moves that reach it ("Go north twice and
east once."): all a policy needs, with no memory, so the anchor is that offset, what the prompt shows. Actions:
"go north", "go south", "go east", "go west", and optionally `idle_actions` of IDLE_ACTIONS, which do nothing
("wait", "look around", ...). A move into the grid's outer wall leaves the agent where it was. The only reward is 1 on
reaching the exit (the episode then terminates). No action ends the game: a wrong move costs two turns (there and
back), a bump or an idle action one, and a step limit (`max_steps`, or the trainer's `max_env_steps`; 1.5 to 2
times `distance`) makes the wasted turns cost the game. This is where GiGPO's step credit should pay (as in ALFWorld's
"Nothing happens" and wrong rooms): the copies of a task start alike and meet the same offsets again, and from one
offset a move towards the exit reaches it sooner (a larger discounted return) than a wasted turn, in winning and
losing episodes alike.
"""

from __future__ import annotations

import random
from typing import Any

from gigpo_trl.env_base import BaseTextEnv, is_int
from gigpo_trl.envs import INFO_ADMISSIBLE_ACTIONS, INFO_ANCHOR, INFO_TASK, INFO_WON

MOVES = {"go north": (0, 1), "go south": (0, -1), "go east": (1, 0), "go west": (-1, 0)}
IDLE_ACTIONS = ("wait", "look around", "listen", "rest")
TASK = "Find the exit of the grid of rooms. Each room tells you where the exit lies."
PHRASINGS = ("offset", "orders")
TIMES = {1: "once", 2: "twice"}


class CompassEnv(BaseTextEnv):
    """See the module docstring. `size` >= 2 rooms a side; `distance` from 1 to 2 x (size - 1), the start's moves
    from the exit; `idle_actions` how many of IDLE_ACTIONS are admissible besides the four moves (0 to 4);
    `phrasing` how an observation says where the exit lies, one of PHRASINGS: "offset" ("The exit is 2 rooms north
    and 1 room east.") or "orders" ("Go north twice and east once."); `max_steps` as in `BaseTextEnv`. `walkthrough`
    is a shortest way to the exit."""

    def __init__(self, size: int = 5, distance: int = 4, idle_actions: int = 0, phrasing: str = "offset", *,
                 max_steps: int | None = None):
        super().__init__(max_steps=max_steps)
        if not is_int(size) or size < 2:
            raise ValueError(f"size must be an int >= 2, got {size!r}")
        if not is_int(distance) or not 1 <= distance <= 2 * (size - 1):
            raise ValueError(f"distance must be an int from 1 to {2 * (size - 1)} (the grid's diameter), got {distance!r}")
        if not is_int(idle_actions) or not 0 <= idle_actions <= len(IDLE_ACTIONS):
            raise ValueError(f"idle_actions must be an int from 0 to {len(IDLE_ACTIONS)}, got {idle_actions!r}")
        if phrasing not in PHRASINGS:
            raise ValueError(f"phrasing must be one of {PHRASINGS}, got {phrasing!r}")
        self.size, self.distance, self.phrasing = size, distance, phrasing
        self.actions = (*MOVES, *IDLE_ACTIONS[:idle_actions])
        self._position = self._exit = (0, 0)

    @property
    def walkthrough(self) -> list[str]:
        """The moves from the current room to the exit: north or south first, then east or west."""
        self.require_reset("the walkthrough")
        east, north = (self._exit[0] - self._position[0], self._exit[1] - self._position[1])
        return (["go north" if north > 0 else "go south"] * abs(north)
                + ["go east" if east > 0 else "go west"] * abs(east))

    def _reset(self, seed: int | None, options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
        if options:
            raise ValueError(f"CompassEnv takes no options, got {sorted(options)}")
        rng = random.Random(seed)
        cells = [(x, y) for x in range(self.size) for y in range(self.size)]
        pairs = [(start, end) for start in cells for end in cells
                 if abs(start[0] - end[0]) + abs(start[1] - end[1]) == self.distance]
        self._position, self._exit = pairs[rng.randrange(len(pairs))]
        return self._observation(), self._info()

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        east, north = MOVES.get(action.strip().lower(), (0, 0))
        x, y = self._position[0] + east, self._position[1] + north
        if 0 <= x < self.size and 0 <= y < self.size:
            self._position = (x, y)
        won = self._position == self._exit
        return self._observation(), 1.0 if won else 0.0, won, self._info()

    def _offset(self) -> tuple[int, int]:
        """Rooms to the exit: (north, east), negative for south and west."""
        return self._exit[1] - self._position[1], self._exit[0] - self._position[0]

    def _observation(self) -> str:
        north, east = self._offset()
        if (north, east) == (0, 0):
            return "You found the exit!"
        legs = [(abs(rooms), name) for rooms, name in ((north, "north" if north > 0 else "south"),
                                                        (east, "east" if east > 0 else "west")) if rooms]
        if self.phrasing == "orders":
            orders = " and ".join(f"{name} {TIMES.get(rooms, f'{rooms} times')}" for rooms, name in legs)
            return f"Go {orders}."
        distances = [f"{rooms} room{'s' if rooms > 1 else ''} {name}" for rooms, name in legs]
        return f"The exit is {' and '.join(distances)}."

    def _info(self) -> dict[str, Any]:
        return {
            INFO_ANCHOR: self._offset(),
            INFO_ADMISSIBLE_ACTIONS: list(self.actions),
            INFO_WON: self._position == self._exit,
            INFO_TASK: TASK,
        }
