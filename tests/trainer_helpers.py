"""Shared pieces of the trainer tests: a small CPU configuration, step samples, parameter snapshots, what backend
trained a model, and the `corridor` environment (tests/toy_envs.py) registered under that name."""

from __future__ import annotations

import random

import torch
from accelerate.utils import gather_object
from trl.distributed import DistributedBackend
from trl.generation.vllm_generation import VLLMGeneration
from toy_envs import Corridor

from gigpo_trl.config import GiGPOConfig
from gigpo_trl.envs import register_env
from gigpo_trl.dialogue import Completion
from gigpo_trl.trainer import GiGPOTrainer

register_env("corridor", Corridor, overwrite=True)


def cpu_config(tmp_path, **overrides) -> GiGPOConfig:
    """2 tasks x 2 copies per rollout, split into 2 micro-batches; short answers and episodes; fp32 on every machine
    (unset, bf16 would follow the CPU's bf16 instructions), no checkpoints."""
    settings = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, steps_per_generation=2,
        gradient_accumulation_steps=2, max_steps=2, max_completion_length=12, max_env_steps=4, logging_steps=1,
        report_to=[], gradient_checkpointing=False, learning_rate=1e-3, save_strategy="no", seed=0, bf16=False,
    )
    return GiGPOConfig(**{**settings, **overrides})


def settings_config(tmp_path, **overrides) -> GiGPOConfig:
    """`cpu_config` on Sokoban with 8-token answers: the setting of the TRL-settings tests."""
    return cpu_config(tmp_path, **{"env_name": "sokoban", "max_completion_length": 8, **overrides})


def parameters(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def step_samples(vocab_size: int, count: int, seed: int) -> tuple[list[Completion], list[float]]:
    """Step samples of different prompt and answer lengths, with advantages of both signs."""
    rng = random.Random(seed)
    completions = [
        Completion([rng.randrange(3, vocab_size) for _ in range(rng.randint(3, 9))],
                   [rng.randrange(3, vocab_size) for _ in range(rng.randint(1, 8))], "")
        for _ in range(count)
    ]
    return completions, [rng.uniform(-2, 2) for _ in range(count)]


def engineless_vllm_backend(model, accelerator) -> VLLMGeneration:
    """TRL's vLLM backend of `model`, with what its weight sync's iteration (`_iter_named_params`) reads, without the
    engine that `__init__` would start."""
    generation = object.__new__(VLLMGeneration)
    generation.model, generation.accelerator = model, accelerator
    generation._dist = DistributedBackend(accelerator)
    return generation


def backend_facts(trainer: GiGPOTrainer) -> dict:
    """What trained the model: accelerate's distributed type, the DeepSpeed engine and its ZeRO stage (None without
    DeepSpeed), and, from every process, how many parameter elements it holds against the model's total."""
    engine = trainer.model_wrapped
    stage = engine.zero_optimization_stage() if type(engine).__name__ == "DeepSpeedEngine" else None
    parameters = list(trainer.model.parameters())
    held = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in parameters)  # ZeRO-3: a shard
    total = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in parameters)
    return {"distributed_type": str(trainer.accelerator.distributed_type), "engine": type(engine).__name__,
            "zero_stage": stage, "elements_held": gather_object([held]), "elements_total": total}
