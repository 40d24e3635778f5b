"""Launched by tests/test_distributed.py (torchrun) and tests/test_deepspeed.py (`accelerate launch` with the
recipes' DeepSpeed configs): a short scripted GiGPO run whose tasks make the processes' episodes very uneven; the
main process writes what the run did as JSON (metrics.json) and every parameter before and after training
(parameters.pt, ZeRO-3 shards gathered); with --lora, what vLLM's weight sync would load after 3 syncs too, in each
mode of vllm_lora_sync (merged: the merged weights; adapter: the adapter's files, and whether only the adapter's
parameters were gathered for them).

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed_run.py MODEL_DIR OUTPUT_DIR [ENV_NAME] [options]
    accelerate launch --config_file recipes/accelerate/deepspeed_zero3.yaml --num_processes 2 --mixed_precision no \\
        tests/distributed_run.py MODEL_DIR OUTPUT_DIR [ENV_NAME] [options]

Each rollout plays 4 corridor tasks x 2 copies, 2 tasks per process with 2 processes: by default the first two
(process 0) are 3-cell corridors, the last two (process 1) 12-cell ones (--lengths changes them). After training it
evaluates a panel of 3 corridors of lengths 3, 20 and 3 (20 cannot be won in max_env_steps), two tasks per process
and batch: the evaluation dataloader plays a task twice to fill the batches. Training is in fp32 on every machine.

ENV_NAME "bad_anchor_on_rank_1" makes the process of rank 1 alone raise in its first rollout. ENV_NAME
"tool_counter" trains TRL's counter environment class (tests/toy_tool_envs.py) instead, from rows in TRL's shape
(MODEL_DIR then needs a tool-calling chat template), without evaluation. ENV_NAME "unwinnable_on_rank_1" trains with
dynamic sampling (2 extra rounds at most, no invalid-answer penalty) on corridors that the process of rank 1 can never
finish (tests/toy_envs.py), without evaluation: its groups carry no signal in any round. --reward-std-filter-ratio P
trains with reward-std filtering at that ratio, without evaluation.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from contextlib import contextmanager

import torch
from accelerate.utils import gather_object
from datasets import Dataset
from scripted_policy import scripted_tool_trainer, scripted_trainer
from toy_envs import BadAnchorOnRank1, Corridor, FailsOnStep, UnwinnableOnRank1
from toy_tool_envs import IncrementEnv
from trainer_helpers import backend_facts, engineless_vllm_backend

from bench.gpu_check import parameter_snapshot
from gigpo_trl.config import GiGPOConfig
from gigpo_trl.envs import register_env
from gigpo_trl.tasks import task_dataset
from gigpo_trl.trainer import GiGPOTrainer
from gigpo_trl.vllm_lora import write_adapter
from gigpo_trl.weight_sync import sync_lora_out_of_place

TRAJECTORIES = 8  # per rollout, over all processes: 4 tasks x 2 copies


def main(options: argparse.Namespace) -> None:
    register_env("corridor", Corridor, overwrite=True)
    register_env("bad_anchor_on_rank_1", BadAnchorOnRank1, overwrite=True)
    register_env("unwinnable_on_rank_1", UnwinnableOnRank1, overwrite=True)
    register_env("fails_on_step", FailsOnStep, overwrite=True)
    sampling = ({"dynamic_sampling_max_rounds": 2, "invalid_action_penalty": 0.0}
                if options.env_name == "unwinnable_on_rank_1" else {})
    if options.reward_std_filter_ratio is not None:
        sampling["reward_std_filter_ratio"] = options.reward_std_filter_ratio
    if options.env_name == "fails_on_step":  # every update trains on nothing: the run goes on to max_steps
        sampling["stop_after_failed_rollouts"] = 0
    config = GiGPOConfig(
        output_dir=options.output_dir, env_name=options.env_name, num_generations=2, steps_per_generation=1,
        gradient_accumulation_steps=1, per_device_train_batch_size=TRAJECTORIES // _world_size(),
        max_steps=options.max_steps, max_env_steps=15, max_completion_length=8, learning_rate=1e-3, logging_steps=1,
        report_to=[], activation_checkpointing=False, shuffle_dataset=False, seed=0, per_device_eval_batch_size=4,
        bf16=False, beta=options.beta, entropy_coef=options.entropy_coef,
        max_step_samples_per_micro_batch=options.max_step_samples, packed_update=not options.plain_update,
        async_staleness=options.async_staleness, **sampling,
        **({"save_strategy": "steps", "save_steps": options.save_steps} if options.save_steps else {"save_strategy": "no"}),
    )
    peft_config = None
    if options.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    lengths = options.lengths * 3  # two rollouts, a third for a producer that runs ahead
    if options.env_name == "tool_counter":
        prompts = [[{"role": "user", "content": f"Task {k}."}] for k in range(len(lengths))]
        trainer = scripted_tool_trainer(options.model_dir, args=config, train_dataset=Dataset.from_dict({"prompt": prompts}),
                                      environment_factory=IncrementEnv)
    else:
        dataset = task_dataset(range(len(lengths)), options=[{"length": n} for n in lengths])
        panel = task_dataset([100, 101, 102], options=[{"length": n} for n in (3, 20, 3)])
        trainer = scripted_trainer(options.model_dir, args=config, train_dataset=dataset, eval_dataset=panel,
                                  peft_config=peft_config)
    before = parameter_snapshot(trainer.model)
    trainer.train(resume_from_checkpoint=options.resume_from)
    synced = lora_syncs(trainer) if options.lora else None
    adapter = adapter_sync(trainer, Path(options.output_dir, f"adapter-{trainer.accelerator.process_index}")) \
        if options.lora else None
    after = parameter_snapshot(trainer.model)
    rollouts = {"train": rollout_facts(trainer)}
    evaluation = {}
    if options.env_name not in ("tool_counter", "fails_on_step") and not sampling and options.async_staleness is None:
        evaluation = trainer.evaluate()
        rollouts["eval"] = rollout_facts(trainer)
    trainer.close_environments()
    backend = backend_facts(trainer)
    if trainer.accelerator.is_main_process:
        logs = [entry for entry in trainer.state.log_history if "env/step_samples" in entry]  # one per rollout
        Path(options.output_dir, "metrics.json").write_text(json.dumps({
            "processes": trainer.accelerator.num_processes, "logs": logs, "evaluation": evaluation, "rollouts": rollouts,
            **backend}))
        torch.save({"before": before, "after": after, "synced": synced, "adapter": adapter},
                   Path(options.output_dir, "parameters.pt"))
    # An orderly end: no process tears its gloo connections down while another still uses them (CI once saw process 1
    # abort, SIGABRT, at the end of a run that passes here every time).
    trainer.accelerator.wait_for_everyone()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def lora_syncs(trainer: GiGPOTrainer, count: int = 3) -> dict[str, torch.Tensor]:
    """What vLLM's weight sync would load after training, synced `count` times (TRL's iteration, its gathering of the
    shards and its names, with gigpo-trl's merge), without a vLLM engine: the weights of the last sync."""
    generation = engineless_vllm_backend(trainer.model, trainer.accelerator)
    sync_lora_out_of_place(generation)
    for _ in range(count):
        weights = {name: tensor.cpu().clone() for name, tensor in generation._iter_named_params()}
    return weights


def adapter_sync(trainer: GiGPOTrainer, folder: Path) -> dict:
    """What the adapter mode's sync writes for vLLM (`write_adapter` with TRL's gathering), without a vLLM engine: the
    adapter's tensors as written, and whether the parameters gathered were the adapter's and only those."""
    from safetensors.torch import load_file

    backend = engineless_vllm_backend(trainer.model, trainer.accelerator)._dist
    gathered = []

    @contextmanager
    def recording_gather(params):
        gathered.extend(params)
        with backend.gather_params(gathered):
            yield

    write_adapter(trainer.model, "default", folder, gather=recording_gather)
    adapter = {id(param) for name, param in trainer.model.named_parameters() if "lora_" in name}
    return {"tensors": load_file(folder / "adapter_model.safetensors"),
            "gathered_adapter_only": {id(param) for param in gathered} == adapter and len(gathered) == len(adapter)}


def rollout_facts(trainer: GiGPOTrainer) -> dict:
    """Per process, of its latest rollout: the length of each of its episodes and the generation calls it made."""
    rollout = trainer.last_rollout
    return {"episode_lengths": gather_object([[episode.length for episode in rollout.episodes]]),
            "generate_calls": gather_object([rollout.generate_calls])}


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))  # a PartialState made here would fix the device before the config


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("output_dir")
    parser.add_argument("env_name", nargs="?", default="corridor")
    parser.add_argument("--lengths", type=int, nargs=4, default=[3, 3, 12, 12],
                        help="corridor lengths of a rollout's 4 tasks, the first two on process 0 (of 2)")
    parser.add_argument("--beta", type=float, default=0.0, help="KL coefficient (> 0: a reference model)")
    parser.add_argument("--entropy-coef", type=float, default=0.0, help="the entropy bonus's coefficient")
    parser.add_argument("--max-step-samples", type=int, default=None,
                        help="max_step_samples_per_micro_batch: the loss's passes of at most this many rows")
    parser.add_argument("--plain-update", action="store_true", help="packed_update False: every row forwarded whole")
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter (r 8, all linear layers)")
    parser.add_argument("--save-steps", type=int, default=None, help="save a checkpoint every this many steps")
    parser.add_argument("--resume-from", default=None, help="a checkpoint folder to resume training from")
    parser.add_argument("--async-staleness", type=int, default=None,
                        help="rollouts played ahead of the update by at most this many updates (async_staleness)")
    parser.add_argument("--max-steps", type=int, default=2, help="updates the run trains")
    parser.add_argument("--reward-std-filter-ratio", type=float, default=None,
                        help="train with reward-std filtering at this ratio (reward_std_filter_ratio)")
    return parser.parse_args()


if __name__ == "__main__":
    main(parse_args())
