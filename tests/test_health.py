"""Training health (`gigpo_trl.health`): the rules that tell a run it has stopped learning. Each is tested on the pure
function, on real rollouts of its kind (a scripted policy on the rooms game: one way into a wall, back and forth,
every task group tied), through the trainer's log, and on the records of measured runs: setting F's control (a
collapse into walking one way, the stall that nothing reported before) and runs that learn, which must stay silent."""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
from trainer_helpers import cpu_config, logged_metrics

from gigpo_trl.dialogue import Completion
from gigpo_trl.env_pool import EnvPool
from gigpo_trl.environments.rooms import RoomsEnv
from gigpo_trl.health import (
    BACK_AND_FORTH_TURN_BACKS, ENTROPY_BASELINE_LOGS, LOOP_WINDOW, NO_SIGNAL_SHARE, NO_SIGNAL_WINDOW, SOLVED_SUCCESS,
    STUCK_STAYS, TrainingHealth, back_and_forth_warning, no_signal_share, no_signal_warning, replay_health,
    stuck_warning, training_steps,
)
from gigpo_trl.records import iteration_record, read_updates, write_records
from gigpo_trl.report import write_report
from gigpo_trl.rollout import collect_rollout
from gigpo_trl.tasks import Task, task_dataset
from gigpo_trl.trainer import GiGPOTrainer

MEASURED = Path(__file__).resolve().parent / "data" / "health"
COLLAPSE_KNOBS = ("history_length", "temperature", "entropy_coef", "epsilon_high", "dynamic_sampling_max_rounds",
                  "reward_std_filter_ratio")

# ------------------------------------------------------------------------------------------
# The pure rules.
# ------------------------------------------------------------------------------------------


def steps_of(count: int, **metrics: float) -> list[dict[str, float]]:
    return [dict(metrics) for _ in range(count)]


def test_the_share_without_signal_is_read_where_the_update_s_groups_are_decided():
    assert no_signal_share({"frac_reward_zero_std": 0.75}) == (0.75, "frac_reward_zero_std")
    # Dynamic sampling keeps only groups with a signal: what it could not find is what the update lacks.
    sampled = {"frac_reward_zero_std": 1.0, "dynamic_sampling/groups_kept": 1.0, "dynamic_sampling/groups_missing": 3.0}
    assert no_signal_share(sampled) == (0.75, "dynamic_sampling/groups_missing")
    # Reward-std filtering keeps the groups of the largest spread: those it kept without any spread have no signal.
    filtered = {"frac_reward_zero_std": 0.9, "reward_std_filter/groups_kept": 4.0,
                "reward_std_filter/groups_kept_zero_std": 1.0}
    assert no_signal_share(filtered) == (0.25, "reward_std_filter/groups_kept_zero_std")
    assert no_signal_share({**sampled, **filtered}) == (0.75, "dynamic_sampling/groups_missing")  # the larger
    assert no_signal_share({"entropy": 0.5}) is None


def test_no_signal_is_said_after_a_whole_window_of_tied_groups_unless_the_tasks_are_solved():
    tied = steps_of(NO_SIGNAL_WINDOW, frac_reward_zero_std=1.0, **{"env/success_rate": 0.5})
    assert no_signal_warning(tied[:-1]) is None  # not before the window is full
    warning = no_signal_warning(tied)
    assert warning.rule == "no_signal" and warning.figure == 1.0
    assert f"last {NO_SIGNAL_WINDOW} logged training steps" in warning.message and "100%" in warning.message
    assert "frac_reward_zero_std" in warning.message and "success rate of 50%" in warning.message
    for knob in ("temperature", "num_generations", "invalid_action_penalty", "dynamic_sampling_max_rounds"):
        assert knob in warning.message
    # Most groups tied but not enough of them, or every copy winning (a solved task leaves nothing to learn): silent.
    assert no_signal_warning(steps_of(NO_SIGNAL_WINDOW, frac_reward_zero_std=NO_SIGNAL_SHARE - 0.05)) is None
    solved = steps_of(NO_SIGNAL_WINDOW, frac_reward_zero_std=1.0, **{"env/success_rate": SOLVED_SUCCESS})
    assert no_signal_warning(solved) is None
    # Where the environment does not say what is won, the ties are said.
    assert "not reported" in no_signal_warning(steps_of(NO_SIGNAL_WINDOW, frac_reward_zero_std=1.0)).message


def test_no_signal_under_dynamic_sampling_names_its_missing_groups_and_what_to_change():
    short = steps_of(NO_SIGNAL_WINDOW, frac_reward_zero_std=1.0, **{"dynamic_sampling/groups_kept": 0.0,
                                                                    "dynamic_sampling/groups_missing": 4.0})
    message = no_signal_warning(short).message
    assert "dynamic_sampling/groups_missing" in message and "dynamic_sampling_max_rounds" in message
    # Dynamic sampling found every group it asked for: the update has its signal, however many groups it dropped.
    found = steps_of(NO_SIGNAL_WINDOW, frac_reward_zero_std=1.0, **{"dynamic_sampling/groups_kept": 4.0,
                                                                    "dynamic_sampling/groups_missing": 0.0})
    assert no_signal_warning(found) is None


def collapse(entropies: list[float], **metrics: float) -> list[dict[str, float]]:
    return [{"entropy": entropy, **metrics} for entropy in entropies]


FALLING = [1.0, 1.1, 0.9, 0.8, 0.6, 0.4, 0.3, 0.3]  # the baseline: the mean of the first 3, 1.0
STEADY = [1.0, 1.1, 0.9, 1.0, 0.9, 1.0, 0.9, 1.0]


@pytest.mark.parametrize(("rule", "metric", "threshold", "words"), [
    (stuck_warning, "loops/stay_share", STUCK_STAYS, "stuck in place"),
    (back_and_forth_warning, "loops/turn_back_share", BACK_AND_FORTH_TURN_BACKS, "back and forth"),
])
def test_a_collapse_is_said_when_its_loop_share_is_high_while_the_entropy_falls(rule, metric, threshold, words):
    assert len(FALLING) == ENTROPY_BASELINE_LOGS + LOOP_WINDOW
    warning = rule(collapse(FALLING, **{metric: threshold}))
    assert warning is not None and words in warning.message and metric in warning.message
    assert f"last {LOOP_WINDOW} logged training steps" in warning.message and "from 1 to 0.48" in warning.message
    assert all(knob in warning.message for knob in COLLAPSE_KNOBS)
    assert rule(collapse(FALLING[:-1], **{metric: 1.0})) is None  # the window is not yet after the baseline
    assert rule(collapse(STEADY, **{metric: 1.0})) is None  # as sure as at the start: a random walk
    assert rule(collapse(FALLING, **{metric: threshold - 0.05})) is None  # the entropy fell, but no such loop
    # The token entropy may stay where it was while the copies of every task play alike (setting F's rerun): a
    # collapse too, unless every copy wins.
    alike = rule(collapse(STEADY, **{metric: threshold, "frac_reward_zero_std": 1.0, "env/success_rate": 0.5}))
    assert alike is not None and "100% of its task groups carried no signal (frac_reward_zero_std)" in alike.message
    solved = collapse(STEADY, **{metric: threshold, "frac_reward_zero_std": 1.0, "env/success_rate": SOLVED_SUCCESS})
    assert rule(solved) is None
    # A policy that wins has learned, however sure it has become and however often it idles (setting E's run).
    assert rule(collapse(FALLING, **{metric: 1.0, "env/success_rate": SOLVED_SUCCESS})) is None


def test_each_warning_is_said_once_and_again_when_it_worsens():
    health = TrainingHealth()
    logged = ([(1.0, 0.5)] * 3  # the baseline: entropy 1.0
              + [(0.4, 0.625)] * 6  # the entropy fell and the policy turns back: said once the window holds it
              + [(0.4, 0.8)] * 6  # the window's share up by more than 0.1 since: said again
              + [(0.1, 0.8)] * 5)  # the window's entropy halved since: said again
    said = [[w.rule for w in health.check({"entropy": entropy, "loops/turn_back_share": share})]
            for entropy, share in logged]
    assert [index for index, rules in enumerate(said) if rules] == [7, 11, 18]
    assert {rule for rules in said for rule in rules} == {"back_and_forth"}
    assert health.check({"entropy": float("nan"), "loops/turn_back_share": None}) == []  # NaN and None left out


def test_the_training_steps_of_a_run_s_records_are_what_its_log_saw():
    iterations = [{"mode": "train", "step": 0, "metrics": {"frac_reward_zero_std": 1.0}},
                  {"mode": "eval", "step": 0, "metrics": {"frac_reward_zero_std": 0.0}},
                  {"mode": "train", "step": 1, "metrics": {"frac_reward_zero_std": 0.5}},
                  {"mode": "train", "step": 2, "metrics": {"frac_reward_zero_std": 0.0}},
                  {"mode": "train", "step": 3, "metrics": {"frac_reward_zero_std": 0.25}}]
    updates = [{"step": 1, "metrics": {"entropy": 0.9}}, {"step": 3, "metrics": {"entropy": 0.7}}]
    assert training_steps(iterations, updates) == [{"frac_reward_zero_std": 1.0, "entropy": 0.9},
                                                   {"frac_reward_zero_std": 0.25, "entropy": 0.7}]


# ------------------------------------------------------------------------------------------
# Real rollouts of each kind: the rooms game without the hint (setting F's), scripted policies.
# ------------------------------------------------------------------------------------------


def always(action: str):
    def generate(prompts, tools):
        return [Completion([1], [4], f"<action>{action}</action>") for _ in prompts]
    return generate


def back_and_forth(prompts, tools):
    """West from an odd room, east from an even one: rooms 4 and 3 forever."""
    rooms = [int(prompt[-1]["content"].split("Room ")[-1].split(".")[0]) for prompt in prompts]
    return [Completion([1], [4], f"<action>{'go west' if room % 2 == 0 else 'go east'}</action>") for room in rooms]


def uniformly_random(seed: int):
    rng = random.Random(seed)

    def generate(prompts, tools):
        return [Completion([1], [4], f"<action>{rng.choice(['go west', 'go east'])}</action>") for _ in prompts]
    return generate


def rooms_rollout_metrics(policy, max_env_steps: int = 14) -> dict[str, float]:
    """4 tasks (2 with the treasure west, 2 east) x 8 copies of setting F's rooms, played by `policy`."""
    with EnvPool(lambda: RoomsEnv(num_rooms=9, treasure="seed", hint=False), num_groups=4, group_size=8,
                 processes=False) as pool:
        rollout = collect_rollout(pool, [Task(seed) for seed in range(4)], policy, max_env_steps=max_env_steps,
                                  show_progress=False)
    return logged_metrics(rollout)


def said_over(metrics: dict[str, float], entropies: list[float]) -> set[str]:
    """The rules said over a run whose every logged step has these rollout metrics and the given entropies."""
    health = TrainingHealth()
    return {warning.rule for entropy in entropies for warning in health.check({**metrics, "entropy": entropy})}


FALLING_RUN = [1.0, 1.0, 1.0, 0.8, 0.6, 0.4, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3]
STEADY_RUN = [1.0, 1.0, 1.0, 0.9, 1.0, 0.9, 1.0, 0.9, 1.0, 0.9, 1.0, 0.9]


def test_a_policy_that_walks_one_way_into_the_wall_is_said_to_be_stuck_and_without_signal():
    metrics = rooms_rollout_metrics(always("go east"))  # the west tasks: 4 rooms east, then 10 bumps into the wall

    assert metrics["loops/stay_share"] == pytest.approx(160 / 272) and metrics["loops/turn_back_share"] == 0.0
    assert metrics["loops/revisit_share"] < 0.8  # the loop warning of before never fired on it
    assert metrics["frac_reward_zero_std"] == 1.0 and metrics["env/success_rate"] == 0.5
    assert said_over(metrics, FALLING_RUN) == {"stuck", "no_signal"}
    assert said_over(metrics, STEADY_RUN) == {"stuck", "no_signal"}  # its copies play alike, whatever the entropy


def test_a_policy_that_walks_back_and_forth_is_said_to_and_without_signal():
    metrics = rooms_rollout_metrics(back_and_forth)

    assert metrics["loops/turn_back_share"] == 1.0 and metrics["loops/stay_share"] == 0.0
    assert said_over(metrics, FALLING_RUN) == {"back_and_forth", "no_signal"}


def test_a_random_policy_whose_groups_all_tie_is_said_to_have_no_signal_and_not_to_loop():
    metrics = rooms_rollout_metrics(uniformly_random(0), max_env_steps=3)  # the treasure is 4 rooms away: all lose

    assert metrics["frac_reward_zero_std"] == 1.0 and metrics["env/success_rate"] == 0.0
    assert said_over(metrics, STEADY_RUN) == {"no_signal"}


def test_a_random_policy_that_wins_now_and_then_is_not_warned_about():
    metrics = rooms_rollout_metrics(uniformly_random(0))

    assert 0.1 < metrics["env/success_rate"] < 0.5 and metrics["frac_reward_zero_std"] < NO_SIGNAL_SHARE
    assert said_over(metrics, STEADY_RUN) == set()


# ------------------------------------------------------------------------------------------
# Through the trainer's log, and on the records of measured runs.
# ------------------------------------------------------------------------------------------


def test_the_trainer_says_each_warning_as_its_log_reaches_it(tmp_path, tiny_model_path):
    trainer = GiGPOTrainer(tiny_model_path, args=cpu_config(tmp_path, env_name="corridor"),
                           train_dataset=task_dataset(range(4)))
    trainer.model.train()

    def log_step(entropy: float, stay_share: float) -> list[str]:
        trainer._metrics["train"]["entropy"].append(entropy)
        trainer._metrics["train"]["loops/stay_share"].append(stay_share)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.log({"loss": 0.0, "grad_norm": 1.0})
        return [str(w.message) for w in caught if "stuck in place" in str(w.message)]

    said = [log_step(entropy, 0.6) for entropy in FALLING_RUN]
    assert [len(messages) for messages in said] == [0] * 7 + [1] + [0] * 4
    assert "60%" in said[7][0] and "loops/stay_share" in said[7][0]
    updates = read_updates(tmp_path)
    assert len(updates) == len(FALLING_RUN) and updates[5]["metrics"]["entropy"] == 0.4
    # The records keep what was said, where it was said; the run report lists it.
    recorded = [record.get("warnings") for record in updates]
    assert recorded == [None] * 7 + [[{"rule": "stuck", "message": said[7][0]}]] + [None] * 4
    parts = [(np.array([1]), np.array([0.0]), np.array([0.0]))]
    write_records(tmp_path, iteration_record(0, "train", 0, {"env/return_mean": 0.0}, parts, episodes=2), [])
    page = (write_report(tmp_path) / "index.html").read_text()
    assert "Training health" in page and f"<li>step {updates[7]['step']}: the policy is stuck in place" in page


def measured(name: str) -> list[dict[str, float]]:
    """The logged training steps of a measured run (tests/data/health/README.md says which and how)."""
    return json.loads((MEASURED / f"{name}.json").read_text())


def test_setting_f_s_collapse_into_walking_one_way_is_said():
    said = replay_health(measured("setting_f_control_seed0"))
    assert {warning.rule for _, warning in said} == {"stuck", "no_signal"}


@pytest.mark.parametrize("run", ["quickstart", "setting_e_gigpo_seed0"])
def test_a_run_that_learns_is_not_warned_about(run):
    assert replay_health(measured(run)) == []
