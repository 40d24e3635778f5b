"""Launched by tests/test_distributed.py with `accelerate launch`: a short scripted GiGPO run whose
tasks make the processes' episodes very uneven; the main process writes the logged metrics as JSON.

    accelerate launch --num_processes 2 --cpu tests/distributed_run.py MODEL_DIR OUTPUT_DIR
"""

import json
import sys
from pathlib import Path

from scripted_policy import ScriptedTrainer
from toy_envs import Corridor

from gigpo_trl.config import GiGPOConfig
from gigpo_trl.envs import register_env
from gigpo_trl.trainer import task_dataset

TRAJECTORIES = 8  # per rollout, over all processes: 4 tasks x 2 copies


def main(model_dir: str, output_dir: str) -> None:
    register_env("corridor", Corridor, overwrite=True)
    config = GiGPOConfig(
        output_dir=output_dir, env_name="corridor", num_generations=2, steps_per_generation=1,
        gradient_accumulation_steps=1, per_device_train_batch_size=TRAJECTORIES // _world_size(),
        max_steps=2, max_env_steps=15, max_completion_length=8, learning_rate=1e-3, logging_steps=1,
        report_to=[], save_strategy="no", gradient_checkpointing=False, shuffle_dataset=False, seed=0,
    )
    # In each rollout the first two tasks (process 0 with 2 processes) are 3-cell corridors, the last two
    # (process 1) 12-cell ones: 2-3 steps against 11-12 steps.
    lengths = [3, 3, 12, 12] * 2
    dataset = task_dataset(range(len(lengths)), options=[{"length": n} for n in lengths])
    trainer = ScriptedTrainer(model_dir, args=config, train_dataset=dataset)
    trainer.train()
    trainer.close_environments()
    if trainer.accelerator.is_main_process:
        logs = [entry for entry in trainer.state.log_history if "env/success_rate" in entry]
        Path(output_dir, "metrics.json").write_text(json.dumps(logs))


def _world_size() -> int:
    from accelerate import PartialState

    return PartialState().num_processes


if __name__ == "__main__":
    main(*sys.argv[1:3])
