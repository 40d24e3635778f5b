"""Real multi-process training on CPU: two processes started by torchrun, talking over gloo.

`accelerate launch --cpu --num_processes 2` is not used: without mpirun, accelerate starts ONE process on CPU."""

from __future__ import annotations

import pytest
from launchers import finished_run, run_script, torchrun

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


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_processes_with_uneven_episodes_finish_and_match_one_process(tmp_path, tiny_model_path):
    two, two_evaluation = launch(2, tiny_model_path, tmp_path / "two")
    one, one_evaluation = launch(1, tiny_model_path, tmp_path / "one")

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
@pytest.mark.timeout(300)
def test_an_error_on_one_process_ends_every_process_promptly_with_the_message(tmp_path, tiny_model_path):
    # A process left waiting in a collective would wait for gloo's 30-minute timeout; torchrun's 240 s limit
    # (subprocess.TimeoutExpired) fails the test long before that.
    result = run_script(torchrun(2), tiny_model_path, str(tmp_path), "bad_anchor_on_rank_1", timeout=240)

    assert result.returncode != 0
    assert "environment 'bad_anchor_on_rank_1': info['anchor'] must be hashable" in result.stderr
