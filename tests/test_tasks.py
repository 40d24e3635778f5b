"""Tasks: dataset rows, the tasks of a batch, and the task arguments of the recipes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gigpo_trl.tasks import Task, TaskArguments, options_of, task_dataset, tasks_from_rows


def test_tasks_from_rows_detects_split_groups():
    rows = [{"seed": 1, "options": ""}, {"seed": 1, "options": ""}, {"seed": 2, "options": '{"length": 5}'}, {"seed": 3}]
    assert [t.seed for t in tasks_from_rows(rows[:2], 2)] == [1]
    with pytest.raises(RuntimeError, match="should be 2 copies of one task"):
        tasks_from_rows(rows, 2)
    with pytest.raises(RuntimeError, match="a batch of 3 rows cannot hold whole groups of 2 copies"):
        tasks_from_rows(rows[:3], 2)


def test_a_task_dataset_round_trips_seeds_and_options():
    dataset = task_dataset([4, 5], options=[{"length": 6}, None])
    rows = [dataset[0], dataset[0], dataset[1], dataset[1]]
    assert tasks_from_rows(rows, 2) == [Task(4, {"length": 6}), Task(5, None)]
    with pytest.raises(ValueError, match="got 2 seeds but 1 options"):
        task_dataset([4, 5], options=[None])


@pytest.mark.parametrize(("options", "message"), [("{not json", "JSON object string"), ("[1, 2]", "must be a dict")])
def test_bad_options_are_refused_naming_them(options, message):
    with pytest.raises(ValueError, match=message):
        options_of({"seed": 0, "options": options})


def test_task_arguments_give_the_train_fold_and_the_held_out_panel():
    train, panel = TaskArguments(num_train_tasks=3, num_eval_tasks=2, eval_fold="test").datasets("sokoban", {})
    assert train["seed"] == [0, 1, 2] and panel["seed"] == [2_000_000, 2_000_001]
    assert TaskArguments(num_train_tasks=1).datasets("rooms", {})[1] is None


def test_building_a_task_dataset_does_not_import_trl():
    code = "import sys; from gigpo_trl import task_dataset; task_dataset([1]); print('trl' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
