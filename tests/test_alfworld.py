"""ALFWorld through `make_env("alfworld", ...)`: the hand-written games of tests/data/alfworld (one per task type,
in ALFWorld's format, made solvable-checked by ALFWorld's own `alfworld-generate`) played by TextWorld's PDDL
engine and the planner built from source."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("alfworld", reason="needs the alfworld extra: pip install 'gigpo-trl[alfworld]'")

from scripted_policy import scripted_trainer  # noqa: E402

from gigpo_trl.config import GiGPOConfig  # noqa: E402
from gigpo_trl.env_pool import EnvPool  # noqa: E402
from gigpo_trl.environments.alfworld_games import (  # noqa: E402
    BANNER,
    TASK_TYPES,
    AlfWorldEnv,
    unread_predicates,
)
from gigpo_trl.envs import env_factory, fold_seeds, make_env  # noqa: E402
from gigpo_trl.records import read_evaluations, read_iterations, read_trajectories  # noqa: E402
from gigpo_trl.tasks import Task, task_dataset  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "alfworld"
TRAIN_GAMES = [  # sorted by path; the movable-receptacle trial and the unsolvable one are not listed
    "look_at_obj_in_light-Book-None-DeskLamp-301/trial_T20261122_100002_000002/game.tw-pddl",
    "pick_and_place_simple-Apple-None-Fridge-1/trial_T20261122_100001_000001/game.tw-pddl",
    "pick_clean_then_place_in_recep-Mug-None-Cabinet-10/trial_T20261122_100003_000003/game.tw-pddl",
    "pick_cool_then_place_in_recep-Tomato-None-CounterTop-3/trial_T20261122_100005_000005/game.tw-pddl",
    "pick_heat_then_place_in_recep-Potato-None-DiningTable-2/trial_T20261122_100004_000004/game.tw-pddl",
    "pick_two_obj_and_place-Pencil-None-Drawer-305/trial_T20261122_100006_000006/game.tw-pddl",
]
APPLE_IN_FRIDGE = 1  # the seed of the pick-and-place training game


@pytest.fixture
def env():
    env = make_env("alfworld", data_dir=DATA)
    yield env
    env.close()


def all_seeds(env: AlfWorldEnv) -> list[int]:
    return [seed for fold in ("train", "dev", "test") for seed in env.fold_seeds(fold)]


def test_splits_list_the_games_alfworld_plays_and_number_them_by_fold(env):
    assert env.fold_seeds("train") == [0, 1, 2, 3, 4, 5]
    assert env.fold_seeds("dev") == env.split_seeds("valid_seen") == [1_000_000]
    assert env.fold_seeds("test") == env.split_seeds("valid_unseen") == [2_000_000, 2_000_001]
    assert fold_seeds("alfworld", "test", 2, data_dir=DATA) == [2_000_000, 2_000_001]
    assert [env.reset(seed=seed)[1]["game"] for seed in env.fold_seeds("train")] == TRAIN_GAMES
    assert env.reset(seed=1_000_000)[1]["split"] == "valid_seen"


def test_task_types_select_games_by_alfworld_or_short_name(env):
    picks = make_env("alfworld", data_dir=DATA, task_types=["pick_and_place_simple", "pick_two"])
    assert [picks.reset(seed=s)[1]["task_type"] for s in picks.fold_seeds("train")] == ["pick", "pick_two"]
    assert picks.fold_seeds("dev") == [1_000_000] and picks.fold_seeds("test") == []
    with pytest.raises(ValueError, match="unknown ALFWorld task types \\['pick_three'\\]"):
        make_env("alfworld", data_dir=DATA, task_types=["pick", "pick_three"])


def test_reset_gives_the_first_observation_without_banner_the_goal_and_the_task_type(env):
    observation, info = env.reset(seed=APPLE_IN_FRIDGE)

    assert observation == (
        "You are in the middle of a room. Looking quickly around you, you see a countertop 1, and a fridge 1.\n\n"
        "Your task is to: put some apple on fridge."
    )
    assert BANNER not in observation
    assert info["task"] == "put some apple on fridge"
    assert info["task_type"] == "pick"
    assert info["admissible_actions"] == ["go to countertop 1", "go to fridge 1", "help", "inventory", "look"]
    assert info["won"] is False and info["seed"] == APPLE_IN_FRIDGE and info["split"] == "train"


def test_every_game_is_won_by_its_walkthrough_on_the_last_step_only(env):
    task_types = set()
    for seed in all_seeds(env):
        _, info = env.reset(seed=seed)
        task_types.add(info["task_type"])
        walkthrough = env.walkthrough
        for i, command in enumerate(walkthrough):
            assert command in info["admissible_actions"]
            observation, reward, terminated, truncated, info = env.step(command)
            last = i == len(walkthrough) - 1
            assert (reward, terminated, info["won"]) == ((10.0, True, True) if last else (0.0, False, False)), seed
            assert not truncated and observation
    assert task_types == set(TASK_TYPES.values())  # one game of every kind ALFWorld has


def test_a_step_acts_on_the_world_and_an_unknown_command_changes_nothing(env):
    _, start = env.reset(seed=APPLE_IN_FRIDGE)
    observation, reward, terminated, _, info = env.step("go to countertop 1")
    assert observation == "You arrive at countertop 1. On the countertop 1, you see a apple 1."
    assert "take apple 1 from countertop 1" in info["admissible_actions"] and info["anchor"] != start["anchor"]

    observation, reward, terminated, truncated, after = env.step("take the apple please")
    assert (observation, reward, terminated, truncated) == ("Nothing happens.", 0.0, False, False)
    assert after["anchor"] == info["anchor"] and after["admissible_actions"] == info["admissible_actions"]


def test_anchors_repeat_exactly_when_the_state_repeats(env):
    _, start = env.reset(seed=APPLE_IN_FRIDGE)
    anchors = {"start": start["anchor"]}
    for name, command in [("look", "look"), ("inventory", "inventory"), ("at fridge", "go to fridge 1"),
                          ("fridge open", "open fridge 1"), ("fridge closed again", "close fridge 1"),
                          ("examined", "examine fridge 1"), ("at countertop", "go to countertop 1"),
                          ("holding apple", "take apple 1 from countertop 1"),
                          ("back at fridge", "go to fridge 1")]:
        anchors[name] = env.step(command)[4]["anchor"]

    # look, inventory and examine change no fact that anything reads; closing undoes opening.
    assert anchors["look"] == anchors["inventory"] == anchors["start"]
    assert anchors["fridge closed again"] == anchors["examined"] == anchors["at fridge"]
    assert len({anchors[n] for n in ("start", "at fridge", "fridge open", "at countertop", "holding apple",
                                     "back at fridge")}) == 6
    # The same game played again, in another environment, passes through the same anchors.
    other = make_env("alfworld", data_dir=DATA)
    assert other.reset(seed=APPLE_IN_FRIDGE)[1]["anchor"] == start["anchor"]
    assert other.step("go to fridge 1")[4]["anchor"] == anchors["at fridge"]


def test_the_anchor_keeps_bookkeeping_facts_a_game_reads(env):
    env.reset(seed=APPLE_IN_FRIDGE)
    pddl_env = env._engine._wrapped_env
    task, grammar = pddl_env._pddl_state.task, pddl_env._game_data["grammar"]

    hidden = unread_predicates(task, grammar)
    assert {"checked", "examined", "not_opened", "not_holds"} <= hidden
    # What the text can show stays: "look" lists the objects next to a receptacle that are not in it.
    assert "not_inreceptacle" not in hidden and "not_istoggled" not in hidden and "opened" not in hidden
    reads_checked = grammar + '\n"condition": "checked(r:receptacle)"'
    assert "checked" not in unread_predicates(task, reads_checked)


def test_max_steps_truncates_and_the_call_order_is_enforced(env):
    limited = make_env("alfworld", data_dir=DATA, max_steps=2)
    with pytest.raises(RuntimeError, match="reset"):
        limited.step("look")
    limited.reset(seed=0)
    assert limited.step("look")[3] is False
    assert limited.step("look")[3] is True
    with pytest.raises(RuntimeError, match="episode has ended"):
        limited.step("look")
    limited.reset(seed=0)
    limited.close()
    with pytest.raises(RuntimeError, match="reset"):
        limited.step("look")
    assert limited.reset(seed=APPLE_IN_FRIDGE)[1]["task_type"] == "pick"  # a closed environment can be reset


def test_unseeded_resets_draw_from_the_split_and_replay_after_a_seeded_reset():
    unseen = make_env("alfworld", data_dir=DATA, split="valid_unseen")
    assert {unseen.reset()[1]["seed"] for _ in range(10)} <= {2_000_000, 2_000_001}
    unseen.reset(seed=0)
    first = [unseen.reset()[1]["seed"] for _ in range(5)]
    unseen.reset(seed=0)
    assert [unseen.reset()[1]["seed"] for _ in range(5)] == first


def test_bad_arguments_are_refused_with_what_is_expected(env, tmp_path):
    with pytest.raises(FileNotFoundError, match="alfworld-download"):
        make_env("alfworld", data_dir=tmp_path)
    with pytest.raises(ValueError, match="split must be one of"):
        make_env("alfworld", data_dir=DATA, split="valid")
    with pytest.raises(ValueError, match="seed 6 is no ALFWorld game .*'train': '0-5'"):
        env.reset(seed=6)
    with pytest.raises(ValueError, match="no reset options"):
        env.reset(seed=0, options={"game": "x"})


def test_the_game_list_is_cached_and_rebuilt_when_a_game_changes(tmp_path):
    data = tmp_path / "data"
    shutil.copytree(DATA, data)
    cache = tmp_path / "cache"
    assert make_env("alfworld", data_dir=data, cache_dir=cache).fold_seeds("dev") == [1_000_000]
    (index_file,) = [p for p in cache.iterdir() if p.name.startswith("valid_seen-")]

    index = json.loads(index_file.read_text())
    index["games"] = []  # a list the environment did not write: used as long as no file of the split changed
    index_file.write_text(json.dumps(index))
    assert make_env("alfworld", data_dir=data, cache_dir=cache).fold_seeds("dev") == []

    game = next((data / "json_2.1.1" / "valid_seen").rglob("game.tw-pddl"))
    game.write_text(json.dumps({**json.loads(game.read_text()), "solvable": False}))
    assert make_env("alfworld", data_dir=data, cache_dir=cache).fold_seeds("dev") == []
    game.write_text(json.dumps({**json.loads(game.read_text()), "solvable": True}))
    assert make_env("alfworld", data_dir=data, cache_dir=cache).fold_seeds("dev") == [1_000_000]


def test_a_pool_of_worker_processes_plays_the_copies_of_a_task_alike():
    with EnvPool(env_factory("alfworld", data_dir=DATA), num_groups=2, group_size=2) as pool:
        outputs = pool.reset([Task(seed=APPLE_IN_FRIDGE), Task(seed=2_000_000)])
        assert [o.info["task_type"] for o in outputs] == ["pick", "pick", "look", "look"]
        assert outputs[0].anchor == outputs[1].anchor != outputs[2].anchor == outputs[3].anchor
        stepped = pool.step({0: "go to fridge 1", 1: "go to fridge 1", 2: "go to sofa 1"})
        assert stepped[0].anchor == stepped[1].anchor and "env_error" not in stepped[2].info


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_recipe_trains_on_alfworld_and_reports_held_out_success_per_task_type(tmp_path, tiny_model_path):
    recipes = Path(__file__).resolve().parent.parent / "recipes"
    command = [sys.executable, str(recipes / "train_gigpo.py"), "--config", str(recipes / "configs" / "alfworld_smoke_cpu.yaml"),
               "--model_name_or_path", tiny_model_path, "--output_dir", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=recipes.parent)
    assert result.returncode == 0, result.stderr[-4000:]

    assert "Held-out success rate (2 tasks):" in result.stdout
    evaluations = read_evaluations(tmp_path)
    assert [record["step"] for record in evaluations] == [0, 2]  # before and after training
    for record in evaluations:
        metrics = record["metrics"]
        assert metrics["env/panel_tasks"] == 2
        assert {"env/success_rate/heat", "env/success_rate/look"} <= metrics.keys()
    training = [record for record in read_iterations(tmp_path) if record["mode"] == "train"]
    assert len(training) == 2 and all(record["metrics"]["env/step_samples"] > 0 for record in training)
    assert (tmp_path / "report" / "index.html").is_file()


@pytest.mark.timeout(300)
def test_training_groups_the_steps_of_the_copies_that_reach_the_same_state(tmp_path, tiny_model_path):
    """Four copies of the pick-and-place game answer scripted random choices among the listed actions
    (tests/scripted_policy.py), so they diverge and meet again; every step's group size in the run's records is
    the number of the group's steps taken in the same state, found here by replaying the copies' actions."""
    config = GiGPOConfig(
        output_dir=str(tmp_path), env_name="alfworld", env_kwargs={"data_dir": str(DATA)}, per_device_train_batch_size=4,
        num_generations=4, steps_per_generation=1, gradient_accumulation_steps=1, max_steps=1, max_completion_length=2,
        max_env_steps=6, logging_steps=1, report_to=[], activation_checkpointing=False, save_strategy="no",
        disable_tqdm=True, seed=0,
    )
    trainer = scripted_trainer(tiny_model_path, args=config, train_dataset=task_dataset([APPLE_IN_FRIDGE]))
    try:
        trainer.train()
    finally:
        trainer.close_environments()
    (episodes,) = read_trajectories(tmp_path).values()
    assert len(episodes) == 4

    replay = make_env("alfworld", data_dir=DATA)
    anchors = []  # (episode, step) -> anchor of the state the step's action was taken in
    for episode in episodes:
        anchor = replay.reset(seed=episode["seed"])[1]["anchor"]
        for step in episode["steps"]:
            anchors.append(anchor)
            anchor = replay.step(step["action"])[4]["anchor"]
    sizes = [step["step_group_size"] for episode in episodes for step in episode["steps"]]
    assert sizes == [anchors.count(anchor) for anchor in anchors]
    assert 1 < len(set(anchors)) < len(anchors)  # the copies diverged, and some of their steps met again


def test_a_malformed_game_folder_is_refused_with_the_file_named(tmp_path):
    data = tmp_path / "data"
    shutil.copytree(DATA, data)
    traj_data = next((data / "json_2.1.1" / "valid_seen").rglob("traj_data.json"))
    traj_data.write_text('{"task_id": "no task type"}')
    with pytest.raises(ValueError, match=f"{traj_data}.*no 'task_type' field"):
        make_env("alfworld", data_dir=data, cache_dir=tmp_path / "cache").fold_seeds("dev")
    traj_data.write_text("not json")
    with pytest.raises(ValueError, match=f"{traj_data} is not valid JSON"):
        make_env("alfworld", data_dir=data, cache_dir=tmp_path / "cache").fold_seeds("dev")
