"""Launched by tests/test_vllm.py under `accelerate launch` with the recipes' DeepSpeed ZeRO-3 config: vLLM colocate
training in every process (`vllm_helpers.train`, at a learning rate that moves the tiny policy), on CPU with
vLLM's CPU engine settings, weight-layout shim and LoRA ops (scripts/vllm_cpu.py). The main process writes the training
logs and what trained the model to OUTPUT_DIR/metrics.json; with --lora-adapter (a LoRA adapter, vllm_lora_sync
'adapter'), also whether the base stayed bit-identical and which adapter versions each process's engine loaded.

    accelerate launch --config_file recipes/accelerate/deepspeed_zero3.yaml --num_processes 2 --mixed_precision no \\
        tests/vllm_run.py MODEL_DIR OUTPUT_DIR [--max-steps N] [--skip-sync-from STEP] [--lora-adapter]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from accelerate.utils import gather_object
from trainer_helpers import backend_facts
from vllm_helpers import CUDA, train, training_logs, vllm_config

from bench.gpu_check import parameter_snapshot
from scripts.vllm_cpu import apply_lora_per_slot, keep_weights_for_sync, use_cpu_engine_environment
from gigpo_trl.tasks import task_dataset
from gigpo_trl.trainer import GiGPOTrainer


def main(options: argparse.Namespace) -> None:
    if not CUDA:
        use_cpu_engine_environment()
        keep_weights_for_sync()
        apply_lora_per_slot()
    if options.lora_adapter:
        from peft import LoraConfig

        config = vllm_config(options.output_dir, max_steps=options.max_steps, learning_rate=3e-2, vllm_lora_sync="adapter")
        trainer = GiGPOTrainer(options.model_dir, args=config, train_dataset=task_dataset(range(16)),
                               peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
        before = parameter_snapshot(trainer.model)  # ZeRO-3: gathered, by every process
        trainer.train()
        trainer.close_environments()
    else:
        trainer = train(options.model_dir, vllm_config(options.output_dir, max_steps=options.max_steps),
                        skip_sync_from=options.skip_sync_from)
    facts = backend_facts(trainer)
    if options.lora_adapter:
        after = parameter_snapshot(trainer.model)
        base = [name for name in before if "lora_" not in name]
        facts["base_changed"] = [name for name in base if not torch.equal(before[name], after[name])]
        facts["adapter_unchanged"] = [name for name in before if "lora_" in name and torch.equal(before[name], after[name])]
        engine = trainer.vllm_generation.llm.llm_engine
        facts["adapter_versions"] = gather_object([(trainer.vllm_adapter_sync.version, sorted(engine.list_loras()))])
    if trainer.accelerator.is_main_process:
        Path(options.output_dir, "metrics.json").write_text(json.dumps({
            "processes": trainer.accelerator.num_processes, "logs": training_logs(trainer), **facts}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("output_dir")
    parser.add_argument("--max-steps", type=int, default=3, help="updates (default 3, vllm_config's)")
    parser.add_argument("--lora-adapter", action="store_true",
                        help="train a LoRA adapter (r 8, all linear layers) with vllm_lora_sync 'adapter'")
    parser.add_argument("--skip-sync-from", type=int, default=None,
                        help="sabotage TRL's weight sync from this global step on (vLLM keeps the weights it has)")
    main(parser.parse_args())
