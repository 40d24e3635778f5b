"""Real multi-process training: `accelerate launch --num_processes 2 --cpu` (gloo)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("distributed_run.py")
SAME_STATISTICS = [
    "env/success_rate", "env/episode_length_mean", "env/truncated_share", "env/invalid_action_rate", "env/step_samples",
    "gigpo/singleton_share", "gigpo/step_group_size_mean", "gigpo/step_group_size_max",
    "gigpo/nonzero_step_advantage_share",
]


def launch(num_processes: int, model_dir: str, output_dir: Path) -> list[dict]:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(num_processes), "--cpu",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(SCRIPT), model_dir,
               str(output_dir)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((output_dir / "metrics.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_processes_with_uneven_episodes_finish_and_match_one_process(tmp_path, tiny_model_path):
    two = launch(2, tiny_model_path, tmp_path / "two")
    one = launch(1, tiny_model_path, tmp_path / "one")

    assert len(two) == len(one) == 2
    for step_two, step_one in zip(two, one):
        for name in SAME_STATISTICS:
            assert step_two[name] == pytest.approx(step_one[name], rel=1e-12), name
        for name in ("gigpo/episode_advantage_std", "gigpo/step_advantage_std"):
            assert step_two[name] == pytest.approx(step_one[name], rel=1e-6), name
    # The run really was uneven: half the episodes took 2-3 steps, half 11-12.
    assert two[0]["env/episode_length_mean"] == pytest.approx((2 + 3 + 2 + 3 + 11 + 12 + 11 + 12) / 8)
