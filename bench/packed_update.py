"""The packed update against TRL's path, side by side in one process: the same rollout's step samples updated by
GRPOTrainer's own forward pass (padded rows, in TRL's shuffled micro-batches) and by the packed one (a prefix trie per
pass, the rows split by prompt; `gigpo_trl.packing`).

    OMP_NUM_THREADS=1 python bench/packed_update.py --config recipes/configs/quickstart_cpu.yaml
    OMP_NUM_THREADS=1 python bench/packed_update.py --config research/configs/learning_simonsays_cpu.yaml \\
        -- --env_kwargs '{"game": "simonsays", "gameLength": 3, "numDistractors": 3}' --max_env_steps 5
    OMP_NUM_THREADS=1 python bench/packed_update.py --config recipes/configs/quickstart_cpu.yaml -- --history_length 2
    OMP_NUM_THREADS=1 python bench/packed_update.py --synthetic 1500 400 64 --tasks 16 --copies 8 --micro-batches 8 \\
        --time-micro-batches 1

With a config, one training rollout of the config's batch (the embedded SmolLM2 unless --model) gives the step
samples; `--synthetic P S A` builds ALFWorld-shaped ones instead: prompts of P tokens whose first S are instructions
every prompt shares, then the task's text, with each task's copies in step groups of `--group-size` identical prompts,
and A-token answers. Each micro-batch's loss pass (`GiGPOTrainer.compute_loss`) and backward pass run with the plain
path, then with the packed one, alternating `--repeats` times; per path: the token positions forwarded, the CPU seconds
(this process, user + system) per step sample, and the activation memory a pass holds for its backward pass. A
`--time-micro-batches` below the micro-batch count times only the first few (for shapes whose plain update takes an
hour); the tokens are counted over all. Writes OUTPUT/packed_update.json.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def config_batch(config: str, model: str, recipe_arguments: list[str]):
    """A trainer built from a recipe config and the batch of its first training rollout (all micro-batches)."""
    from trl import ModelConfig, TrlParser

    from gigpo_trl import GiGPOConfig, GiGPOTrainer, TaskArguments

    overrides = ["--output_dir", str(ROOT / "outputs" / "packed_update"), "--report_to", "none", "--eval_strategy", "no",
                 "--log_trajectories", "0", "--save_strategy", "no"]
    task_args, args, _ = TrlParser((TaskArguments, GiGPOConfig, ModelConfig)).parse_args_and_config(
        args=["--config", config, *recipe_arguments, *overrides])
    train, _ = task_args.datasets(args.env_name, args.env_kwargs)
    trainer = GiGPOTrainer(model, args=args, train_dataset=train)
    tasks = args.per_device_train_batch_size * args.steps_per_generation // args.num_generations
    trainer.model.train()
    batch = trainer._generate_and_score_completions([train[k] for k in range(tasks) for _ in range(args.num_generations)])
    trainer.close_environments()
    return trainer, batch


def synthetic_batch(model: str, prompt_tokens: int, shared_tokens: int, answer_tokens: int, tasks: int, copies: int,
                    group_size: int, micro_batches: int, max_step_samples: int | None):
    """ALFWorld-shaped step samples: one step of `tasks` x `copies`, each task's copies in step groups of `group_size`
    identical prompts; every prompt starts with the same `shared_tokens` instructions."""
    from gigpo_trl import GiGPOConfig, GiGPOTrainer, task_dataset
    from gigpo_trl.batch import loss_batch
    from gigpo_trl.dialogue import Completion

    rows = tasks * copies
    args = GiGPOConfig(output_dir=str(ROOT / "outputs" / "packed_update"), env_name="rooms", env_processes=False,
                       num_generations=copies, per_device_train_batch_size=rows // micro_batches,
                       steps_per_generation=micro_batches, gradient_accumulation_steps=micro_batches, use_cpu=True,
                       bf16=False, activation_checkpointing=False, max_step_samples_per_micro_batch=max_step_samples,
                       report_to=[], save_strategy="no",
                       max_completion_length=answer_tokens)
    trainer = GiGPOTrainer(model, args=args, train_dataset=task_dataset(range(tasks)))
    rng, vocab = random.Random(0), trainer.model.config.vocab_size
    tokens = lambda count: [rng.randrange(3, vocab) for _ in range(count)]  # noqa: E731
    instructions, completions = tokens(shared_tokens), []
    for _ in range(tasks):
        for _ in range(copies // group_size):
            prompt = instructions + tokens(prompt_tokens - shared_tokens)
            completions += [Completion(prompt, tokens(answer_tokens), "") for _ in range(group_size)]
    advantages = [rng.gauss(0.0, 1.0) for _ in completions]
    trainer.model.train()
    return trainer, loss_batch(trainer, completions, [1.0] * rows, advantages, "train")


def micro_batches_of(trainer, batch: dict, packed: bool) -> list[dict]:
    """The micro-batches each path trains on: TRL's shuffled split for the plain path, the split by prompt where the
    packed path uses it (`GiGPOLossMixin._prepare_inputs`)."""
    import torch
    from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

    from gigpo_trl.packing import rows_by_prompt

    torch.manual_seed(0)
    ordered = rows_by_prompt(batch) if packed and trainer._rows_by_prompt else shuffle_sequence_dict(batch)
    return split_tensor_dict(ordered, trainer.args.steps_per_generation)


def positions_forwarded(trainer, micro_batches: list[dict], packed: bool) -> int:
    """Token positions the model forwards over the micro-batches (padding included), in passes of the memory bound."""
    import torch

    from gigpo_trl.loss import row_chunks
    from gigpo_trl.packing import pack_rows

    total = 0
    for micro_batch in micro_batches:
        for chunk in row_chunks(micro_batch, trainer.args.max_step_samples_per_micro_batch):
            input_ids = torch.cat([chunk["prompt_ids"], chunk["completion_ids"]], 1)
            if packed:
                attention_mask = torch.cat([chunk["prompt_mask"], chunk["completion_mask"]], 1)
                total += pack_rows(input_ids, attention_mask, chunk["completion_ids"].size(1)).input_ids.numel()
            else:
                total += input_ids.numel()
    return total


def timed_update(trainer, micro_batches: list[dict], packed: bool) -> dict:
    """The CPU seconds of the micro-batches' loss and backward passes, and the largest activation memory a pass
    holds for its backward pass (the distinct storages autograd saves, the weights aside: an order-free measure, where
    the process's resident peak would count the allocator's pages the other path left). A micro-batch runs in passes
    of the memory bound (`row_chunks`), each a `compute_loss` and its backward pass, as `compute_loss` runs them."""
    import torch

    from gigpo_trl.loss import row_chunks

    bound, trainer.args.max_step_samples_per_micro_batch = trainer.args.max_step_samples_per_micro_batch, None
    trainer._packed_update = packed
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    trainer.model.zero_grad()
    cpu, peak = 0.0, 0
    weights = {parameter.untyped_storage().data_ptr() for parameter in trainer.model.parameters()}
    for chunk in [chunk for micro_batch in micro_batches for chunk in row_chunks(micro_batch, bound)]:
        saved: dict[int, int] = {}

        def keep(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in weights:
                saved[storage.data_ptr()] = storage.nbytes()
            return tensor

        started = time.process_time()
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor), \
                trainer.compute_loss_context_manager():
            loss = trainer.compute_loss(trainer.model, chunk)
        trainer.accelerator.backward(loss)
        cpu += time.process_time() - started
        peak = max(peak, sum(saved.values()))
    trainer.args.max_step_samples_per_micro_batch = bound
    return {"cpu_s": cpu, "saved_activations_mib": peak / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="a recipe config: its first training rollout gives the step samples")
    source.add_argument("--synthetic", type=int, nargs=3, metavar=("PROMPT", "SHARED", "ANSWER"),
                        help="ALFWorld-shaped step samples: prompt tokens, of which shared instructions, answer tokens")
    parser.add_argument("--model", default="embedded:SmolLM2-135M-Instruct")
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4, help="--synthetic: identical prompts per step group")
    parser.add_argument("--micro-batches", type=int, default=8, help="--synthetic: micro-batches of the update")
    parser.add_argument("--max-step-samples", type=int, default=None,
                        help="--synthetic: max_step_samples_per_micro_batch, the rows of a pass (in fp32 a plain pass "
                        "of 1,500-token rows holds about 3.6 GB of activations per row)")
    parser.add_argument("--time-micro-batches", type=int, default=None, help="time only the first N micro-batches")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output", type=Path, default=ROOT / "outputs" / "packed_update")
    parser.add_argument("recipe_arguments", nargs="*", help="after --: recipe arguments added to --config")
    args = parser.parse_args()

    if args.config:
        trainer, batch = config_batch(args.config, args.model, args.recipe_arguments)
    else:
        trainer, batch = synthetic_batch(args.model, *args.synthetic, args.tasks, args.copies, args.group_size,
                                         args.micro_batches, args.max_step_samples)
    samples = int(batch["tool_mask"].any(dim=1).sum())
    paths = {"plain": False, "packed": True}
    micro = {name: micro_batches_of(trainer, batch, packed) for name, packed in paths.items()}
    timed = {name: batches[:args.time_micro_batches] for name, batches in micro.items()}
    timed_rows = sum(int(b["tool_mask"].any(dim=1).sum()) for b in timed["plain"])
    runs = {name: [] for name in paths}
    for _ in range(args.repeats):
        for name, packed in paths.items():
            runs[name].append(timed_update(trainer, timed[name], packed))
    result = {"source": args.config or f"synthetic {args.synthetic}", "recipe_arguments": args.recipe_arguments,
              "model": args.model, "step_samples": samples, "timed_step_samples": timed_rows,
              "rows": batch["prompt_ids"].size(0), "micro_batches": len(micro["plain"]),
              "real_tokens": int(batch["prompt_mask"].sum() + batch["completion_mask"].sum())}
    for name, packed in paths.items():
        best = min(runs[name], key=lambda run: run["cpu_s"])
        result[name] = {"positions_forwarded": positions_forwarded(trainer, micro[name], packed),
                        "cpu_s_per_step_sample": best["cpu_s"] / timed_rows,
                        "saved_activations_mib": best["saved_activations_mib"],
                        "runs": runs[name]}
    result["token_ratio"] = result["plain"]["positions_forwarded"] / result["packed"]["positions_forwarded"]
    result["speed_ratio"] = result["plain"]["cpu_s_per_step_sample"] / result["packed"]["cpu_s_per_step_sample"]
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "packed_update.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({key: value for key, value in result.items() if key not in paths} |
                     {name: {k: v for k, v in result[name].items() if k != "runs"} for name in paths}, indent=2))


if __name__ == "__main__":
    main()
