"""TextWorldExpress games through `make_env("textworld_express", ...)`: real games in a real JVM."""

from __future__ import annotations

import os
import shutil
import signal

import pytest

pytest.importorskip("textworld_express")
pytestmark = pytest.mark.skipif(shutil.which("java") is None, reason="TextWorldExpress needs a Java runtime (java)")

from gigpo_trl.env_pool import EnvPool  # noqa: E402
from gigpo_trl.environments.textworld_express_games import GAMES, TextWorldExpressEnv  # noqa: E402
from gigpo_trl.envs import make_env  # noqa: E402
from gigpo_trl.tasks import Task  # noqa: E402

SMALL = {
    "cookingworld": {"numLocations": 1, "numIngredients": 1, "numDistractorItems": 0, "includeDoors": 0},
    "coin": {"numLocations": 3, "includeDoors": 1},
    "twc": {"numLocations": 1, "numItemsToPutAway": 2},
    "mapreader": {"numLocations": 4, "maxDistanceApart": 2},
    "simonsays": {"gameLength": 3},
}
OPPOSITE = {"north": "south", "south": "north", "east": "west", "west": "east"}


@pytest.fixture
def env_of():
    made = []

    def make(game, **params):
        env = make_env("textworld_express", game=game, **{**SMALL.get(game, {}), **params})
        made.append(env)
        return env

    yield make
    for env in made:
        env.close()


def play(env, actions):
    for action in actions:
        observation, reward, terminated, truncated, info = env.step(action)
    return observation, info


@pytest.mark.parametrize("game", GAMES)
def test_the_walkthrough_wins_every_game_with_rewards_summing_to_the_score(env_of, game):
    env = env_of(game)
    observation, info = env.reset(seed=4)
    assert observation and info["fold"] == "train" and info["seed"] == 4 and not info["won"]
    assert info["task"] and info["admissible_actions"] == sorted(info["admissible_actions"])
    assert info["task_type"].startswith(game)
    total = 0.0
    for action in env.walkthrough:
        assert action in info["admissible_actions"] or action == "look around", action
        observation, reward, terminated, truncated, info = env.step(action)
        total += reward
    assert terminated and not truncated and info["won"] and not info["lost"]
    assert total == pytest.approx(info["score"]) == pytest.approx(1.0)
    with pytest.raises(RuntimeError, match="reset"):
        env.step("look around")


def test_a_seed_plays_the_same_game_everywhere_and_names_its_fold(env_of):
    first, second = env_of("cookingworld"), env_of("cookingworld")
    assert first.reset(seed=10007) == second.reset(seed=10007)
    assert first.reset(seed=10007)[1]["fold"] == "dev"
    assert first.reset(seed=20000)[1]["fold"] == "test"
    assert first.fold_seeds("dev")[:2] == [10000, 10001] and len(first.fold_seeds("test")) == 1000
    with pytest.raises(ValueError, match="seed 5000 is in no fold"):
        first.reset(seed=5000)
    with pytest.raises(ValueError, match="fold must be one of"):
        first.fold_seeds("valid")
    assert first.reset()[1]["seed"] in first.fold_seeds("train")  # unseeded: a train game


def test_options_switch_the_game_and_parameters_for_one_episode(env_of):
    env = env_of("cookingworld")
    _, info = env.reset(seed=3, options={"game": "coin", "numLocations": 2, "includeDoors": 0})
    assert info["task_type"] == "coin(includeDoors=0,numLocations=2)" and "coin" in info["task"]
    assert env.reset(seed=3)[1]["task_type"].startswith("cookingworld(")


def test_bad_arguments_are_refused_with_what_is_known(env_of):
    with pytest.raises(ValueError, match="unknown TextWorldExpress game 'cooking'"):
        make_env("textworld_express", game="cooking")
    with pytest.raises(ValueError, match="must be an int"):
        make_env("textworld_express", numLocations="3")
    env = env_of("cookingworld", numRooms=3)
    with pytest.raises(ValueError, match="numRooms.*Known properties: numLocations"):
        env.reset(seed=0)
    with pytest.raises(ValueError, match="max_steps"):
        make_env("textworld_express", max_steps=0)


def test_max_steps_truncates(env_of):
    env = env_of("coin", max_steps=2)
    env.reset(seed=0)
    assert env.step("inventory")[3] is False
    assert env.step("inventory")[3] is True


def test_without_java_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setenv("PATH", "")
    with pytest.raises(RuntimeError, match="openjdk-17-jre-headless"):
        TextWorldExpressEnv("coin")


# ------------------------------------------------------------------------------------------------------------
# Anchors: the same state reached by different paths shares one; states that read the same differ.
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("game", ["cookingworld", "coin", "twc", "mapreader", "arithmetic", "sorting", "peckingorder"])
def test_actions_that_change_nothing_keep_the_anchor_whatever_the_move_count(env_of, game):
    env = env_of(game)
    _, start = env.reset(seed=1)
    _, after = play(env, ["inventory", "look around", "inventory"])
    assert after["anchor"] == start["anchor"]


def test_cookingworld_opening_and_closing_returns_to_the_anchor_and_hidden_contents_count(env_of):
    env = env_of("cookingworld")
    _, start = env.reset(seed=0)
    assert play(env, ["open fridge", "close fridge"])[1]["anchor"] == start["anchor"]
    anchors = {}
    for container in ("fridge", "kitchen cupboard"):
        env.reset(seed=0)
        observation, info = play(env, ["take knife", f"open {container}", f"put knife in {container}",
                                       f"close {container}", "look around"])
        anchors[container] = (observation, info["anchor"])
    (look_fridge, fridge), (look_cupboard, cupboard) = anchors.values()
    assert look_fridge == look_cupboard  # the knife is out of sight in both: the text cannot tell them apart
    assert fridge != cupboard


def test_coin_a_door_opened_in_another_room_changes_the_anchor(env_of):
    env = env_of("coin", numLocations=4, includeDoors=1)
    for seed in range(50):
        _, info = env.reset(seed=seed)
        moves = [a for a in info["admissible_actions"] if a.startswith("move ")]
        for move in moves:
            env.reset(seed=seed)
            _, there = play(env, [move])
            doors = [a for a in there["admissible_actions"] if a.startswith("open door to ")]
            back = f"move {OPPOSITE[move.split()[-1]]}"
            if doors and back in there["admissible_actions"] and not there["won"]:
                _, returned = play(env, [back])
                env.reset(seed=seed)
                observation_after_door, after_door = play(env, [move, doors[0], back])
                assert returned["anchor"] == info["anchor"]  # there and back: the start again
                assert after_door["anchor"] != info["anchor"]  # a door away from here is open now
                return
    pytest.fail("no coin game with a closed door one room away in seeds 0-49")


def test_twc_moving_an_object_between_closed_containers_changes_the_anchor(env_of):
    env = env_of("twc", numLocations=1, numItemsToPutAway=2)
    _, start = env.reset(seed=1)
    thing = next(a for a in start["admissible_actions"] if a.startswith("take "))[len("take "):]
    containers = [a[len("open "):] for a in start["admissible_actions"] if a.startswith("open ")]
    anchors = set()
    for container in containers[:2]:
        env.reset(seed=1)
        anchors.add(play(env, [f"take {thing}", f"open {container}", f"put {thing} in {container}",
                               f"close {container}"])[1]["anchor"])
    assert len(containers) >= 2 and len(anchors) == 2


def test_simonsays_each_step_of_the_sequence_has_its_own_anchor(env_of):
    env = env_of("simonsays")
    _, info = env.reset(seed=2)
    anchors = [info["anchor"]]
    for action in env.walkthrough:
        anchors.append(env.step(action)[4]["anchor"])
    assert len(set(anchors)) == len(anchors)


def test_the_same_seed_gives_the_same_anchors_in_another_process_s_jvm(env_of):
    first, second = env_of("mapreader"), env_of("mapreader")
    path = first.reset(seed=10001) and first.walkthrough
    second.reset(seed=10001)
    assert [first.step(a)[4]["anchor"] for a in path] == [second.step(a)[4]["anchor"] for a in path]


# ------------------------------------------------------------------------------------------------------------
# JVMs: one per environment, and a killed one ends only its own trajectory.
# ------------------------------------------------------------------------------------------------------------


class JVMKillingEnv(TextWorldExpressEnv):
    """Kills its own JVM when told to, then steps as usual (into the dead JVM)."""

    def step(self, action):
        if action == "kill the jvm":
            os.kill(self._engine._gateway.java_process.pid, signal.SIGKILL)
            self._engine._gateway.java_process.wait()
            action = "look around"
        return super().step(action)


def test_a_killed_jvm_ends_only_its_own_trajectory_and_its_worker_is_replaced():
    with EnvPool(lambda: JVMKillingEnv("coin", **SMALL["coin"]), num_groups=1, group_size=3, step_timeout=20) as pool:
        first = pool.reset([Task(seed=2)])
        results = pool.step({0: "look around", 1: "kill the jvm", 2: "look around"})
        assert "env_error" in results[1].info and results[1].truncated
        assert not results[0].done and not results[2].done
        assert results[0].info["anchor"] == results[2].info["anchor"] == first[0].info["anchor"]
        again = pool.reset([Task(seed=2)])  # the failed worker comes back with a fresh environment and JVM
        assert [output.info["anchor"] for output in again] == [first[0].info["anchor"]] * 3
        assert pool.num_restarts == 1


def test_close_stops_the_jvm_and_a_later_reset_starts_another(env_of):
    env = env_of("coin")
    env.reset(seed=0)
    process = env._engine._gateway.java_process
    env.close()
    assert process.wait(timeout=10) is not None
    assert env.reset(seed=0)[0]


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the JVM's environment from /proc")
def test_the_jvm_starts_with_the_lean_options_and_the_user_s_own_last(env_of, monkeypatch):
    monkeypatch.setenv("JAVA_TOOL_OPTIONS", "-Xmx300m")
    env = env_of("coin")
    env.reset(seed=0)
    launched_with = open(f"/proc/{env._engine._gateway.java_process.pid}/environ", "rb").read().split(b"\0")
    assert (b"JAVA_TOOL_OPTIONS=-XX:-UsePerfData -Xlog:disable -Xlog:all=warning:stderr "
            b"-XX:+UseSerialGC -XX:TieredStopAtLevel=1 -Xmx192m -Xmx300m") in launched_with
    assert os.environ["JAVA_TOOL_OPTIONS"] == "-Xmx300m"  # restored after the launch
