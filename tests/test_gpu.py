"""GPU-only checks: vLLM generation (colocate) inside the rollout, and bf16 training on CUDA.
They skip cleanly on machines without a CUDA GPU or without vLLM (CI has neither)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from gigpo_trl.config import GiGPOConfig
from gigpo_trl.trainer import GiGPOTrainer, task_dataset

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (pip install -e .[vllm])")

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]


def gpu_config(tmp_path, **overrides) -> GiGPOConfig:
    settings = dict(
        output_dir=str(tmp_path), env_name="sokoban", per_device_train_batch_size=8, num_generations=4,
        steps_per_generation=1, gradient_accumulation_steps=1, max_steps=2, max_completion_length=32,
        max_env_steps=6, logging_steps=1, report_to=[], save_strategy="no", bf16=True, learning_rate=1e-5,
    )
    return GiGPOConfig(**{**settings, **overrides})


@needs_cuda
def test_bf16_training_on_cuda(tmp_path, tiny_model_path):
    trainer = GiGPOTrainer(tiny_model_path, args=gpu_config(tmp_path), train_dataset=task_dataset(range(16)))
    trainer.train()
    logs = [e for e in trainer.state.log_history if "env/success_rate" in e]
    assert len(logs) == 2 and all(e["env/step_samples"] > 0 for e in logs)
    trainer.close_environments()


@needs_cuda
@needs_vllm
def test_vllm_colocate_generates_every_turn_with_importance_sampling(tmp_path, tiny_model_path):
    config = gpu_config(tmp_path, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.2,
                        vllm_max_model_length=2048)
    trainer = GiGPOTrainer(tiny_model_path, args=config, train_dataset=task_dataset(range(16)))
    trainer.train()
    logs = [e for e in trainer.state.log_history if "env/success_rate" in e]
    assert len(logs) == 2 and all(e["generation/tokens_per_s"] > 0 for e in logs)
    trainer.close_environments()
