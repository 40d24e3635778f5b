"""Real multi-process training on CPU: two processes started by torchrun, talking over gloo.

`accelerate launch --cpu --num_processes 2` is not used: without mpirun, accelerate starts ONE process on CPU."""

from __future__ import annotations

import json
import math

import pytest
import torch
from launchers import finished_run, run_script, torchrun

LEARNING_RATE = 1e-3  # distributed_run.py's

SAME_STATISTICS = [
    "env/success_rate", "env/episode_length_mean", "env/truncated_share", "env/invalid_action_rate", "env/step_samples",
    "gigpo/singleton_share", "gigpo/step_group_size_mean", "gigpo/step_group_size_max",
    "gigpo/nonzero_step_advantage_share",
]


def launch(num_processes: int, model_dir: str, output_dir, *options: str) -> tuple[list[dict], dict]:
    """tests/distributed_run.py under torchrun: its logs (one per rollout) and evaluation; `options` as its command line's."""
    written = finished_run(torchrun(num_processes), model_dir, output_dir, *options)
    assert written["processes"] == num_processes
    return written["logs"], written["evaluation"]


# The two runs compared with each other: both with the entropy bonus; the two processes' packed (the default
# packed_update) in passes of one row (the memory bound), the one process's with every row forwarded whole (TRL's path)
# in one pass per micro-batch. Padding rows: process 0's episodes are short.
ENTROPY_COEF = 0.1


@pytest.fixture(scope="module")
def two_processes(tiny_model_path, tmp_path_factory) -> dict:
    return finished_run(torchrun(2), tiny_model_path, tmp_path_factory.mktemp("two"), "--entropy-coef", str(ENTROPY_COEF),
                        "--max-step-samples", "1")


@pytest.fixture(scope="module")
def one_process(tiny_model_path, tmp_path_factory) -> dict:
    return finished_run(torchrun(1), tiny_model_path, tmp_path_factory.mktemp("one"), "--entropy-coef", str(ENTROPY_COEF),
                        "--plain-update")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_processes_with_uneven_episodes_finish_and_match_one_process(two_processes, one_process):
    assert (two_processes["processes"], one_process["processes"]) == (2, 1)
    two, two_evaluation = two_processes["logs"], two_processes["evaluation"]
    one, one_evaluation = one_process["logs"], one_process["evaluation"]

    assert len(two) == len(one) == 2
    for step_two, step_one in zip(two, one):
        for name in SAME_STATISTICS:
            assert step_two[name] == pytest.approx(step_one[name], rel=1e-12), name
        for name in ("gigpo/episode_advantage_std", "gigpo/step_advantage_std"):
            assert step_two[name] == pytest.approx(step_one[name], rel=1e-6), name
    # The run really was uneven: half the episodes took 2-3 steps, half 11-12.
    assert two[0]["env/episode_length_mean"] == pytest.approx((2 + 3 + 2 + 3 + 11 + 12 + 11 + 12) / 8)

    # The evaluation panel (corridors of 3, 20 and 3 cells; 20 cannot be won) counts each task once: averaging the
    # batches would give 3/4 on either process count (a 1-task last batch on one process, a task played twice on two).
    for evaluation in (one_evaluation, two_evaluation):
        assert evaluation["eval_env/panel_tasks"] == 3
        assert evaluation["eval_env/success_rate"] == pytest.approx(2 / 3)
        assert evaluation["eval_env/success_rate/corridor-3"] == 1.0
        assert evaluation["eval_env/success_rate/corridor-20"] == 0.0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_entropy_bonus_and_the_memory_bound_leave_two_processes_update_that_of_one(two_processes, one_process):
    # The same samples (scripted answers) make the same update: the loss is a token mean over the rollout, the entropy
    # bonus too (TRL's mean per micro-batch would weigh process 0's few real tokens as much as process 1's many),
    # passes of one row accumulate the gradient of the whole micro-batch, and the packed forward passes give the plain
    # ones' log-probs and gradients.
    for ours, theirs in zip(two_processes["logs"], one_process["logs"]):
        for name in ("loss", "grad_norm", "entropy", "entropy_coef"):
            assert ours[name] == pytest.approx(theirs[name], rel=1e-5), name
    before, after = (torch.load(run["output_dir"] / "parameters.pt") for run in (two_processes, one_process))
    two_step = {name: before["after"][name] - before["before"][name] for name in before["after"]}
    one_step = {name: after["after"][name] - after["before"][name] for name in after["after"]}
    assert max(step.abs().max().item() for step in one_step.values()) > LEARNING_RATE  # the weights did move
    assert max((two_step[name] - one_step[name]).abs().max().item() for name in one_step) <= 1e-2 * LEARNING_RATE


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_error_on_one_process_ends_every_process_promptly_with_the_message(tmp_path, tiny_model_path):
    # A process left waiting in a collective would wait for gloo's 30-minute timeout; torchrun's 240 s limit
    # (subprocess.TimeoutExpired) fails the test long before that.
    result = run_script(torchrun(2), tiny_model_path, str(tmp_path), "bad_anchor_on_rank_1", timeout=240)

    assert result.returncode != 0
    assert "environment 'bad_anchor_on_rank_1': info['anchor'] must be hashable" in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_processes_complete_iterations_in_which_one_process_s_groups_were_all_dropped(tmp_path, tiny_model_path):
    # Rank 1's corridors cannot be finished (tests/toy_envs.py, UnwinnableOnRank1): with dynamic sampling it plays its 2
    # extra rounds while rank 0, whose 16-cell corridors carry a signal (one copy wins at the 15th and last step
    # allowed, the other, which first steps left, is cut off), generates with it; then rank 1 trains on zero-weight
    # rows and rank 0 on its own samples.
    result = run_script(torchrun(2), tiny_model_path, str(tmp_path), "unwinnable_on_rank_1",
                        "--lengths", "16", "16", "12", "12")

    assert result.returncode == 0, result.stderr[-4000:]
    logs = json.loads((tmp_path / "metrics.json").read_text())["logs"]
    assert len(logs) == 2
    for log in logs:
        assert log["dynamic_sampling/extra_rounds"] == 2
        assert log["dynamic_sampling/groups_rolled"] == 2 + 2 * 3  # rank 0: its 2 tasks; rank 1: 2 tasks x 3 rounds
        assert log["dynamic_sampling/groups_kept"] == 2 and log["dynamic_sampling/groups_dropped"] == 6
        assert log["dynamic_sampling/groups_missing"] == 2
        # Rank 1 played 3 rounds of 2 tasks x 2 copies cut off at 15 steps; rank 0's copies all lasted 15 steps too.
        assert log["env/step_samples"] == 3 * 4 * 15 + 2 * (15 + 15)
        assert log["gigpo/update_step_samples"] == 2 * (15 + 15)
        assert log["env/success_rate"] == 2 / (2 * 2 + 3 * 2 * 2)  # rank 0's first copies
        assert log["grad_norm"] > 0 and math.isfinite(log["loss"])
    assert "dynamic sampling: after 2 extra round(s)" in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_reward_std_filtering_ranks_the_groups_of_both_processes_together(tmp_path, tiny_model_path):
    # Rank 0's 16-cell corridors carry a signal (one copy wins at the 15th and last step allowed, the other is cut off:
    # std 0.71); both copies of rank 1's 12-cell corridors win (std 0). Keeping half of the 4 groups over both processes
    # keeps rank 0's two, where each process keeping its own half would keep one each; rank 1 trains on zero-weight
    # rows, in lock-step.
    written = finished_run(torchrun(2), tiny_model_path, tmp_path, "--lengths", "16", "16", "12", "12",
                           "--reward-std-filter-ratio", "0.5")

    assert written["processes"] == 2 and len(written["logs"]) == 2
    for log in written["logs"]:
        assert log["reward_std_filter/groups_ranked"] == 4 and log["reward_std_filter/groups_kept"] == 2
        assert log["reward_std_filter/std_threshold"] == pytest.approx(math.sqrt(0.5))
        assert log["reward_std_filter/kept_std_mean"] == pytest.approx(math.sqrt(0.5))
        assert log["reward_std_filter/dropped_std_mean"] == log["reward_std_filter/groups_kept_zero_std"] == 0.0
        assert log["env/step_samples"] == 2 * (15 + 15) + 2 * (11 + 12)
        assert log["gigpo/update_step_samples"] == 2 * (15 + 15)  # rank 0's groups, all of their samples
        assert log["grad_norm"] > 0 and math.isfinite(log["loss"])
    calls = written["rollouts"]["train"]["generate_calls"]
    assert calls == [15, 15]  # rank 1's episodes ended after 12 turns; it kept generating with rank 0


@pytest.mark.timeout(300)
def test_updates_whose_every_trajectory_failed_on_both_processes_move_no_weight(tmp_path, tiny_model_path):
    # Every step of tests/toy_envs.py's FailsOnStep raises (a service it needs is down), on both processes; the run goes
    # on (stop_after_failed_rollouts=0) and its 2 updates train on nothing: no optimizer step moves a weight.
    written = finished_run(torchrun(2), tiny_model_path, tmp_path, "fails_on_step")
    assert [(log["env/env_error_share"], log["grad_norm"]) for log in written["logs"]] == [(1.0, 0.0), (1.0, 0.0)]
    parameters = torch.load(tmp_path / "parameters.pt")
    assert all(torch.equal(parameters["before"][name], parameters["after"][name]) for name in parameters["before"])
