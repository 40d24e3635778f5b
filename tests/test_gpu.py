"""GPU-only checks on the tiny model: bf16 full and LoRA training, the update's memory bound, DeepSpeed ZeRO-3
through `accelerate launch`, and vLLM colocate generation inside the rollout. `bench/gpu_check.py` runs them and
the same checks on real sizes. They skip cleanly without a CUDA GPU, DeepSpeed or vLLM (CI has none of them)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from bench.gpu_check import deepspeed_launcher, run_worker, train_once
from gigpo_trl.config import GiGPOConfig
from gigpo_trl.tasks import task_dataset
from gigpo_trl.trainer import GiGPOTrainer

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (pip install -e .[vllm])")
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="needs deepspeed (pip install -e .[deepspeed])")

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]


@needs_cuda
def test_bf16_full_training_changes_the_weights_and_logs_finite_losses(tmp_path, tiny_model_path):
    figures = train_once(tiny_model_path, str(tmp_path), max_steps=2)
    assert figures["problems"] == []
    assert figures["weights_changed_share"] > 0.5 and figures["env/step_samples"] > 0


@needs_cuda
def test_bf16_lora_training_changes_the_adapter_only(tmp_path, tiny_model_path):
    figures = train_once(tiny_model_path, str(tmp_path), max_steps=2, lora=True)
    assert figures["problems"] == []
    assert figures["adapter_changed_share"] > 0.5 and figures["base_changed_share"] == 0.0


@needs_cuda
def test_update_peak_memory_does_not_grow_with_the_rollout_beyond_the_micro_batch_bound(tiny_model_path):
    def peak(tasks):
        result = run_worker("update_peak", {"size": "qwen2.5-0.5b", "bound": 2, "num_tasks": tasks,
                                            "tokenizer": tiny_model_path}, timeout=600)
        assert result["problems"] == []
        assert result["trained_samples"] == result["step_samples"]  # every sample trains, in passes of the bound
        return result

    small, large = peak(2), peak(4)
    assert large["step_samples"] == 2 * small["step_samples"]
    assert large["update_peak_gib"] <= 1.05 * small["update_peak_gib"]


@needs_cuda
@needs_deepspeed
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_training_through_accelerate_launch(stage, tiny_model_path):
    result = run_worker("train", {"model": tiny_model_path, "max_steps": 2}, timeout=600, launcher=deepspeed_launcher(stage))
    assert result["problems"] == [], result.get("output_tail")
    # DeepSpeed steps fp32 master weights; the module keeps their bf16 copies, which move only where a 1e-5 step
    # crosses a bf16 rounding boundary (measured on an H100: 32% of the tiny model's weights under ZeRO-3).
    assert result["weights_changed_share"] > 0.05


@needs_cuda
@needs_vllm
def test_vllm_colocate_generates_every_turn_with_importance_sampling(tmp_path, tiny_model_path):
    config = GiGPOConfig(
        output_dir=str(tmp_path), env_name="sokoban", per_device_train_batch_size=8, num_generations=4,
        steps_per_generation=1, gradient_accumulation_steps=1, max_steps=2, max_completion_length=32,
        max_env_steps=6, logging_steps=1, report_to=[], save_strategy="no", bf16=True, learning_rate=1e-5,
        use_vllm=True, vllm_mode="colocate", vllm_max_model_length=2048,
        # a KV cache of its own size: bench/gpu_check.py --jobs runs this beside other processes on the GPU
        vllm_gpu_memory_utilization=0.05, vllm_engine_kwargs={"kv_cache_memory_bytes": 2**30},
    )
    trainer = GiGPOTrainer(tiny_model_path, args=config, train_dataset=task_dataset(range(16)))
    trainer.train()
    logs = [e for e in trainer.state.log_history if "env/success_rate" in e]
    assert len(logs) == 2 and all(e["generation/tokens_per_s"] > 0 for e in logs)
    trainer.close_environments()
