"""Held-out evaluation: success on held-out seeds, a panel that stays fixed when an environment fails to start, and
the evaluation loss in passes of bounded size."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scripted_policy import ScriptedTrainer
from toy_envs import FailsToStart
from trainer_helpers import cpu_config, settings_config

from gigpo_trl.recipe import train_and_report
from gigpo_trl.records import read_evaluations
from gigpo_trl.tasks import task_dataset
from gigpo_trl.trainer import GiGPOTrainer

pytestmark = pytest.mark.timeout(300)


def test_evaluation_on_held_out_seeds_reports_the_success_rate(tmp_path, tiny_model_path):
    config = cpu_config(tmp_path, env_name="corridor", eval_greedy=True, per_device_eval_batch_size=2)
    held_out = task_dataset([100, 101], options=[{"length": 4}, {"length": 6}])
    trainer = ScriptedTrainer(tiny_model_path, args=config, train_dataset=task_dataset(range(4)), eval_dataset=held_out)

    metrics = trainer.evaluate()

    # The scripted walk needs 3-4 steps for 4 cells and 5-6 for 6 cells: with max_env_steps=4 the
    # copies of the first task win, those of the second are cut off.
    assert metrics["eval_env/success_rate"] == pytest.approx(0.5)
    assert metrics["eval_env/truncated_share"] == pytest.approx(0.5)
    trainer.close_environments()


def failing_panel_trainer(tmp_path, tiny_model_path, failures: dict[int, int], **overrides) -> GiGPOTrainer:
    """The tiny model on corridors whose resets fail `failures[seed]` times (-1: always), in worker processes; the
    held-out panel is seeds 100-102, one copy each, two per batch (the last batch plays a task twice)."""
    (tmp_path / "starts").mkdir()
    config = cpu_config(tmp_path / "run", env_kwargs={"attempts_dir": str(tmp_path / "starts"), "failures": failures},
                        env_processes=True, num_generations_eval=1, per_device_eval_batch_size=2, **overrides)
    return GiGPOTrainer(tiny_model_path, args=config, env=FailsToStart, train_dataset=task_dataset(range(4)),
                        eval_dataset=task_dataset([100, 101, 102]))


def test_a_held_out_task_whose_environment_fails_to_start_at_first_is_played_and_the_panel_stays_full(
        tmp_path, tiny_model_path):
    trainer = failing_panel_trainer(tmp_path, tiny_model_path, {101: 2})

    metrics = trainer.evaluate()
    trainer.close_environments()

    assert metrics["eval_env/env_error_share"] == 0.0 and metrics["eval_env/episode_length_mean"] >= 1
    assert metrics["eval_env/panel_tasks"] == 3 and metrics["eval_env/panel_unplayed"] == 0
    assert "eval_env/panel_unplayed_tasks" not in metrics
    assert (tmp_path / "starts" / "seed-101").read_text() == "..."  # two failed starts, then it played
    [record] = read_evaluations(tmp_path / "run")
    assert record["tasks"] == ["seed 100", "seed 101", "seed 102"] and record["unplayed"] == {}


def test_a_held_out_task_that_never_starts_is_reported_by_id_and_left_out_of_the_figures(
        tmp_path, tiny_model_path, capsys):
    trainer = failing_panel_trainer(tmp_path, tiny_model_path, {102: -1}, max_steps=1)

    with pytest.warns(UserWarning, match=r"played 2 of its 3 held-out tasks.*seed 102: environment raised OSError"):
        outcome = train_and_report(trainer)  # the recipe's path: evaluate, train, evaluate, report

    for metrics in (outcome.before, outcome.after):
        assert metrics["eval_env/panel_tasks"] == 3 and metrics["eval_env/panel_unplayed"] == 1
        assert metrics["eval_env/panel_unplayed_tasks"] == "seed 102"
        assert metrics["eval_env/episode_length_mean"] >= 1  # over the 2 tasks played: no episode of length 0
    for record in read_evaluations(tmp_path / "run"):
        assert record["tasks"] == ["seed 100", "seed 101"] and list(record["unplayed"]) == ["seed 102"]
        assert record["unplayed"]["seed 102"].startswith("environment raised OSError: the engine of seed 102 did not")
        assert record["unplayed"]["seed 102"].endswith("(the reset failed all 3 attempts)")
    printed = capsys.readouterr().out
    assert (f"Held-out success rate: {outcome.before['eval_env/success_rate']:.1%} before training (2 of 3 tasks "
            f"played; 1 could not be: seed 102) -> {outcome.after['eval_env/success_rate']:.1%} after (2 of 3 tasks "
            "played; 1 could not be: seed 102)") in printed
    page = (outcome.report / "index.html").read_text()
    assert "Held-out tasks that could not be played" in page and "<b>seed 102</b> (environment raised OSError" in page


def forward_batch_sizes(model) -> list[int]:
    """Records the batch size of every scoring forward pass of the (real) model: the loss's and the log-probs'
    (TRL scores with `fused_lm_head=True`), not generation's."""
    sizes: list[int] = []

    def record(module, args, kwargs):
        if kwargs.get("fused_lm_head"):
            sizes.append(kwargs["input_ids"].size(0))

    model.register_forward_pre_hook(record, with_kwargs=True)
    return sizes


def test_the_evaluation_loss_runs_in_passes_of_at_most_the_bound_and_equals_one_pass(tmp_path, tiny_model_path):
    settings = dict(env_name="sokoban", max_env_steps=3, env_processes=False, per_device_eval_batch_size=4,
                    num_generations_eval=2, max_step_samples_per_micro_batch=3)
    trainer = GiGPOTrainer(tiny_model_path, args=settings_config(tmp_path, **settings), train_dataset=task_dataset(range(4)),
                           eval_dataset=task_dataset(range(100, 102)))
    trainer.model.eval()
    inputs = trainer._prepare_inputs([{"seed": seed, "options": ""} for seed in (100, 100, 101, 101)])
    assert inputs["prompt_ids"].size(0) == 12  # 4 episodes x 3 steps: every sample kept, none drawn out
    sizes = forward_batch_sizes(trainer.model)

    with torch.no_grad():
        in_parts = trainer._loss_in_passes(trainer.model, inputs, 3, backward=False)
        assert sizes == [3, 3, 3, 3]
        whole = trainer.compute_loss(trainer.model, inputs)
    torch.testing.assert_close(in_parts, whole, rtol=1e-5, atol=1e-7)

    sizes.clear()
    metrics = trainer.evaluate()
    assert np.isfinite(metrics["eval_loss"]) and sizes and max(sizes) <= 3
    trainer.close_environments()


def test_a_recipe_told_the_panel_figure_before_training_plays_it_after_training_only(tmp_path, tiny_model_path,
                                                                                      capsys):
    config = cpu_config(tmp_path, env_name="corridor", eval_greedy=True, per_device_eval_batch_size=2, max_steps=1)
    trainer = ScriptedTrainer(tiny_model_path, args=config, train_dataset=task_dataset(range(4)),
                              eval_dataset=task_dataset([100, 101]))

    outcome = train_and_report(trainer, evaluate_first=False)

    assert outcome.before is None and outcome.after["eval_env/panel_tasks"] == 2
    assert [record["step"] for record in read_evaluations(tmp_path)] == [1]  # after the one update, not at step 0
    assert (f"Held-out success rate: not played before training (evaluate_before_training false) -> "
            f"{outcome.after['eval_env/success_rate']:.1%} after") in capsys.readouterr().out


def test_the_panel_after_training_is_the_last_periodic_evaluation_when_the_run_made_one_at_its_last_step(
        tmp_path, tiny_model_path):
    config = cpu_config(tmp_path, env_name="corridor", eval_greedy=True, per_device_eval_batch_size=2, max_steps=2,
                        eval_strategy="steps", eval_steps=1)
    trainer = ScriptedTrainer(tiny_model_path, args=config, train_dataset=task_dataset(range(4)),
                              eval_dataset=task_dataset([100, 101]))

    outcome = train_and_report(trainer)

    records = read_evaluations(tmp_path)
    assert [record["step"] for record in records] == [0, 1, 2]  # before, then after each update: step 2 played once
    assert outcome.before["eval_env/success_rate"] == records[0]["metrics"]["env/success_rate"]
    assert outcome.after["eval_env/success_rate"] == records[-1]["metrics"]["env/success_rate"]
