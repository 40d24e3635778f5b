"""The benchmarks of bench/: the tabular policy gradient and the rooms labels the learning diagnostics rely on, the
iteration timing of bench_rollout, and cpu_precision's pass timings."""

from __future__ import annotations

import csv
import itertools
import json
import random
import re
from pathlib import Path

import numpy as np
import pytest

from bench.credit_tabular import TabularPolicy
from bench.learning import draught_action, draught_move
from gigpo_trl.envs import make_env


def mean_weighted_log_probability(policy: TabularPolicy, observations, actions, advantages) -> float:
    return float(np.mean([a * np.log(policy.probabilities(o)[k]) for o, k, a in zip(observations, actions, advantages)]))


OBSERVATIONS, ACTIONS, ADVANTAGES = ["a", "b", "a", "a"], [0, 2, 1, 0], np.array([0.7, -1.2, 0.3, -0.4])


def random_policy(optimizer: str, learning_rate: float) -> TabularPolicy:
    policy = TabularPolicy(3, optimizer, learning_rate)
    rng = np.random.default_rng(0)
    policy.logits = {"a": rng.normal(size=3), "b": rng.normal(size=3), "unseen in the batch": rng.normal(size=3)}
    return policy


def test_tabular_sgd_update_is_a_gradient_step_on_the_policy_gradient_objective():
    policy = random_policy("sgd", learning_rate=0.5)
    observations, actions, advantages = OBSERVATIONS, ACTIONS, ADVANTAGES

    numeric = {}
    for observation in policy.logits:
        numeric[observation] = np.zeros(3)
        for k in range(3):
            for sign in (1, -1):
                policy.logits[observation][k] += sign * 1e-6
                numeric[observation][k] += sign * mean_weighted_log_probability(policy, observations, actions, advantages) / 2e-6
                policy.logits[observation][k] -= sign * 1e-6
    before = {o: logits.copy() for o, logits in policy.logits.items()}
    policy.update(observations, actions, advantages)

    for observation in before:
        np.testing.assert_allclose(policy.logits[observation] - before[observation], 0.5 * numeric[observation], atol=1e-7)


def test_tabular_adam_first_step_moves_every_gradient_entry_by_the_learning_rate():
    policy = random_policy("adam", learning_rate=0.01)
    gradient = policy.gradient(OBSERVATIONS, ACTIONS, ADVANTAGES)
    before = {o: logits.copy() for o, logits in policy.logits.items()}
    policy.update(OBSERVATIONS, ACTIONS, ADVANTAGES)

    for observation in ("a", "b"):  # bias-corrected Adam's first step is lr * g / |g|
        np.testing.assert_allclose(policy.logits[observation] - before[observation], 0.01 * np.sign(gradient[observation]), rtol=1e-6)
    np.testing.assert_array_equal(policy.logits["unseen in the batch"], before["unseen in the batch"])


def test_tabular_policy_rejects_an_unknown_optimizer():
    with pytest.raises(ValueError, match="optimizer must be 'sgd' or 'adam', got 'rmsprop'"):
        TabularPolicy(2, "rmsprop")


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


@pytest.mark.timeout(300)
def test_iteration_timing_splits_each_iteration_into_its_parts(tiny_model_path):
    from bench.bench_rollout import bench_iterations

    smoke = Path(__file__).resolve().parent.parent / "recipes" / "configs" / "smoke_cpu.yaml"
    rows = bench_iterations(str(smoke), 2, tiny_model_path)

    assert len(rows) == 2
    for row in rows:
        assert set(row["parts_s"]) == {"generation", "environments", "rollout loop", "advantages", "update"}
        assert all(seconds >= 0 for seconds in row["parts_s"].values()) and row["parts_s"]["update"] > 0
        assert row["seconds"] == pytest.approx(sum(row["parts_s"].values()))
        assert row["step_samples"] > 0 and row["generated_tokens_per_s"] > 0


def test_the_median_iteration_takes_each_figure_over_iterations_separately():
    from bench.bench_rollout import median_iteration

    parts = ["generation", "environments", "rollout loop", "advantages", "update"]
    rows = [{"seconds": total, "step_samples": samples, "generated_tokens_per_s": tokens, "parts_s": dict(zip(parts, split))}
            for total, samples, tokens, split in [(10.0, 20, 5.0, (4, 0, 0, 0, 6)), (30.0, 30, 9.0, (9, 1, 0, 0, 20)),
                                                   (20.0, 10, 7.0, (5, 0, 1, 0, 14))]]
    median = median_iteration(rows)

    assert median["seconds"] == 20.0 and median["generated_tokens_per_s"] == 7.0
    assert median["step_samples_per_s"] == 1.0  # of 2.0, 1.0 and 0.5 per second: not 20 samples / 20 s
    assert median["parts_s"] == {"generation": 5, "environments": 0, "rollout loop": 0, "advantages": 0, "update": 14}


@pytest.mark.timeout(300)
def test_configs_are_timed_side_by_side_in_one_run(tiny_model_path, tmp_path, capsys):
    import yaml

    from bench.bench_rollout import compare_iterations

    smoke = Path(__file__).resolve().parent.parent / "recipes" / "configs" / "smoke_cpu.yaml"
    shorter = tmp_path / "shorter_answers.yaml"
    shorter.write_text(yaml.safe_dump(yaml.safe_load(smoke.read_text()) | {"max_completion_length": 4}))
    medians = compare_iterations([str(smoke), str(shorter)], 1, tiny_model_path)

    assert list(medians) == [str(smoke), str(shorter)]
    assert all(median["seconds"] > 0 and median["step_samples_per_s"] > 0 for median in medians.values())
    side_by_side = capsys.readouterr().out.split("Median iteration, side by side:")[1]
    assert str(smoke) in side_by_side and str(shorter) in side_by_side


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("recipe_arguments", "signal"), [
    # Sokoban, by advantages: in these rollouts the copies' returns are equal (3 step penalties) but not their off-format
    # answers, so the invalid-answer penalty gives every group a signal
    (["--dynamic_sampling_signal", "advantages"], True),
    (["--env_name", "rooms", "--max_env_steps", "3", "--invalid_action_penalty", "0"], False),  # no treasure in reach
], ids=["every-group-with-a-signal", "no-group-with-a-signal"])
def test_dynamic_sampling_is_measured_with_and_without_on_the_same_first_tasks(tiny_model_path, tmp_path,
                                                                                 recipe_arguments, signal):
    from bench.bench_rollout import main

    smoke = Path(__file__).resolve().parent.parent / "recipes" / "configs" / "smoke_cpu.yaml"  # 2 tasks x 2 copies
    output = tmp_path / "dynamic_sampling.json"
    main(["--dynamic-sampling", str(smoke), "--max-rounds", "1", "--num-iterations", "2", "--model", tiny_model_path,
          "--output", str(output), *recipe_arguments])

    figures = json.loads(output.read_text())
    rows = figures["rows"]
    assert [(row["iteration"], row["arm"]) for row in rows] == [(0, "without"), (0, "with"), (1, "with"), (1, "without")]
    for k in (0, 1):
        without, with_ = ({row["arm"]: row for row in rows if row["iteration"] == k}[arm] for arm in ("without", "with"))
        assert with_["first_round_seeds"] == without["first_round_seeds"] and len(without["first_round_seeds"]) == 2
        assert without["extra_rounds"] == 0 and without["groups_rolled"] == without["groups_kept"] == 2
        assert without["update_samples"] == without["step_samples"]  # without it every sample is in the update
        assert with_["groups_rolled"] == 2 * (1 + with_["extra_rounds"])
        assert with_["groups_kept"] == min(2, with_["groups_with_signal"])
        assert with_["groups_dropped"] == with_["groups_rolled"] - with_["groups_with_signal"]
        assert with_["nonzero_samples"] >= with_["groups_kept"]  # a kept group has a sample with a nonzero advantage
        assert with_["update_groups_with_signal"] == with_["groups_kept"]
        assert without["update_groups_with_signal"] == without["groups_with_signal"]
        if signal:
            assert with_["extra_rounds"] == 0 and without["groups_with_signal"] == 2
        else:  # every round's groups dropped, up to the limit; nothing to train on
            assert with_["extra_rounds"] == 1 and with_["groups_dropped"] == 4 and with_["update_samples"] == 0
            assert without["nonzero_samples"] == 0 and without["update_samples"] == 2 * 2 * 3
        for row in (without, with_):
            assert 0 <= row["nonzero_samples"] <= row["update_samples"] <= row["step_samples"]
            assert row["rollout_s"] >= row["extra_rollout_s"] >= 0 and (row["extra_rollout_s"] > 0) == (row["extra_rounds"] > 0)
    for arm, summary in figures["arms"].items():
        of_arm = [row for row in rows if row["arm"] == arm]
        assert summary["nonzero_advantage_share"] == pytest.approx(
            sum(row["nonzero_samples"] for row in of_arm) / max(sum(row["update_samples"] for row in of_arm), 1))
        assert summary["groups_rolled"] == sum(row["groups_rolled"] for row in of_arm)


@pytest.mark.timeout(300)
def test_reward_std_filtering_is_measured_with_and_without_on_the_same_first_tasks(tiny_model_path, tmp_path):
    from bench.bench_rollout import main

    smoke = Path(__file__).resolve().parent.parent / "recipes" / "configs" / "smoke_cpu.yaml"  # 2 tasks x 2 copies
    output = tmp_path / "std_filter.json"
    main(["--dynamic-sampling", str(smoke), "--max-rounds", "0", "--reward-std-filter-ratio", "0.5",
          "--num-iterations", "2", "--model", tiny_model_path, "--output", str(output)])

    figures = json.loads(output.read_text())
    assert figures["reward_std_filter_ratio"] == 0.5 and figures["max_rounds"] == 0
    for k in (0, 1):
        without, with_ = ({row["arm"]: row for row in figures["rows"] if row["iteration"] == k}[arm]
                          for arm in ("without", "with"))
        assert with_["first_round_seeds"] == without["first_round_seeds"]
        assert without["groups_kept"] == 2 and without["groups_dropped"] == 0 and "std_threshold" not in without
        assert without["update_samples"] == without["step_samples"]
        # ceil(0.5 x 2) = 1 of the 2 groups, no extra round; the kept one has the larger std
        assert (with_["groups_rolled"], with_["groups_kept"], with_["groups_dropped"],
                with_["extra_rounds"]) == (2, 1, 1, 0)
        assert with_["kept_std_mean"] == with_["std_threshold"] >= with_["dropped_std_mean"]
        assert with_["update_groups_with_signal"] == (with_["std_threshold"] > 0)
        assert 0 < with_["update_samples"] < with_["step_samples"]
    assert figures["arms"]["with"]["groups_kept"] == 2 and "std_threshold_mean" in figures["arms"]["with"]
    assert "std_threshold_mean" not in figures["arms"]["without"]


@pytest.mark.parametrize("arguments", [["--max-rounds", "0"], ["--num-iterations", "0"]])
def test_the_dynamic_sampling_bench_refuses_a_run_that_measures_nothing(arguments, capsys):
    from bench.bench_rollout import main

    with pytest.raises(SystemExit):
        main(["--dynamic-sampling", "config.yaml", *arguments])
    assert "--max-rounds and --num-iterations must be >= 1" in capsys.readouterr().err


def test_recipe_arguments_are_refused_outside_the_dynamic_sampling_bench(capsys):
    from bench.bench_rollout import main

    with pytest.raises(SystemExit):
        main(["--iterations", "config.yaml", "--use_cpu", "true"])
    assert "unrecognized arguments: --use_cpu true" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_comparison_runs_six_processes_at_once_and_reports_the_pre_registered_decision(tiny_model_path, tmp_path):
    import json
    import shutil
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    command = [sys.executable, str(root / "bench" / "learning.py"), "--parallel", "--config",
               str(root / "recipes" / "configs" / "learning_rooms_cpu.yaml"), "--model", tiny_model_path, "--output",
               str(tmp_path), "--max_steps", "2", "--num_eval_tasks", "4", "--per_device_eval_batch_size", "4",
               "--eval_steps", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=root)

    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary["wall_seconds"]) == 6 and summary["decision"].startswith(("decided", "undecided"))
    rows = (tmp_path / "learning_curves.csv").read_text().splitlines()[1:]
    assert {(row.split(",")[0], row.split(",")[1]) for row in rows} == {
        (method, str(seed)) for method in ("GiGPO", "GRPO (omega=0)") for seed in range(3)}
    assert (tmp_path / "learning_curves.png").is_file()
    # --analyze-only compares what the runs have written so far: here one run has no records (not started).
    shutil.rmtree(tmp_path / "gigpo-seed2" / "gigpo")
    subprocess.run([*command[:2], "--analyze-only", "--output", str(tmp_path)], check=True, capture_output=True, cwd=root)
    rows = (tmp_path / "learning_curves.csv").read_text().splitlines()[1:]
    assert len({(row.split(",")[0], row.split(",")[1]) for row in rows}) == 5


def test_the_decision_is_the_pre_registered_criterion():
    from bench.learning import decision

    def rows(gigpo, grpo):
        return [{"method": method, "seed": seed, "mode": "eval", "step": step, "success_rate": value}
                for method, finals in (("GiGPO", gigpo), ("GRPO (omega=0)", grpo))
                for seed, value in enumerate(finals) for step, value in ((0, 0.1), (100, value))]

    assert decision(rows([0.6, 0.5, 0.7], [0.4, 0.4, 0.6])) == "decided: GiGPO above GRPO (omega=0) on every seed (3)"
    assert decision(rows([0.3, 0.3, 0.3], [0.4, 0.5, 0.6])).startswith("decided: GRPO (omega=0) above GiGPO")
    assert decision(rows([0.6, 0.4, 0.7], [0.4, 0.4, 0.6])).startswith("undecided")  # a tie on one seed


PANEL = ["seed 1000000", "seed 1000001", "seed 1000002"]


def write_run(directory: Path, eval_success: dict[int, float], unplayed: dict[int, list[str]]) -> None:
    """The records of a run as GiGPOTrainer writes them (through gigpo_trl.records): training rollouts at steps 0-1,
    evaluations of the 3-task PANEL at the steps of `eval_success`, those of `unplayed` without some tasks."""
    from gigpo_trl.records import iteration_record, write_evaluation, write_records

    parts = [(np.array([2, 2]), np.zeros(2), np.zeros(2))]

    def metrics(success: float) -> dict[str, float]:
        return {"env/success_rate": success, "env/return_mean": success, "env/episode_length_mean": 5.0,
                "gigpo/singleton_share": 0.0, "gigpo/step_group_size_mean": 2.0, "timing/rollout_s": 1.0,
                "timing/advantages_s": 0.0}

    for step in (0, 1):
        write_records(directory, iteration_record(step, "train", step, metrics(0.5), parts), [])
    for rollout, (step, success) in enumerate(eval_success.items()):
        write_records(directory, iteration_record(step, "eval", rollout, metrics(success), parts), [])
        missing = unplayed.get(step, [])
        write_evaluation(directory, step, metrics(success), [task for task in PANEL if task not in missing],
                         {task: "environment raised OSError: no port (the reset failed all 3 attempts)" for task in missing})
    (directory.parent / f"{directory.name}.log").write_text("")


def test_the_comparison_refuses_held_out_figures_of_runs_whose_panels_differ_unless_allowed(tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    for seed in (0, 1):  # GiGPO above GRPO on both seeds, but GRPO seed 1's last evaluation could not play a task
        write_run(tmp_path / f"gigpo-seed{seed}", {0: 0.2, 2: 0.6}, {})
        write_run(tmp_path / f"grpo-seed{seed}", {0: 0.2, 2: 0.5}, {2: ["seed 1000001"]} if seed else {})
    command = [sys.executable, str(root / "bench" / "learning.py"), "--analyze-only", "--seeds", "0", "1", "--output",
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
    from bench.learning import decision, held_out_panels, panel_differences

    runs = {("GiGPO", 0): tmp_path / "gigpo-seed0", ("GRPO (omega=0)", 0): tmp_path / "grpo-seed0"}
    write_run(tmp_path / "early" / "grpo-seed0", {0: 0.2, 2: 0.5}, {0: ["seed 1000002"]})
    panels = held_out_panels(runs | {("GRPO (omega=0)", 0): tmp_path / "early" / "grpo-seed0"})
    rows = [{"method": method, "seed": 0, "mode": "eval", "step": 2, "success_rate": value}
            for method, value in (("GiGPO", 0.6), ("GRPO (omega=0)", 0.5))]
    assert decision(rows, panels=panels).startswith("decided: GiGPO above")
    assert panel_differences(panels, ("GiGPO", "GRPO (omega=0)")) == (
        "the held-out panels differ: GRPO (omega=0) seed 0 at step 0 played 2 of the 3 tasks (not: seed 1000002)")


def test_runs_stopped_at_a_fixed_time_are_compared_at_the_last_evaluation_every_run_reached(tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    # GRPO seed 1 was stopped before its evaluation at step 4; at step 2 GiGPO is above on both seeds, at 4 it is not.
    for seed in (0, 1):
        write_run(tmp_path / f"gigpo-seed{seed}", {0: 0.2, 2: 0.6, 4: 0.1}, {})
        write_run(tmp_path / f"grpo-seed{seed}", {0: 0.2, 2: 0.5} if seed else {0: 0.2, 2: 0.5, 4: 0.7}, {})
    command = [sys.executable, str(root / "bench" / "learning.py"), "--analyze-only", "--seeds", "0", "1", "--output",
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

    from bench.learning import cut_at_common_evaluation

    rows = [{"method": "GiGPO", "seed": 0, "mode": "train", "step": 1}]
    with pytest.raises(ValueError, match="GiGPO seed 0 evaluated nothing"):
        cut_at_common_evaluation(rows)


def test_runs_started_at_once_get_ports_of_their_own_unless_the_user_set_one(monkeypatch):
    from bench.learning import run_environment

    monkeypatch.delenv("MASTER_PORT", raising=False)
    ports = {run_environment()["MASTER_PORT"] for _ in range(2)}  # ephemeral ports: equal about once in 28,000
    assert len(ports) == 2 and all(1024 < int(port) < 65536 for port in ports)
    monkeypatch.setenv("MASTER_PORT", "31337")
    assert run_environment()["MASTER_PORT"] == "31337"


def test_cpu_precision_kernels_time_every_pass_in_both_precisions(tiny_model_path, tmp_path):
    from bench.cpu_precision import main

    output = tmp_path / "kernels.json"
    result = main(["--kernels", "--repeats", "2", "--model", tiny_model_path, "--output", str(output)])

    assert set(result["kernel_seconds"]) == {"forward_backward_8x256", "generate_16x200_plus_12"}
    for by_precision in result["kernel_seconds"].values():
        assert set(by_precision) == {"fp32", "bf16"}
        assert all(len(seconds) == 2 and min(seconds) > 0 for seconds in by_precision.values())  # the warm-up not kept
    for name, ratio in result["bf16_over_fp32_median_time"].items():
        seconds = result["kernel_seconds"][name]
        assert ratio == pytest.approx(sum(seconds["bf16"]) / sum(seconds["fp32"]))  # the median of two is their mean
    assert json.loads(output.read_text()) == result and "avx512_bf16" in result["cpu"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_lambda_arm_runs_beside_gigpo_and_grpo_and_is_compared_with_both(tiny_model_path, tmp_path):
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    command = [sys.executable, str(root / "bench" / "learning.py"), "--step-lambda", "0.5", "--seeds", "0", "--config",
               str(root / "recipes" / "configs" / "learning_rooms_cpu.yaml"), "--model", tiny_model_path, "--output",
               str(tmp_path), "--max_steps", "2", "--num_eval_tasks", "4", "--per_device_eval_batch_size", "4",
               "--eval_steps", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=root)

    assert result.returncode == 0, result.stderr[-4000:]
    # Each run's recipe says which advantage it trains with.
    assert "A = A_E + 1 * A_S, step value lambda 0.5" in (tmp_path / "gigpo-lambda0.5-seed0.log").read_text()
    assert "A = A_E + 1 * A_S, step value lambda 1" in (tmp_path / "gigpo-seed0.log").read_text()
    assert "A = A_E + 0 * A_S, step value lambda 1" in (tmp_path / "grpo-seed0.log").read_text()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["methods"] == ["GiGPO", "GRPO (omega=0)", "GiGPO lambda 0.5"]
    assert set(summary["decisions"]) == {"GiGPO against GRPO (omega=0)", "GiGPO lambda 0.5 against GRPO (omega=0)",
                                         "GiGPO lambda 0.5 against GiGPO"}
    assert set(summary["first_step_at_train_success"]["GiGPO lambda 0.5"]) == {"0.5", "0.8"}
    # --analyze-only finds the third arm from its folder.
    subprocess.run([*command[:2], "--analyze-only", "--seeds", "0", "--output", str(tmp_path)], check=True,
                   capture_output=True, cwd=root)
    assert json.loads((tmp_path / "summary.json").read_text())["methods"] == summary["methods"]


def test_the_decision_of_any_two_methods_and_the_first_iterations_at_a_success_target():
    from bench.learning import decision, first_steps_at, methods, run_directory

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


def test_the_tabular_comparison_pairs_every_method_with_gigpo_seed_by_seed():
    from bench.credit_tabular import compare, paired_difference, per_seed_summary, table

    curves = {"GiGPO": [[0.0, 0.6, 0.6, 0.6, 0.6, 0.6]] * 2, "GRPO (omega=0)": [[0.0] * 6] * 2,
              "GiGPO lambda 0.5": [[1.0] * 6, [0.0, 0.6, 0.6, 0.6, 0.6, 0.6]]}
    summary = per_seed_summary(curves, 6, (0.5,))
    # Trailing means of 5 of GiGPO's curve: 0, 0.3, 0.4, 0.45, 0.48, 0.6: 0.5 first at iteration 5.
    assert summary["GiGPO"]["iterations_to_0.5"]["mean"] == 5.0
    never = {key: value for key, value in summary["GRPO (omega=0)"]["iterations_to_0.5"].items() if key != "minus GiGPO"}
    assert never == {"mean": 6.0, "std": 0.0, "median": 6.0, "min": 6.0, "max": 6.0, "never_reached": 2}
    paired = summary["GiGPO lambda 0.5"]["iterations_to_0.5"]["minus GiGPO"]
    assert paired["mean"] == -2.5 and paired["seeds_ahead"] == 1 and paired["seeds_equal"] == 1  # 0 - 5 and 5 - 5
    assert paired_difference(np.array([0.1, 0.1]), higher_is_better=True)["ci95"] == [pytest.approx(0.1)] * 2

    settings = {"env_name": "rooms", "env_kwargs": {"num_rooms": 9, "treasure": "west", "idle_actions": 2},
                "num_generations": 4, "per_device_train_batch_size": 8, "max_env_steps": 12, "gamma": 0.95,
                "advantage_norm": "mean_std", "episode_stats": "steps"}
    result = compare(settings, "adam", 0.03, seeds=2, iterations=4, lambdas=(0.5,))
    assert set(result["per_seed"]) == {"GiGPO", "GRPO (omega=0)", "GiGPO lambda 0.5"}
    assert "| GiGPO lambda 0.5 | " in table(result)


def test_the_loop_share_counts_the_steps_that_come_back_to_the_observation_of_two_steps_before():
    from bench.learning import two_step_loop_share

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

    from bench import learning
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


def test_an_entropy_source_without_an_entropy_column_is_refused_by_name(tmp_path):
    from bench.learning import earlier_entropy

    curves = tmp_path / "summary.csv"
    curves.write_text("method,seed,mode,step,success_rate\nGiGPO,0,train,0,0.5\n")
    with pytest.raises(ValueError, match="summary.csv is not a learning_curves.csv with an entropy column"):
        earlier_entropy(curves)


def test_the_update_memory_estimate_reproduces_the_h100_runs_and_refuses_the_plan_that_ran_out_of_memory():
    from bench.update_memory import BYTES_PER_TOKEN_LAYER_HIDDEN, pass_memory_gib, plan_fits, run_memory_gib

    smollm2 = dict(parameters=134_515_008, hidden_size=576, num_layers=30)  # the embedded SmolLM2-135M
    h100_gib = 79.2

    def per_run(rows: int) -> float:
        coefficient = BYTES_PER_TOKEN_LAYER_HIDDEN["cuda", "bf16"] * smollm2["hidden_size"]
        pass_gib = pass_memory_gib(coefficient, rows, 355, smollm2["num_layers"])  # setting D: 355 tokens at most
        return run_memory_gib(smollm2["parameters"], pass_gib=pass_gib, reference_model=False, total_gib=h100_gib,
                              vllm_share=None)

    assert 21 <= per_run(64) <= 25  # measured: one process peaked at about 23 GiB with 64 samples per pass
    with pytest.raises(SystemExit, match="the plan does not fit: 9 runs"):
        plan_fits(9 * per_run(64), h100_gib, "9 runs")  # setting D as designed: all 9 died of CUDA out of memory
    plan_fits(4 * per_run(16), h100_gib, "4 runs")  # as run: 3-4 runs at 16 per pass took 26-36 GiB in all
    assert 4 * per_run(16) <= 36
    # vLLM colocate's share counts once per run: 4 runs at TRL's default 0.3 of the GPU cannot share it.
    with_vllm = run_memory_gib(smollm2["parameters"], pass_gib=1.0, reference_model=False, total_gib=h100_gib,
                               vllm_share=0.3)
    with pytest.raises(SystemExit, match="lower vllm_gpu_memory_utilization"):
        plan_fits(4 * with_vllm, h100_gib, "4 runs with vLLM")


def test_an_arms_file_names_any_arms_and_its_control(tmp_path):
    from bench.learning import read_arms, recipe_value, run_directory

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


def trap_rows(method: str, seed: int, entropy: tuple[float, float], west: tuple[float, float],
              east: tuple[float, float], revisits: tuple[float, float]) -> list[dict]:
    """40 training updates of one run: the first 20 at the first values, the last 20 at the second."""
    return [{"method": method, "seed": seed, "mode": "train", "step": step, "success_rate": (w + e) / 2,
             "entropy": h, "success_treasure_west": w, "success_treasure_east": e, "revisit_share": r}
            for step in range(40) for h, w, e, r in [tuple(pair[step >= 20] for pair in (entropy, west, east, revisits))]]


def test_the_trap_reading_is_the_pre_registered_rule():
    from bench.learning import trap_reading

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


def test_the_memory_label_keeps_the_last_move_and_turns_at_the_walls_and_wins_every_task():
    from bench.learning import memory_action

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

    from bench.learning import state_prompts

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


def test_the_memoryless_success_is_exact_and_no_memoryless_policy_found_wins_more_than_half():
    from bench.memoryless_rooms import best_memoryless, memoryless_success

    # 3 rooms, 3 steps, uniform: half win at once; the others reach the far end, come back (1/4) and go on (1/8).
    assert memoryless_success(np.full(3, 0.5), 3) == pytest.approx(0.5 + 0.5 * 0.5 * 0.5)
    assert memoryless_success(np.ones(9), 14) == 0.5  # always west: exactly the west tasks
    assert memoryless_success(np.full(9, 0.5), 14) == pytest.approx(0.30188, abs=1e-5)
    best, policy = best_memoryless(9, 14, restarts=2)
    assert 0.5 <= best < 0.51 and len(policy) == 9


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_named_arms_run_two_at_a_time_and_are_read_again_from_their_output(tiny_model_path, tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    arms = tmp_path / "arms.yaml"
    arms.write_text("arms:\n  no history: [--history_length, 0]\n  history 2, T=1: [--history_length, 2, --temperature, 1.0]\n"
                    "control: no history\n")
    output = tmp_path / "out"
    command = [sys.executable, str(root / "bench" / "learning.py"), "--arms", str(arms), "--jobs", "2", "--seeds", "0",
               "--config", str(root / "recipes" / "configs" / "learning_trap_cpu.yaml"), "--model", tiny_model_path,
               "--output", str(output), "--max_steps", "2", "--num_eval_tasks", "4", "--per_device_eval_batch_size", "4",
               "--eval_steps", "1"]
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


@pytest.mark.timeout(600)
def test_the_screen_plays_each_candidate_at_each_temperature_and_times_a_training_iteration(tiny_model_path, tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    candidates = tmp_path / "candidates.yaml"
    candidates.write_text("arms:\n  two steps: [--max_env_steps, 2]\n  four steps: [--max_env_steps, 4]\n")
    output = tmp_path / "screen"
    command = [sys.executable, str(root / "bench" / "learning.py"), "--screen",
               str(root / "bench" / "screen_configs" / "rooms9.yaml"), "--arms", str(candidates), "--model",
               tiny_model_path, "--screen-tasks", "4", "2", "2", "--screen-temperatures", "0.6", "1.0",
               "--screen-update", "--output", str(output), "--per_device_train_batch_size", "2",
               "--steps_per_generation", "2", "--gradient_accumulation_steps", "2", "--num_generations", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=root)

    assert result.returncode == 0, result.stderr[-4000:]
    screened = json.loads((output / "screen.json").read_text())
    assert [candidate["candidate"] for candidate in screened] == ["two steps", "four steps"]
    for candidate, limit in zip(screened, (2, 4)):
        assert candidate["held_out_tasks"] == 4 and 0 <= candidate["held_out_success"] <= 1
        assert 0 < candidate["held_out_decisions_per_episode"] <= limit  # the candidate's own step limit applied
        assert set(candidate["sampled"]) == {"0.6", "1"}
        for sampled in candidate["sampled"].values():
            assert 0 <= sampled["success"] <= 1 and 0 < sampled["decisions_per_episode"] <= limit
            assert 0 < sampled["prompt_tokens_mean"] <= sampled["prompt_tokens_max"]
        iteration = candidate["iteration"]
        assert iteration["rollout_cpu_s"] > 0 and iteration["update_cpu_s"] > 0
        assert 2 * 2 <= iteration["step_samples"] <= 2 * 2 * limit  # 2 tasks x 2 copies, 1 to `limit` steps each
