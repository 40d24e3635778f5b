"""Sokoban as a text environment: push every box onto a target.

Rooms are generated as in gym-sokoban (Schrader 2018, the environment of the GiGPO paper's Sokoban
results): a random walk carves the floor, the boxes start on their targets, and the player then plays
backwards, walking and pulling boxes, so every room is solvable by construction. Of several reverse plays
the room kept is the one whose boxes were moved farthest (gym-sokoban's score: number of switches between
pulled boxes times the total distance of the boxes from their targets); no box is left on a target.

Observation: the grid, one line per row, cells separated by one space (so that a tokenizer sees one token
per cell). Symbols:

    #  wall          _  target            P  player
    .  floor         O  box               S  player on a target
                     X  box on a target

Actions: "up", "down", "left", "right" (surrounding whitespace and case are ignored). Any other text is an
invalid action: nothing moves, the step penalty applies and `info["invalid_action"]` is True.

Rewards, as in gym-sokoban: -0.1 every step, +1 when a box is pushed onto a target, -1 when a box is pushed
off a target, +10 when all boxes are on targets (the episode then terminates).

`reset(seed=s)` re-seeds the environment's random generator: the same seed and options give the same room;
`reset()` without a seed draws the next room from the same generator. Stepping before `reset()` or after
the episode ended (terminated or truncated) raises a RuntimeError, as gymnasium's OrderEnforcing does.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gigpo_trl.env_base import BaseTextEnv, is_int
from gigpo_trl.envs import INFO_ADMISSIBLE_ACTIONS, INFO_ANCHOR, INFO_TASK, INFO_TASK_TYPE, INFO_WON
from gigpo_trl.prompts import PromptTemplate

Cell = tuple[int, int]  # (row, column), row 0 at the top

ACTIONS = ("up", "down", "left", "right")
_MOVES: dict[str, Cell] = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
_DIRECTIONS = tuple(_MOVES.values())

WALL = "#"
FLOOR = "."
TARGET = "_"
BOX = "O"
BOX_ON_TARGET = "X"
PLAYER = "P"
PLAYER_ON_TARGET = "S"

STEP_PENALTY = -0.1
BOX_ON_TARGET_REWARD = 1.0
BOX_OFF_TARGET_PENALTY = -1.0
SOLVED_REWARD = 10.0

TASK = (
    "Sokoban: push every box onto a target. You push a box by walking into it; boxes cannot be pulled, "
    "and a box cannot be pushed into a wall or into another box. "
    f"Actions: {', '.join(ACTIONS)}. "
    f"Symbols: {WALL} wall, {FLOOR} floor, {TARGET} target, {BOX} box, {BOX_ON_TARGET} box on a target, "
    f"{PLAYER} you, {PLAYER_ON_TARGET} you on a target."
)

OPTION_KEYS = ("num_boxes", "dim_room", "layout")

# The default wording of Sokoban's step prompts (registered with the name "sokoban": `GiGPOConfig.prompt_template`).
PROMPT_TEMPLATE = PromptTemplate(
    system="You are solving a Sokoban puzzle: push every box onto a target. Boxes can be pushed but never pulled.",
    current="Current grid (step {step}):\n{observation}",
)

# Room generation, with gym-sokoban's constants where it has one.
_TURN_PROBABILITY = 0.35  # chance that the carving walk changes direction at a step
_CARVE_STEPS_PER_SIDE = 1.7  # carving walk length = 1.7 * (height + width)
_CARVE_MASKS: tuple[tuple[Cell, ...], ...] = (  # floor carved around the walker, as offsets from it
    ((0, -1), (0, 0), (0, 1)),
    ((-1, 0), (0, 0), (1, 0)),
    ((0, -1), (0, 0), (1, 0)),
    ((0, -1), (0, 0), (1, -1), (1, 0)),
    ((0, 0), (0, 1), (1, 0)),
)
_REVERSE_PLAYS = 8  # reverse plays per carved room; the best one is kept
_REVERSE_MOVES_PER_FLOOR_CELL = 6  # length of a reverse play, for the room's number of floor cells
_PULL_PROBABILITY = 0.8  # chance to pull the box behind the player when walking away from it
_MAX_ROOM_ATTEMPTS = 200  # carved rooms tried before giving up (only tiny, crowded rooms get there)


@dataclass(frozen=True)
class _Room:
    """The fixed part of a room: its size, walls and targets."""

    height: int
    width: int
    walls: frozenset[Cell]
    targets: frozenset[Cell]


@dataclass(frozen=True)
class _ReversePlay:
    """Where a reverse play left the player and the boxes, and gym-sokoban's score of that room."""

    score: int
    player: Cell
    boxes: tuple[Cell, ...]


class SokobanEnv(BaseTextEnv):
    """Sokoban with text observations and text actions (see the module docstring for symbols and rewards).

    Args:
        dim_room: (height, width) of the room, outer wall ring included; both at least 3, one at least 5.
        num_boxes: number of boxes (and targets); the room's inside must hold them, the player and a free cell.
        max_steps: None: the environment never truncates; an int n >= 1: `truncated` is True at the n-th step
            (with `terminated` too when that step solves the room, as gymnasium's TimeLimit does).

    `reset(options=...)` takes None or a dict with any of `num_boxes` and `dim_room` (overriding the
    constructor's for that episode), or only `layout`: a grid in the observation's symbols (cells may be
    separated by spaces), to play that fixed room. A layout must be rectangular, walled all around, hold
    one player, at least one box and as many targets as boxes, and not be solved already; its
    solvability is not checked.

    `info` on reset and step: `anchor` (the observation: the exact state), `admissible_actions`, `won`,
    `task`, `task_type` (the room size and box count, e.g. "6x6, 1 box"), `num_boxes`, `boxes_on_target`; on
    step also `invalid_action`.
    """

    def __init__(
        self, *, dim_room: Sequence[int] = (6, 6), num_boxes: int = 1, max_steps: int | None = None
    ) -> None:
        super().__init__(max_steps=max_steps)
        self.dim_room = _checked_dim_room(dim_room)
        self.num_boxes = _checked_num_boxes(num_boxes, self.dim_room)
        self._rng: random.Random | None = None
        self._room: _Room | None = None
        self._player: Cell = (0, 0)
        self._boxes: frozenset[Cell] = frozenset()

    seed_description = "a non-negative int"

    def seed_in_range(self, seed: int) -> bool:
        return seed >= 0

    def _reset(self, seed: int | None, options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
        """Start an episode in a new room."""
        if seed is not None:
            self._rng = random.Random(seed)
        elif self._rng is None:
            self._rng = random.Random()
        options = _checked_options(options)
        if "layout" in options:
            self._room, self._player, self._boxes = _parse_layout(options["layout"])
        else:
            dim_room = _checked_dim_room(options.get("dim_room", self.dim_room))
            num_boxes = _checked_num_boxes(options.get("num_boxes", self.num_boxes), dim_room)
            self._room, self._player, self._boxes = _generate_room(self._rng, dim_room, num_boxes)
        observation = self._render()
        return observation, self._info(observation)

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        move = _MOVES.get(action.strip().lower())
        boxes_on_target_before = self._boxes_on_target()
        if move is not None:
            self._walk(move)

        boxes_on_target = self._boxes_on_target()
        reward = STEP_PENALTY
        if boxes_on_target > boxes_on_target_before:
            reward += BOX_ON_TARGET_REWARD
        elif boxes_on_target < boxes_on_target_before:
            reward += BOX_OFF_TARGET_PENALTY
        terminated = boxes_on_target == len(self._boxes)
        if terminated:
            reward += SOLVED_REWARD

        observation = self._render()
        info = self._info(observation)
        info["invalid_action"] = move is None
        return observation, reward, terminated, info

    def _walk(self, move: Cell) -> None:
        """Move the player one cell, pushing the box in the way if the cell behind it is free."""
        ahead = _shifted(self._player, move)
        if ahead in self._room.walls:
            return
        if ahead in self._boxes:
            beyond = _shifted(ahead, move)
            if beyond in self._room.walls or beyond in self._boxes:
                return
            self._boxes = (self._boxes - {ahead}) | {beyond}
        self._player = ahead

    def _boxes_on_target(self) -> int:
        return len(self._boxes & self._room.targets)

    def _render(self) -> str:
        room = self._room
        rows = []
        for row in range(room.height):
            cells = []
            for column in range(room.width):
                cell = (row, column)
                on_target = cell in room.targets
                if cell in room.walls:
                    cells.append(WALL)
                elif cell == self._player:
                    cells.append(PLAYER_ON_TARGET if on_target else PLAYER)
                elif cell in self._boxes:
                    cells.append(BOX_ON_TARGET if on_target else BOX)
                else:
                    cells.append(TARGET if on_target else FLOOR)
            rows.append(" ".join(cells))
        return "\n".join(rows)

    def _info(self, observation: str) -> dict[str, Any]:
        boxes_on_target = self._boxes_on_target()
        return {
            INFO_ANCHOR: observation,
            INFO_ADMISSIBLE_ACTIONS: list(ACTIONS),
            INFO_WON: boxes_on_target == len(self._boxes),
            INFO_TASK: TASK,
            INFO_TASK_TYPE: f"{self._room.height}x{self._room.width}, {len(self._boxes)} box{'es' if len(self._boxes) > 1 else ''}",
            "num_boxes": len(self._boxes),
            "boxes_on_target": boxes_on_target,
        }


# --------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------


def _checked_dim_room(dim_room: Any) -> tuple[int, int]:
    if (
        not isinstance(dim_room, (tuple, list))
        or len(dim_room) != 2
        or not all(is_int(side) and side >= 3 for side in dim_room)
        or max(dim_room) < 5
    ):
        raise ValueError(
            "dim_room must be (height, width) counting the outer walls: two ints >= 3, one of them >= 5 "
            f"(a box needs three free cells in a row to be pushed), got {dim_room!r}"
        )
    return (dim_room[0], dim_room[1])


def _checked_num_boxes(num_boxes: Any, dim_room: tuple[int, int]) -> int:
    if not is_int(num_boxes) or num_boxes < 1:
        raise ValueError(f"num_boxes must be an int >= 1, got {num_boxes!r}")
    inside = (dim_room[0] - 2) * (dim_room[1] - 2)
    if num_boxes + 2 > inside:
        raise ValueError(
            f"num_boxes={num_boxes} does not fit a {dim_room[0]}x{dim_room[1]} room: its {inside} inside cells "
            "must hold the boxes, the player and at least one free cell"
        )
    return num_boxes


def _checked_options(options: Any) -> dict[str, Any]:
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ValueError(f"options must be None or a dict, got {type(options).__name__}")
    unknown = sorted(set(options) - set(OPTION_KEYS), key=str)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}; known options: {list(OPTION_KEYS)}")
    if "layout" in options and len(options) > 1:
        raise ValueError("option 'layout' fixes the room; it cannot be combined with 'num_boxes' or 'dim_room'")
    return options


def _parse_layout(layout: Any) -> tuple[_Room, Cell, frozenset[Cell]]:
    """Room, player and boxes of a text grid in the observation's symbols."""
    if not isinstance(layout, str):
        raise ValueError(f"layout must be a str, got {type(layout).__name__}")
    rows = ["".join(line.split()) for line in layout.strip().splitlines()]
    if not rows or len({len(row) for row in rows}) != 1:
        raise ValueError(f"layout must be a non-empty rectangular grid, got rows of lengths {[len(r) for r in rows]}")
    height, width = len(rows), len(rows[0])
    walls, targets, boxes, players = set(), set(), set(), []
    for row, line in enumerate(rows):
        for column, symbol in enumerate(line):
            cell = (row, column)
            if symbol not in (WALL, FLOOR, TARGET, BOX, BOX_ON_TARGET, PLAYER, PLAYER_ON_TARGET):
                raise ValueError(f"layout has an unknown symbol {symbol!r} at row {row}, column {column}")
            if symbol == WALL:
                walls.add(cell)
            elif row in (0, height - 1) or column in (0, width - 1):
                raise ValueError(f"layout must be walled all around; row {row}, column {column} is {symbol!r}")
            if symbol in (TARGET, BOX_ON_TARGET, PLAYER_ON_TARGET):
                targets.add(cell)
            if symbol in (BOX, BOX_ON_TARGET):
                boxes.add(cell)
            if symbol in (PLAYER, PLAYER_ON_TARGET):
                players.append(cell)
    if len(players) != 1:
        raise ValueError(f"layout must hold exactly one player ({PLAYER} or {PLAYER_ON_TARGET}), got {len(players)}")
    if not boxes or len(boxes) != len(targets):
        raise ValueError(
            "layout must hold at least one box and as many targets as boxes, "
            f"got {len(boxes)} boxes and {len(targets)} targets"
        )
    if boxes == targets:
        raise ValueError("layout is already solved: every box is on a target")
    return _Room(height, width, frozenset(walls), frozenset(targets)), players[0], frozenset(boxes)


# --------------------------------------------------------------------------------------------
# Room generation (gym-sokoban's algorithm, with random reverse plays instead of its exhaustive search)
# --------------------------------------------------------------------------------------------


def _shifted(cell: Cell, move: Cell) -> Cell:
    return (cell[0] + move[0], cell[1] + move[1])


def _generate_room(
    rng: random.Random, dim_room: tuple[int, int], num_boxes: int
) -> tuple[_Room, Cell, frozenset[Cell]]:
    """A solvable, unsolved room: carve the floor, put the boxes on targets, play backwards, keep the best."""
    height, width = dim_room
    for _ in range(_MAX_ROOM_ATTEMPTS):
        floor = _carve_floor(rng, height, width)
        if len(floor) < num_boxes + 2:
            continue
        player, *targets = rng.sample(sorted(floor), num_boxes + 1)
        plays = [_reverse_play(rng, floor, tuple(targets), player) for _ in range(_REVERSE_PLAYS)]
        best = max(plays, key=lambda play: play.score)
        if best.score > 0:
            walls = frozenset((row, column) for row in range(height) for column in range(width)) - floor
            return _Room(height, width, walls, frozenset(targets)), best.player, frozenset(best.boxes)
    raise RuntimeError(
        f"could not generate a {height}x{width} room with {num_boxes} boxes in {_MAX_ROOM_ATTEMPTS} attempts; "
        "use a bigger room or fewer boxes"
    )


def _carve_floor(rng: random.Random, height: int, width: int) -> set[Cell]:
    """gym-sokoban's room topology: a random walk inside the outer walls that carves a small mask at each step."""
    direction = rng.choice(_DIRECTIONS)
    row, column = rng.randint(1, height - 2), rng.randint(1, width - 2)
    floor = set()
    for _ in range(int(_CARVE_STEPS_PER_SIDE * (height + width))):
        if rng.random() < _TURN_PROBABILITY:
            direction = rng.choice(_DIRECTIONS)
        row = min(max(row + direction[0], 1), height - 2)
        column = min(max(column + direction[1], 1), width - 2)
        for d_row, d_column in rng.choice(_CARVE_MASKS):
            cell = (row + d_row, column + d_column)
            if 0 < cell[0] < height - 1 and 0 < cell[1] < width - 1:
                floor.add(cell)
    return floor


def _reverse_play(rng: random.Random, floor: set[Cell], targets: tuple[Cell, ...], player: Cell) -> _ReversePlay:
    """Play backwards from the solved room: walk at random, pulling the box behind the player most of the time.

    Every reverse move undoes a forward move (a walk, or a push of the pulled box), so every room passed
    through is solvable. Score of a room (gym-sokoban's): box switches (how often the pulled box changed)
    times the total Manhattan distance of the boxes from their own targets; 0 while a box is on a target.
    """
    boxes = list(targets)  # boxes[i] started on targets[i]
    best = _ReversePlay(0, player, tuple(boxes))
    last_pulled, box_switches = -1, 0
    for _ in range(_REVERSE_MOVES_PER_FLOOR_CELL * len(floor)):
        move = rng.choice(_DIRECTIONS)
        ahead = _shifted(player, move)
        if ahead not in floor or ahead in boxes:
            continue
        behind = (player[0] - move[0], player[1] - move[1])
        if behind in boxes and rng.random() < _PULL_PROBABILITY:
            pulled = boxes.index(behind)
            boxes[pulled] = player
            if pulled != last_pulled:
                last_pulled, box_switches = pulled, box_switches + 1
        player = ahead
        if any(box in targets for box in boxes):
            continue
        score = box_switches * sum(abs(b[0] - t[0]) + abs(b[1] - t[1]) for b, t in zip(boxes, targets))
        # On a tie the later room wins: the player walks on, away from the box it just pulled.
        if score > 0 and score >= best.score:
            best = _ReversePlay(score, player, tuple(boxes))
    return best
