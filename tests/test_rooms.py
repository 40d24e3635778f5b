"""The rooms environment of the learning comparison."""

from __future__ import annotations

import pytest

from gigpo_trl.env_checker import check_env
from gigpo_trl.envs import make_env


def play(env, actions):
    return [env.step(action) for action in actions]


@pytest.mark.parametrize(("seed", "direction", "way"), [(0, "west", "go west"), (1, "east", "go east")])
def test_following_the_draught_wins_in_half_the_corridor(seed, direction, way):
    env = make_env("rooms", num_rooms=9)
    observation, info = env.reset(seed=seed)

    assert observation == f"Room 4. The draught blows {direction}."
    steps = play(env, [way] * 4)
    assert [reward for _, reward, _, _, _ in steps] == [0.0, 0.0, 0.0, 1.0]
    assert steps[-1][2] and steps[-1][4]["won"] and "found the treasure" in steps[-1][0]


def test_the_far_wall_stops_the_agent_and_states_repeat():
    env = make_env("rooms", num_rooms=3)
    _, start = env.reset(seed=0)  # treasure in room 0
    steps = play(env, ["go east", "go east", "go west"])

    assert [info["anchor"] for *_, info in steps] == [(0, 2), (0, 2), (0, 1)]
    assert steps[-1][4]["anchor"] == start["anchor"]
    assert not any(terminated for _, _, terminated, _, _ in steps)


def test_unknown_text_does_not_move():
    env = make_env("rooms")
    env.reset(seed=1)
    observation, reward, terminated, _, info = env.step("dance")
    assert (info["anchor"], reward, terminated) == ((8, 4), 0.0, False)


def test_rooms_follows_the_contract_and_rejects_bad_arguments():
    check_env(make_env("rooms"))
    with pytest.raises(ValueError, match="num_rooms must be an odd int >= 3"):
        make_env("rooms", num_rooms=4)
    with pytest.raises(ValueError, match="takes no options"):
        make_env("rooms").reset(seed=0, options={"num_rooms": 5})


def test_idle_actions_are_admissible_and_waste_a_step_without_moving():
    env = make_env("rooms", num_rooms=5, idle_actions=2)
    observation, info = env.reset(seed=0)
    assert info["admissible_actions"] == ["go west", "go east", "wait", "look around"]

    steps = play(env, ["wait", "look around", "go west", "wait", "go west"])
    assert [info["anchor"] for *_, info in steps] == [(0, 2), (0, 2), (0, 1), (0, 1), (0, 0)]
    assert steps[0][0] == observation
    assert [reward for _, reward, _, _, _ in steps] == [0.0, 0.0, 0.0, 0.0, 1.0]
    check_env(env)


@pytest.mark.parametrize("idle_actions", [-1, 5, 1.0])
def test_idle_actions_out_of_range_are_rejected(idle_actions):
    with pytest.raises(ValueError, match="idle_actions must be an int from 0 to 4"):
        make_env("rooms", idle_actions=idle_actions)


@pytest.mark.parametrize(("treasure", "expected"), [("west", [0, 0]), ("east", [8, 8]), ("seed", [0, 8])])
def test_the_treasure_end_can_be_fixed_for_every_task(treasure, expected):
    env = make_env("rooms", treasure=treasure)
    assert [env.reset(seed=seed)[1]["anchor"][0] for seed in (0, 1)] == expected


def test_an_unknown_treasure_end_is_rejected():
    with pytest.raises(ValueError, match="treasure must be 'seed', 'west' or 'east', got 'north'"):
        make_env("rooms", treasure="north")


def test_without_the_hint_observations_name_the_room_only_and_anchors_stay_the_exact_state():
    env = make_env("rooms", num_rooms=5, hint=False)
    observation, info = env.reset(seed=1)  # the treasure east
    assert observation == "Room 2." and info["task"] == "Find the treasure at one end of the corridor of rooms."

    steps = play(env, ["go west", "go west", "go west", "go east"])  # to the west wall, into it, and back
    assert [observation for observation, *_ in steps] == ["Room 1.", "Room 0.", "Room 0.", "Room 1."]
    # Room 1 looks the same whichever way the agent came, and its anchor is the same: the state, not the history.
    assert [info["anchor"] for *_, info in steps] == [(4, 1), (4, 0), (4, 0), (4, 1)]
    assert not any(terminated or reward for _, reward, terminated, _, _ in steps)

    west_task = make_env("rooms", num_rooms=5, hint=False)
    west_task.reset(seed=0)
    observation, _, _, _, info = west_task.step("go west")
    assert observation == "Room 1." and info["anchor"] == (0, 1)  # the same text, another state (the treasure's end)
    check_env(make_env("rooms", num_rooms=5, hint=False))


def test_without_the_hint_the_draught_is_never_mentioned_and_the_treasure_is_still_found():
    env = make_env("rooms", num_rooms=5, hint=False)
    env.reset(seed=1)  # treasure east
    steps = play(env, ["go east", "go east"])
    assert [observation for observation, *_ in steps] == ["Room 3.", "Room 4: you found the treasure!"]
    assert steps[-1][1] == 1.0 and steps[-1][4]["won"]


def test_a_hint_that_is_not_a_bool_is_rejected():
    with pytest.raises(ValueError, match="hint must be True or False, got 'no'"):
        make_env("rooms", hint="no")
