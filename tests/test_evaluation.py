"""Held-out evaluation: success on held-out seeds, a panel that stays fixed when an environment fails to start, the
evaluation loss in passes of bounded size, and the evaluation command (recipes/evaluate.py): a saved checkpoint or
adapter plays panels greedily and sampled, with pass@k."""

from __future__ import annotations

import importlib.util
import itertools
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import LoraConfig
from scripted_policy import scripted_trainer
from toy_envs import FailsToStart
from trainer_helpers import cpu_config, settings_config

from gigpo_trl.envs import fold_seeds
from gigpo_trl.metrics import PanelEpisode, panel_metrics
from gigpo_trl.recipe import train_and_report
from gigpo_trl.records import read_evaluations
from gigpo_trl.tasks import task_dataset
from gigpo_trl.trainer import GiGPOTrainer

RECIPES = Path(__file__).resolve().parent.parent / "recipes"

pytestmark = pytest.mark.timeout(300)


def test_evaluation_on_held_out_seeds_reports_the_success_rate(tmp_path, tiny_model_path):
    config = cpu_config(tmp_path, env_name="corridor", eval_greedy=True, per_device_eval_batch_size=2)
    held_out = task_dataset([100, 101], options=[{"length": 4}, {"length": 6}])
    trainer = scripted_trainer(tiny_model_path, args=config, train_dataset=task_dataset(range(4)), eval_dataset=held_out)

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


def forward_batch_sizes(trainer) -> list[int]:
    """Records the rows of every scoring pass of the trainer (the loss's and the log-probs', TRL's
    `_get_per_token_logps_and_entropies` in passes of its `batch_size`), not generation's. (The model's own forward
    calls would count packed rows: `packed_update` folds a pass's rows into fewer.)"""
    sizes: list[int] = []
    score = trainer._get_per_token_logps_and_entropies

    def record(model, input_ids, *args, batch_size=None, **kwargs):
        rows = input_ids.size(0)
        sizes.extend(min(batch_size or rows, rows - start) for start in range(0, rows, batch_size or rows))
        return score(model, input_ids, *args, batch_size=batch_size, **kwargs)

    trainer._get_per_token_logps_and_entropies = record
    return sizes


def test_the_evaluation_loss_runs_in_passes_of_at_most_the_bound_and_equals_one_pass(tmp_path, tiny_model_path):
    settings = dict(env_name="sokoban", max_env_steps=3, env_processes=False, per_device_eval_batch_size=4,
                    num_generations_eval=2, max_step_samples_per_micro_batch=3)
    trainer = GiGPOTrainer(tiny_model_path, args=settings_config(tmp_path, **settings), train_dataset=task_dataset(range(4)),
                           eval_dataset=task_dataset(range(100, 102)))
    trainer.model.eval()
    inputs = trainer._prepare_inputs([{"seed": seed, "options": ""} for seed in (100, 100, 101, 101)])
    assert inputs["prompt_ids"].size(0) == 12  # 4 episodes x 3 steps: every sample kept, none drawn out
    sizes = forward_batch_sizes(trainer)

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
    trainer = scripted_trainer(tiny_model_path, args=config, train_dataset=task_dataset(range(4)),
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
    trainer = scripted_trainer(tiny_model_path, args=config, train_dataset=task_dataset(range(4)),
                              eval_dataset=task_dataset([100, 101]))

    outcome = train_and_report(trainer)

    records = read_evaluations(tmp_path)
    assert [record["step"] for record in records] == [0, 1, 2]  # before, then after each update: step 2 played once
    assert outcome.before["eval_env/success_rate"] == records[0]["metrics"]["env/success_rate"]
    assert outcome.after["eval_env/success_rate"] == records[-1]["metrics"]["env/success_rate"]


# ------------------------------------------------------------------------------------------
# Evaluation as its own command: recipes/evaluate.py (gigpo_trl.evaluation).
# ------------------------------------------------------------------------------------------

def evaluate_command(arguments: list[str]) -> list[dict]:
    """recipes/evaluate.py, parsed and run as from its command line, in this process (where the corridor is
    registered)."""
    spec = importlib.util.spec_from_file_location("evaluate_recipe", RECIPES / "evaluate.py")
    module = sys.modules.setdefault("evaluate_recipe", importlib.util.module_from_spec(spec))  # dataclasses look it up
    spec.loader.exec_module(module)
    return module.main(*module.parse(arguments))


def trained_checkpoint(tmp_path, tiny_model_path, peft_config=None) -> Path:
    """The folder a short real training run (one update of the tiny model on corridors) saves."""
    config = cpu_config(tmp_path / "run", env_name="corridor", max_steps=1)
    trainer = GiGPOTrainer(tiny_model_path, args=config, train_dataset=task_dataset(range(4)), peft_config=peft_config)
    trainer.train()
    trainer.save_model(tmp_path / "run")
    trainer.close_environments()
    return tmp_path / "run"


def command_line(model: Path | str, output_dir: Path, *more: str) -> list[str]:
    return ["--model_name_or_path", str(model), "--output_dir", str(output_dir), "--env_name", "corridor",
            "--max_env_steps", "3", "--max_completion_length", "6", "--num_generations", "2",
            "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "2", "--num_generations_eval", "1",
            "--temperature", "1.5", "--report_to", "none", "--bf16", "false", *more]


def hand_pass_at_k(outcomes: list[bool], k: int) -> float:
    """The share of the k-subsets of a task's copies that hold a win, counted."""
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(subset) for subset in subsets) / len(subsets)


def test_pass_at_k_is_the_share_of_k_subsets_of_the_samples_that_hold_a_win_averaged_over_tasks():
    wins = {"seed 1": [True, False, False, True, False], "seed 2": [False] * 5, "seed 3": [True] * 5,
            "seed 4": [False, False, False, False, True]}
    episodes = [PanelEpisode(task, copy, "corridor-4", won, float(won), 3)
                for task, outcomes in wins.items() for copy, won in enumerate(outcomes)]

    metrics = panel_metrics(episodes, pass_ks=[1, 2, 3, 5])

    for k in (1, 2, 3, 5):
        expected = np.mean([hand_pass_at_k(outcomes, k) for outcomes in wins.values()])
        assert metrics[f"env/pass@{k}"] == pytest.approx(expected)
        assert metrics[f"env/pass@{k}/corridor-4"] == pytest.approx(expected)
    assert metrics["env/pass@2"] == pytest.approx((0.7 + 0 + 1 + 0.4) / 4)  # e.g. seed 1: 7 of the 10 pairs
    assert panel_metrics(episodes)["env/pass@4"] == pytest.approx(np.mean([hand_pass_at_k(o, 4) for o in wins.values()]))
    with pytest.raises(ValueError, match="k <= copies"):
        panel_metrics(episodes, pass_ks=[6])


@pytest.mark.timeout(900)  # a training run and four evaluations
def test_the_command_evaluates_a_checkpoint_saved_by_training_on_two_panels_greedily_and_sampled(
        tmp_path, tiny_model_path, capsys):
    checkpoint = trained_checkpoint(tmp_path, tiny_model_path)

    records = evaluate_command(command_line(checkpoint, tmp_path / "evaluation", "--panels", "dev", "test:corridor-4",
                                            "--num_tasks", "2", "--samples", "3", "--pass_at", "1", "3"))

    assert [(r["panel"], r["decoding"], r["copies"]) for r in records] == [
        ("dev", "greedy", 1), ("dev", "sampled", 3), ("test:corridor-4", "greedy", 1), ("test:corridor-4", "sampled", 3)]
    dev_seeds = fold_seeds("corridor", "dev", 2)
    assert records[0]["tasks"] == sorted(f"seed {seed}" for seed in dev_seeds)
    test_seeds = [seed for seed in fold_seeds("corridor", "test", 2) if 3 + seed % 4 == 4]  # the corridors of 4 cells
    assert records[2]["tasks"] == sorted(f"seed {seed}" for seed in test_seeds) and test_seeds
    episodes = [json.loads(line) for line in (tmp_path / "evaluation" / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == 2 * 1 + 2 * 3 + len(test_seeds) * (1 + 3)
    for record in records:
        played = [e for e in episodes if (e["panel"], e["decoding"]) == (record["panel"], record["decoding"])]
        metrics = record["metrics"]
        assert metrics["env/success_rate"] == pytest.approx(np.mean([e["won"] for e in played]))
        assert metrics["env/return_mean"] == pytest.approx(np.mean([e["return"] for e in played]))
        assert "loops/revisit_share" in metrics
        if record["decoding"] == "sampled":
            outcomes = {task: [e["won"] for e in played if e["task"] == task] for task in record["tasks"]}
            assert {len(o) for o in outcomes.values()} == {3}
            for k in (1, 3):
                assert metrics[f"env/pass@{k}"] == pytest.approx(np.mean([hand_pass_at_k(o, k) for o in outcomes.values()]))
    report = json.loads((tmp_path / "evaluation" / "evaluation.json").read_text())
    assert report["model"] == str(checkpoint) and report["evaluations"] == records
    printed = capsys.readouterr().out
    assert (f"dev (2 tasks from seed {dev_seeds[0]}, sampled x 3): success "
            f"{records[1]['metrics']['env/success_rate']:.1%}, pass@1") in printed
    assert [r["panel"] for r in read_evaluations(tmp_path / "evaluation")] == [r["panel"] for r in records]


@pytest.mark.timeout(600)
def test_the_command_evaluates_a_lora_adapter_on_its_base_model(tmp_path, tiny_model_path):
    checkpoint = trained_checkpoint(tmp_path, tiny_model_path, LoraConfig(r=4, target_modules="all-linear",
                                                                         task_type="CAUSAL_LM"))
    assert (checkpoint / "adapter_config.json").is_file() and not (checkpoint / "model.safetensors").exists()

    [record] = evaluate_command(command_line(checkpoint, tmp_path / "evaluation", "--num_tasks", "2"))

    assert record["panel"] == "dev" and record["metrics"]["env/panel_tasks"] == 2


def test_the_command_takes_a_training_config_that_evaluates_every_few_steps(tmp_path, tiny_model_path):
    """A training config's evaluation schedule (eval_strategy "steps", as research/configs' have) is the training's:
    the command plays its panel once, instead of failing for want of an eval_dataset."""
    [record] = evaluate_command(command_line(tiny_model_path, tmp_path / "evaluation", "--num_tasks", "2",
                                             "--eval_strategy", "steps", "--eval_steps", "3"))

    assert record["panel"] == "dev" and record["metrics"]["env/panel_tasks"] == 2


@pytest.mark.parametrize(("more", "error", "message"), [
    (["--panels", "validation"], ValueError, "unknown fold 'validation', the folds are train, dev, test"),
    (["--samples", "4", "--pass_at", "8"], ValueError, "pass_at 8 needs 1 <= k <= samples = 4"),
    (["--greedy", "false"], ValueError, "nothing to play"),
])
def test_the_command_refuses_a_panel_or_pass_at_k_it_cannot_play(tmp_path, more, error, message):
    with pytest.raises(error, match=re.escape(message)):
        evaluate_command(command_line("embedded:SmolLM2-135M-Instruct", tmp_path, *more))


def test_the_command_says_when_the_checkpoint_folder_is_missing_or_holds_no_model(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(f"model '{tmp_path}/checkpoint-5': no such folder")):
        evaluate_command(command_line(tmp_path / "checkpoint-5", tmp_path / "evaluation"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds neither a model .config.json. nor a PEFT adapter"):
        evaluate_command(command_line(tmp_path / "empty", tmp_path / "evaluation"))


@pytest.mark.timeout(600)
def test_the_command_plays_the_runs_own_panel_in_a_folder_of_its_own_and_leaves_the_runs_records_alone(
        tmp_path, tiny_model_path, capsys):
    checkpoint = trained_checkpoint(tmp_path, tiny_model_path)  # its records: tmp_path/run/gigpo
    records_before = {path.name: path.read_text() for path in (checkpoint / "gigpo").glob("*.jsonl")}
    config = tmp_path / "training.yaml"  # the training run's config: its held-out panel is 3 tasks of the test fold
    config.write_text(f"output_dir: {checkpoint}\nenv_name: corridor\nnum_train_tasks: 4\nnum_eval_tasks: 3\n"
                      "eval_fold: test\n")
    arguments = [argument for argument in command_line(checkpoint, tmp_path, "--config", str(config))]
    del arguments[arguments.index("--output_dir"):arguments.index("--output_dir") + 2]  # as the README's example

    [record] = evaluate_command(arguments)

    assert {path.name: path.read_text() for path in (checkpoint / "gigpo").glob("*.jsonl")} == records_before
    assert not list((checkpoint / "gigpo").glob("set_aside-*"))
    evaluation = checkpoint / "evaluation"
    assert json.loads((evaluation / "evaluation.json").read_text())["evaluations"] == [record]
    test_seeds = fold_seeds("corridor", "test", 3)
    assert record["panel"] == "test" and record["tasks"] == sorted(f"seed {seed}" for seed in test_seeds)
    printed = capsys.readouterr().out
    assert f"test (3 tasks from seed {test_seeds[0]}, greedy x 1): success" in printed
    assert f"Episodes and report: {evaluation}" in printed


def test_the_command_refuses_to_write_among_a_training_runs_records(tmp_path, tiny_model_path):
    checkpoint = trained_checkpoint(tmp_path, tiny_model_path)
    with pytest.raises(ValueError, match=re.escape(f"{checkpoint} holds the records of a training run")):
        evaluate_command(command_line(tiny_model_path, checkpoint))
