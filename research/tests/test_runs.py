"""research/runs.py and the command line of research/learning.py: the arms and their run folders, the processes'
ports, and whole comparisons run two or six at a time on the tiny model."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import numpy as np
import pytest

def test_runs_started_at_once_get_ports_of_their_own_unless_the_user_set_one(monkeypatch):
    from research.runs import run_environment

    monkeypatch.delenv("MASTER_PORT", raising=False)
    ports = {run_environment()["MASTER_PORT"] for _ in range(2)}  # ephemeral ports: equal about once in 28,000
    assert len(ports) == 2 and all(1024 < int(port) < 65536 for port in ports)
    monkeypatch.setenv("MASTER_PORT", "31337")
    assert run_environment()["MASTER_PORT"] == "31337"


def test_an_arms_file_names_any_arms_and_its_control(tmp_path):
    from research.runs import read_arms, recipe_value, run_directory

    path = tmp_path / "arms.yaml"
    path.write_text("arms:\n  history 0: [--history_length, 0]\n  history 2, T=1.0: [--history_length, 2, --temperature, 1.0]\n"
                    "control: history 0\n")
    arms, control = read_arms(path)
    assert arms == {"history 0": ["--history_length", "0"],
                    "history 2, T=1.0": ["--history_length", "2", "--temperature", "1.0"]}
    assert control == "history 0"
    assert run_directory(Path("out"), "history 2, T=1.0", 3) == Path("out/history-2-t-1.0-seed3")
    assert run_directory(Path("out"), "GiGPO lambda 0.5", 0) == Path("out/gigpo-lambda0.5-seed0")  # as before
    assert recipe_value(["--history_length", "0", "--history_length=2"], "history_length") == "2"
    assert recipe_value(["--temperature", "1.0"], "history_length") is None

    for text, problem in [
        ("arms: {}\n", "expected a mapping with 'arms'"),
        ("arms:\n  a: [--seed, 1]\n", "sets ['--seed'], which the bench sets for every run"),
        ("arms:\n  a: [--history_length, 0]\ncontrol: b\n", "the control 'b' is not one of the arms ['a']"),
        ("arms:\n  History 0: []\n  history-0: []\n", "two arms share a run folder"),
        ("arms:\n  a: [--foo, {x: 1}]\n", "must be a string or a number"),
        ("arms:\n  a: []\nreading: trap\n", "unknown keys ['reading']"),
    ]:
        path.write_text(text)
        with pytest.raises(ValueError, match=re.escape(problem)):
            read_arms(path)


# The smallest run that exercises every path of the runner: 2 tasks x 4 copies an update, episodes of at most 6
# steps (the rooms' treasure is 4 away), 2 updates and a 4-task panel after each.
SMALL_RUN = ["--max_steps", "2", "--num_eval_tasks", "4", "--per_device_eval_batch_size", "4", "--eval_steps", "1",
             "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_env_steps", "6"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_three_arms_run_at_once_and_the_pre_registered_decisions_compare_the_lambda_arm_with_both(tiny_model_path,
                                                                                                   tmp_path):
    """--parallel --step-lambda 0.5 on 2 seeds: 6 runs started at once (one process each), each run's recipe naming
    the advantage it trains with, the summary's decisions between every pair of arms over the seeds, and
    --analyze-only reading the runs again: finding the third arm from its folders, and comparing what the runs have
    written when one run has no records (not started)."""
    import shutil
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, str(root / "research" / "learning.py"), "--parallel", "--step-lambda", "0.5", "--seeds",
               "0", "1", "--config", str(root / "research" / "configs" / "learning_rooms_cpu.yaml"), "--model",
               tiny_model_path, "--output", str(tmp_path), *SMALL_RUN]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=root)

    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary["wall_seconds"]) == 6
    assert summary["methods"] == ["GiGPO", "GRPO (omega=0)", "GiGPO lambda 0.5"]
    assert set(summary["decisions"]) == {"GiGPO against GRPO (omega=0)", "GiGPO lambda 0.5 against GRPO (omega=0)",
                                         "GiGPO lambda 0.5 against GiGPO"}
    assert summary["decision"].startswith(("decided", "undecided"))
    assert set(summary["first_step_at_train_success"]["GiGPO lambda 0.5"]) == {"0.5", "0.8"}
    for seed in (0, 1):  # each run's recipe says which advantage it trains with
        assert "A = A_E + 1 * A_S, step value lambda 0.5" in (tmp_path / f"gigpo-lambda0.5-seed{seed}.log").read_text()
        assert "A = A_E + 1 * A_S, step value lambda 1" in (tmp_path / f"gigpo-seed{seed}.log").read_text()
        assert "A = A_E + 0 * A_S, step value lambda 1" in (tmp_path / f"grpo-seed{seed}.log").read_text()
    rows = (tmp_path / "learning_curves.csv").read_text().splitlines()[1:]
    assert {(row.split(",")[0], row.split(",")[1]) for row in rows} == {
        (method, str(seed)) for method in summary["methods"] for seed in range(2)}
    assert (tmp_path / "learning_curves.png").is_file()
    # --analyze-only finds the third arm from its folder ...
    subprocess.run([*command[:2], "--analyze-only", "--seeds", "0", "1", "--output", str(tmp_path)], check=True,
                   capture_output=True, cwd=root)
    assert json.loads((tmp_path / "summary.json").read_text())["methods"] == summary["methods"]
    # ... and compares what the runs have written so far: here one run has no records (not started).
    shutil.rmtree(tmp_path / "gigpo-seed1" / "gigpo")
    subprocess.run([*command[:2], "--analyze-only", "--seeds", "0", "1", "--output", str(tmp_path)], check=True,
                   capture_output=True, cwd=root)
    rows = (tmp_path / "learning_curves.csv").read_text().splitlines()[1:]
    assert len({(row.split(",")[0], row.split(",")[1]) for row in rows}) == 5


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_named_arms_run_two_at_a_time_and_are_read_again_from_their_output(tiny_model_path, tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    arms = tmp_path / "arms.yaml"
    arms.write_text("arms:\n  no history: [--history_length, 0]\n  history 2, T=1: [--history_length, 2, --temperature, 1.0]\n"
                    "control: no history\n")
    output = tmp_path / "out"
    command = [sys.executable, str(root / "research" / "learning.py"), "--arms", str(arms), "--jobs", "2", "--seeds", "0",
               "--config", str(root / "research" / "configs" / "learning_trap_cpu.yaml"), "--model", tiny_model_path,
               "--output", str(output), *SMALL_RUN]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=root)

    assert result.returncode == 0, result.stderr[-4000:]
    # Each run trained with its arm's arguments (its log's first line is its command).
    commands = {name: (output / f"{name}-seed0.log").read_text().splitlines()[0] for name in ("no-history", "history-2-t-1")}
    assert "--history_length 0 --seed 0" in commands["no-history"]
    assert "--history_length 2 --temperature 1.0 --seed 0" in commands["history-2-t-1"]
    summary = json.loads((output / "summary.json").read_text())
    assert summary["methods"] == ["no history", "history 2, T=1"] and summary["control"] == "no history"
    assert set(summary["decisions"]) == {"history 2, T=1 against no history"} and "decision" not in summary
    assert set(summary["cpu_seconds"]) == {"no history seed 0", "history 2, T=1 seed 0"}
    assert all(seconds > 0 for seconds in summary["cpu_seconds"].values())
    reading = summary["trap_reading"]
    assert reading["control"].startswith("no history: trap") and set(reading["arms"]) == set(summary["methods"])
    rows = list(csv.DictReader((output / "learning_curves.csv").open()))
    train = [row for row in rows if row["mode"] == "train"]
    assert len(train) == 4 and all(0 <= float(row["revisit_share"]) <= 1 for row in train)  # loops/*, logged
    assert all(0 <= float(row[f"success_treasure_{side}"]) <= 1 or np.isnan(float(row[f"success_treasure_{side}"]))
               for row in train for side in ("west", "east"))
    assert any(not np.isnan(float(row["success_treasure_west"])) for row in train)
    # --analyze-only reads the arms the runs were started with (OUTPUT/arms.yaml).
    subprocess.run([*command[:2], "--analyze-only", "--seeds", "0", "--config", command[9], "--output", str(output)],
                   check=True, capture_output=True, cwd=root)
    assert json.loads((output / "summary.json").read_text())["methods"] == summary["methods"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resume_takes_the_last_complete_checkpoint_and_sets_a_cut_one_aside(tmp_path):
    from research.runs import resume_point

    assert resume_point(tmp_path / "never-started") == (None, False)
    for step, complete in ((2, True), (10, False)):  # checkpoint-10 cut while being written
        (tmp_path / f"checkpoint-{step}").mkdir()
        if complete:
            (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"global_step": step, "max_steps": 8}))

    assert resume_point(tmp_path) == (tmp_path / "checkpoint-2", False)
    assert (tmp_path / "incomplete-checkpoint-10").is_dir() and not (tmp_path / "checkpoint-10").exists()
    (tmp_path / "checkpoint-8").mkdir()
    (tmp_path / "checkpoint-8" / "trainer_state.json").write_text(json.dumps({"global_step": 8, "max_steps": 8}))
    assert resume_point(tmp_path) == (tmp_path / "checkpoint-8", True)  # by number, not by name: 8 after 2, 10 aside


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_runs_stopped_part_way_resume_from_their_checkpoints_and_their_records_go_on_exactly(tiny_model_path, tmp_path):
    """Setting H's config (compass), both arms of seed 0 two at a time, stopped (the whole command killed) once both
    runs have saved a checkpoint and before they end; then the same command with --resume: each run goes on from its
    checkpoint, its records hold every update once, in order, its log keeps the first part and the entropy of every
    update; a third time, both runs are finished and not started again. The summary holds setting H's readings.
    About 90 s: two runs of 4 updates on the tiny model, started twice, the fewest that leave a checkpoint before the
    end to be killed at."""
    import os
    import signal
    import subprocess
    import sys
    import time

    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, str(root / "research" / "learning.py"), "--jobs", "2", "--seeds", "0", "--config",
               str(root / "research" / "configs" / "learning_compass_cpu.yaml"), "--model", tiny_model_path,
               "--output", str(tmp_path), "--max_steps", "4", "--save_steps", "1", "--eval_steps", "4",
               "--num_eval_tasks", "4", "--per_device_eval_batch_size", "4", "--per_device_train_batch_size", "8",
               "--num_generations", "4", "--max_env_steps", "6"]
    runs = [tmp_path / "gigpo-seed0", tmp_path / "grpo-seed0"]
    first = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=root,
                             start_new_session=True)
    deadline = time.monotonic() + 600
    while not all(list(run.glob("checkpoint-*/trainer_state.json")) for run in runs) and first.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    # the last complete checkpoint (a later one may have been cut while being written: resume_point sets it aside)
    stopped_at = {run.name: max(int(state.parent.name.split("-")[1]) for state in run.glob("checkpoint-*/trainer_state.json"))
                  for run in runs}
    assert all(step < 4 for step in stopped_at.values()), f"the runs ended before the kill: {stopped_at}"
    # what a run recorded after its last checkpoint (killed while saving the next one, say): the resume sets it aside
    after_checkpoint = {run.name: _records_after(run / "gigpo", stopped_at[run.name]) for run in runs}

    resumed = subprocess.run([*command, "--resume"], capture_output=True, text=True, timeout=600, cwd=root)

    assert resumed.returncode == 0, resumed.stderr[-4000:]
    for run in runs:
        log = (tmp_path / f"{run.name}.log").read_text()
        assert f"# resumed from checkpoint-{stopped_at[run.name]}\n" in log and log.startswith(sys.executable)
        assert f"(from checkpoint-{stopped_at[run.name]})" in resumed.stdout
        records = [json.loads(line) for line in (run / "gigpo" / "iterations.jsonl").read_text().splitlines()]
        assert [record["step"] for record in records if record["mode"] == "train"] == [0, 1, 2, 3]
        aside = list((run / "gigpo").glob("set_aside-*"))
        if after_checkpoint[run.name]:
            assert len(aside) == 1 and _records_after(aside[0], -1) == after_checkpoint[run.name]
        else:
            assert not aside
    rows = [row for row in csv.DictReader((tmp_path / "learning_curves.csv").open()) if row["mode"] == "train"]
    assert len(rows) == 8
    for run, method in zip(runs, ("GiGPO", "GRPO (omega=0)")):  # each update's entropy: the first part's up to the
        # checkpoint, then the resumed part's (the updates the first part made after its checkpoint are played again)
        before, after = (tmp_path / f"{run.name}.log").read_text().split("# resumed from ")
        logged = [*[float(v) for v in re.findall(r"'entropy': '?([0-9.e-]+)", before)][:stopped_at[run.name]],
                  *[float(v) for v in re.findall(r"'entropy': '?([0-9.e-]+)", after)]]
        assert [float(row["entropy"]) for row in sorted((r for r in rows if r["method"] == method),
                                                        key=lambda r: int(r["step"]))] == pytest.approx(logged)
        assert len(logged) == 4
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["step_credit_reading"]["verdict"].startswith("not readable")  # one seed
    assert set(summary["advantage_by_shortest_move"]) == set(summary["won_decisions"]) - {"base"} == {
        "GiGPO seed 0", "GRPO (omega=0) seed 0"}

    again = subprocess.run([*command, "--resume"], capture_output=True, text=True, timeout=600, cwd=root)

    assert again.returncode == 0, again.stderr[-4000:]
    assert "GiGPO seed 0: finished at checkpoint-4, not started again" in again.stdout
    assert "GRPO (omega=0) seed 0: finished at checkpoint-4, not started again" in again.stdout


def _records_after(folder: Path, step: int) -> list[tuple[str, str, int]]:
    """The records in `folder` (a run's gigpo/ or a set-aside one) from after the checkpoint of `step`: training
    rollouts played for later updates (step >= `step`), logged steps and evaluations past it; as (file, mode, step)."""
    records = []
    for name in ("iterations.jsonl", "evaluations.jsonl", "updates.jsonl"):
        path = folder / name
        for line in path.read_text().splitlines() if path.is_file() else []:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # the last line, cut by the kill
                continue
            mode = record.get("mode", "train" if name == "updates.jsonl" else "eval")
            if record["step"] > step or (name == "iterations.jsonl" and mode == "train" and record["step"] == step):
                records.append((name, mode, record["step"]))
    return records
