"""Launched by tests/test_vllm.py under `accelerate launch` with the recipes' DeepSpeed ZeRO-3 config: vLLM colocate
training in every process (`vllm_helpers.train`, at a learning rate that moves the tiny policy), on CPU with
vLLM's CPU engine settings and weight-layout shim (bench/vllm_cpu.py). The main process writes the training logs and
what trained the model to OUTPUT_DIR/metrics.json.

    accelerate launch --config_file recipes/accelerate/deepspeed_zero3.yaml --num_processes 2 --mixed_precision no \\
        tests/vllm_run.py MODEL_DIR OUTPUT_DIR [--max-steps N] [--skip-sync-from STEP]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from trainer_helpers import backend_facts
from vllm_helpers import CUDA, train, training_logs, vllm_config

from bench.vllm_cpu import apply_lora_per_slot, keep_weights_for_sync, use_cpu_engine_environment


def main(options: argparse.Namespace) -> None:
    if not CUDA:
        use_cpu_engine_environment()
        keep_weights_for_sync()
        apply_lora_per_slot()
    trainer = train(options.model_dir, vllm_config(options.output_dir, max_steps=options.max_steps),
                    skip_sync_from=options.skip_sync_from)
    facts = backend_facts(trainer)
    if trainer.accelerator.is_main_process:
        Path(options.output_dir, "metrics.json").write_text(json.dumps({
            "processes": trainer.accelerator.num_processes, "logs": training_logs(trainer), **facts}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("output_dir")
    parser.add_argument("--max-steps", type=int, default=3, help="updates (default 3, vllm_config's)")
    parser.add_argument("--skip-sync-from", type=int, default=None,
                        help="sabotage TRL's weight sync from this global step on (vLLM keeps the weights it has)")
    main(parser.parse_args())
