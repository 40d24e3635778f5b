"""`collect_rollout` on its own: real environments in a pool, answers from a script, no model and no trainer."""

from __future__ import annotations

import re

import pytest
from toy_envs import Corridor, FragileCorridor

from gigpo_trl.env_pool import EnvPool
from gigpo_trl.dialogue import DUMMY_PROMPT, Completion, TextDialogue
from gigpo_trl.rollout import collect_rollout
from gigpo_trl.tasks import Task

pytestmark = pytest.mark.timeout(120)


class ScriptedGenerator:
    """Answers each prompt with `answer(observation, step, batch position)` and records every call's prompts."""

    def __init__(self, answer):
        self.answer, self.calls = answer, []

    def __call__(self, prompts, tools):
        assert tools == [None] * len(prompts)  # text environments offer no tools
        self.calls.append(prompts)
        completions = []
        for position, prompt in enumerate(prompts):
            text = prompt[-1]["content"]
            step = re.search(r"\(step (\d+)\)", text)
            observation = text.split("\n")[1] if step else ""
            answer = self.answer(observation, int(step.group(1)) if step else None, position)
            completions.append(Completion([1, 2, 3], [4] * len(answer), answer))
        return completions


def walk_right_but_copy_1_starts_left(observation, step, position):
    return "<action>left</action>" if step == 0 and position == 1 else "<action>right</action>"


def test_the_step_columns_hold_every_step_of_every_copy_in_turn_order():
    generate = ScriptedGenerator(walk_right_but_copy_1_starts_left)
    with EnvPool(Corridor, num_groups=1, group_size=2, processes=False) as pool:
        rollout = collect_rollout(pool, [Task(seed=0)], generate, max_env_steps=5, show_progress=False)  # 3 cells

    steps = rollout.steps
    assert steps.trajectory == [0, 1, 0, 1, 1]  # turn by turn; copy 0 won at its 2nd step and stopped generating
    assert steps.step == [0, 0, 1, 1, 2]
    assert steps.anchor == [(3, 0), (3, 0), (3, 1), (3, 0), (3, 1)]
    assert steps.action == ["right", "left", "right", "right", "right"]
    assert steps.reward == [0.0, 0.0, 1.0, 0.0, 1.0]
    assert steps.valid == [True] * 5 and steps.group == [0] * 5
    assert steps.observation[1] == "You are in cell 0 of a corridor of 3 cells."
    assert steps.rows_of(1) == [1, 3, 4]
    assert [len(prompts) for prompts in generate.calls] == [2, 2, 1]  # finished environments do not generate
    episodes = rollout.episodes
    assert [(e.length, e.episode_return, e.won, e.done, e.truncated) for e in episodes] == [
        (2, 1.0, True, True, False), (3, 1.0, True, True, False)]
    assert rollout.generate_calls == 3 and rollout.generated_tokens == sum(len(c.completion_ids) for c in steps.completion)


def test_episodes_cut_off_by_max_env_steps_are_truncated_failures():
    generate = ScriptedGenerator(lambda observation, step, position: "<action>left</action>")
    with EnvPool(Corridor, num_groups=2, group_size=2, processes=False) as pool:
        rollout = collect_rollout(pool, [Task(seed=0), Task(seed=1)], generate, max_env_steps=3, show_progress=False)

    assert len(rollout.steps) == 4 * 3 and len(generate.calls) == 3
    assert all(e.truncated and e.done and not e.won and e.length == 3 for e in rollout.episodes)
    assert [e.group for e in rollout.episodes] == [0, 0, 1, 1]


def test_the_prompt_shows_the_last_k_observations_and_actions():
    generate = ScriptedGenerator(lambda observation, step, position: "<action>left</action>")
    with EnvPool(Corridor, num_groups=1, group_size=1, processes=False) as pool:
        collect_rollout(pool, [Task(seed=3)], generate, max_env_steps=4, dialogue=TextDialogue(history_length=2),
                        show_progress=False)

    last_prompt = generate.calls[-1][0][-1]["content"]
    assert "[Step 1] Your action: left" in last_prompt and "[Step 2] Your action: left" in last_prompt
    assert "[Step 0]" not in last_prompt  # K = 2: only the two most recent steps
    assert "Current observation (step 3):" in last_prompt and "1. left\n2. right" in last_prompt


def test_a_process_with_no_live_environment_still_generates_while_others_play():
    """Lock-step across processes: while the busiest process (here: 3 live environments, as `max_across_processes`
    reports) still plays, this one makes the same generation calls, with a dummy prompt once its own episodes
    ended, or as many prompts as the busiest process when the backend slices results by rank."""
    for equal_prompt_counts, expected_sizes in ((False, [2, 2, 1, 1]), (True, [3, 3, 3, 3])):
        generate = ScriptedGenerator(walk_right_but_copy_1_starts_left)
        with EnvPool(Corridor, num_groups=1, group_size=2, processes=False) as pool:
            rollout = collect_rollout(pool, [Task(seed=0)], generate, max_env_steps=4, show_progress=False,
                                      max_across_processes=lambda live: 3, equal_prompt_counts=equal_prompt_counts)

        assert [len(prompts) for prompts in generate.calls] == expected_sizes
        assert generate.calls[-1][-1] == DUMMY_PROMPT
        assert len(rollout.steps) == 5  # the dummy prompts' answers are dropped


def test_a_process_without_tasks_makes_the_generation_calls_of_the_turns_others_play():
    """A process that sits a round of dynamic sampling out plays nothing, and generates the dummy prompt at every turn
    in which another process still has live environments (here 3, then 2, then none)."""
    generate = ScriptedGenerator(walk_right_but_copy_1_starts_left)
    live_elsewhere = iter([3, 2, 0])
    with EnvPool(Corridor, num_groups=1, group_size=2, processes=False) as pool:
        rollout = collect_rollout(pool, [], generate, max_env_steps=5, show_progress=False,
                                  max_across_processes=lambda live: max(live, next(live_elsewhere)))

    assert generate.calls == [[DUMMY_PROMPT], [DUMMY_PROMPT]]
    assert rollout.episodes == [] and len(rollout.steps) == 0 and rollout.num_groups == 0
    assert rollout.generate_calls == 2


def test_an_environment_that_fails_ends_only_its_own_trajectory():
    def answer(observation, step, position):
        return "<action>raise</action>" if position == 0 and step == 1 else "<action>right</action>"

    with EnvPool(FragileCorridor, num_groups=1, group_size=2, processes=False) as pool:
        rollout = collect_rollout(pool, [Task(seed=1)], ScriptedGenerator(answer), max_env_steps=5, show_progress=False)

    failed, healthy = rollout.episodes
    assert failed.truncated and "the interpreter broke" in failed.env_error and failed.length == 2
    assert healthy.won and healthy.env_error is None and healthy.length == 3
