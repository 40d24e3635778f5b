# /// script
# dependencies = ["gigpo-trl"]
# ///
"""Train an LLM agent with GiGPO in a text environment (TextWorld, Sokoban, or your own).

CPU quickstart, the embedded SmolLM2-135M-Instruct on small TextWorld games (about 8 minutes on 2 cores):

    python recipes/train_gigpo.py --config recipes/configs/quickstart_cpu.yaml

One GPU with LoRA:

    accelerate launch --config_file recipes/accelerate/single_gpu.yaml recipes/train_gigpo.py \\
        --config recipes/configs/textworld_cooking_lora_gigpo.yaml

8 GPUs with DeepSpeed ZeRO-3 (Qwen2.5-1.5B-Instruct, the paper's settings):

    accelerate launch --config_file recipes/accelerate/deepspeed_zero3.yaml recipes/train_gigpo.py \\
        --config recipes/configs/textworld_cooking_gigpo.yaml

Every config has a `*_grpo.yaml` twin with step_advantage_weight 0 (step-wise GRPO, the baseline).
Any field of GiGPOConfig / GRPOConfig / TrainingArguments and of ModelConfig can be set in the YAML
or overridden on the command line (`--max_steps 10`), as with TRL's own scripts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import ModelConfig, TrlParser, get_peft_config

from gigpo_trl import EMBEDDED_MODEL, GiGPOConfig, GiGPOTrainer, fold_seeds, task_dataset
from gigpo_trl.report import write_report


@dataclass
class TaskArguments:
    """Which tasks to train and evaluate on: seeds of the folds of the environment (`env_name`, `env_kwargs`),
    see `gigpo_trl.fold_seeds`. The held-out panel is fixed by `eval_fold` and `num_eval_tasks` alone, so every run
    is evaluated on the same tasks whatever its seed, batch sizes or number of processes."""

    num_train_tasks: int = field(default=1000, metadata={"help": "Training tasks: the first N seeds of the train fold."})
    num_eval_tasks: int = field(
        default=0, metadata={"help": "Held-out tasks evaluated before and after training: the first N seeds of "
                             "eval_fold (0: no evaluation)."}
    )
    eval_fold: str = field(default="dev", metadata={"help": "Fold of the held-out tasks: 'dev' or 'test'."})


def main(task_args: TaskArguments, training_args: GiGPOConfig, model_args: ModelConfig) -> None:
    model = model_args.model_name_or_path or EMBEDDED_MODEL
    training_args.model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        **(training_args.model_init_kwargs or {}),
    }
    env_kwargs = training_args.env_kwargs
    train_tasks = task_dataset(fold_seeds(training_args.env_name, "train", task_args.num_train_tasks, **env_kwargs))
    eval_tasks = None
    if task_args.num_eval_tasks:
        eval_seeds = fold_seeds(training_args.env_name, task_args.eval_fold, task_args.num_eval_tasks, **env_kwargs)
        eval_tasks = task_dataset(eval_seeds)
    trainer = GiGPOTrainer(
        model, args=training_args, train_dataset=train_tasks, eval_dataset=eval_tasks,
        peft_config=get_peft_config(model_args),
    )

    if trainer.accelerator.is_main_process:
        print(f"GiGPO on {trainer.accelerator.num_processes} process(es), {trainer.accelerator.device}")
    before = trainer.evaluate() if eval_tasks is not None else None
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    after = trainer.evaluate() if eval_tasks is not None else None
    trainer.save_model(training_args.output_dir)
    trainer.close_environments()
    if trainer.accelerator.is_main_process:
        report = write_report(training_args.output_dir)
        if before is not None:
            print(f"Held-out success rate ({task_args.num_eval_tasks} tasks): "
                  f"{before['eval_env/success_rate']:.1%} before training -> {after['eval_env/success_rate']:.1%} after")
        print(f"Report: {report / 'index.html'}")
    if training_args.push_to_hub:
        trainer.push_to_hub()


if __name__ == "__main__":
    parser = TrlParser((TaskArguments, GiGPOConfig, ModelConfig))
    main(*parser.parse_args_and_config())
