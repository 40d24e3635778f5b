"""The compass environment of setting H: the observation says where the exit lies, mistakes waste turns."""

from __future__ import annotations

import pytest

from gigpo_trl.env_checker import check_env
from gigpo_trl.envs import make_env
from gigpo_trl.shortest_paths import shortest_path_length


def offset_of(observation: str) -> tuple[int, int]:
    """(north, east) rooms to the exit, read back from the observation's words."""
    words = observation.rstrip(".").split()
    north = east = 0
    for k, word in enumerate(words):
        if word.startswith("room"):
            rooms, direction = int(words[k - 1]), words[k + 1]
            if direction in ("north", "south"):
                north = rooms if direction == "north" else -rooms
            else:
                east = rooms if direction == "east" else -rooms
    return north, east


@pytest.mark.parametrize("seed", range(12))
def test_every_task_starts_its_distance_away_and_its_walkthrough_wins_in_that_many_moves(seed):
    env = make_env("compass", size=5, distance=4)
    observation, info = env.reset(seed=seed)
    north, east = offset_of(observation)

    assert abs(north) + abs(east) == 4 and info["anchor"] == (north, east)
    assert shortest_path_length(env, seed, 8) == 4
    env.reset(seed=seed)
    steps = [env.step(action) for action in env.walkthrough]
    assert len(steps) == 4 and [reward for _, reward, *_ in steps] == [0.0, 0.0, 0.0, 1.0]
    assert steps[-1][0] == "You found the exit!" and steps[-1][2] and steps[-1][4]["won"]
    assert all(abs(sum(map(abs, offset_of(o)))) == 3 - k for k, (o, *_) in enumerate(steps[:-1]))


def test_the_copies_of_a_task_start_alike_and_tasks_differ():
    starts = {seed: make_env("compass").reset(seed=seed)[0] for seed in range(20)}
    assert all(make_env("compass").reset(seed=seed)[0] == start for seed, start in starts.items())
    assert len(set(starts.values())) > 5


def test_a_wrong_move_costs_two_turns_a_bump_or_an_idle_action_one_and_none_ends_the_game():
    env = make_env("compass", size=2, distance=1, idle_actions=2)
    observation, info = env.reset(seed=0)
    assert info["admissible_actions"] == ["go north", "go south", "go east", "go west", "wait", "look around"]
    (way,) = env.walkthrough
    away = {"go north": "go south", "go south": "go north", "go east": "go west", "go west": "go east"}[way]

    bump = env.step(away)  # on a 2 x 2 grid the room one move from the exit has the wall behind it
    idle = env.step("wait")
    nonsense = env.step("dance")
    assert [step[0] for step in (bump, idle, nonsense)] == [observation] * 3
    assert [step[4]["anchor"] for step in (bump, idle, nonsense)] == [info["anchor"]] * 3
    assert not any(step[2] or step[3] for step in (bump, idle, nonsense))
    assert env.step(way)[1:3] == (1.0, True)

    moved_away = 0
    for seed in range(10):  # a move away from the exit, where no wall stops it, and the move back
        env = make_env("compass", size=5, distance=2)
        _, info = env.reset(seed=seed)
        first = env.walkthrough[0]
        back = {"go north": "go south", "go south": "go north", "go east": "go west", "go west": "go east"}[first]
        away_info = env.step(back)[4]
        if away_info["anchor"] == info["anchor"]:  # the wall: a bump
            continue
        moved_away += 1
        assert sum(map(abs, away_info["anchor"])) == 3 and env.step(first)[4]["anchor"] == info["anchor"]
        assert shortest_path_length(env, seed, 8, prefix=[back]) == 3
    assert moved_away >= 5


def test_the_step_limit_truncates_a_game_of_wasted_turns():
    env = make_env("compass", distance=4, idle_actions=1, max_steps=8)
    env.reset(seed=5)
    steps = [env.step("wait") for _ in range(8)]
    assert [step[3] for step in steps] == [False] * 7 + [True] and not any(step[2] for step in steps)


def test_the_observation_words_each_direction():
    env = make_env("compass", size=5, distance=3)
    seen = {env.reset(seed=seed)[0] for seed in range(60)}
    assert "The exit is 1 room north and 2 rooms east." in seen or "The exit is 2 rooms north and 1 room east." in seen
    assert any(o.startswith("The exit is 3 rooms ") and " and " not in o for o in seen)


@pytest.mark.parametrize("seed", range(6))
def test_orders_name_the_moves_left_and_keep_the_offset_as_the_anchor(seed):
    orders, offset = make_env("compass", size=7, distance=6, phrasing="orders"), make_env("compass", size=7, distance=6)
    observations = [orders.reset(seed=seed)]
    offset.reset(seed=seed)
    observations += [orders.step(move)[::4] for move in ["go north", "go south"]]
    observations += [orders.step(move)[::4] for move in orders.walkthrough]
    for observation, info in observations[:-1]:
        north, east = info["anchor"]
        legs = [f"{name} {count}" for rooms, name in ((north, "north" if north > 0 else "south"),
                                                      (east, "east" if east > 0 else "west")) if rooms
                for count in [{1: "once", 2: "twice"}.get(abs(rooms), f"{abs(rooms)} times")]]
        assert observation == f"Go {' and '.join(legs)}."
    assert observations[0][1]["anchor"] == offset.reset(seed=seed)[1]["anchor"]
    assert observations[-1][0] == "You found the exit!" and observations[-1][1]["won"]


def test_compass_follows_the_contract_and_refuses_bad_arguments():
    check_env(make_env("compass", idle_actions=2))
    check_env(make_env("compass", phrasing="orders"))
    for kwargs, message in [({"size": 1}, "size must be an int >= 2"),
                            ({"size": 3, "distance": 5}, "distance must be an int from 1 to 4"),
                            ({"distance": True}, "distance must be an int"),
                            ({"idle_actions": 5}, "idle_actions must be an int from 0 to 4"),
                            ({"phrasing": "Orders"}, "phrasing must be one of \\('offset', 'orders'\\)")]:
        with pytest.raises(ValueError, match=message):
            make_env("compass", **kwargs)
    with pytest.raises(ValueError, match="takes no options"):
        make_env("compass").reset(seed=0, options={"size": 3})
