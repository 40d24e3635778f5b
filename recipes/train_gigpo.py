# /// script
# dependencies = ["gigpo-trl"]
# ///
"""Train an LLM agent with GiGPO in a text environment (TextWorld, Sokoban, or your own).

CPU quickstart, the embedded SmolLM2-135M-Instruct on TextWorldExpress's "Simon says" (about 6 minutes on 2 cores):

    python recipes/train_gigpo.py --config recipes/configs/quickstart_cpu.yaml

One GPU with LoRA (add --vllm_lora_sync adapter to hand vLLM the adapter alone; --load_in_4bit true for QLoRA):

    accelerate launch --config_file recipes/accelerate/single_gpu.yaml recipes/train_gigpo.py \\
        --config recipes/configs/textworld_cooking_lora_gigpo.yaml

8 GPUs with DeepSpeed ZeRO-3 (Qwen2.5-1.5B-Instruct, the paper's settings):

    accelerate launch --config_file recipes/accelerate/deepspeed_zero3.yaml recipes/train_gigpo.py \\
        --config recipes/configs/textworld_cooking_gigpo.yaml

The baseline, step-wise GRPO, is any config with `--step_advantage_weight 0` (and its own `--output_dir`); the
bootstrapped step value (beyond the paper, docs/advantages.md) is `--step_advantage_lambda 0.5` (or any lambda < 1).
Any field of GiGPOConfig / GRPOConfig / TrainingArguments and of ModelConfig can be set in the YAML
or overridden on the command line (`--max_steps 10`), as with TRL's own scripts.
"""

from __future__ import annotations

from trl import ModelConfig, TrlParser, get_peft_config, get_quantization_config

from gigpo_trl import EMBEDDED_MODEL, GiGPOConfig, GiGPOTrainer, TaskArguments
from gigpo_trl.recipe import train_and_report


def main(task_args: TaskArguments, training_args: GiGPOConfig, model_args: ModelConfig) -> None:
    model = model_args.model_name_or_path or EMBEDDED_MODEL
    training_args.model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        "quantization_config": get_quantization_config(model_args),  # --load_in_4bit true: QLoRA (docs/launching.md)
        **(training_args.model_init_kwargs or {}),
    }
    train_tasks, eval_tasks = task_args.datasets(training_args.env_name, training_args.env_kwargs)
    trainer = GiGPOTrainer(
        model, args=training_args, train_dataset=train_tasks, eval_dataset=eval_tasks,
        peft_config=get_peft_config(model_args),
    )

    if trainer.accelerator.is_main_process:
        print(f"GiGPO on {trainer.accelerator.num_processes} process(es), {trainer.accelerator.device}: "
              f"A = A_E + {training_args.step_advantage_weight:g} * A_S, step value lambda "
              f"{training_args.step_advantage_lambda:g}")
    train_and_report(trainer, training_args.resume_from_checkpoint,
                     panel=f"Held-out success rate ({task_args.num_eval_tasks} tasks)",
                     evaluate_first=task_args.evaluate_before_training)
    if training_args.push_to_hub:
        trainer.push_to_hub()


if __name__ == "__main__":
    parser = TrlParser((TaskArguments, GiGPOConfig, ModelConfig))
    main(*parser.parse_args_and_config())
