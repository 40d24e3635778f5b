"""research/analysis.py: the pre-registered decision rules, the held-out panels' check, the budget rule's cut, the
loop share, the entropy of runs brought back without their logs and the rows of runs whose records are gone, and
setting F's trap reading."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

PANEL = ["seed 1000000", "seed 1000001", "seed 1000002"]


def write_run(directory: Path, eval_success: dict[int, float], unplayed: dict[int, list[str]]) -> None:
    """The records of a run as GiGPOTrainer writes them (through gigpo_trl.records): training rollouts at steps 0-1,
    evaluations of the 3-task PANEL at the steps of `eval_success`, those of `unplayed` without some tasks."""
    from gigpo_trl.records import evaluation_record, iteration_record, write_evaluation, write_records

    parts = [(np.array([2, 2]), np.zeros(2), np.zeros(2))]

    def metrics(success: float) -> dict[str, float]:
        return {"env/success_rate": success, "env/return_mean": success, "env/episode_length_mean": 5.0,
                "gigpo/singleton_share": 0.0, "gigpo/step_group_size_mean": 2.0, "timing/rollout_s": 1.0,
                "timing/advantages_s": 0.0}

    for step in (0, 1):
        write_records(directory, iteration_record(step, "train", step, metrics(0.5), parts, episodes=4), [])
    for rollout, (step, success) in enumerate(eval_success.items()):
        write_records(directory, iteration_record(step, "eval", rollout, metrics(success), parts, episodes=4), [])
        missing = unplayed.get(step, [])
        write_evaluation(directory, evaluation_record(
            step, metrics(success), [task for task in PANEL if task not in missing],
            {task: "environment raised OSError: no port (the reset failed all 3 attempts)" for task in missing}))
    (directory.parent / f"{directory.name}.log").write_text("")


def trap_rows(method: str, seed: int, entropy: tuple[float, float], west: tuple[float, float],
              east: tuple[float, float], revisits: tuple[float, float]) -> list[dict]:
    """40 training updates of one run: the first 20 at the first values, the last 20 at the second."""
    return [{"method": method, "seed": seed, "mode": "train", "step": step, "success_rate": (w + e) / 2,
             "entropy": h, "success_treasure_west": w, "success_treasure_east": e, "revisit_share": r}
            for step in range(40) for h, w, e, r in [tuple(pair[step >= 20] for pair in (entropy, west, east, revisits))]]


def test_the_decision_is_the_pre_registered_criterion():
    from research.analysis import decision

    def rows(gigpo, grpo):
        return [{"method": method, "seed": seed, "mode": "eval", "step": step, "success_rate": value}
                for method, finals in (("GiGPO", gigpo), ("GRPO (omega=0)", grpo))
                for seed, value in enumerate(finals) for step, value in ((0, 0.1), (100, value))]

    assert decision(rows([0.6, 0.5, 0.7], [0.4, 0.4, 0.6])) == "decided: GiGPO above GRPO (omega=0) on every seed (3)"
    assert decision(rows([0.3, 0.3, 0.3], [0.4, 0.5, 0.6])).startswith("decided: GRPO (omega=0) above GiGPO")
    assert decision(rows([0.6, 0.4, 0.7], [0.4, 0.4, 0.6])).startswith("undecided")  # a tie on one seed


@pytest.mark.slow
def test_the_comparison_refuses_held_out_figures_of_runs_whose_panels_differ_unless_allowed(tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    for seed in (0, 1):  # GiGPO above GRPO on both seeds, but GRPO seed 1's last evaluation could not play a task
        write_run(tmp_path / f"gigpo-seed{seed}", {0: 0.2, 2: 0.6}, {})
        write_run(tmp_path / f"grpo-seed{seed}", {0: 0.2, 2: 0.5}, {2: ["seed 1000001"]} if seed else {})
    command = [sys.executable, str(root / "research" / "learning.py"), "--analyze-only", "--seeds", "0", "1", "--output",
               str(tmp_path)]

    subprocess.run(command, check=True, capture_output=True, cwd=root)
    refused = json.loads((tmp_path / "summary.json").read_text())

    difference = ("the held-out panels differ: GRPO (omega=0) seed 1 at step 2 played 2 of the 3 tasks (not: "
                  "seed 1000001)")
    assert refused["decision"].startswith(f"refused: {difference}; their held-out figures are not over the same tasks")
    assert refused["decisions"]["GiGPO against GRPO (omega=0)"] == refused["decision"]
    for field in ("success_rate", "episode_length"):
        assert refused["eval"][field]["GiGPO against GRPO (omega=0)"]["refused"].startswith(difference)
    assert refused["held_out_panels"] == {"same_tasks": False, "differences": difference, "compared_anyway": False,
                                          "tasks_not_recorded": []}
    assert "final" in refused["train"]["success_rate"]["GiGPO against GRPO (omega=0)"]  # training is not a panel

    subprocess.run([*command, "--allow-panel-mismatch"], check=True, capture_output=True, cwd=root)
    allowed = json.loads((tmp_path / "summary.json").read_text())

    assert allowed["decision"] == ("decided: GiGPO above GRPO (omega=0) on every seed (2) (compared with "
                                   f"--allow-panel-mismatch although {difference})")
    assert allowed["eval"]["success_rate"]["GiGPO against GRPO (omega=0)"]["final"] == {
        "GiGPO": pytest.approx(0.6), "GRPO (omega=0)": pytest.approx(0.5)}
    assert allowed["held_out_panels"]["compared_anyway"] is True

    # A difference at an earlier evaluation leaves the decision (last evaluations) alone, not the curves.
    from research.analysis import decision, held_out_panels, panel_differences

    runs = {("GiGPO", 0): tmp_path / "gigpo-seed0", ("GRPO (omega=0)", 0): tmp_path / "grpo-seed0"}
    write_run(tmp_path / "early" / "grpo-seed0", {0: 0.2, 2: 0.5}, {0: ["seed 1000002"]})
    panels = held_out_panels(runs | {("GRPO (omega=0)", 0): tmp_path / "early" / "grpo-seed0"})
    rows = [{"method": method, "seed": 0, "mode": "eval", "step": 2, "success_rate": value}
            for method, value in (("GiGPO", 0.6), ("GRPO (omega=0)", 0.5))]
    assert decision(rows, panels=panels).startswith("decided: GiGPO above")
    assert panel_differences(panels, ("GiGPO", "GRPO (omega=0)")) == (
        "the held-out panels differ: GRPO (omega=0) seed 0 at step 0 played 2 of the 3 tasks (not: seed 1000002)")


@pytest.mark.slow
def test_runs_stopped_at_a_fixed_time_are_compared_at_the_last_evaluation_every_run_reached(tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    # GRPO seed 1 was stopped before its evaluation at step 4; at step 2 GiGPO is above on both seeds, at 4 it is not.
    for seed in (0, 1):
        write_run(tmp_path / f"gigpo-seed{seed}", {0: 0.2, 2: 0.6, 4: 0.1}, {})
        write_run(tmp_path / f"grpo-seed{seed}", {0: 0.2, 2: 0.5} if seed else {0: 0.2, 2: 0.5, 4: 0.7}, {})
    command = [sys.executable, str(root / "research" / "learning.py"), "--analyze-only", "--seeds", "0", "1", "--output",
               str(tmp_path)]

    subprocess.run([*command, "--cut-at-common-evaluation"], check=True, capture_output=True, cwd=root)
    cut = json.loads((tmp_path / "summary.json").read_text())
    subprocess.run(command, check=True, capture_output=True, cwd=root)
    whole = json.loads((tmp_path / "summary.json").read_text())

    assert cut["cut_at_step"] == 2 and "cut_at_step" not in whole
    assert cut["decision"] == "decided: GiGPO above GRPO (omega=0) on every seed (2)"
    # Without the cut each run's own last evaluation counts: GiGPO's at step 4 against GRPO seed 1's at step 2.
    assert whole["decision"] == "decided: GRPO (omega=0) above GiGPO on every seed (2)"
    curves = list(csv.DictReader((tmp_path / "learning_curves.csv").open()))
    assert max(int(row["step"]) for row in curves) == 4  # the last analysis (without the cut) kept every row

    from research.analysis import cut_at_common_evaluation

    rows = [{"method": "GiGPO", "seed": 0, "mode": "train", "step": 1}]
    with pytest.raises(ValueError, match="GiGPO seed 0 evaluated nothing"):
        cut_at_common_evaluation(rows)


def test_the_decision_of_any_two_methods_and_the_first_iterations_at_a_success_target():
    from research.analysis import decision, first_steps_at
    from research.runs import methods, run_directory

    rows = [{"method": method, "seed": 0, "mode": "eval", "step": 10, "success_rate": value}
            for method, value in (("GiGPO", 0.5), ("GiGPO lambda 0.5", 0.7))]
    assert decision(rows, "GiGPO lambda 0.5", "GiGPO") == "decided: GiGPO lambda 0.5 above GiGPO on every seed (1)"
    train = [{"method": "GiGPO", "seed": 3, "mode": "train", "step": step, "success_rate": value}
             for step, value in enumerate([0.0, 1.0, 1.0, 1.0, 1.0, 1.0])]
    # Trailing means of 5: 0, 0.5, 0.67, 0.75, 0.8, 1.0.
    assert first_steps_at(train, "GiGPO", 0.5) == {"3": 1} and first_steps_at(train, "GiGPO", 0.8) == {"3": 4}
    assert first_steps_at(train, "GiGPO", 1.01) == {"3": None}
    assert methods(0.0)["GiGPO lambda 0"] == ["--step_advantage_weight", "1", "--step_advantage_lambda", "0"]
    assert run_directory(Path("out"), "GiGPO lambda 0.9", 2) == Path("out/gigpo-lambda0.9-seed2")


def test_the_loop_share_counts_the_steps_that_come_back_to_the_observation_of_two_steps_before():
    from research.analysis import two_step_loop_share

    def episode(observations):
        return {"steps": [{"observation": observation, "action": "move"} for observation in observations]}

    # Steps 2, 3, 4 of K P K P K come back; of K K K (the agent stays) and K P L (it goes on) none does.
    assert two_step_loop_share([episode("KPKPK")]) == 1.0
    assert two_step_loop_share([episode("KKK"), episode("KPL")]) == 0.0
    assert two_step_loop_share([episode("KPKL"), episode("KP")]) == 0.5  # a 2-step episode has no third step
    assert np.isnan(two_step_loop_share([episode("KP")]))


def test_the_analysis_reads_runs_brought_back_without_their_logs(tmp_path, monkeypatch, capsys):
    """Records copied from a GPU machine without the runs' logs: --analyze-only takes their entropy from the CSV of an
    analysis made there (--entropy-from), says which runs have none, and reports the subsampled step samples and the
    loops of the logged trajectories."""
    import csv
    import sys

    from research import learning
    from gigpo_trl.records import write_records

    def record(step, mode, rollout, success):
        metrics = {"env/success_rate": success, "env/return_mean": success, "env/episode_length_mean": 9.0,
                   "env/step_samples": 80.0, "env/invalid_action_rate": 0.0, "gigpo/subsampled_rows": 16.0 * (mode == "train"),
                   "gigpo/singleton_share": 0.1, "gigpo/step_group_size_mean": 6.0, "gigpo/nonzero_advantage_share": 0.5,
                   "frac_reward_zero_std": 0.25, "timing/rollout_s": 1.0, "timing/advantages_s": 0.001, "timing/update_s": 2.0}
        return {"step": step, "mode": mode, "rollout": rollout, "metrics": metrics, "step_group_sizes": {"6": 1}}

    loop = [{"seed": 0, "won": False, "truncated": True, "env_error": None,  # as the records hold an episode
             "steps": [{"observation": o, "action": "move"} for o in ("kitchen", "pantry", "kitchen", "hall")]}]
    for run, finals in (("gigpo-seed0", 0.5), ("grpo-seed0", 0.25)):
        for step, mode, rollout, success in ((0, "eval", 0, 0.2), (0, "train", 0, 0.1), (1, "train", 1, 0.3),
                                             (2, "eval", 1, finals)):
            write_records(tmp_path / run, record(step, mode, rollout, success), loop if (mode, rollout) == ("train", 1) else [])
    (tmp_path / "gigpo-seed0.log").write_text("{'loss': '0.1', 'entropy': '0.5'}\n{'loss': '0.2', 'entropy': '0.25'}\n")
    earlier = tmp_path / "earlier.csv"
    earlier.write_text("method,seed,mode,step,entropy\nGRPO (omega=0),0,eval,0,nan\nGRPO (omega=0),0,train,0,0.4\n"
                       "GRPO (omega=0),0,train,1,0.3\n")

    def analyze(*arguments):
        monkeypatch.setattr(sys, "argv", ["learning.py", "--analyze-only", "--seeds", "0", "--output", str(tmp_path),
                                          *arguments])
        learning.main()
        with open(tmp_path / "learning_curves.csv", newline="") as file:
            return [row for row in csv.DictReader(file)], capsys.readouterr().out

    rows, out = analyze("--entropy-from", str(earlier))
    train = {(row["method"], int(row["step"])): row for row in rows if row["mode"] == "train"}
    assert [float(train["GiGPO", step]["entropy"]) for step in (0, 1)] == [0.5, 0.25]  # from the run's own log
    assert [float(train["GRPO (omega=0)", step]["entropy"]) for step in (0, 1)] == [0.4, 0.3]  # from the earlier CSV
    assert "grpo-seed0: no grpo-seed0.log: entropy from --entropy-from" in out
    assert {float(row["subsampled_rows"]) for row in train.values()} == {16.0}
    # Of the logged episode's 4 steps, the third comes back to the kitchen and the fourth does not.
    assert float(train["GiGPO", 1]["two_step_loop_share"]) == 0.5 and np.isnan(float(train["GiGPO", 0]["two_step_loop_share"]))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["per_iteration_mean"]["GiGPO"]["subsampled_rows"] == 16.0
    assert summary["decision"] == "decided: GiGPO above GRPO (omega=0) on every seed (1)"

    rows, out = analyze()
    assert "grpo-seed0: no grpo-seed0.log: entropy not known" in out
    assert all(np.isnan(float(row["entropy"])) for row in rows if row["method"] == "GRPO (omega=0)")


def test_runs_whose_records_are_gone_are_analysed_again_from_an_earlier_csv(tmp_path, monkeypatch, capsys):
    """--rows-from: a run whose records were lost (another machine) comes back from the CSV of an earlier analysis,
    as it was there, beside the runs that still have their records; the summary says its held-out tasks are not
    known, and without --analyze-only the option is refused."""
    import shutil
    import sys

    from research import learning

    for seed in (0, 1):
        write_run(tmp_path / f"gigpo-seed{seed}", {0: 0.2, 2: 0.6}, {})
        write_run(tmp_path / f"grpo-seed{seed}", {0: 0.2, 2: 0.4 + 0.3 * seed}, {})

    def analyze(*arguments):
        monkeypatch.setattr(sys, "argv", ["learning.py", "--seeds", "0", "1", "--output", str(tmp_path), *arguments])
        learning.main()
        with open(tmp_path / "learning_curves.csv", newline="") as file:
            rows = {(row["method"], row["seed"], row["mode"], row["step"]): row for row in csv.DictReader(file)}
        return rows, json.loads((tmp_path / "summary.json").read_text()), capsys.readouterr().out

    before, summary_before, _ = analyze("--analyze-only")
    earlier = tmp_path / "earlier.csv"
    shutil.copy(tmp_path / "learning_curves.csv", earlier)
    shutil.rmtree(tmp_path / "grpo-seed0")  # listed after seed 1 when it comes back

    _, without, _ = analyze("--analyze-only")
    assert without["learning_reading"]["GRPO (omega=0)"]["seeds"].keys() == {"1"}

    after, summary, out = analyze("--analyze-only", "--rows-from", str(earlier))
    assert "rows from " in out and ": GRPO (omega=0) seed 0" in out
    assert after == before  # every run's rows as they were, the lost run's from the earlier CSV
    assert summary["decision"] == summary_before["decision"] == (
        "undecided: neither method is above the other on every seed (2)")
    assert summary["learning_reading"] == summary_before["learning_reading"]
    assert summary["eval"] == summary_before["eval"]  # the per-seed figures in the order of the seeds
    assert summary["eval"]["success_rate"]["GiGPO against GRPO (omega=0)"]["final_per_seed"]["GRPO (omega=0)"] == [
        pytest.approx(0.4), pytest.approx(0.7)]
    assert summary["held_out_panels"]["tasks_not_recorded"] == ["GRPO (omega=0) seed 0"]

    monkeypatch.setattr(sys, "argv", ["learning.py", "--output", str(tmp_path), "--rows-from", str(earlier)])
    with pytest.raises(SystemExit):
        learning.main()
    assert "--rows-from completes an analysis of runs whose records are gone" in capsys.readouterr().err


def test_an_entropy_source_without_an_entropy_column_is_refused_by_name(tmp_path):
    from research.analysis import earlier_entropy

    curves = tmp_path / "summary.csv"
    curves.write_text("method,seed,mode,step,success_rate\nGiGPO,0,train,0,0.5\n")
    with pytest.raises(ValueError, match="summary.csv is not a learning_curves.csv with an entropy column"):
        earlier_entropy(curves)


def test_the_trap_reading_is_the_pre_registered_rule():
    from research.analysis import trap_reading

    rows = []
    for seed in range(5):  # the control: entropy halves, one side won, loops stay; seed 4 keeps its entropy
        rows += trap_rows("history 0", seed, (0.6, 0.1 if seed < 4 else 0.5), (0.3, 1.0), (0.3, 0.0), (0.6, 0.6))
        # escapes on every seed but seed 2, where the east side is still lost
        rows += trap_rows("history 2", seed, (0.6, 0.3), (0.3, 0.9), (0.3, 0.1 if seed == 2 else 0.5), (0.6, 0.3))
        rows += trap_rows("recipe", seed, (0.6, 0.5), (0.3, 0.8), (0.3, 0.6), (0.6, 0.2))
    rows.append({"method": "recipe", "seed": 0, "mode": "eval", "step": 40, "success_rate": 0.75})
    reading = trap_reading(rows, ["history 0", "history 2", "recipe"], "history 0")

    assert reading["control"] == "history 0: trap shown on 4 of 5 seeds"
    assert reading["arms"]["history 2"] == "does not escape: balanced success >= 0.6 on 4 of 5 seeds"
    assert reading["arms"]["recipe"] == "escapes: balanced success >= 0.6 on 5 of 5 seeds"
    seed0 = reading["per_seed"]["recipe"]["0"]
    assert seed0["balanced_success"] == pytest.approx((0.3, 0.7)) and seed0["held_out_last"] == 0.75
    assert reading["balanced_by_treasure_side"] and seed0["revisit_share"] == pytest.approx((0.6, 0.2))

    # The thresholds as written before the run: entropy down to 0.55 of its start is a fall (at most 0.6), balanced
    # success 0.55 is at the ceiling (at most 0.5 + 0.05), an arm at 0.61 on every seed escapes (at least 0.6).
    edge = [row for seed in range(5) for row in trap_rows("c", seed, (1.0, 0.55), (0.3, 1.0), (0.3, 0.1), (0.6, 0.5))]
    edge += [row for seed in range(5) for row in trap_rows("a", seed, (1.0, 0.9), (0.3, 0.62), (0.3, 0.6), (0.6, 0.3))]
    edge_reading = trap_reading(edge, ["c", "a"], "c")
    assert edge_reading["control"] == "c: trap shown on 5 of 5 seeds"
    assert edge_reading["arms"]["a"].startswith("escapes")

    # One more seed that keeps its entropy: 4 of 6 is under the 80% the rule asks for.
    rows += trap_rows("history 0", 5, (0.6, 0.5), (0.3, 1.0), (0.3, 0.0), (0.6, 0.6))
    assert trap_reading(rows, ["history 0"], "history 0")["control"] == "history 0: trap not shown on 4 of 6 seeds"
    # Steps that stop looping (the memory policy's revisit share is 0.29) do not show the trap.
    for row in rows:
        row["revisit_share"] = 0.3
    assert trap_reading(rows, ["history 0"], "history 0")["control"] == "history 0: trap not shown on 0 of 6 seeds"


def test_an_arm_learns_when_every_seed_ends_at_twice_its_start_and_twenty_points_above_it():
    from research.analysis import learning_reading

    def rows(method, evaluations):
        return [{"method": method, "seed": seed, "mode": "eval", "step": step, "success_rate": value}
                for seed, by_step in enumerate(evaluations) for step, value in by_step.items()]

    every_seed = rows("GiGPO", [{0: 0.10, 3: 0.20, 6: 0.30}, {0: 0.10, 6: 0.50}])
    doubled_not_twenty = rows("GRPO (omega=0)", [{0: 0.10, 6: 0.30}, {0: 0.05, 6: 0.15}])  # seed 1: x3, +10 points
    twenty_not_doubled = rows("high start", [{0: 0.30, 6: 0.55}])  # +25 points, short of 0.60

    reading = learning_reading([*every_seed, *doubled_not_twenty, *twenty_not_doubled],
                               ["GiGPO", "GRPO (omega=0)", "high start"])

    assert reading["GiGPO"]["verdict"] == "learns on every seed (2)"
    assert reading["GiGPO"]["seeds"][0] == {"before": 0.10, "final": 0.30, "final_step": 6, "learns": True}
    assert reading["GRPO (omega=0)"]["verdict"] == "does not learn: the rule fails on seed(s) 1 of 2"
    assert reading["high start"]["seeds"][0]["learns"] is False
    unreadable = learning_reading(rows("GiGPO", [{3: 0.5, 6: 0.6}]), ["GiGPO"])  # no evaluation before training
    assert unreadable["GiGPO"]["verdict"].startswith("not readable")


def test_the_shared_evaluation_before_training_is_every_run_s_step_0(tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    write_run(tmp_path / "base", {0: 0.1}, {})
    for seed in (0, 1):  # the runs evaluated after training only (evaluate_before_training false)
        write_run(tmp_path / f"gigpo-seed{seed}", {2: 0.5}, {})
        write_run(tmp_path / f"grpo-seed{seed}", {2: 0.2 + 0.2 * seed}, {2: ["seed 1000001"]} if seed else {})
    command = [sys.executable, str(root / "research" / "learning.py"), "--analyze-only", "--seeds", "0", "1", "--output",
               str(tmp_path)]

    subprocess.run(command, check=True, capture_output=True, cwd=root)
    summary = json.loads((tmp_path / "summary.json").read_text())

    reading = summary["learning_reading"]
    assert reading["GiGPO"]["verdict"] == "learns on every seed (2)"
    assert reading["GRPO (omega=0)"]["seeds"]["1"] == {"before": 0.1, "final": 0.4, "final_step": 2, "learns": True}
    assert reading["GRPO (omega=0)"]["verdict"] == "does not learn: the rule fails on seed(s) 0 of 2"
    curves = list(csv.DictReader((tmp_path / "learning_curves.csv").open()))
    starts = {(row["method"], row["seed"]) for row in curves if row["mode"] == "eval" and row["step"] == "0"}
    assert starts == {(method, str(seed)) for method in ("GiGPO", "GRPO (omega=0)") for seed in (0, 1)}
    # The base panel counts as each run's step 0: GRPO seed 1's last evaluation lacks a task, its first does not.
    assert summary["held_out_panels"]["differences"] == ("the held-out panels differ: GRPO (omega=0) seed 1 at step 2 "
                                                         "played 2 of the 3 tasks (not: seed 1000001)")


def test_step_credit_reading_is_setting_h_s_pre_registered_rule():
    from research.analysis import step_credit_reading

    def rows(finals_first, finals_second):
        return [{"method": method, "seed": seed, "mode": "eval", "step": step, "success_rate": value}
                for method, finals in (("GiGPO", finals_first), ("GRPO (omega=0)", finals_second))
                for seed, final in enumerate(finals) for step, value in ((0, 0.2), (5, 0.3), (10, final))]

    every_seed = step_credit_reading(rows([0.5, 0.6, 0.45, 0.7, 0.5], [0.4, 0.5, 0.425, 0.6, 0.45]), 40)
    assert every_seed["verdict"] == "GiGPO beats GRPO (omega=0): above on every seed (5)"
    assert every_seed["final"]["GRPO (omega=0)"] == [0.4, 0.5, 0.425, 0.6, 0.45]
    # one seed reversed by one panel task (0.025 of 40), the mean far above twice its standard error
    by_mean = step_credit_reading(rows([0.7, 0.8, 0.475, 0.9, 0.8], [0.4, 0.5, 0.5, 0.6, 0.5]), 40)
    assert by_mean["verdict"].startswith("GiGPO beats GRPO (omega=0): mean difference +0.235 above twice")
    assert by_mean["difference_standard_error"] == pytest.approx(np.std([0.3, 0.3, -0.025, 0.3, 0.3], ddof=1) / 5 ** 0.5)
    reversed_by_two = step_credit_reading(rows([0.7, 0.8, 0.45, 0.9, 0.8], [0.4, 0.5, 0.5, 0.6, 0.5]), 40)
    assert reversed_by_two["verdict"] == "neither beats the other"
    other_way = step_credit_reading(rows([0.4, 0.5, 0.425], [0.5, 0.6, 0.45]), 40)
    assert other_way["verdict"] == "GRPO (omega=0) beats GiGPO: above on every seed (3)"
    noisy = step_credit_reading(rows([0.6, 0.3, 0.5], [0.4, 0.5, 0.45]), 40)  # +0.2, -0.2, +0.05: not beyond 2 SE
    assert noisy["verdict"] == "neither beats the other"
    assert step_credit_reading(rows([0.6], [0.4]), 40)["verdict"].startswith("not readable")



def test_an_evaluation_played_in_batches_is_one_row_with_the_whole_panels_success(tmp_path):
    # setting I's panel of 120 episodes is played in 4 batches of 30, each writing an iteration record: the curves
    # must read the panel (the evaluation record), not the last batch
    from gigpo_trl.records import evaluation_record, iteration_record, write_evaluation, write_records
    from research.analysis import curves

    run = tmp_path / "gigpo-seed0"
    parts = [(np.array([2, 2]), np.zeros(2), np.zeros(2))]

    def metrics(success: float, length: float) -> dict[str, float]:
        return {"env/success_rate": success, "env/return_mean": success, "env/episode_length_mean": length,
                "gigpo/singleton_share": 0.0, "gigpo/step_group_size_mean": 2.0, "timing/rollout_s": length,
                "timing/advantages_s": 0.0}

    write_records(run, iteration_record(0, "train", 0, metrics(0.5, 5.0), parts, episodes=4), [])
    for rollout, (success, length) in enumerate([(1.0, 4.0), (0.5, 6.0)]):  # 3 episodes, then 2
        write_records(run, iteration_record(1, "eval", rollout, metrics(success, length), parts, episodes=4), [])
    write_evaluation(run, evaluation_record(1, metrics(0.8, 4.8), PANEL, {}))
    (tmp_path / "gigpo-seed0.log").write_text("")

    rows = curves({("GiGPO", 0): run}, {("GiGPO", 0): []}, {("GiGPO", 0): {}}, {}, {"env_name": "compass"})
    evaluations = [row for row in rows if row["mode"] == "eval"]
    assert len(evaluations) == 1 and evaluations[0]["step"] == 1
    assert (evaluations[0]["success_rate"], evaluations[0]["episode_length"]) == (0.8, 4.8)  # the panel's
    assert evaluations[0]["rollout_s"] == 5.0  # the batches' mean
    assert [row["mode"] for row in rows] == ["train", "eval"]


def test_setting_i_reads_the_sampled_panel_with_its_resolution_as_the_reversal_tolerance_and_the_curve_mean():
    from research.analysis import curve_mean_rows, panel_resolution, step_credit_reading

    assert panel_resolution(40) == pytest.approx(0.025)  # greedy: one task of 40, setting H's
    assert panel_resolution(40, 4, greedy=False) == pytest.approx(0.5 / 160 ** 0.5)  # 0.0395

    def rows(finals_first, finals_second, halfway=0.3):
        return [{"method": method, "seed": seed, "mode": "eval", "step": step, "success_rate": value}
                for method, finals in (("GiGPO", finals_first), ("GRPO (omega=0)", finals_second))
                for seed, final in enumerate(finals) for step, value in ((0, 0.2), (5, halfway), (10, final))]

    # one seed reversed by 0.035: beyond one task of 40 (0.025), within the sampled panel's resolution (0.0395)
    finals = [0.7, 0.8, 0.465, 0.9, 0.8], [0.4, 0.5, 0.5, 0.6, 0.5]
    assert step_credit_reading(rows(*finals), 40)["verdict"] == "neither beats the other"
    sampled = step_credit_reading(rows(*finals), 40, tolerance=panel_resolution(40, 4, greedy=False))
    assert sampled["verdict"].startswith("GiGPO beats GRPO (omega=0): mean difference")
    assert sampled["verdict"].endswith("no seed reversed by more than the panel's resolution (0.040)")
    # the curve's mean: the evaluations after step 0 (the base's, shared, left out)
    means = {(row["method"], row["seed"]): row["success_rate"] for row in curve_mean_rows(rows(*finals))}
    assert means["GiGPO", 0] == pytest.approx((0.3 + 0.7) / 2) and means["GRPO (omega=0)", 2] == pytest.approx(0.4)
    assert step_credit_reading(curve_mean_rows(rows(*finals)), 40)["final"]["GiGPO"] == pytest.approx(
        [0.5, 0.55, 0.3825, 0.6, 0.55])

def test_the_shortest_move_advantages_compare_the_steps_taken_from_one_state():
    from research.analysis import shortest_move_advantages, shortest_moves, won_decisions

    def step(observation, action, advantage, episode_term):
        return {"observation": observation, "action": action, "advantage": advantage,
                "episode_advantage": episode_term, "step_advantage": advantage - episode_term}

    start, later = "Go north twice and east once.", "The exit is 1 room east."
    trajectories = {
        "train-00000": [
            {"seed": 7, "length": 3, "won": True, "steps": [step(start, "go north", 1.0, 0.5), step(start, "go east", 0.8, 0.5),
                                                            step(later, "go east", 1.0, 0.5)]},
            {"seed": 7, "length": 2, "won": False, "steps": [step(start, "go south", -1.0, -0.5),
                                                             step(later, "<action>go", -0.6, -0.5)]},
            {"seed": 8, "length": 1, "won": False, "steps": [step(start, "wait", -2.0, -1.0)]},  # another task: no pair
        ],
        "eval-00000": [{"seed": 1, "length": 4, "won": True, "steps": []}, {"seed": 2, "length": 6, "won": True, "steps": []},
                       {"seed": 3, "length": 8, "won": False, "steps": []}],
        "eval-00001": [{"seed": 1, "length": 8, "won": False, "steps": []}],
    }

    steps = shortest_moves(trajectories)
    assert [shortest for _, shortest, _ in steps] == [True, True, True, False, False, False]
    reading = shortest_move_advantages(steps)
    # state (0, 7, start): 0.9 - (-1.0) = 1.9; state (0, 7, later): 1.0 - (-0.6) = 1.6
    assert reading["gap"] == pytest.approx(1.75) and reading["states"] == 2 and reading["steps"] == 5
    assert reading["episode_term_gap"] == pytest.approx(1.0) and reading["step_term_gap"] == pytest.approx(0.75)
    advantages = [1.0, 0.8, 1.0, -1.0, -0.6, -2.0]
    assert reading["gap_in_std"] == pytest.approx(1.75 / np.std(advantages)) and reading["shortest_share"] == 0.5
    assert shortest_move_advantages(steps[:3]) is None
    decisions = won_decisions(trajectories)
    assert decisions["eval-00000"] == 5.0 and np.isnan(decisions["eval-00001"])


def test_the_entropy_of_a_resumed_run_drops_the_updates_its_checkpoint_did_not_hold(tmp_path):
    from research.analysis import logged_entropy

    log = tmp_path / "gigpo-seed0.log"
    log.write_text("python recipes/train_gigpo.py ...\n"
                   + "".join(f"{{'loss': 0.1, 'entropy': '{value}', 'epoch': 1.0}}\n" for value in (1.0, 2.0, 3.0))
                   + "# resumed from checkpoint-2\npython recipes/train_gigpo.py ... --resume_from_checkpoint x\n"
                   + "".join(f"{{'loss': 0.1, 'entropy': '{value}', 'epoch': 1.0}}\n" for value in (3.5, 4.0)))

    assert logged_entropy(log) == [1.0, 2.0, 3.5, 4.0]  # update 3 of the first part was played again
