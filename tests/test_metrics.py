"""What a run logs: environment, GiGPO and timing metrics in TRL's logs, TRL's standard metrics in GiGPO's terms,
the completion logs, and the singleton warning."""

from __future__ import annotations

import functools
import re
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from scripted_policy import scripted_trainer
from toy_envs import Corridor, FailsToStart
from trainer_helpers import cpu_config, settings_config

from gigpo_trl import metric_names
from gigpo_trl.advantages import compute_gigpo_advantages
from gigpo_trl.batch import behaviour_metrics
from gigpo_trl.dialogue import Completion
from gigpo_trl.dynamic_sampling import SamplingCounts, StdFilterCounts
from gigpo_trl.env_checker import EnvCheckError, check_env
from gigpo_trl.env_pool import EnvPool
from gigpo_trl.metrics import (
    EnvMetricTotals, PanelEpisode, RolloutSummary, RolloutTimes, async_metrics, panel_metrics, panel_tasks,
    rollout_metrics,
)
from gigpo_trl.rollout import collect_rollout
from gigpo_trl.tasks import Task, task_dataset
from gigpo_trl.trainer import GiGPOTrainer

pytestmark = pytest.mark.timeout(300)


def test_the_standard_grpo_metrics_are_logged_in_gigpo_terms(tmp_path, tiny_model_path):
    trainer = GiGPOTrainer(tiny_model_path, args=settings_config(tmp_path, max_env_steps=3, env_processes=False, max_steps=1,
                                                        logging_steps=1), train_dataset=task_dataset(range(4)))
    trainer.train()
    log = next(entry for entry in trainer.state.log_history if "env/step_samples" in entry)
    rollout = trainer.last_rollout

    rewards = np.array(rollout.steps.reward)
    lengths = [len(c.completion_ids) for c in rollout.steps.completion]
    assert log["reward"] == pytest.approx(rewards.mean()) and log["reward_std"] == pytest.approx(rewards.std(ddof=1))
    assert (log["completions/min_length"], log["completions/max_length"]) == (min(lengths), max(lengths))
    ends = {*trainer.eos_token_ids, trainer.processing_class.pad_token_id}
    cut = [len(c.completion_ids) == 8 and c.completion_ids[-1] not in ends for c in rollout.steps.completion]
    assert log["completions/clipped_ratio"] == pytest.approx(np.mean(cut))  # max_completion_length 8
    groups: dict[int, list[float]] = {}
    for episode in rollout.episodes:
        groups.setdefault(episode.group, []).append(episode.episode_return)
    assert log["frac_reward_zero_std"] == pytest.approx(np.mean([np.std(g) == 0 for g in groups.values()]))
    returns = [r for g in groups.values() for r in g]
    assert log["env/return_std"] == pytest.approx(np.std(returns, ddof=1))
    trainer.close_environments()


def test_update_time_is_the_update_s_own_even_with_evaluations_between_updates(tmp_path, tiny_model_path):
    """`timing/update_s` runs from the end of one training rollout to the start of the next, the evaluations between
    them left out. Checked with relations that hold however loaded the machine is: the update holds the sleep this
    test injects into every optimizer step, and it equals the gap between the two rollouts less the evaluations in
    it, both timed here around the trainer's own methods (each evaluation sleeps at least 1.6 s)."""
    from toy_envs import Corridor
    from transformers import TrainerCallback

    from gigpo_trl.envs import register_env

    class SlowWhenAsked(Corridor):
        def reset(self, *, seed=None, options=None):
            self.delay = (options or {}).get("delay", 0.0)
            return super().reset(seed=seed, options=options)

        def step(self, action):
            time.sleep(self.delay)
            return super().step(action)

    class SlowOptimizerStep(TrainerCallback):
        """Makes every update last at least 0.6 s (it runs between a step's backward and the evaluation)."""

        def on_step_end(self, args, state, control, **kwargs):
            time.sleep(0.6)

    class TimedTrainer(GiGPOTrainer):
        """Records when each training rollout and each evaluation started and ended."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.rollouts, self.evaluations = [], []

        def _generate_and_score_completions(self, inputs):
            started, training = time.perf_counter(), self.model.training
            batch = super()._generate_and_score_completions(inputs)
            if training:
                self.rollouts.append((started, time.perf_counter()))
            return batch

        def evaluate(self, *args, **kwargs):
            started = time.perf_counter()
            try:
                return super().evaluate(*args, **kwargs)
            finally:
                self.evaluations.append((started, time.perf_counter()))

    register_env("slow_when_asked", SlowWhenAsked, overwrite=True)
    settings = dict(env_name="slow_when_asked", max_env_steps=4, env_processes=False, max_steps=3, logging_steps=1,
                    eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=2, num_generations_eval=2)
    trainer = TimedTrainer(tiny_model_path, args=settings_config(tmp_path, **settings), callbacks=[SlowOptimizerStep()],
                           train_dataset=task_dataset(range(4), options=[{"length": 3}] * 4),
                           eval_dataset=task_dataset([9], options=[{"length": 9, "delay": 0.4}]))
    trainer.train()  # every evaluation plays 4 slow steps: at least 1.6 s

    updates = [entry["timing/update_s"] for entry in trainer.state.log_history if "timing/update_s" in entry]
    assert len(updates) == 2 and len(trainer.rollouts) == 3
    for update, (_, previous_end), (next_start, _) in zip(updates, trainer.rollouts, trainer.rollouts[1:]):
        evaluations = [end - start for start, end in trainer.evaluations if previous_end <= start and end <= next_start]
        assert len(evaluations) == 1 and evaluations[0] >= 1.6  # the evaluation in between, which is not the update's
        assert update >= 0.6  # the update's own injected sleep
        # Before: the evaluation's rollout reset the clock, so the update before it went unmeasured (about 0.0 s).
        assert update == pytest.approx(next_start - previous_end - evaluations[0], abs=0.25)
    trainer.close_environments()


def test_the_singleton_warning_is_about_training_rollouts_not_single_copy_evaluations(tmp_path, tiny_model_path):
    import warnings

    from toy_envs import Corridor

    class CountingCorridor(Corridor):
        """The anchor is the step count: copies share their first state, then every step group is a singleton."""

        def reset(self, *, seed=None, options=None):
            self.moves = 0
            return super().reset(seed=seed, options=options)

        def step(self, action):
            self.moves += 1
            return super().step(action)

        def _info(self):
            return {**super()._info(), "anchor": ("start",) if self.moves == 0 else (id(self), self.moves)}

    settings = dict(max_env_steps=30, env_processes=False, max_steps=1, per_device_eval_batch_size=2,
                    num_generations_eval=1)
    long_corridors = [{"length": 99}] * 4
    evaluating = GiGPOTrainer(tiny_model_path, args=settings_config(tmp_path / "eval", **settings), env=CountingCorridor,
                              train_dataset=task_dataset(range(4)), eval_dataset=task_dataset(range(2), long_corridors[:2]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        evaluating.evaluate()  # one copy per task: every step group is a singleton, by design
    assert not [w for w in caught if "singletons" in str(w.message)]
    evaluating.close_environments()

    training = GiGPOTrainer(tiny_model_path, args=settings_config(tmp_path / "train", **settings), env=CountingCorridor,
                            train_dataset=task_dataset(range(4), long_corridors))
    with pytest.warns(UserWarning, match="of step groups are singletons"):
        training.train()
    training.close_environments()


def test_completion_logs_hold_each_step_prompt_answer_reward_and_advantage(tmp_path, tiny_model_path):
    config = cpu_config(tmp_path, env_name="corridor", per_device_train_batch_size=2, steps_per_generation=1,
                        gradient_accumulation_steps=1, max_env_steps=6, log_completions=True)
    trainer = scripted_trainer(tiny_model_path, args=config, train_dataset=task_dataset([1]))
    trainer.model.train()

    batch = trainer._generate_and_score_completions([trainer.train_dataset[0]] * 2)

    assert len(trainer._logs["prompt"]) == len(trainer._logs["completion"]) == 7
    assert "Reach the last cell." in trainer._logs["prompt"][0][-1]["content"]  # the real prompt, task included
    assert trainer._logs["completion"][2] == "I go right"
    assert list(trainer._logs["rewards"]["environment_reward"]) == [0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    np.testing.assert_allclose(trainer._logs["advantages"], batch["advantages"].numpy(), rtol=1e-6)
    trainer.close_environments()


class SilentOnOddLengths(Corridor):
    """A corridor that says whether it is won (info["won"]) only when its length is even."""

    def _info(self):
        info = super()._info()
        if self.length % 2:
            del info["won"]
        return info


def walk_right(prompts, tools):
    return [Completion([1, 2, 3], [4], "<action>right</action>") for _ in prompts]


def walked_rollout(env_fn, seeds: list[int], group_size: int, max_env_steps: int, reset_attempts: int = 3,
                   prefill_tokens: int | None = None, **summary_options) -> tuple:
    """`walk_right` in `group_size` copies of each seed's environment: the rollout, its advantages and its summary as
    the trainer makes them (`prefill_tokens`: what the generator says each answer's prompt forwarded)."""
    def walk(prompts, tools):
        return [replace(completion, prefill_tokens=prefill_tokens) for completion in walk_right(prompts, tools)]

    with EnvPool(env_fn, num_groups=len(seeds), group_size=group_size, processes=False,
                 reset_attempts=reset_attempts) as pool:
        rollout = collect_rollout(pool, [Task(seed) for seed in seeds], walk, max_env_steps=max_env_steps,
                                  show_progress=False)
    steps = rollout.steps
    gigpo = compute_gigpo_advantages(steps.reward, steps.group, steps.trajectory, steps.step, steps.anchor)
    summary = RolloutSummary.of(rollout, gigpo, RolloutTimes(1.0, 0.5, 0.5, 0.0), max_completion_length=8,
                                end_token_ids={4}, update_samples=range(len(steps)), **summary_options)
    return rollout, gigpo, summary


def success_metrics(seeds: list[int]) -> tuple[list, dict[str, float], dict[str, float]]:
    """Three steps to the right in corridors of 3 + seed % 4 cells: the episodes, the rollout's metrics and the
    evaluation panel's metrics."""
    rollout, _, summary = walked_rollout(SilentOnOddLengths, seeds, group_size=1, max_env_steps=3)
    panel = panel_metrics([PanelEpisode.of(episode, group_size=1) for episode in rollout.episodes])
    return rollout.episodes, rollout_metrics([summary]), panel


def test_the_success_rate_counts_the_episodes_whose_environment_says_and_no_other():
    # Corridors of 3, 4, 5 and 6 cells: three steps win those of 3 and 4; only those of 4 and 6 say so.
    episodes, metrics, panel = success_metrics([0, 1, 2, 3])

    assert [(e.episode_return, e.won) for e in episodes] == [(1.0, None), (1.0, True), (0.0, None), (0.0, False)]
    assert metrics["env/success_rate"] == panel["env/success_rate"] == 0.5  # not 1/4: the silent win is not a loss
    assert {name: value for name, value in panel.items() if name.startswith("env/success_rate/")} == {
        "env/success_rate/corridor-4": 1.0, "env/success_rate/corridor-6": 0.0}


def test_a_rollout_where_no_environment_says_has_no_success_rate_rather_than_zero():
    episodes, metrics, panel = success_metrics([0, 2])  # corridors of 3 and 5 cells: neither says

    assert [(e.episode_return, e.won) for e in episodes] == [(1.0, None), (0.0, None)]
    assert metrics["env/return_mean"] == panel["env/return_mean"] == 0.5
    assert [name for name in (*metrics, *panel) if "success_rate" in name] == []


def test_a_rollout_s_means_leave_out_the_episodes_whose_environment_never_started(tmp_path):
    # Corridors of 3 cells walked right: 2 steps to the win. Seed 7's copies fail their only reset attempt each.
    env_fn = functools.partial(FailsToStart, tmp_path, {7: -1})
    rollout, _, summary = walked_rollout(env_fn, [0, 7], group_size=2, max_env_steps=3, reset_attempts=1)
    metrics = rollout_metrics([summary])

    assert [(e.length, e.env_error is not None) for e in rollout.episodes] == [(2, False)] * 2 + [(0, True)] * 2
    # Not 1.0 steps, a return of 0.5 and a success of 0.5: the two that never started were never played.
    assert metrics["env/episode_length_mean"] == 2.0 and metrics["env/return_mean"] == 1.0
    assert metrics["env/success_rate"] == 1.0 and metrics["env/truncated_share"] == 0.0
    assert metrics["env/env_error_share"] == 0.5  # but their environments did fail
    assert metrics["frac_reward_zero_std"] == 1.0  # over the one task group played


def test_a_panel_task_that_could_not_start_is_named_and_counts_in_no_figure(tmp_path):
    # Corridors of 3 (seed 0) and 4 cells, walked right 3 times: won in 2 and 3 steps. Seed 7's first copy fails its
    # only reset attempt; its second copy starts (and plays), but the task was not played whole.
    env_fn = functools.partial(FailsToStart, tmp_path, {7: 1})
    with EnvPool(env_fn, num_groups=3, group_size=2, processes=False, reset_attempts=1) as pool:
        rollout = collect_rollout(pool, [Task(0), Task(7), Task(0, {"length": 4})], walk_right, max_env_steps=3,
                                  show_progress=False)
    episodes = [PanelEpisode.of(episode, group_size=2) for episode in rollout.episodes]

    played, unplayed = panel_tasks(episodes)
    assert played == ["seed 0", 'seed 0, options {"length": 4}']
    assert unplayed == {"seed 7": "environment raised OSError: the engine of seed 7 did not start (attempt 1)"}
    panel = panel_metrics(episodes)
    assert panel["env/panel_tasks"] == 3 and panel["env/panel_unplayed"] == 1
    # Over the 4 copies of the 2 tasks played; seed 7's copy that did play counts neither.
    assert panel["env/success_rate"] == 1.0 and panel["env/episode_length_mean"] == 2.5
    assert panel_metrics([episodes[2]]) == {"env/panel_tasks": 1, "env/panel_unplayed": 1}  # nothing played


def test_the_metric_names_defined_once_are_the_names_the_metrics_are_logged_under():
    """`gigpo_trl.metric_names` is where the report, the records and the recipe read the names from: each must be a
    name the metrics functions write (the trainer's own two aside: an evaluation's unplayed tasks, a gradient spike)."""
    sampling = SamplingCounts(groups_rolled=2, groups_kept=2, groups_dropped=0, groups_surplus=0, groups_missing=0,
                              extra_rounds=0, extra_rollout_s=0.0)
    std_filter = StdFilterCounts.of([[0.5, 0.0]], kept=[[0]])
    rollout, gigpo, summary = walked_rollout(Corridor, [0, 1], group_size=2, max_env_steps=3, sampling=sampling,
                                             std_filter=std_filter, prefill_tokens=10)
    logged = {*rollout_metrics([summary], update_seconds=1.0),
              *panel_metrics([PanelEpisode.of(episode, group_size=2) for episode in rollout.episodes]),
              *gigpo.stats.as_metrics(),  # its row count, which the rollout's metrics log as env/step_samples
              *async_metrics([(1, 0, 0.5, 0.0)]),  # a rollout one update old (async_staleness)
              *behaviour_metrics(torch.ones(2, 3), torch.ones(2, 3), lambda local: local)}
    names = {value for name, value in vars(metric_names).items()
             if name.isupper() and isinstance(value, str) and not name.endswith("PREFIX")}
    families = {name for name in names if name.endswith("/")}  # a family's names: the prefix + "mean", "min", ...

    assert names - families - logged == {metric_names.PANEL_UNPLAYED_TASKS, metric_names.GRAD_NORM_SPIKE}
    assert families and all(any(name.startswith(family) for name in logged) for family in families)


class MeasuredCorridor(Corridor):
    """A corridor that reports metrics of its own: the cells still ahead, and the share of the way walked."""

    def _info(self):
        return {**super()._info(), "metrics": {"cells_left": self.length - 1 - self.position,
                                               "progress": self.position / (self.length - 1)}}


def test_an_environment_s_own_metrics_are_logged_from_each_episode_s_latest_values_overall_and_per_task_type():
    # Corridors of 3 (seed 0) and 6 cells (seed 3) walked right twice: the first is won, the second is 3 cells short.
    rollout, _, summary = walked_rollout(MeasuredCorridor, [0, 3], group_size=2, max_env_steps=2)
    metrics = rollout_metrics([summary])
    panel = panel_metrics([PanelEpisode.of(episode, group_size=2) for episode in rollout.episodes])

    assert [e.metrics for e in rollout.episodes] == [{"cells_left": 0.0, "progress": 1.0}] * 2 + [
        {"cells_left": 3.0, "progress": 0.4}] * 2
    for logged in (metrics, panel):
        assert logged["env/cells_left"] == 1.5 and logged["env/progress"] == pytest.approx(0.7)
        assert logged["env/cells_left/corridor-3"] == 0.0 and logged["env/cells_left/corridor-6"] == 3.0
        assert logged["env/progress/corridor-6"] == pytest.approx(0.4)
    # Summed over processes, as each process's rollout holds some of the episodes.
    assert EnvMetricTotals.combine([EnvMetricTotals.of([("a", {"x": 1.0})]), EnvMetricTotals.of([(None, {"x": 3.0})])]
                                   ).as_metrics() == {"env/x": 2.0, "env/x/a": 1.0}


@pytest.mark.parametrize(("metrics", "problem"), [
    ({"success_rate": 1.0}, r"info\['metrics'\]\['success_rate'\] would be logged as env/success_rate, which the "
                            r"trainer logs itself: rename it"),
    ({"score/max": 1.0}, r"info\['metrics'\] has the name 'score/max': use letters, digits"),
    ({"score": float("nan")}, r"info\['metrics'\]\['score'\] must be a finite number, got nan"),
    ({"score": "high"}, r"info\['metrics'\]\['score'\] must be a finite number, got 'high'"),
    ([1.0], r"info\['metrics'\] must be a dict of \{name: number\}, got list"),
])
def test_an_environment_metric_that_cannot_be_logged_is_refused_by_name(metrics, problem):
    class Declares(Corridor):
        def _info(self):
            return {**super()._info(), "metrics": metrics}

    with pytest.raises(EnvCheckError, match=problem):
        check_env(Declares())
    with EnvPool(Declares, num_groups=1, group_size=1, processes=False) as pool, \
            pytest.raises(ValueError, match=r"environment 'Declares', task seed 0: " + problem):
        collect_rollout(pool, [Task(0)], walk_right, max_env_steps=1, show_progress=False)


def test_the_prefill_is_logged_only_where_every_process_says_what_it_forwarded():
    played, _, cached = walked_rollout(Corridor, [0, 1], group_size=2, max_env_steps=3, prefill_tokens=7)
    _, _, vllm = walked_rollout(Corridor, [0, 1], group_size=2, max_env_steps=3)  # the generator did not say

    assert played.prefill_tokens == 7 * len(played.steps)
    assert rollout_metrics([cached, cached])["generation/prefill_tokens"] == 2 * 7 * len(played.steps)
    assert "generation/prefill_tokens" not in rollout_metrics([cached, vllm])
    assert rollout_metrics([cached, vllm])["generation/prompt_tokens"] == 2 * cached.prompt_tokens


def test_off_format_answers_are_told_apart_by_whether_the_lenient_parser_found_an_admissible_action_in_them():
    # Per step of a 4-cell corridor: a well-formed answer, one that breaks the format but names "right" (mapped by the
    # lenient parser, played), and one that names no admissible action (sent as written: the corridor does not move).
    answers = ["<action>right</action>", "I go right", "Let me think about it.", "<action>right</action>"]

    def mixed(prompts, tools):
        step = int(re.search(r"\(step (\d+)\)", prompts[0][-1]["content"]).group(1))
        return [Completion([1, 2, 3], [4], answers[step]) for _ in prompts]

    with EnvPool(Corridor, num_groups=1, group_size=2, processes=False) as pool:
        rollout = collect_rollout(pool, [Task(1)], mixed, max_env_steps=4, show_progress=False)
    steps = rollout.steps
    gigpo = compute_gigpo_advantages(steps.reward, steps.group, steps.trajectory, steps.step, steps.anchor)
    summary = RolloutSummary.of(rollout, gigpo, RolloutTimes(1.0, 0.5, 0.5, 0.0), max_completion_length=8,
                                end_token_ids={4}, update_samples=range(len(steps)))
    metrics = rollout_metrics([summary])

    # turn by turn, both copies alike
    assert steps.action_match == ["exact", "exact", "contained", "contained", None, None, "exact", "exact"]
    assert steps.valid == [True, True, False, False, False, False, True, True]
    assert steps.action[4] == "Let me think about it." and rollout.episodes[0].won
    assert metrics["env/invalid_action_rate"] == 0.5 and metrics["env/invalid_mapped_rate"] == 0.25
