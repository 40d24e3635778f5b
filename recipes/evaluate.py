# /// script
# dependencies = ["gigpo-trl"]
# ///
"""Evaluate a trained model without training: a checkpoint (a full model folder, or a LoRA adapter folder played on
its base model), a Hub model, or the embedded SmolLM2-135M-Instruct plays held-out panels, greedily and/or with k
sampled copies of each task (success rate, pass@k, mean return, loop metrics), through the same evaluation as a
training run's (`GiGPOTrainer.evaluate`). Give it the training config, for the environment, the prompt settings and
the held-out panel (`eval_fold`, `num_eval_tasks`: the panel played unless --panels and --num_tasks say otherwise):

    python recipes/evaluate.py --config recipes/configs/quickstart_cpu.yaml \\
        --model_name_or_path outputs/quickstart --panels dev test --samples 4

It writes, in a folder of its own (`gigpo_trl.evaluation.evaluation_dir`: `<model folder>/evaluation` for a saved
model, `<output_dir>/evaluation-<model name>` otherwise, or --output_dir given on the command line; never among a
training run's records), episodes.jsonl (one line per episode), evaluation.json (the report) and the trainer's records
under gigpo/, and prints a line per panel and decoding. Any field of EvaluationArguments (gigpo_trl.evaluation),
TaskArguments, GiGPOConfig and ModelConfig can be set in the YAML or on the command line; the training-only fields of
a training config are ignored.
"""

from __future__ import annotations

import sys

from transformers.trainer_utils import IntervalStrategy
from trl import ModelConfig, TrlParser

from gigpo_trl import EMBEDDED_MODEL, GiGPOConfig, GiGPOTrainer, TaskArguments, fold_seeds, task_dataset
from gigpo_trl.evaluation import EvaluationArguments, evaluate_panels, evaluation_dir, load_model, panel_datasets, summary


def main(arguments: EvaluationArguments, task_args: TaskArguments, config: GiGPOConfig,
         model_args: ModelConfig) -> list[dict]:
    """Play the panels; `config.output_dir` is the evaluation's folder (`parse`)."""
    name = model_args.model_name_or_path or EMBEDDED_MODEL
    panels = panel_datasets(arguments, task_args, config.env_name, config.env_kwargs)
    model, tokenizer = load_model(name, model_args.dtype)
    if isinstance(model, str):  # loaded by the trainer (an adapter's base is loaded by load_model)
        config.model_init_kwargs = {"dtype": model_args.dtype, **(config.model_init_kwargs or {})}
    # The trainer is built with training tasks; nothing trains on them. A training config's evaluation schedule
    # (eval_strategy "steps") would ask the trainer for an eval_dataset: the panels are played below, once.
    config.eval_strategy = IntervalStrategy.NO
    tasks_per_rollout = config.generation_batch_size // config.num_generations
    trainer = GiGPOTrainer(
        model, args=config, processing_class=tokenizer,
        train_dataset=task_dataset(fold_seeds(config.env_name, "train", tasks_per_rollout, **config.env_kwargs)),
    )
    records = evaluate_panels(trainer, panels, arguments, name)
    trainer.close_environments()
    if trainer.accelerator.is_main_process:
        print(f"{name}\n{summary(records)}\nEpisodes and report: {config.output_dir}")
    return records


def parse(args: list[str] | None = None) -> tuple[EvaluationArguments, TaskArguments, GiGPOConfig, ModelConfig]:
    """The command line (`args`, or sys.argv), with `output_dir` made the evaluation's folder (`evaluation_dir`). A
    training config's keys that are not the evaluation's are left unused; an unknown command-line argument is
    refused."""
    parser = TrlParser((EvaluationArguments, TaskArguments, GiGPOConfig, ModelConfig))
    arguments, task_args, config, model_args = parser.parse_args_and_config(args=args, fail_with_unknown_args=False)
    given = [arg for arg in (sys.argv[1:] if args is None else args) if arg.split("=")[0] == "--output_dir"]
    config.output_dir = str(evaluation_dir(model_args.model_name_or_path or EMBEDDED_MODEL, config.output_dir,
                                           output_dir_given=bool(given)))
    return arguments, task_args, config, model_args


if __name__ == "__main__":
    main(*parse())
