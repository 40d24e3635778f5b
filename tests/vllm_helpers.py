"""The vLLM tests' training setting, shared by tests/test_vllm.py and the processes tests/vllm_run.py starts."""

from __future__ import annotations

import torch
from trainer_helpers import settings_config

from gigpo_trl.config import GiGPOConfig
from gigpo_trl.tasks import task_dataset
from gigpo_trl.trainer import GiGPOTrainer

CUDA = torch.cuda.is_available()


def vllm_config(tmp_path, **overrides) -> GiGPOConfig:
    """`settings_config` (2 Sokoban tasks x 2 copies, 8-token answers, 2 micro-batches), 3 turns, generating with
    vLLM colocate, 3 updates at a learning rate that moves the tiny policy (0.2 to 0.4 per token and update)."""
    return settings_config(tmp_path, **{
        "use_vllm": True, "vllm_mode": "colocate", "max_env_steps": 3, "max_steps": 3, "learning_rate": 1e-2,
        "bf16": CUDA, **overrides})


def train(model: str, config: GiGPOConfig, *, skip_sync_from: int | None = None, **kwargs) -> GiGPOTrainer:
    """Train a GiGPOTrainer on Sokoban tasks; `skip_sync_from` sabotages TRL's weight sync from that global step on
    (0: vLLM keeps the first weights)."""
    trainer = GiGPOTrainer(model, args=config, train_dataset=task_dataset(range(16)), **kwargs)
    if skip_sync_from is not None:
        sync = trainer.vllm_generation.sync_weights
        trainer.vllm_generation.sync_weights = lambda: None if trainer.state.global_step >= skip_sync_from else sync()
    trainer.train()
    trainer.close_environments()
    return trainer


def training_logs(trainer: GiGPOTrainer) -> list[dict]:
    """The log entry of every training iteration (an environment without `won` logs no success rate)."""
    return [entry for entry in trainer.state.log_history if "env/step_samples" in entry]
