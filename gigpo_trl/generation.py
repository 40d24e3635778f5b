"""The generation switches a rollout flips on TRL's backends: greedy decoding for held-out evaluation, and vLLM's
sleep mode woken once per rollout instead of once per turn; the images a turn's prompts hand TRL's generation
(`generation_image_inputs`); TRL's generated tokens turned into `Completion`s; and the room a prompt has in the model's
context (`prompt_token_limit`, `over_long_prompts`).

The switches change attributes of a `GRPOTrainer` (its `generation_config`, or its `vllm_generation`) for the
duration of a `with` block and restore them after it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from gigpo_trl.batch import PER_TOKEN_IMAGE_KEYS
from gigpo_trl.dialogue import Completion, Prompt, prompt_messages
from gigpo_trl.observations import message_images

if TYPE_CHECKING:
    from trl import GRPOTrainer


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


def completions_from_tokens(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                            logprobs: Sequence[Sequence[float | None]] | None, *, eos_token_id: int,
                            decode: Callable[[list[int]], str]) -> list[Completion]:
    """`Completion`s from what TRL's `_generate_single_turn` returns for a batch of prompts.

    vLLM reports a token whose log-prob is NaN as None: it becomes NaN again (no importance-sampling correction for
    it). An empty answer becomes the EOS token alone (TRL's loss reads the last token of every answer), with a NaN
    log-prob.
    """
    completions = []
    for k, ids in enumerate(completion_ids):
        lps = None if logprobs is None else [float("nan") if lp is None else float(lp) for lp in logprobs[k]]
        ids = list(ids)
        if not ids:
            ids = [eos_token_id]
            lps = None if lps is None else [float("nan")]
        completions.append(Completion(list(prompt_ids[k]), ids, decode(ids), lps))
    return completions


def generation_image_inputs(prompts: Sequence[Prompt], prompt_ids: Sequence[Sequence[int]],
                            image_inputs: Sequence[dict[str, Any] | None]
                            ) -> tuple[list[list[Any] | None] | None, dict[str, Any]]:
    """What TRL's `_generate_single_turn` takes with a turn's prompt ids for their images: `images`, each prompt's
    images (vLLM's `multi_modal_data`; None for a prompt without, and None in all without any), and the processor's
    tensors of the prompts that have images, concatenated in prompt order (HF generation's `pixel_values`, ...); a
    per-token key (`gigpo_trl.batch.PER_TOKEN_IMAGE_KEYS`) as one list per prompt, 0s for a prompt without images,
    which TRL left-pads with the prompts."""
    if not any(image_inputs):
        return None, {}
    images = [message_images(prompt_messages(prompt)) if inputs else None
              for prompt, inputs in zip(prompts, image_inputs)]
    rows = [inputs for inputs in image_inputs if inputs]
    fields = {}
    for key in rows[0]:
        if key in PER_TOKEN_IMAGE_KEYS:
            fields[key] = [inputs[key].reshape(-1).tolist() if inputs else [0] * len(ids)
                           for ids, inputs in zip(prompt_ids, image_inputs)]
        elif key != "num_images":
            fields[key] = torch.cat([inputs[key] for inputs in rows])
    return images, fields


def prompt_token_limit(max_position_embeddings: int | None, vllm_max_model_length: int | None,
                       max_completion_length: int) -> int | None:
    """The most tokens a prompt may have so that its answer, up to `max_completion_length` tokens, fits the model's
    context: vLLM's `max_model_len` where one is set (`vllm_max_model_length`, under vLLM), else the model's
    `max_position_embeddings`; None where neither is known (no limit is checked)."""
    context = vllm_max_model_length or max_position_embeddings
    return None if context is None else context - max_completion_length


def over_long_prompts(prompt_ids: Sequence[Sequence[int]], limit: int | None) -> dict[int, int]:
    """{position: token count} of the prompts of more than `limit` tokens (none without a limit)."""
    if limit is None:
        return {}
    return {k: len(ids) for k, ids in enumerate(prompt_ids) if len(ids) > limit}
