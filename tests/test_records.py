"""A run's records (`gigpo_trl.records`) survive a restart: a run that resumes from a checkpoint keeps the records up to
the checkpoint and sets the later ones aside; one that starts afresh where records exist sets them all aside and says
so; the two runs' records are never mixed. On the files, and through the trainer."""

from __future__ import annotations

import json

import numpy as np
import pytest
from trainer_helpers import cpu_config

from gigpo_trl.records import (
    RECORDS_DIR, SET_ASIDE_PREFIX, checkpoint_step, count_rollouts, evaluation_record, iteration_record, open_records,
    read_evaluations, read_iterations, read_trajectories, read_updates, write_evaluation, write_records, write_update,
)
from gigpo_trl.tasks import task_dataset
from gigpo_trl.trainer import GiGPOTrainer


def record_a_run(output_dir, steps: int, evaluate_every: int = 2) -> None:
    """What a run of `steps` updates records, in the trainer's order: the training rollout of step k (played for update
    k + 1), the update's log at step k + 1, and an evaluation after every `evaluate_every` updates (and before the
    first)."""
    parts = [(np.array([1, 1]), np.array([0.5, -0.5]), np.array([0.0, 0.0]))]
    rollouts = {"train": 0, "eval": 0}

    def rollout(step: int, mode: str) -> None:
        record = iteration_record(step, mode, rollouts[mode], {"env/return_mean": float(step)}, parts, episodes=2)
        write_records(output_dir, record, [{"step of": step}])
        rollouts[mode] += 1

    def evaluation(step: int) -> None:
        rollout(step, "eval")
        write_evaluation(output_dir, evaluation_record(step, {"env/success_rate": step / 10}, ["seed 0"], {}))

    evaluation(0)
    for step in range(steps):
        rollout(step, "train")
        write_update(output_dir, step + 1, {"loss": 0.1, "entropy": 1.0 / (step + 1)})
        if (step + 1) % evaluate_every == 0:
            evaluation(step + 1)


def set_aside_folders(output_dir) -> list:
    return sorted((output_dir / RECORDS_DIR).glob(f"{SET_ASIDE_PREFIX}*"))


def test_a_resumed_run_keeps_the_records_up_to_its_checkpoint_and_sets_the_later_ones_aside(tmp_path):
    record_a_run(tmp_path, steps=5)  # stopped after update 5; its last checkpoint is at step 2

    counts, message = open_records(tmp_path, resume_step=2)

    assert [r["step"] for r in read_updates(tmp_path)] == [1, 2]
    assert [r["step"] for r in read_evaluations(tmp_path)] == [0, 2]
    assert [(r["mode"], r["step"]) for r in read_iterations(tmp_path)] == [
        ("eval", 0), ("train", 0), ("train", 1), ("eval", 2)]  # the rollout of step 2 was played after the checkpoint
    assert sorted(read_trajectories(tmp_path)) == ["eval-00000", "eval-00001", "train-00000", "train-00001"]
    assert counts == {"train": 2, "eval": 2}  # the resumed run's rollouts are numbered on from these
    (aside,) = set_aside_folders(tmp_path)
    lines = {name: [json.loads(line) for line in (aside / name).read_text().splitlines()]
             for name in ("iterations.jsonl", "evaluations.jsonl", "updates.jsonl")}
    assert [r["step"] for r in lines["updates.jsonl"]] == [3, 4, 5]
    assert [r["step"] for r in lines["evaluations.jsonl"]] == [4]
    assert [(r["mode"], r["step"]) for r in lines["iterations.jsonl"]] == [
        ("train", 2), ("train", 3), ("eval", 4), ("train", 4)]
    assert sorted(path.stem for path in (aside / "trajectories").glob("*.json")) == [
        "eval-00002", "train-00002", "train-00003", "train-00004"]
    assert "step 2" in message and str(aside) in message and "training rollouts of steps 2-4" in message


def test_a_resumed_run_with_nothing_after_its_checkpoint_sets_nothing_aside(tmp_path):
    record_a_run(tmp_path, steps=2)
    (tmp_path / RECORDS_DIR / "trajectories" / "train-00001.json").unlink()
    (tmp_path / RECORDS_DIR / "iterations.jsonl").write_text(
        "".join(line + "\n" for line in (tmp_path / RECORDS_DIR / "iterations.jsonl").read_text().splitlines()
                if '"train", "rollout": 1' not in line))

    assert open_records(tmp_path, resume_step=2) == ({"train": 1, "eval": 2}, None)
    assert set_aside_folders(tmp_path) == [] and [r["step"] for r in read_updates(tmp_path)] == [1, 2]


def test_a_fresh_run_where_records_exist_sets_them_all_aside_and_says_so(tmp_path):
    record_a_run(tmp_path, steps=3)
    before = (tmp_path / RECORDS_DIR / "iterations.jsonl").read_text()

    counts, message = open_records(tmp_path, resume_step=None)

    assert counts == {"train": 0, "eval": 0}
    assert read_iterations(tmp_path) == [] and read_updates(tmp_path) == [] and read_evaluations(tmp_path) == []
    assert read_trajectories(tmp_path) == {}
    (aside,) = set_aside_folders(tmp_path)
    assert (aside / "iterations.jsonl").read_text() == before and len(list((aside / "trajectories").glob("*"))) == 5
    assert "held the records of an earlier run" in message and str(aside) in message
    assert "resume_from_checkpoint" in message
    # A third run sets the second's records aside beside the first's, never into them.
    record_a_run(tmp_path, steps=1)
    open_records(tmp_path, resume_step=None)
    assert len(set_aside_folders(tmp_path)) == 2


def test_a_line_that_is_not_a_record_goes_aside_with_a_fresh_runs_records_and_stops_a_resume_naming_it(tmp_path):
    record_a_run(tmp_path, steps=2)
    iterations = tmp_path / RECORDS_DIR / "iterations.jsonl"
    with open(iterations, "a") as file:  # a user's own line, or another version's format
        file.write('{"marker": 1}\n')
    written = iterations.read_text()

    with pytest.raises(ValueError, match=r"iterations.jsonl, line 5, is not a GiGPO record .*'\{\"marker\": 1\}'"):
        read_iterations(tmp_path)
    with pytest.raises(ValueError, match=r"iterations.jsonl, line 5, is not a GiGPO record"):
        open_records(tmp_path, resume_step=2)  # which records come before the checkpoint: not for a run to guess
    assert iterations.read_text() == written  # nothing was rewritten or dropped

    counts, message = open_records(tmp_path, resume_step=None)
    (aside,) = set_aside_folders(tmp_path)
    assert counts == {"train": 0, "eval": 0} and (aside / "iterations.jsonl").read_text() == written
    assert read_iterations(tmp_path) == [] and "held the records of an earlier run" in message


def test_a_resumed_run_drops_the_line_its_stopped_run_left_half_written(tmp_path):
    record_a_run(tmp_path, steps=2)
    updates = tmp_path / RECORDS_DIR / "updates.jsonl"
    updates.write_text(updates.read_text() + '{"step": 3, "metr')  # stopped while writing

    assert [r["step"] for r in read_updates(tmp_path)] == [1, 2]
    open_records(tmp_path, resume_step=2)
    assert updates.read_text().endswith("}\n")  # the next record starts a line of its own
    write_update(tmp_path, 3, {"loss": 0.1})
    assert [r["step"] for r in read_updates(tmp_path)] == [1, 2, 3]


def test_a_run_in_an_empty_folder_has_nothing_to_set_aside(tmp_path):
    assert open_records(tmp_path, resume_step=None) == ({"train": 0, "eval": 0}, None)
    assert open_records(tmp_path, resume_step=4) == ({"train": 0, "eval": 0}, None)
    assert count_rollouts(tmp_path) == {"train": 0, "eval": 0}


def test_the_checkpoint_step_is_read_as_transformers_resumes(tmp_path):
    for step in (2, 10):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"global_step": step}))

    assert checkpoint_step(tmp_path, None) is None and checkpoint_step(tmp_path, False) is None
    assert checkpoint_step(tmp_path, True) == 10  # the last checkpoint
    assert checkpoint_step(tmp_path, str(tmp_path / "checkpoint-2")) == 2
    with pytest.raises(ValueError, match="No valid checkpoint found"):
        checkpoint_step(tmp_path / "checkpoint-2", True)
    with pytest.raises(FileNotFoundError, match="no trainer_state.json"):
        checkpoint_step(tmp_path, str(tmp_path))


# ------------------------------------------------------------------------------------------
# Through the trainer: a run stopped after its checkpoints, resumed, and a fresh run in the same folder.
# ------------------------------------------------------------------------------------------


def training_run(tmp_path, model: str, **overrides) -> GiGPOTrainer:
    config = cpu_config(tmp_path, **{"env_name": "corridor", "max_steps": 4, "save_strategy": "steps", "save_steps": 2,
                                     "env_processes": False, "disable_tqdm": True, **overrides})
    return GiGPOTrainer(model, args=config, train_dataset=task_dataset(range(8)))


def test_a_resumed_run_continues_the_records_of_its_checkpoint_and_a_fresh_run_sets_them_aside(tmp_path,
                                                                                              tiny_model_path):
    first = training_run(tmp_path, tiny_model_path)
    first.train()
    first.close_environments()
    before = read_iterations(tmp_path)
    assert [(r["mode"], r["step"], r["rollout"]) for r in before] == [("train", step, step) for step in range(4)]

    resumed = training_run(tmp_path, tiny_model_path)
    with pytest.warns(UserWarning, match="resuming from the checkpoint of step 2: the 4 records"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    resumed.close_environments()

    after = read_iterations(tmp_path)
    assert [(r["mode"], r["step"], r["rollout"]) for r in after] == [("train", step, step) for step in range(4)]
    assert after[:2] == before[:2]  # the records up to the checkpoint, as the stopped run wrote them
    assert [r["step"] for r in read_updates(tmp_path)] == [1, 2, 3, 4]
    assert sorted(read_trajectories(tmp_path)) == [f"train-0000{k}" for k in range(4)]
    (aside,) = set_aside_folders(tmp_path)
    assert [json.loads(line)["step"] for line in (aside / "iterations.jsonl").read_text().splitlines()] == [2, 3]
    assert [json.loads(line)["step"] for line in (aside / "updates.jsonl").read_text().splitlines()] == [3, 4]

    fresh = training_run(tmp_path, tiny_model_path, max_steps=1)
    with pytest.warns(UserWarning, match="held the records of an earlier run"):
        fresh.train()
    fresh.close_environments()
    assert [(r["step"], r["rollout"]) for r in read_iterations(tmp_path)] == [(0, 0)]
    assert [r["step"] for r in read_updates(tmp_path)] == [1] and len(set_aside_folders(tmp_path)) == 2
