"""SokobanEnv: seeded rooms that are always solvable, gym-sokoban's rewards, exact anchors, strict arguments."""

from __future__ import annotations

from collections import deque

import pytest

from gigpo_trl.env_checker import check_env
from gigpo_trl.environments.sokoban import ACTIONS, TASK, SokobanEnv
from gigpo_trl.envs import make_env

MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
SYMBOLS = set("#._OXPS")

# Fixed rooms, in the observation's symbols.
OPEN_ROOM = """
# # # # # #
# . . . . #
# . P O _ #
# . . . . #
# # # # # #
"""
TWO_BOXES = """
# # # # # # #
# P O _ . . #
# . . . . . #
# . O . _ . #
# # # # # # #
"""
ONE_PUSH_FROM_SOLVED = """
# # # # # #
# P O _ . #
# . . . . #
# . . X . #
# # # # # #
"""
BOX_AGAINST_WALL = """
# # # # # #
# _ . P O #
# # # # # #
"""
BOX_AGAINST_BOX = """
# # # # # # #
# P O O _ _ #
# # # # # # #
"""


def parse(observation: str) -> tuple[set, frozenset, tuple, frozenset]:
    """Walls, targets, player and boxes of an observation."""
    walls, targets, boxes = set(), set(), set()
    for row, line in enumerate(observation.splitlines()):
        for column, symbol in enumerate(line.split(" ")):
            cell = (row, column)
            if symbol == "#":
                walls.add(cell)
            if symbol in "_XS":
                targets.add(cell)
            if symbol in "OX":
                boxes.add(cell)
            if symbol in "PS":
                player = cell
    return walls, frozenset(targets), player, frozenset(boxes)


def solve(observation: str) -> list[str] | None:
    """A shortest solution (breadth-first over player and box positions), or None when there is none."""
    walls, targets, player, boxes = parse(observation)
    start = (player, boxes)
    came_from = {start: None}
    frontier = deque([start])
    while frontier:
        state = frontier.popleft()
        player, boxes = state
        if boxes == targets:
            actions = []
            while came_from[state] is not None:
                state, action = came_from[state]
                actions.append(action)
            return actions[::-1]
        for action, (d_row, d_column) in MOVES.items():
            ahead = (player[0] + d_row, player[1] + d_column)
            if ahead in walls:
                continue
            next_boxes = boxes
            if ahead in boxes:
                beyond = (ahead[0] + d_row, ahead[1] + d_column)
                if beyond in walls or beyond in boxes:
                    continue
                next_boxes = (boxes - {ahead}) | {beyond}
            next_state = (ahead, next_boxes)
            if next_state not in came_from:
                came_from[next_state] = (state, action)
                frontier.append(next_state)
    return None


def play(layout: str, *actions: str, **env_kwargs) -> tuple[SokobanEnv, list[tuple]]:
    """Reset on `layout`, take `actions`; the env and the list of step results."""
    env = SokobanEnv(**env_kwargs)
    env.reset(options={"layout": layout})
    return env, [env.step(action) for action in actions]


# --------------------------------------------------------------------------------------------
# Generated rooms
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_boxes", [1, 2])
def test_the_same_seed_gives_the_same_room(num_boxes: int) -> None:
    env, other_env = SokobanEnv(num_boxes=num_boxes), SokobanEnv(num_boxes=num_boxes)
    for seed in [0, 1, 2, 7, 42, 123456789]:
        observation, info = env.reset(seed=seed)
        other_env.reset(seed=seed + 1)
        assert other_env.reset(seed=seed) == (observation, info)


def test_reset_without_a_seed_draws_the_next_room_of_the_seeded_sequence() -> None:
    env = SokobanEnv()
    env.reset(seed=3)
    rooms = [env.reset()[0] for _ in range(5)]
    env.reset(seed=3)
    assert [env.reset()[0] for _ in range(5)] == rooms


@pytest.mark.parametrize("num_boxes", [1, 2])
def test_different_seeds_give_varied_rooms(num_boxes: int) -> None:
    env = SokobanEnv(num_boxes=num_boxes)
    rooms = {env.reset(seed=seed)[0] for seed in range(40)}
    assert len(rooms) >= 35


@pytest.mark.parametrize(("num_boxes", "seeds"), [(1, range(100)), (2, range(50))])
def test_every_generated_room_is_solvable_and_not_solved(num_boxes: int, seeds: range) -> None:
    env = SokobanEnv(num_boxes=num_boxes)
    for seed in seeds:
        observation, info = env.reset(seed=seed)
        solution = solve(observation)
        assert solution, f"seed {seed}: {'unsolvable' if solution is None else 'already solved'}\n{observation}"
        assert not info["won"]
        assert info["boxes_on_target"] == 0


@pytest.mark.parametrize(("dim_room", "num_boxes"), [((7, 7), 3), ((5, 9), 2), ((3, 8), 1)])
def test_other_room_sizes_are_solvable_too(dim_room: tuple[int, int], num_boxes: int) -> None:
    env = SokobanEnv(dim_room=dim_room, num_boxes=num_boxes)
    for seed in range(5):
        observation, info = env.reset(seed=seed)
        assert len(observation.splitlines()) == dim_room[0]
        assert info["num_boxes"] == num_boxes
        assert solve(observation), observation


def test_big_rooms_with_many_boxes_are_generated() -> None:
    env = SokobanEnv(dim_room=(12, 12), num_boxes=4)
    for seed in range(10):
        observation, info = env.reset(seed=seed)
        walls, targets, player, boxes = parse(observation)
        assert len(boxes) == len(targets) == 4
        assert info["boxes_on_target"] == 0


@pytest.mark.parametrize("num_boxes", [1, 2])
def test_replaying_the_solution_wins_with_the_rewards_the_spec_implies(num_boxes: int) -> None:
    env = SokobanEnv(num_boxes=num_boxes)
    for seed in range(20):
        observation, _ = env.reset(seed=seed)
        solution = solve(observation)
        rewards = []
        for action in solution:
            observation, reward, terminated, truncated, info = env.step(action)
            rewards.append(reward)
            assert terminated == (len(rewards) == len(solution))
            assert not truncated
        assert info["won"]
        assert info["boxes_on_target"] == num_boxes
        # Every box goes from off to on a target once more than the other way round, and the last push solves.
        assert sum(rewards) == pytest.approx(-0.1 * len(solution) + num_boxes * 1 + 10)


def test_options_override_the_room_size_and_box_count_for_one_episode() -> None:
    env = SokobanEnv()
    observation, info = env.reset(seed=0, options={"dim_room": (7, 8), "num_boxes": 2})
    assert [len(line.split(" ")) for line in observation.splitlines()] == [8] * 7
    assert info["num_boxes"] == 2
    observation, info = env.reset(seed=0)
    assert len(observation.splitlines()) == 6
    assert info["num_boxes"] == 1


# --------------------------------------------------------------------------------------------
# Observation and info
# --------------------------------------------------------------------------------------------


def test_the_observation_is_the_grid_in_the_documented_symbols() -> None:
    observation, info = SokobanEnv().reset(seed=5)
    rows = [line.split(" ") for line in observation.splitlines()]
    assert all(len(row) == 6 for row in rows) and len(rows) == 6
    assert {symbol for row in rows for symbol in row} <= SYMBOLS
    assert rows[0] == rows[-1] == ["#"] * 6
    assert info["task"] == TASK
    for symbol in SYMBOLS:
        assert f"{symbol} " in TASK


def test_info_carries_the_contract_keys() -> None:
    env = SokobanEnv()
    observation, info = env.reset(seed=1)
    assert info["anchor"] == observation
    assert info["admissible_actions"] == list(ACTIONS) == ["up", "down", "left", "right"]
    assert info["won"] is False
    _, _, _, _, info = env.step("up")
    assert set(info) >= {"anchor", "admissible_actions", "won", "task", "num_boxes", "boxes_on_target"}
    assert info["invalid_action"] is False


def test_the_task_type_is_the_room_size_and_box_count() -> None:
    env = SokobanEnv()
    assert env.reset(seed=1)[1]["task_type"] == "6x6, 1 box"
    assert env.reset(seed=1, options={"dim_room": (7, 8), "num_boxes": 2})[1]["task_type"] == "7x8, 2 boxes"


def test_a_layout_round_trips_through_the_observation() -> None:
    env = SokobanEnv()
    observation, _ = env.reset(seed=11, options={"num_boxes": 2})
    assert env.reset(options={"layout": observation})[0] == observation
    compact = "\n".join(line.replace(" ", "") for line in OPEN_ROOM.strip().splitlines())
    assert env.reset(options={"layout": compact})[0] == OPEN_ROOM.strip()


def test_the_same_state_reached_by_two_paths_has_the_same_anchor() -> None:
    _, up_then_left = play(OPEN_ROOM, "up", "left")
    _, left_then_up = play(OPEN_ROOM, "left", "up")
    _, up_only = play(OPEN_ROOM, "up")
    anchor = up_then_left[-1][4]["anchor"]
    hash(anchor)
    assert anchor == left_then_up[-1][4]["anchor"]
    assert anchor != up_only[-1][4]["anchor"]


def test_states_differing_only_in_a_box_have_different_anchors() -> None:
    _, pushed = play(TWO_BOXES, "right", "left")
    _, walked = play(TWO_BOXES, "down", "up")
    assert pushed[-1][4]["anchor"] != walked[-1][4]["anchor"]


# --------------------------------------------------------------------------------------------
# Rewards and dynamics (gym-sokoban's)
# --------------------------------------------------------------------------------------------


def test_a_plain_move_costs_the_step_penalty() -> None:
    _, [(observation, reward, terminated, truncated, info)] = play(OPEN_ROOM, "up")
    assert reward == pytest.approx(-0.1)
    assert not terminated and not truncated
    assert observation.splitlines()[1] == "# . P . . #"


def test_pushing_a_box_onto_a_target_gives_plus_one() -> None:
    _, [(observation, reward, terminated, _, info)] = play(TWO_BOXES, "right")
    assert reward == pytest.approx(-0.1 + 1)
    assert not terminated
    assert observation.splitlines()[1] == "# . P X . . #"
    assert info["boxes_on_target"] == 1


def test_pushing_a_box_off_a_target_gives_minus_one() -> None:
    _, [_, (observation, reward, terminated, _, info)] = play(TWO_BOXES, "right", "right")
    assert reward == pytest.approx(-0.1 - 1)
    assert not terminated
    assert observation.splitlines()[1] == "# . . S O . #"
    assert info["boxes_on_target"] == 0


@pytest.mark.parametrize("layout", [OPEN_ROOM, ONE_PUSH_FROM_SOLVED])
def test_the_solving_push_gives_plus_one_plus_ten_and_terminates(layout: str) -> None:
    _, [(observation, reward, terminated, truncated, info)] = play(layout, "right")
    assert reward == pytest.approx(-0.1 + 1 + 10)
    assert terminated and not truncated
    assert info["won"]
    assert "O" not in observation and "_" not in observation


def test_walking_into_a_wall_costs_the_step_penalty_and_changes_nothing() -> None:
    env, [(observation, reward, terminated, _, info)] = play(TWO_BOXES, "up")
    assert reward == pytest.approx(-0.1)
    assert observation == TWO_BOXES.strip()
    assert not terminated and not info["invalid_action"]


@pytest.mark.parametrize("layout", [BOX_AGAINST_WALL, BOX_AGAINST_BOX])
def test_a_box_cannot_be_pushed_into_a_wall_or_another_box(layout: str) -> None:
    _, [(observation, reward, _, _, _)] = play(layout, "right")
    assert reward == pytest.approx(-0.1)
    assert observation == layout.strip()


@pytest.mark.parametrize("action", ["jump", "", "go up", "upp", "<action>up</action>", "u p"])
def test_an_invalid_action_costs_the_step_penalty_moves_nothing_and_is_flagged(action: str) -> None:
    _, [(observation, reward, terminated, truncated, info)] = play(OPEN_ROOM, action)
    assert reward == pytest.approx(-0.1)
    assert observation == OPEN_ROOM.strip()
    assert info["invalid_action"] is True
    assert not terminated and not truncated


@pytest.mark.parametrize("action", ["UP", " up ", "Up\n", "\tuP"])
def test_actions_ignore_case_and_surrounding_whitespace(action: str) -> None:
    _, [(observation, _, _, _, info)] = play(OPEN_ROOM, action)
    assert info["invalid_action"] is False
    assert observation.splitlines()[1] == "# . P . . #"


def test_the_reward_is_the_reward_of_the_step_not_the_running_total() -> None:
    _, results = play(OPEN_ROOM, "up", "down", "up")
    assert [reward for _, reward, *_ in results] == pytest.approx([-0.1, -0.1, -0.1])


def test_max_steps_truncates_at_that_step() -> None:
    _, results = play(OPEN_ROOM, "up", "left", "down", max_steps=3)
    assert [truncated for *_, truncated, _ in results] == [False, False, True]
    assert not any(terminated for _, _, terminated, _, _ in results)


def test_without_max_steps_the_environment_never_truncates() -> None:
    _, results = play(OPEN_ROOM, *["up", "down"] * 100)
    assert not any(truncated for *_, truncated, _ in results)


def test_solving_on_the_last_allowed_step_is_terminated_and_truncated() -> None:
    _, [(_, reward, terminated, truncated, _)] = play(OPEN_ROOM, "right", max_steps=1)
    assert terminated and truncated
    assert reward == pytest.approx(10.9)


def test_stepping_after_the_episode_ended_raises_until_reset() -> None:
    env, _ = play(OPEN_ROOM, "right")
    with pytest.raises(RuntimeError, match="reset"):
        env.step("left")
    env.reset(options={"layout": OPEN_ROOM})
    env.step("left")
    truncated_env, _ = play(OPEN_ROOM, "up", max_steps=1)
    with pytest.raises(RuntimeError, match="reset"):
        truncated_env.step("down")


def test_stepping_before_reset_raises() -> None:
    with pytest.raises(RuntimeError, match="reset"):
        SokobanEnv().step("up")


def test_an_action_that_is_not_text_raises_type_error() -> None:
    env = SokobanEnv()
    env.reset(seed=0)
    with pytest.raises(TypeError, match="str"):
        env.step(0)


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("num_boxes", [1, 2])
def test_it_passes_check_env(num_boxes: int) -> None:
    for seed in range(5):
        check_env(SokobanEnv(num_boxes=num_boxes, max_steps=15), seed=seed, num_steps=20)


def test_make_env_builds_it_by_name() -> None:
    env = make_env("sokoban", num_boxes=2, max_steps=15)
    assert isinstance(env, SokobanEnv)
    assert env.reset(seed=0)[1]["num_boxes"] == 2
    env.close()


# --------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dim_room": (6,)}, "dim_room"),
        ({"dim_room": "6x6"}, "dim_room"),
        ({"dim_room": (6.0, 6)}, "dim_room"),
        ({"dim_room": (2, 6)}, "dim_room"),
        ({"dim_room": (4, 4)}, "dim_room"),
        ({"num_boxes": 0}, "num_boxes"),
        ({"num_boxes": True}, "num_boxes"),
        ({"num_boxes": 1.0}, "num_boxes"),
        ({"num_boxes": 15}, "does not fit"),
        ({"max_steps": 0}, "max_steps"),
        ({"max_steps": 2.5}, "max_steps"),
    ],
)
def test_bad_constructor_arguments_raise_value_errors_naming_them(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SokobanEnv(**kwargs)


@pytest.mark.parametrize(
    ("reset_kwargs", "message"),
    [
        ({"options": {"boxes": 2, "seed": 1}}, r"unknown option\(s\) \['boxes', 'seed'\]"),
        ({"options": "layout"}, "options must be"),
        ({"options": {"num_boxes": 0}}, "num_boxes"),
        ({"options": {"num_boxes": 8, "dim_room": (5, 5)}}, "does not fit"),
        ({"options": {"dim_room": (6, 6, 6)}}, "dim_room"),
        ({"options": {"layout": OPEN_ROOM, "num_boxes": 2}}, "layout"),
        ({"seed": -1}, "seed"),
        ({"seed": "1"}, "seed"),
    ],
)
def test_bad_reset_arguments_raise_value_errors_naming_them(reset_kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SokobanEnv().reset(**reset_kwargs)


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (None, "layout must be a str"),
        ("", "rectangular"),
        ("# # # #\n# P O _ #\n# # # # #", "rectangular"),
        ("# # # # #\n# P $ . #\n# # # # #", r"unknown symbol '\$' at row 1, column 2"),
        ("# # # # #\n. P O _ #\n# # # # #", "walled all around"),
        ("# # # # # #\n# . O _ . #\n# # # # # #", "exactly one player"),
        ("# # # # # #\n# P O _ P #\n# # # # # #", "exactly one player"),
        ("# # # # # #\n# P O . . #\n# # # # # #", "as many targets as boxes"),
        ("# # # # # #\n# P . _ . #\n# # # # # #", "at least one box"),
        ("# # # # # #\n# P X . . #\n# # # # # #", "already solved"),
    ],
)
def test_bad_layouts_raise_value_errors_saying_what_is_wrong(layout: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SokobanEnv().reset(options={"layout": layout})
