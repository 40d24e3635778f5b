"""research/probes.py: the right actions of the rooms game that the probes and the diagnostics use as labels, the
warm-up's prompts, and the screen of candidate settings."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import pytest

from gigpo_trl.envs import make_env
from research.probes import draught_action, draught_move

@pytest.mark.parametrize("seed", range(4))
def test_following_the_draught_label_reaches_the_treasure_by_the_shortest_path(seed):
    env = make_env("rooms", num_rooms=9)
    observation, info = env.reset(seed=seed)
    # Start anywhere: walk a few steps the wrong way first, then follow the label.
    for _ in range(2):
        wrong = [a for a in info["admissible_actions"] if a != draught_move(observation)][0]
        observation, _, _, _, info = env.step(wrong)
    for steps in range(1, 9):
        number = draught_action(observation, info["admissible_actions"])
        observation, reward, terminated, _, info = env.step(info["admissible_actions"][number - 1])
        if terminated:
            break
    assert reward == 1.0 and info["won"]
    assert steps == 6  # 4 rooms from the middle to the end, plus the 2 wrong steps to undo


def test_the_memory_label_keeps_the_last_move_and_turns_at_the_walls_and_wins_every_task():
    from research.probes import memory_action

    actions = ["go west", "go east"]
    assert memory_action("Room 3.", actions, [("Room 4.", "go west")], 9) == 1
    assert memory_action("Room 3.", actions, [("Room 1.", "go east"), ("Room 2.", "go east")], 9) == 2
    assert memory_action("Room 0.", actions, [("Room 0.", "go west")], 9) == 2  # the west wall: turn
    assert memory_action("Room 8.", actions, [("Room 7.", "go east")], 9) == 1
    for seed in (0, 1):  # from a first move west, the label's policy wins both ends within 4 + 8 steps
        env = make_env("rooms", num_rooms=9, hint=False)
        observation, info = env.reset(seed=seed)
        history = [(observation, "go west")]
        observation, *_ = env.step("go west")
        for steps in range(2, 13):
            action = actions[memory_action(observation, actions, history, 9) - 1]
            history.append((observation, action))
            observation, reward, terminated, _, _ = env.step(action)
            if terminated:
                break
        assert reward == 1.0 and steps == (4 if seed == 0 else 12)


def test_warm_up_prompts_show_none_or_the_last_k_moves_and_none_at_k_0(tiny_model_path):
    from transformers import AutoTokenizer

    from research.probes import state_prompts

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    kwargs = {"num_rooms": 9, "hint": False}
    without = list(itertools.islice(state_prompts("rooms", kwargs, "numbered", tokenizer, random.Random(0)), 40))
    assert all(not shown and "most recent steps" not in tokenizer.decode(prompt) for prompt, _, _, shown in without)
    with_history = list(itertools.islice(state_prompts("rooms", kwargs, "numbered", tokenizer, random.Random(0), 2), 40))
    shown_counts = {len(shown) for *_, shown in with_history}
    assert shown_counts == {0, 1, 2}  # none drawn, or the last 2 moves of episodes of 1 move or more
    for prompt, _, _, shown in with_history:
        text = tokenizer.decode(prompt)
        assert ("most recent steps" in text) == bool(shown)
        assert all(f"Your action: {action}" in text for _, action in shown)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_screen_plays_each_candidate_at_each_temperature_and_times_a_training_iteration(tiny_model_path, tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    candidates = tmp_path / "candidates.yaml"
    candidates.write_text("arms:\n  two steps: [--max_env_steps, 2]\n  four steps: [--max_env_steps, 4]\n")
    output = tmp_path / "screen"
    command = [sys.executable, str(root / "research" / "learning.py"), "--screen",
               str(root / "research" / "configs" / "screens" / "rooms9.yaml"), "--arms", str(candidates), "--model",
               tiny_model_path, "--screen-tasks", "4", "2", "2", "--screen-temperatures", "0.6", "1.0",
               "--screen-update", "--output", str(output), "--per_device_train_batch_size", "2",
               "--steps_per_generation", "2", "--gradient_accumulation_steps", "2", "--num_generations", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=root)

    assert result.returncode == 0, result.stderr[-4000:]
    screened = json.loads((output / "screen.json").read_text())
    assert [candidate["candidate"] for candidate in screened] == ["two steps", "four steps"]
    for k, (candidate, limit) in enumerate(zip(screened, (2, 4))):
        assert candidate["held_out_tasks"] == 4 and 0 <= candidate["held_out_success"] <= 1
        assert 0 < candidate["held_out_decisions_per_episode"] <= limit  # the candidate's own step limit applied
        assert set(candidate["sampled"]) == {"0.6", "1"}
        for sampled in candidate["sampled"].values():
            assert 0 <= sampled["success"] <= 1 and 0 < sampled["decisions_per_episode"] <= limit
            assert 0 < sampled["prompt_tokens_mean"] <= sampled["prompt_tokens_max"]
            # wasted: steps that bring no win nearer (the tiny model's answers mostly name no move: most of them)
            assert 0 <= sampled["wasted_steps_per_episode"] <= sampled["decisions_per_episode"]
            assert sampled["wasted_steps_per_episode"] > 0 or sampled["success"] == 1
        # each candidate's records in a folder of its own: their sampled rollouts hold the return spread reported
        records = [json.loads(line) for line in
                   (output / "records" / f"rooms9-{k}" / "gigpo" / "iterations.jsonl").read_text().splitlines()]
        assert [record["mode"] for record in records] == ["eval", "train", "train"]
        assert [sampled["groups_with_return_spread"] for sampled in candidate["sampled"].values()] == \
            [1.0 - record["metrics"]["frac_reward_zero_std"] for record in records[1:]]
        iteration = candidate["iteration"]
        assert iteration["rollout_cpu_s"] > 0 and iteration["update_cpu_s"] > 0
        assert 2 * 2 <= iteration["step_samples"] <= 2 * 2 * limit  # 2 tasks x 2 copies, 1 to `limit` steps each


def test_wasted_turn_costs_count_the_groups_that_both_won_and_lost_and_how_often_a_wasted_turn_lost():
    from research.probes import wasted_turn_costs

    # (task seed, won, wasted turns, distance to a win after the last step)
    episodes = [(1, True, 0, 0.0), (1, False, 2, 1.0), (1, True, 1, 0.0),   # task 1: won and lost
                (2, False, 3, 3.0), (2, False, 1, 2.0), (2, False, 2, 4.0),  # task 2: all lost
                (3, True, 0, 0.0), (3, True, 0, 0.0), (3, True, 0, 0.0)]     # task 3: all won, no waste
    costs = wasted_turn_costs(episodes)
    assert costs["task_groups"] == 3 and costs["groups_with_return_spread"] == pytest.approx(1 / 3)
    assert costs["wasted_turns_per_episode"] == pytest.approx(9 / 9)
    assert costs["episodes_with_wasted_turn_share"] == pytest.approx(5 / 9)
    assert costs["wasted_turn_loss_share"] == pytest.approx(4 / 5)  # of the 5 that wasted a turn, 4 lost
    assert costs["lost_with_wasted_turn_share"] == 1.0
    assert costs["lost_within_2_moves_share"] == pytest.approx(2 / 4)
    nothing_lost = wasted_turn_costs([(1, True, 0, 0.0)])
    assert math.isnan(nothing_lost["wasted_turn_loss_share"]) and math.isnan(nothing_lost["lost_within_2_moves_share"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_screen_plays_the_held_out_panel_sampled_k_copies_a_task_through_the_trainers_evaluation(
        tiny_model_path, tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    output = tmp_path / "screen"
    command = [sys.executable, str(root / "research" / "learning.py"), "--screen",
               str(root / "research" / "configs" / "learning_compass_cpu.yaml"), "--model", tiny_model_path,
               "--screen-tasks", "3", "1", "2", "--screen-eval-samples", "2", "--output", str(output),
               "--max_env_steps", "5", "--prompt_template", "action_one_shot"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=root)

    assert result.returncode == 0, result.stderr[-4000:]
    panel = json.loads((output / "screen.json").read_text())[0]["sampled_held_out"]
    assert panel["copies"] == 2 and panel["temperature"] == 0.6 and panel["episodes"] == 3 * 2
    assert panel["task_groups"] == 3 and 0 <= panel["success"] <= 1 and 0 < panel["decisions_per_episode"] <= 5
    assert 0 <= panel["wasted_turns_per_episode"] <= panel["decisions_per_episode"]
    # in compass an episode that wastes no turn wins (the limit is above the shortest path): every loss wasted one
    assert panel["lost_with_wasted_turn_share"] == 1.0 or panel["success"] == 1.0
    records = [json.loads(line) for line in
               (output / "records" / "learning_compass_cpu-0" / "gigpo" / "evaluations.jsonl").read_text().splitlines()]
    assert [(record["copies"], record["decoding"]) for record in records] == [(1, "greedy"), (2, "sampled")]


@pytest.mark.timeout(300)
def test_the_screen_of_an_environment_without_admissible_actions_reads_its_walkthrough_and_skips_wasted_turns(
        tiny_model_path, tmp_path):
    """search_qa's actions are free text: no breadth-first distances, so the optimal path is the walkthrough's length and
    the sampled panel says only how the copies of a task split."""
    from research.probes import ROOT, screen

    result = screen(ROOT / "research" / "configs" / "learning_search_qa_cpu.yaml", tiny_model_path, 2, 1, 2,
                    ["--env_kwargs", '{"families": ["collect"], "top_k": 1}', "--max_completion_length", "8",
                     "--eval_greedy", "true", "--num_generations_eval", "1"],
                    records_dir=tmp_path / "records", eval_samples=2)

    assert result["optimal_path_mean"] == 3.0 and result["unwinnable_within_limit"] == 0  # two searches and an answer
    panel = result["sampled_held_out"]
    assert panel["episodes"] == 4 and panel["task_groups"] == 2 and 0 <= panel["groups_with_return_spread"] <= 1
    assert "wasted_turns_per_episode" not in panel and "wasted_steps_per_episode" not in result["sampled"]["0.6"]
