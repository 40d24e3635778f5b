"""The choices of GiGPO's options, and the checks of option values that the configuration shares with the code that
runs them. It imports nothing of the package, so that the configuration (`gigpo_trl.config`) sits at the bottom of
the import graph with it: the modules that run an option import its names from here, never from the configuration's
neighbours.
"""

from __future__ import annotations

import math
from typing import Any

# advantage_norm: how the episode and step advantages are normalized within their groups (`gigpo_trl.advantages`).
NORM_MODES = ("mean_std", "mean")
# episode_stats: what the episode advantage's group statistics are taken over.
EPISODE_STATS_MODES = ("steps", "trajectories")
# dynamic_sampling_signal: what makes a task group worth an update (`gigpo_trl.dynamic_sampling`).
SIGNAL_MODES = ("returns", "advantages")
# vllm_lora_sync: how vLLM gets a LoRA model's weights (`gigpo_trl.weight_sync`, `gigpo_trl.vllm_lora`).
VLLM_LORA_SYNC_MODES = ("merged", "adapter")
# tool_anchor: the anchors of TRL's environment classes (`gigpo_trl.trl_environment`).
TOOL_ANCHOR_MODES = ("state", "tool_calls")
# context_overflow: what a conversation does when its next prompt would not fit the model's context (`gigpo_trl.turns`).
CONTEXT_OVERFLOW_MODES = ("truncate", "drop_oldest")

# The arguments of TRL 1.16's colocated `LLM(...)` call (`VLLMGeneration._init_vllm`) and of the adapter mode, each
# with the setting that sets it: vllm_engine_kwargs may not set them a second time.
ENGINE_ARGUMENTS_SET = {
    "model": "the model given to the trainer", "tensor_parallel_size": "vllm_tensor_parallel_size",
    "gpu_memory_utilization": "vllm_gpu_memory_utilization", "max_model_len": "vllm_max_model_length",
    "max_num_seqs": "per_device_train_batch_size x steps_per_generation",
    "enable_sleep_mode": "vllm_enable_sleep_mode", "model_impl": "vllm_model_impl",
    "distributed_executor_backend": "TRL (external_launcher)", "seed": "TRL (the process index)",
    "max_num_batched_tokens": "TRL (4096)", "logprobs_mode": "TRL (processed_logprobs)",
    "quantization": "the model's quantization_config", "trust_remote_code": "trust_remote_code",
    "enable_lora": "vllm_lora_sync", "max_lora_rank": "vllm_lora_sync (the adapter's rank)",
    "max_loras": "vllm_lora_sync",
}


def std_filter_kept_count(num_groups: int, ratio: float) -> int:
    """`k = ceil(ratio * num_groups)`: the groups the reward-std filter keeps of `num_groups`; at least 1 of any.
    (RAGEN floors, which keeps none where ratio * num_groups < 1.) The product is rounded to 9 decimals first, so
    that 0.3 of 10 groups keeps 3 (0.3 * 10 is 3.0000000000000004 in binary floating point)."""
    return math.ceil(round(ratio * num_groups, 9))


def engine_kwargs_problems(engine_kwargs: Any, use_vllm: bool, vllm_mode: str) -> list[str]:
    """Why `vllm_engine_kwargs` cannot be added to the colocated engine's start: not a dict of names, set without a
    colocated engine, or naming an argument TRL (or the adapter mode) already sets (`ENGINE_ARGUMENTS_SET`)."""
    if not engine_kwargs:
        return []
    if not isinstance(engine_kwargs, dict) or not all(isinstance(name, str) for name in engine_kwargs):
        return [f"vllm_engine_kwargs must be a dict of vLLM engine arguments, got {engine_kwargs!r}"]
    if not use_vllm or vllm_mode != "colocate":
        return [f"vllm_engine_kwargs are added to the colocated vLLM engine, and this run has none (use_vllm={use_vllm}, "
                f"vllm_mode={vllm_mode!r}): a server takes its engine arguments on its own command line (vllm serve "
                "--kv-cache-memory-bytes ...)"]
    taken = [f"{name} (set by {ENGINE_ARGUMENTS_SET[name]})" for name in engine_kwargs if name in ENGINE_ARGUMENTS_SET]
    if taken:
        return [f"vllm_engine_kwargs may not set what TRL's engine start already sets: {', '.join(taken)}"]
    return []
