"""bench/credit_probe.py: the labels (breadth-first distances before and after each step), the measures of a credit
signal, and the whole probe at tiny scale."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from bench.credit_probe import (
    label_means, main, over_seeds, pairwise_ranking, probe_rollout, sign_agreement, signals, step_distances, step_label,
    subgroup_ids, verdict, zero_share,
)
from gigpo_trl.env_pool import EnvPool
from gigpo_trl.environments.rooms import RoomsEnv
from gigpo_trl.rollout import Completion, StepColumns, collect_rollout
from gigpo_trl.tasks import Task
from scripted_policy import ScriptedTrainer
from tests.toy_envs import UnseededCorridor

# The advantage settings of setting D's recipe (recipes/configs/learning_coin_gpu.yaml).
SETTINGS = SimpleNamespace(gamma=0.95, advantage_norm="mean_std", episode_stats="steps", invalid_action_penalty=0.0,
                           similarity_threshold=None)


def scripted_rollout(env_fn, copies: int, turns: list[list[str]], seed: int = 0, max_env_steps: int = 10):
    """A real rollout of one task x `copies` whose answers are scripted: turns[t] holds the actions of the copies
    still playing at turn t, in the pool's order."""

    def generate(prompts, tools):
        actions = turns[generate.turn]
        generate.turn += 1
        assert len(actions) == len(prompts), f"turn {generate.turn - 1}: {len(prompts)} copies play, {len(actions)} scripted"
        return [Completion([0], [0], f"<action>{action}</action>") for action in actions]

    generate.turn = 0
    with EnvPool(env_fn, 1, copies, processes=False) as pool:
        return collect_rollout(pool, [Task(seed=seed)], generate, max_env_steps=max_env_steps, show_progress=False)


def five_rooms():
    """5 rooms and 2 idle actions: the seed 0 hides the treasure in room 0, west; the start is room 2."""
    return RoomsEnv(num_rooms=5, idle_actions=2)


def test_labels_are_the_hand_counted_distances_to_the_treasure():
    actions = ["go east", "wait", "go east", "go east", "sing a song", "go west", "go west", "go west", "go west"]
    rollout = scripted_rollout(five_rooms, 1, [[action] for action in actions])
    # Room k is k steps from the treasure in room 0; walking into the east wall (room 4) and text the game does not
    # act on leave the room as it is.
    rooms_before = [2, 3, 3, 4, 4, 4, 3, 2, 1]
    rooms_after = [3, 3, 4, 4, 4, 3, 2, 1, 0]

    before, after = step_distances(five_rooms(), rollout, search_depth=10)

    assert rollout.episodes[0].won and rollout.steps.action == actions
    assert before.tolist() == rooms_before and after.tolist() == rooms_after
    assert [step_label(b, a) for b, a in zip(before, after)] == [
        "regress", "neutral", "regress", "neutral", "neutral", "progress", "progress", "progress", "progress"]


def test_states_are_searched_once_per_task_and_anchor():
    # Copy 0 waits in room 2; copy 1 goes to room 1, back to 2, then to 3.
    rollout = scripted_rollout(five_rooms, 2, [["wait", "go west"], ["wait", "go east"], ["wait", "go east"]],
                               max_env_steps=3)
    cache = {}

    before, after = step_distances(five_rooms(), rollout, search_depth=10, cache=cache)

    assert before.tolist() == [2, 2, 2, 1, 2, 2] and after.tolist() == [2, 1, 2, 2, 2, 3]  # rows turn by turn
    assert sorted(cache.values()) == [1, 2, 3]  # rooms 1, 2 and 3 of task 0, each searched once


def test_a_game_that_does_not_replay_is_refused():
    env = UnseededCorridor()  # its start is never the same in two resets in a row
    rollout = scripted_rollout(lambda: env, 1, [["right"]], max_env_steps=1)

    with pytest.raises(RuntimeError, match="does not replay deterministically"):
        step_distances(env, rollout, search_depth=5)


def test_the_step_advantage_ranks_progress_above_regress_where_the_episode_advantage_ties_them():
    # Three copies of one task from room 2: copy 0 walks west and wins in 2 steps; copy 1 first goes east (away from
    # the treasure), then wins in 4; copy 2 waits until it is cut off after 6 steps.
    turns = [["go west", "go east", "wait"], ["go west", "go west", "wait"], ["go west", "wait"], ["go west", "wait"],
             ["wait"], ["wait"]]
    rollout = scripted_rollout(five_rooms, 3, turns, max_env_steps=6)
    before, after = step_distances(five_rooms(), rollout, search_depth=10)
    labels = [step_label(b, a) for b, a in zip(before, after)]
    advantages, _ = signals(rollout.steps, subgroup_ids(rollout.steps, 3, 3), SETTINGS)
    first = {trajectory: row for row, (trajectory, step) in enumerate(zip(rollout.steps.trajectory, rollout.steps.step))
             if step == 0}  # the three first steps, all taken in room 2

    assert [labels[first[copy]] for copy in range(3)] == ["progress", "regress", "neutral"]
    gigpo, grpo = advantages["GiGPO"], advantages["GRPO (omega=0)"]
    # Both winners get the same positive episode advantage: step-wise GRPO cannot tell the two moves apart.
    assert grpo[first[0]] == grpo[first[1]] > 0 > grpo[first[2]]
    assert gigpo[first[0]] > gigpo[first[1]] > gigpo[first[2]]
    assert advantages["A_S alone"][first[0]] > advantages["A_S alone"][first[1]] > 0
    result = probe_rollout(rollout, before, after, 3, [3], SETTINGS)["by_group_size"]["3"]
    assert result["GiGPO"]["pairs"]["progress>regress"] == {"pairs": 2, "right": 1.0, "tied": 0.0, "wrong": 0.0,
                                                           "accuracy": 1.0}
    assert result["GRPO (omega=0)"]["pairs"]["progress>regress"]["tied"] == 1.0
    assert result["GRPO (omega=0)"]["pairs"]["progress>regress"]["accuracy"] == 0.5
    # The regress step belongs to a winning episode: its advantage is positive under both signals (the Monte-Carlo
    # return-to-go of A_S carries the episode's later win too), so neither sign agrees with its label.
    assert result["GiGPO"]["sign_agreement"]["regress_negative"] == result["GRPO (omega=0)"]["sign_agreement"][
        "regress_negative"] == 0.0


def test_sign_agreement_counts_a_zero_advantage_as_no_agreement():
    advantages = np.array([1.0, 0.0, -2.0, 0.5, -0.5, 0.0, 3.0])
    labels = ["progress", "progress", "regress", "regress", "neutral", "neutral", "neutral"]

    agreement = sign_agreement(advantages, labels)

    assert agreement == {"directed": 0.5, "progress_positive": 0.5, "regress_negative": 0.5,
                         "neutral_negative": pytest.approx(1 / 3), "neutral_zero": pytest.approx(1 / 3),
                         "neutral_positive": pytest.approx(1 / 3)}
    assert zero_share(advantages) == pytest.approx(2 / 7)
    means = label_means(advantages, labels)
    assert means["progress"] == 0.5 and means["regress"] == -0.75 and means["separation"] == pytest.approx(
        1.25 / advantages.std())
    assert math.isnan(label_means(np.zeros(3), labels[:3])["separation"])  # no spread: no separation


def test_pairs_are_compared_inside_step_groups_only():
    advantages = np.array([2.0, 1.0, 1.0, 5.0, -5.0])
    labels = ["progress", "regress", "neutral", "regress", "progress"]
    groups = [0, 0, 0, 1, 2]  # rows 3 and 4 are alone in their step groups

    ranking = pairwise_ranking(advantages, labels, groups)

    assert ranking["progress>regress"]["pairs"] == 1 and ranking["progress>regress"]["right"] == 1.0
    assert ranking["neutral>regress"] == {"pairs": 1, "right": 0.0, "tied": 1.0, "wrong": 0.0, "accuracy": 0.5}
    assert ranking["all"]["pairs"] == 3 and ranking["all"]["accuracy"] == pytest.approx(2.5 / 3)
    assert math.isnan(pairwise_ranking(advantages, labels, [0, 1, 2, 3, 4])["all"]["accuracy"])


def test_the_copies_of_a_task_split_into_consecutive_groups():
    steps = StepColumns(group=[0, 0, 0, 1, 1], trajectory=[0, 3, 7, 8, 15])

    assert subgroup_ids(steps, 8, 4) == [(0, 0), (0, 0), (0, 1), (1, 0), (1, 1)]
    assert subgroup_ids(steps, 8, 8) == [(0, 0), (0, 0), (0, 0), (1, 0), (1, 0)]
    with pytest.raises(ValueError, match="must divide the 8 copies"):
        subgroup_ids(steps, 8, 3)


def test_over_seeds_and_the_reading_rule():
    summary = over_seeds([{"a": 1.0, "b": {"c": math.nan}}, {"a": 3.0, "b": {"c": 2.0}}])
    assert summary == {"a": {"mean": 2.0, "min": 1.0, "max": 3.0}, "b": {"c": {"mean": 2.0, "min": 2.0, "max": 2.0}}}

    assert verdict([0.7, 0.6, 0.55], [0.5, 0.5, 0.5]).startswith("the step signal beats the episode signal")
    assert verdict([0.4, 0.45, 0.3], [0.5, 0.5, 0.5]).startswith("the step signal loses")
    assert verdict([0.7, 0.5, 0.6], [0.5, 0.5, 0.5]) == "undecided (GiGPO's ranking above GRPO's on 2 of 3 seeds)"
    assert verdict([0.7, math.nan], [0.5, math.nan]).startswith("undecided: a seed has no pair")


@pytest.mark.slow
def test_the_probe_runs_at_tiny_scale(tiny_model_path, tmp_path, capsys):
    """The whole probe on the 5 rooms game, the tiny model generating and a scripted policy answering (a random
    admissible action, so every label occurs): 2 seeds x 1 task x 4 copies, group sizes 2 and 4."""
    from bench.credit_probe import ROOT

    config = ROOT / "bench" / "screen_configs" / "rooms5_idle2.yaml"
    output = tmp_path / "probe.json"

    report = main(["--tiny", "--configs", str(config), "--model", tiny_model_path, "--output", str(output)],
                  trainer_class=ScriptedTrainer)

    assert json.loads(output.read_text())["games"].keys() == {"rooms5_idle2"}
    game = report["games"]["rooms5_idle2"]
    assert [seed["tasks"] for seed in game["seeds"].values()] == [[0], [1]]  # disjoint tasks per seed
    for seed in game["seeds"].values():
        assert seed["trajectories"] == 4 and sum(seed["labels"].values()) == pytest.approx(1.0)
        assert 0 < seed["labels"]["progress"] < 1  # the random policy both moves and wanders
        for group_size in ("2", "4"):
            figures = seed["by_group_size"][group_size]
            # The three signals are measured on the same rows and the same pairs.
            assert len({figures[signal]["pairs"]["all"]["pairs"] for signal in
                        ("GiGPO", "GRPO (omega=0)", "A_S alone")}) == 1
            for signal in ("GiGPO", "GRPO (omega=0)", "A_S alone"):
                pairs = figures[signal]["pairs"]["all"]
                if pairs["pairs"]:
                    assert pairs["right"] + pairs["tied"] + pairs["wrong"] == pytest.approx(1.0)
            # Rewards 0 or 1 and no invalid-action penalty: GiGPO keeps every order GRPO gives a pair (a winning row's
            # return-to-go is above a losing row's) and can only break GRPO's ties.
            gigpo, grpo = figures["GiGPO"]["pairs"]["all"], figures["GRPO (omega=0)"]["pairs"]["all"]
            if grpo["pairs"]:
                assert gigpo["right"] >= grpo["right"] and gigpo["wrong"] >= grpo["wrong"]
                assert gigpo["tied"] <= grpo["tied"]
        # Groups of 4 hold the groups of 2: step groups can only grow.
        assert seed["by_group_size"]["4"]["step_group_size_mean"] >= seed["by_group_size"]["2"]["step_group_size_mean"]
    spread = game["over_seeds"]["by_group_size"]["4"]["GiGPO"]["zero_share"]
    assert spread["min"] <= spread["mean"] <= spread["max"]
    assert game["decision"].startswith(("the step signal", "undecided"))
    printed = capsys.readouterr().out
    assert "rooms5_idle2" in printed and f"Reading rule at N = 4: {game['decision']}." in printed
    main(["--report-only", str(output)])  # the same tables again, from the file
    again = capsys.readouterr().out.strip()
    assert again.startswith("**rooms5_idle2**") and again in printed
