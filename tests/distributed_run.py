"""Launched by tests/test_distributed.py with torchrun: a short scripted GiGPO run whose tasks make the
processes' episodes very uneven; the main process writes the process count and the logged metrics as JSON.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed_run.py MODEL_DIR OUTPUT_DIR [ENV_NAME]

After training it evaluates a panel of 3 corridors of lengths 3, 20 and 3 (20 cannot be won in max_env_steps),
two tasks per process and batch: the evaluation dataloader plays a task twice to fill the batches.

ENV_NAME "bad_anchor_on_rank_1" makes the process of rank 1 alone raise in its first rollout. ENV_NAME
"tool_counter" trains TRL's counter environment class (tests/toy_tool_envs.py) instead, from rows in TRL's shape
(MODEL_DIR then needs a tool-calling chat template), without evaluation. ENV_NAME "unwinnable_on_rank_1" trains with
dynamic sampling (2 extra rounds at most, no invalid-answer penalty) on corridors that the process of rank 1 can never
finish (tests/toy_envs.py), without evaluation: its groups carry no signal in any round.
"""

import json
import os
import sys
from pathlib import Path

from datasets import Dataset
from scripted_policy import ScriptedToolTrainer, ScriptedTrainer
from toy_envs import BadAnchorOnRank1, Corridor, UnwinnableOnRank1
from toy_tool_envs import IncrementEnv

from gigpo_trl.config import GiGPOConfig
from gigpo_trl.envs import register_env
from gigpo_trl.tasks import task_dataset

TRAJECTORIES = 8  # per rollout, over all processes: 4 tasks x 2 copies


def main(model_dir: str, output_dir: str, env_name: str = "corridor") -> None:
    register_env("corridor", Corridor, overwrite=True)
    register_env("bad_anchor_on_rank_1", BadAnchorOnRank1, overwrite=True)
    register_env("unwinnable_on_rank_1", UnwinnableOnRank1, overwrite=True)
    sampling = {"dynamic_sampling_max_rounds": 2, "invalid_action_penalty": 0.0} if env_name == "unwinnable_on_rank_1" else {}
    config = GiGPOConfig(
        output_dir=output_dir, env_name=env_name, num_generations=2, steps_per_generation=1,
        gradient_accumulation_steps=1, per_device_train_batch_size=TRAJECTORIES // _world_size(),
        max_steps=2, max_env_steps=15, max_completion_length=8, learning_rate=1e-3, logging_steps=1,
        report_to=[], save_strategy="no", gradient_checkpointing=False, shuffle_dataset=False, seed=0,
        per_device_eval_batch_size=4, **sampling,
    )
    # In each rollout the first two tasks (process 0 with 2 processes) are 3-cell corridors, the last two
    # (process 1) 12-cell ones: 2-3 steps against 11-12 steps.
    lengths = [3, 3, 12, 12] * 2
    if env_name == "tool_counter":
        prompts = [[{"role": "user", "content": f"Task {k}."}] for k in range(len(lengths))]
        trainer = ScriptedToolTrainer(model_dir, args=config, train_dataset=Dataset.from_dict({"prompt": prompts}),
                                      environment_factory=IncrementEnv)
        trainer.train()
        evaluation = {}
    else:
        dataset = task_dataset(range(len(lengths)), options=[{"length": n} for n in lengths])
        panel = task_dataset([100, 101, 102], options=[{"length": n} for n in (3, 20, 3)])
        trainer = ScriptedTrainer(model_dir, args=config, train_dataset=dataset, eval_dataset=panel)
        trainer.train()
        evaluation = {} if sampling else trainer.evaluate()
    trainer.close_environments()
    if trainer.accelerator.is_main_process:
        logs = [entry for entry in trainer.state.log_history if "env/step_samples" in entry]  # one per rollout
        processes = trainer.accelerator.num_processes
        Path(output_dir, "metrics.json").write_text(json.dumps({"processes": processes, "logs": logs,
                                                                "evaluation": evaluation}))


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))  # a PartialState made here would fix the device before the config


if __name__ == "__main__":
    main(*sys.argv[1:4])
