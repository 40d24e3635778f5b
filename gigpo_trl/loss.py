"""What GiGPO changes around TRL's loss, as functions of tensors: a micro-batch split into row chunks of bounded size
(the memory bound, `max_step_samples_per_micro_batch`), and the entropy bonus as a token mean over the whole rollout.

Why chunks are exact: the loss types GiGPO allows ("dapo", "cispo", "vespo") sum the per-token loss over a micro-batch
and divide by one number fixed by the whole rollout (`rollout_token_normalizer`), so the loss of a micro-batch is the
sum of the losses of its row chunks, and its gradient the sum of theirs. A chunk's activations are freed by its
backward pass before the next chunk runs: the update's peak memory is that of one chunk, and every sample trains.

Why TRL's entropy bonus is not used as it is: `GRPOTrainer` averages the entropy over each micro-batch's own tokens and
then weighs the micro-batches equally, so a micro-batch of few real rows (the zero-weight rows that keep processes in
lock-step, or a chunk) weighs as much as a full one. Here the bonus of a micro-batch is
`coef * sum(H * mask) / normalizer`, with the policy term's normalizer: over one optimizer step, the bonus is `coef`
times the mean entropy of every real completion token of the rollout, on one process or many, however the rows are
split. That is TRL's documented objective `L = L_policy - coef * H`, with H the rollout's token mean.
"""

from __future__ import annotations

from typing import Any

import torch


def row_chunks(inputs: dict[str, Any], size: int | None) -> list[dict[str, Any]]:
    """A micro-batch (the dict `GRPOTrainer._compute_loss` reads) as consecutive slices of at most `size` rows.

    Every tensor with a row dimension ((B, ...) tensors) is sliced along it; anything else (the 0-dim
    `num_items_in_batch`, which spans the whole rollout) is shared by every chunk. `size` None: one chunk, the
    micro-batch itself.
    """
    rows = inputs["prompt_ids"].size(0)
    if size is None or rows <= size:
        return [inputs]
    return [{key: value[start : start + size] if isinstance(value, torch.Tensor) and value.dim() else value
             for key, value in inputs.items()} for start in range(0, rows, size)]


def rollout_token_normalizer(num_items_in_batch: torch.Tensor, *, num_processes: int, accumulation_steps: int | None,
                             steps_per_generation: int) -> torch.Tensor:
    """What GRPOTrainer divides a micro-batch's summed token loss by under the loss types "dapo", "cispo" and
    "vespo": the real completion tokens of the whole generation batch (all processes) per process, rescaled to one
    accumulation window in training. Summed over the micro-batches of an optimizer step and averaged over processes,
    `sum(x * mask) / normalizer` is the token mean of x over the rollout.

    Args:
        num_items_in_batch: 0-dim, the real completion tokens of the generation batch on all processes.
        accumulation_steps: the Trainer's current gradient accumulation steps in training; None in evaluation, where the
            batch is neither split across steps nor accumulated.
    """
    normalizer = num_items_in_batch.clamp(min=1.0) / num_processes
    if accumulation_steps is not None:
        normalizer = normalizer * accumulation_steps / steps_per_generation
    return normalizer


def entropy_bonus(entropies: torch.Tensor, mask: torch.Tensor, normalizer: torch.Tensor, coef: float) -> torch.Tensor:
    """`coef * sum(H * mask) / normalizer`: this micro-batch's share of `coef` times the rollout's token-mean entropy.

    Args:
        entropies: (B, C) per-token entropies of the policy (with gradient).
        mask: (B, C) the tokens the bonus acts on (real completion tokens; under `top_entropy_quantile` < 1 only the
            high-entropy ones, as in TRL).
        normalizer: 0-dim, `rollout_token_normalizer` of the micro-batch.
    """
    return coef * (entropies * mask).sum() / normalizer


def next_entropy_coef(coef: float, entropy: float, *, target: float, delta: float, minimum: float,
                      maximum: float) -> float:
    """The adaptive entropy coefficient of Skywork-OR1 (TRL's `use_adaptive_entropy`), after an optimizer step whose
    rollout's token-mean entropy was `entropy`: raised by `delta` (at most `maximum`) when the entropy is at or below
    `target`, lowered by `delta` (at least `minimum`) otherwise."""
    if entropy <= target:
        return min(coef + delta, maximum)
    return max(coef - delta, minimum)
