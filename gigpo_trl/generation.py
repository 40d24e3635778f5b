"""TRL's generation backends as the turn's backend (`TRLGeneration`, `gigpo_trl.turns`), the prefix cache that serves
their HF path where one can (`generation_prefix_cache`, `generate_through_prefix_cache`), a model of its own as a
backend (`SnapshotGeneration`, the async producer's), and the switches a rollout flips on them: greedy decoding for
held-out evaluation, and vLLM's sleep mode woken once per rollout instead of once per turn.

The switches change attributes of a `GRPOTrainer` (its `generation_config`, or its `vllm_generation`) for the
duration of a `with` block and restore them after it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from trl.models import unwrap_model_for_generation

from gigpo_trl.prefix_cache import PrefixCache, prefix_cache_problem, until_eos
from gigpo_trl.turns import GeneratedTokens, TurnBatch

if TYPE_CHECKING:
    from trl import GRPOTrainer


@dataclass(frozen=True)
class TRLGeneration:
    """A `GRPOTrainer`'s generation (transformers, vLLM colocate, vLLM server) as the turn's backend: one call of its
    `_generate_single_turn` per turn (`GiGPOTrainer`'s runs HF generation at the training's precision, through the
    prefix cache where one serves, `generate_through_prefix_cache`). On the HF paths it says the prompt tokens each row
    forwarded: those the prefix cache counted, else every prompt token (vLLM's engine does not say)."""

    trainer: GRPOTrainer

    def __call__(self, batch: TurnBatch) -> GeneratedTokens:
        trainer = self.trainer
        completion_ids, logprobs = trainer._generate_single_turn(batch.prompt_ids, batch.images, batch.image_fields, 1)
        if trainer.use_vllm:
            return GeneratedTokens(completion_ids, logprobs)
        cache = trainer.turns.prefix_cache
        counted = cache.take_counts().forwarded_by_prompt if cache is not None else []
        return GeneratedTokens(completion_ids, logprobs, counted or [len(ids) for ids in batch.prompt_ids])


def generate_through_prefix_cache(trainer: GRPOTrainer, cache: PrefixCache, prompt_ids: list[list[int]]
                                  ) -> list[list[int]]:
    """TRL's `generate` path of `_generate_single_turn` through the prefix cache: the same model set-up and generation
    config, each answer up to its first end token (included), but each prompt token that a sequence forwarded earlier
    in the rollout holds read from its kept keys and values."""
    with (
        unwrap_model_for_generation(
            trainer.model_wrapped, trainer.accelerator, gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
            generation_kwargs=trainer.generation_kwargs,
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
        ) as model,
        torch.no_grad(),
        trainer._dist.summon_full_params(trainer.model_wrapped, recurse=False),
    ):
        return prefix_cache_answers(model, cache, prompt_ids, trainer.generation_config, trainer._tokenizer.pad_token_id,
                                    trainer.eos_token_ids)


def prefix_cache_answers(model: torch.nn.Module, cache: PrefixCache, prompt_ids: list[list[int]], generation_config: Any,
                         pad_token_id: int, eos_token_ids: Sequence[int]) -> list[list[int]]:
    """The answers `model` generates through the prefix cache, each up to its first end token (included)."""
    generated = cache.generate(model, prompt_ids, generation_config, pad_token_id)
    return [until_eos(row, set(eos_token_ids)) for row in generated.tolist()]


@dataclass(frozen=True)
class SnapshotGeneration:
    """A model of its own as the turn's backend (the async producer's snapshot of the policy): HF generation through
    the prefix cache with the trainer's generation config, under `autocast` (the training's precision), the answers and
    the prompt tokens each row forwarded as `TRLGeneration` gives them on its prefix-cache path."""

    model: torch.nn.Module
    cache: PrefixCache
    generation_config: Any
    pad_token_id: int
    eos_token_ids: tuple[int, ...]
    autocast: Callable[[], Any]

    def __call__(self, batch: TurnBatch) -> GeneratedTokens:
        with self.autocast(), torch.no_grad():
            answers = prefix_cache_answers(self.model, self.cache, batch.prompt_ids, self.generation_config,
                                           self.pad_token_id, self.eos_token_ids)
        counted = self.cache.take_counts().forwarded_by_prompt
        return GeneratedTokens(answers, None, counted or [len(ids) for ids in batch.prompt_ids])


def generation_prefix_cache(trainer: GRPOTrainer) -> PrefixCache | None:
    """The prefix cache of a trainer's HF generation (`generation_prefix_cache`), or None: under vLLM (its own prefix
    caching does the same), where switched off, or where it cannot serve (said in one warning)."""
    if trainer.use_vllm or not trainer.args.generation_prefix_cache:
        return None
    zero3 = trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3
    problem = prefix_cache_problem(
        trainer.model.config, trainer.generation_config,
        continuous_batching=trainer.use_transformers_continuous_batching,
        sharded="ZeRO-3" if zero3 else "FSDP" if trainer.is_fsdp_enabled else None,
    )
    if problem:
        warnings.warn(f"generation_prefix_cache is off: {problem}; every prompt is forwarded whole at every turn "
                      "(TRL's generate)", stacklevel=4)
        return None
    return PrefixCache()


@contextmanager
def greedy_decoding(trainer: GRPOTrainer, enabled: bool = True) -> Iterator[None]:
    """Decode greedily inside the block (held-out evaluation): vLLM at temperature 0, or `generate` without sampling."""
    if not enabled:
        yield
        return
    backend, name, greedy = ((trainer.vllm_generation, "temperature", 0.0) if trainer.use_vllm
                             else (trainer.generation_config, "do_sample", False))
    saved = getattr(backend, name)
    setattr(backend, name, greedy)
    try:
        yield
    finally:
        setattr(backend, name, saved)


@contextmanager
def vllm_awake(trainer: GRPOTrainer) -> Iterator[None]:
    """vLLM colocate with `vllm_enable_sleep_mode`: TRL's generate wakes the engine (a level-2 sleep discards the
    weights, so every weight is pushed again) and puts it back to sleep at every call, which is every turn of a
    rollout. Inside the block the engine is woken once, with the current weights, and it sleeps once after it.
    Nothing changes for another backend."""
    generation = getattr(trainer, "vllm_generation", None) if trainer.use_vllm else None
    if generation is None or generation.mode != "colocate" or not generation.enable_sleep_mode:
        yield
        return
    if generation._llm_weights_sleeping:
        generation.sync_weights()  # wakes the weights up and loads the current ones
        trainer._last_loaded_step = trainer.state.global_step
    generation.llm.wake_up(tags=["kv_cache"])
    generation.enable_sleep_mode = False  # TRL's generate: no wake-up and no sleep per turn
    try:
        yield
    finally:
        generation.enable_sleep_mode = True
        generation.llm.sleep(level=2)
        generation._llm_weights_sleeping = True
