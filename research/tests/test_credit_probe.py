"""research/credit_probe.py: the labels (breadth-first distances before and after each step), the measures of a credit
signal, and the whole probe at tiny scale."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from gigpo_trl.advantages import anchor_step_groups, compute_gigpo_advantages
from gigpo_trl.dialogue import Completion
from gigpo_trl.env_pool import EnvPool
from gigpo_trl.environments.rooms import RoomsEnv
from gigpo_trl.rollout import StepColumns, collect_rollout
from gigpo_trl.tasks import Task
from research.credit_probe import (
    LAMBDAS, bootstrapped_step_advantages, chosen_lambda, label_means, lambda_signal, lambda_verdict,
    losing_episode_credit, main, optimal_state_values, over_seeds, pairwise_ranking, probe_rollout,
    shuffle_state_values, sign_agreement, signal_names, signals, state_values, step_distances, step_label,
    subgroup_ids, verdict, zero_share,
)
from tests.scripted_policy import scripted_trainer
from tests.toy_envs import UnseededCorridor

# The advantage settings of setting D's recipe (research/configs/learning_coin_gpu.yaml).
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
    gigpo, grpo = result["GiGPO"]["all"], result["GRPO (omega=0)"]["all"]
    progress_regress = dict(gigpo["pairs"]["progress>regress"])
    assert math.isnan(progress_regress.pop("newly_untied_accuracy"))  # GiGPO is the reference: it unties nothing new
    assert progress_regress == {"pairs": 2, "right": 1.0, "tied": 0.0, "wrong": 0.0, "accuracy": 1.0,
                                "untied_accuracy": 1.0, "newly_untied": 0}
    assert grpo["pairs"]["progress>regress"]["tied"] == 1.0
    assert grpo["pairs"]["progress>regress"]["accuracy"] == 0.5
    # The regress step belongs to a winning episode: its advantage is positive under both signals (the Monte-Carlo
    # return-to-go of A_S carries the episode's later win too), so neither sign agrees with its label.
    assert gigpo["sign_agreement"]["regress_negative"] == grpo["sign_agreement"]["regress_negative"] == 0.0


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
    neutral_regress = dict(ranking["neutral>regress"])
    assert math.isnan(neutral_regress.pop("untied_accuracy"))  # its only pair is tied
    assert neutral_regress == {"pairs": 1, "right": 0.0, "tied": 1.0, "wrong": 0.0, "accuracy": 0.5}
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
    from research.credit_probe import ROOT

    config = ROOT / "research" / "configs" / "screens" / "rooms5_idle2.yaml"
    output = tmp_path / "probe.json"

    report = main(["--tiny", "--configs", str(config), "--model", tiny_model_path, "--output", str(output)],
                  make_trainer=scripted_trainer)

    assert json.loads(output.read_text())["games"].keys() == {"rooms5_idle2"}
    game = report["games"]["rooms5_idle2"]
    assert [seed["tasks"] for seed in game["seeds"].values()] == [[0], [1]]  # disjoint tasks per seed
    for seed in game["seeds"].values():
        assert seed["trajectories"] == 4 and sum(seed["labels"].values()) == pytest.approx(1.0)
        assert 0 < seed["labels"]["progress"] < 1  # the random policy both moves and wanders
        for group_size in ("2", "4"):
            figures = seed["by_group_size"][group_size]
            # Every signal is measured on the same rows and the same pairs.
            assert len({figures[signal]["all"]["pairs"]["all"]["pairs"] for signal in signal_names(LAMBDAS)}) == 1
            for signal in signal_names(LAMBDAS):
                pairs = figures[signal]["all"]["pairs"]["all"]
                if pairs["pairs"]:
                    assert pairs["right"] + pairs["tied"] + pairs["wrong"] == pytest.approx(1.0)
            # Rewards 0 or 1 and no invalid-action penalty: GiGPO keeps every order GRPO gives a pair (a winning row's
            # return-to-go is above a losing row's) and can only break GRPO's ties.
            gigpo, grpo = figures["GiGPO"]["all"]["pairs"]["all"], figures["GRPO (omega=0)"]["all"]["pairs"]["all"]
            if grpo["pairs"]:
                assert gigpo["right"] >= grpo["right"] and gigpo["wrong"] >= grpo["wrong"]
                assert gigpo["tied"] <= grpo["tied"]
            assert gigpo["newly_untied"] == 0
            # A task group without a win values every state 0: the group's estimate, shuffled or not, gives every row
            # of it A = 0 at every lambda (rewards 0 everywhere, no penalty: A_E is 0 too).
            for lam in LAMBDAS if figures["groups_without_win"] else ():
                for signal in (lambda_signal(lam), lambda_signal(lam, "shuffled V, ")):
                    assert figures[signal]["without_win"]["zero_share"] == 1.0
        # Groups of 4 hold the groups of 2: step groups can only grow.
        assert seed["by_group_size"]["4"]["step_group_size_mean"] >= seed["by_group_size"]["2"]["step_group_size_mean"]
    spread = game["over_seeds"]["by_group_size"]["4"]["GiGPO"]["all"]["zero_share"]
    assert spread["min"] <= spread["mean"] <= spread["max"]
    assert game["decision"].startswith(("the step signal", "undecided"))
    assert set(game["lambda_decisions"]) == {"0.9", "0.5", "0"}
    assert report["chosen_lambda"]["lambda"] in LAMBDAS
    printed = capsys.readouterr().out
    assert "rooms5_idle2" in printed and f"Reading rule at N = 4: {game['decision']}." in printed
    assert f"Reading rule, lambda 0.5: {game['lambda_decisions']['0.5']}." in printed
    assert "Chosen lambda for the learning comparisons: " in printed
    main(["--report-only", str(output)])  # the same tables again, from the file
    again = capsys.readouterr().out.strip()
    assert again.startswith("**rooms5_idle2**") and again in printed


# --------------------------------------------------------------------------------------------
# Bootstrapped step values (issue 40): the signals, the controls and the reading rule.
# --------------------------------------------------------------------------------------------


def losing_progress_rollout():
    """Four copies from room 2 of five rooms: copy 0 walks west twice and wins; copy 1 steps west (progress), then east
    back to room 2 and waits until cut off; copies 2 and 3 step east (regress), then wait or go on east. Every loser's
    first move has a return-to-go of 0."""
    turns = [["go west", "go west", "go east", "go east"], ["go west", "go east", "wait", "go east"],
             ["wait", "wait", "wait"], ["wait", "wait", "wait"]]
    return scripted_rollout(five_rooms, 4, turns, max_env_steps=4)


def test_a_bootstrap_credits_the_progress_of_a_losing_episode_that_lambda_1_ties_with_its_regress():
    rollout = losing_progress_rollout()
    before, after = step_distances(five_rooms(), rollout, search_depth=10)
    steps = rollout.steps
    first = {trajectory: row for row, (trajectory, step) in enumerate(zip(steps.trajectory, steps.step)) if step == 0}
    assert [rollout.episodes[copy].won for copy in range(4)] == [True, False, False, False]
    assert [step_label(before[first[c]], after[first[c]]) for c in range(4)] == ["progress", "progress", "regress",
                                                                                   "regress"]

    advantages, _ = signals(steps, subgroup_ids(steps, 4, 4), SETTINGS, LAMBDAS, before)

    # lambda 1: both losers' first moves tie; bootstrapped, the move into room 1 (where copy 0 went on to win) ranks
    # above the move into room 3 (which no winner visited).
    assert advantages["GiGPO"][first[1]] == advantages["GiGPO"][first[2]]
    for lam in LAMBDAS:
        assert advantages[lambda_signal(lam)][first[1]] > advantages[lambda_signal(lam)][first[2]]
        assert advantages[lambda_signal(lam)][first[0]] > advantages[lambda_signal(lam)][first[1]]  # the winner's first
    figures = probe_rollout(rollout, before, after, 4, [4], SETTINGS, LAMBDAS)["by_group_size"]["4"]
    for lam in LAMBDAS:
        measures = figures[lambda_signal(lam)]["all"]
        assert measures["pairs"]["progress>regress"]["newly_untied"] >= 1
        assert measures["pairs"]["progress>regress"]["newly_untied_accuracy"] == 1.0
    # Near lambda 1 the loser's progress still ranks below the group's mean (its own continuation, 0, weighs 0.9); from
    # 0.5 down it is above it, and the losers' regress steps are never.
    for lam in (0.5, 0.0):
        losing = figures[lambda_signal(lam)]["all"]["losing_episodes"]
        assert losing["progress_positive"] == 1.0 and losing["regress_positive"] == 0.0
    assert figures["GiGPO"]["all"]["losing_episodes"]["progress_positive"] == 0.0  # Monte Carlo credits no loser


def test_the_bootstrap_with_the_groups_own_values_is_the_engines():
    rollout = losing_progress_rollout()
    steps, group_ids = rollout.steps, subgroup_ids(rollout.steps, 4, 4)
    step_groups = anchor_step_groups(group_ids, steps.anchor, steps.step)
    values = state_values(steps, step_groups, SETTINGS.gamma)

    # Room 2: the 4 first steps and copy 1's 2 steps after its return; only copy 0 won from it, 2 steps later.
    assert values[0] == pytest.approx(0.95 / 6)
    for lam in (0.0, 0.5, 0.9, 1.0):
        engine = compute_gigpo_advantages(steps.reward, group_ids, steps.trajectory, steps.step, steps.anchor,
                                          gamma=SETTINGS.gamma, invalid_penalty=0.0, step_lambda=lam)
        np.testing.assert_allclose(bootstrapped_step_advantages(steps, step_groups, values, lam, SETTINGS),
                                   engine.step_advantages, rtol=1e-12, atol=1e-12)


def test_shuffled_values_stay_in_their_task_group_and_their_state():
    group_ids = ["a", "a", "a", "a", "b", "b", "b"]
    step_groups = np.array([0, 0, 1, 2, 3, 4, 4])
    values = np.array([0.5, 0.5, 0.0, 1.0, 0.2, 0.7, 0.7])

    for seed in range(20):
        shuffled = shuffle_state_values(values, group_ids, step_groups, np.random.default_rng(seed))
        assert shuffled[0] == shuffled[1] and shuffled[5] == shuffled[6]  # one value per state
        assert sorted(shuffled[[0, 2, 3]]) == [0.0, 0.5, 1.0] and sorted(shuffled[[4, 5]]) == [0.2, 0.7]


def test_the_optimal_value_is_the_discounted_reward_of_the_shortest_path():
    np.testing.assert_allclose(optimal_state_values(np.array([1.0, 2.0, 4.0, math.inf]), 0.9), [1.0, 0.9, 0.9**3, 0.0])


def test_pairs_the_reference_ties_are_counted_with_their_accuracy():
    labels = ["progress", "regress", "neutral", "regress"]
    reference = np.array([0.0, 0.0, 0.0, 0.0])  # ties every pair
    signal = np.array([1.0, 0.5, 0.5, 2.0])  # progress > regress (right), progress < regress (wrong), neutral = regress

    ranking = pairwise_ranking(signal, labels, [0, 0, 0, 0], reference)

    assert ranking["progress>regress"]["newly_untied"] == 2 and ranking["progress>regress"]["newly_untied_accuracy"] == 0.5
    assert ranking["all"]["newly_untied"] == 4  # the neutral row is tied with one regress row, untied with the other
    assert ranking["all"]["untied_accuracy"] == pytest.approx(2 / 4)
    assert "newly_untied" not in pairwise_ranking(signal, labels, [0, 0, 0, 0])["all"]


def test_losing_credit_counts_the_steps_of_losing_episodes_only():
    credit = losing_episode_credit(np.array([1.0, 0.0, 2.0, -1.0, 3.0]), ["progress", "progress", "regress", "regress",
                                   "progress"], np.array([False, False, False, False, True]))
    assert credit == {"progress_positive": 0.5, "progress_steps": 2, "regress_positive": 0.5, "regress_steps": 2}


def game_of(accuracies: dict[str, list[float]], wins: list[int]) -> dict:
    """A report's game with given ranking accuracies per signal and seed at N = 8, and task groups with a win."""
    seeds = {}
    for k, with_win in enumerate(wins):
        figures = {signal: {"all": {"pairs": {"all": {"accuracy": values[k]}}}} for signal, values in accuracies.items()}
        seeds[str(k)] = {"by_group_size": {"8": figures | {"groups_with_win": with_win}}}
    return {"seeds": seeds}


def test_the_lambda_reading_rule_counts_the_seeds_with_a_win_only():
    game = game_of({"GiGPO": [0.5, 0.5, 0.5], "GiGPO lambda 0.5": [0.6, 0.5, 0.55], "GiGPO lambda 0": [0.4, 0.5, 0.6]},
                   wins=[2, 0, 1])

    assert lambda_verdict(game, 8, 0.5) == "beats lambda 1 (above on 2 of 2 seeds with a win); not counted (no win): seeds 1"
    assert lambda_verdict(game, 8, 0.0).startswith("undecided (above on 1, below on 1 of 2 seeds with a win)")
    assert lambda_verdict(game_of({"GiGPO": [0.5, 0.5], "GiGPO lambda 0.5": [0.6, 0.6]}, wins=[1, 0]), 8, 0.5) \
        .startswith("not enough seeds with a win (1; 2 needed)")
    other = game_of({"GiGPO": [0.5, 0.5], "GiGPO lambda 0.5": [0.52, 0.51], "GiGPO lambda 0": [0.7, 0.4]}, wins=[1, 1])
    choice = chosen_lambda({"a": game, "b": other}, 8, [0.5, 0.0])
    assert choice["lambda"] == 0.5 and choice["supported_by_the_probe"] and choice["beats_lambda_1_on_every_game"] == [0.5]
    neither = chosen_lambda({"b": other, "c": game_of({"GiGPO": [0.5, 0.5], "GiGPO lambda 0.5": [0.4, 0.6],
                                                       "GiGPO lambda 0": [0.9, 0.4]}, wins=[1, 1])}, 8, [0.5, 0.0])
    assert neither["lambda"] == 0.0 and not neither["supported_by_the_probe"]  # the best mean, said to be unsupported
