"""ScienceWorld's real tasks (PyPI scienceworld 1.2.3, a JVM engine): folds, resets, rewards, anchors that repeat
with the state and agree across processes, the disabled command, bad arguments, a training run of the recipe.
(`check_env` and the walkthrough of find-living-thing run in tests/test_env_contract.py.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("scienceworld")
pytestmark = [pytest.mark.skipif(shutil.which("java") is None, reason="ScienceWorld needs a Java runtime (java)"),
              pytest.mark.timeout(300)]

from gigpo_trl.env_pool import EnvPool  # noqa: E402
from gigpo_trl.environments.scienceworld_games import ScienceWorldEnv, canonical_tree  # noqa: E402
from gigpo_trl.envs import env_factory, fold_seeds  # noqa: E402
from gigpo_trl.records import read_evaluations  # noqa: E402
from gigpo_trl.tasks import Task  # noqa: E402

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


@pytest.fixture
def env():
    environment = ScienceWorldEnv("find-living-thing", simplification="")
    yield environment
    environment.close()


def play(environment, actions):
    return [environment.step(action) for action in actions]


def test_the_folds_are_the_engine_s_variation_sets():
    assert fold_seeds("scienceworld", "train", 14, task="boil") == list(range(14))
    assert fold_seeds("scienceworld", "dev", 7, task="boil") == list(range(14, 21))
    assert fold_seeds("scienceworld", "test", 9, task="boil") == list(range(21, 30))
    with pytest.raises(ValueError, match="the dev fold of 'scienceworld' has 7 tasks, fewer than the 8 asked for"):
        fold_seeds("scienceworld", "dev", 8, task="boil")


def test_a_seed_gives_the_same_first_state_and_the_reset_says_which_game(env):
    first, info = env.reset(seed=3)
    again, info_again = env.reset(seed=3)
    other, info_other = env.reset(seed=4)

    assert first == again and info["anchor"] == info_again["anchor"] and info["anchor"] != info_other["anchor"]
    assert first.startswith(("This room is called the", "This outside location is called the"))
    assert (info["seed"], info["fold"], info["task_type"], info["score"], info["won"]) == (3, "train", "find-living-thing", 0, False)
    assert info["task"].startswith("Your task is to find a(n) living thing.") and "focus on OBJ" in info["task"]


def test_looking_leaves_the_anchor_and_the_same_state_by_two_paths_shares_one(env):
    _, start = env.reset(seed=0)
    anchors = [info["anchor"] for *_, info in play(env, ["look around", "inventory", "look around"])]
    assert anchors == [start["anchor"]] * 3  # free actions, and the move count is not part of the state

    *_, (_, _, _, _, one_way) = play(env, ["open door to kitchen", "open door to art studio"])
    env.reset(seed=0)
    *_, (_, _, _, _, other_way) = play(env, ["open door to art studio", "open door to kitchen"])
    assert one_way["anchor"] == other_way["anchor"] != start["anchor"]
    env.reset(seed=0)
    *_, (_, _, _, _, only_one) = play(env, ["open door to kitchen", "close door to art studio"])
    assert only_one["anchor"] != one_way["anchor"]  # the art studio's door stayed closed

def test_an_ambiguous_command_is_a_state_of_its_own():
    environment = ScienceWorldEnv("boil", simplification="")
    _, start = environment.reset(seed=0)
    observation, _, terminated, _, info = environment.step("look at door")
    environment.close()

    assert observation.startswith("Ambiguous request") and not terminated and info["anchor"] != start["anchor"]


def test_the_reward_is_the_score_s_change_and_failing_the_task_ends_it_lost(env):
    env.reset(seed=0)
    gold = ScienceWorldEnv("find-living-thing", simplification="", gold_paths=True)
    gold.reset(seed=0)
    walkthrough = gold.walkthrough
    gold.close()
    rewards = [reward for _, reward, *_ in play(env, walkthrough)]
    assert sum(rewards) == 100.0 and all(reward >= 0 for reward in rewards)

    env.reset(seed=0)
    _, reward, terminated, truncated, info = env.step("focus on air")  # focusing on the wrong thing fails the task
    assert (reward, terminated, truncated, info["lost"], info["won"], info["score"]) == (-100.0, True, False, True, False, -100)


def test_the_reset_task_command_is_disabled_and_changes_nothing(env):
    _, start = env.reset(seed=0)
    observation, reward, terminated, _, info = env.step("reset task")
    assert observation == "The 'reset task' command is disabled here."
    assert (reward, terminated, info["anchor"]) == (0.0, False, start["anchor"])


def test_the_valid_actions_are_offered_on_request_without_the_disabled_command():
    environment = ScienceWorldEnv("find-living-thing", admissible_actions=True)
    _, info = environment.reset(seed=0)
    environment.close()
    actions = info["admissible_actions"]
    assert actions == sorted(actions) and "look around" in actions and "reset task" not in actions and len(actions) > 50


def test_replays_in_two_worker_processes_reach_the_same_anchors_step_by_step():
    """Boil heats water: the engine's heat transfer runs in a random order in 1.2.3, so temperatures differ between
    replays by hundredths of a degree; the anchor's temperature bins make the replays agree anyway."""
    gold = ScienceWorldEnv("boil", gold_paths=True)
    gold.reset(seed=0)
    walkthrough = gold.walkthrough
    gold.close()
    with EnvPool(env_factory("scienceworld", task="boil"), num_groups=1, group_size=2, step_timeout=60) as pool:
        outputs = pool.reset([Task(seed=0)])
        anchors = [(outputs[0].anchor, outputs[1].anchor)]
        for action in walkthrough:
            outputs = pool.step({0: action, 1: action})
            anchors.append((outputs[0].anchor, outputs[1].anchor))
            if outputs[0].done:
                break
    assert all(first == second for first, second in anchors)
    assert outputs[0].info["won"] and outputs[1].info["won"]
    assert len(set(anchors)) > len(anchors) // 2  # the states do differ along the way


def test_the_canonical_tree_ignores_ids_child_order_and_temperature_noise():
    def tree(water_temperature, order):
        water = {"uuid": 7, "name": "water", "propMaterial": {"temperatureC": water_temperature}, "contents": {}}
        pot = {"uuid": 8, "name": "pot", "propElectricalConnection": {"connectedTo": [7]}, "contents": {}}
        children = [("water-7", water), ("pot-8", pot)][::order]
        return {"uuid": 1, "name": "kitchen", "contents": dict(children)}

    renumbered = tree(20.004, 1)
    renumbered["contents"]["water-7"]["uuid"] = 99
    renumbered["contents"]["pot-8"]["propElectricalConnection"]["connectedTo"] = [99]
    assert canonical_tree(tree(20.004, 1)) == canonical_tree(tree(19.996, -1)) == canonical_tree(renumbered)
    assert canonical_tree(tree(20.0, 1)) != canonical_tree(tree(30.0, 1))  # a real change of temperature


@pytest.mark.parametrize(
    ("kwargs", "reset_kwargs", "message"),
    [
        ({"task": "fly"}, {}, "unknown ScienceWorld task 'fly'"),
        ({"simplification": "teleport"}, {}, "simplification must be '' or some of"),
        ({"temperature_bin": 0}, {}, "temperature_bin must be > 0"),
        ({}, {"seed": 300}, "seed 300 is no variation of ScienceWorld's find-living-thing: its variations are 0-299"),
        ({}, {"seed": 0, "options": {"level": 2}}, r"unknown ScienceWorld reset options \['level'\]"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kwargs, reset_kwargs, message):
    with pytest.raises(ValueError, match=message):
        environment = ScienceWorldEnv(**{"task": "find-living-thing", **kwargs})
        try:
            environment.reset(**reset_kwargs)
        finally:
            environment.close()


def test_without_java_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setenv("PATH", "")
    with pytest.raises(RuntimeError, match="ScienceWorld runs its games in a Java virtual machine.*openjdk-17"):
        ScienceWorldEnv()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_recipe_trains_on_scienceworld_and_evaluates_the_dev_panel(tmp_path, tiny_model_path):
    command = [sys.executable, str(RECIPES / "train_gigpo.py"), "--config", str(RECIPES / "configs" / "scienceworld_smoke_cpu.yaml"),
               "--model_name_or_path", tiny_model_path, "--output_dir", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)

    assert result.returncode == 0, result.stderr[-4000:]
    assert "Held-out success rate (2 tasks):" in result.stdout
    evaluations = read_evaluations(tmp_path)
    assert [record["metrics"]["env/panel_tasks"] for record in evaluations] == [2, 2]
    assert all("env/success_rate/find-living-thing" in record["metrics"] for record in evaluations)
