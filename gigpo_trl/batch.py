"""From step samples to the batch TRL's loss consumes: which samples become rows, padding, tensors, the old and
reference log-probs, and vLLM's importance-sampling ratio.

Every process must hand the loss the same number of rows, divisible by `steps_per_generation` (TRL splits the batch
into that many micro-batches and runs collective forward passes under ZeRO-3/FSDP). A process with fewer samples
pads with copies of its own rows whose loss weight (`tool_mask`) and advantage are 0, added after the advantages
were computed, so they change neither the group statistics nor, for the allowed loss types, the gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

import torch
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import pad, use_adapter

from gigpo_trl.dialogue import Completion
from gigpo_trl.metric_names import ASYNC_BEHAVIOUR_MASKED_SHARE, ASYNC_BEHAVIOUR_RATIO
from gigpo_trl.observations import PER_TOKEN_IMAGE_KEYS

if TYPE_CHECKING:
    from trl import GRPOTrainer


def image_batch(completions: Sequence[Completion], prompt_width: int, completion_width: int,
                device: torch.device | str = "cpu") -> dict[str, Any]:
    """The image inputs of a batch's rows in TRL's layout (what `GRPOTrainer._get_per_token_logps_and_entropies`
    slices per row): each key's tensors of the rows that have images (`Completion.image_inputs`) concatenated on
    their first dimension, in row order; the per-token keys (`PER_TOKEN_IMAGE_KEYS`) as (B, prompt_width +
    completion_width) rows aligned with the batch's left-padded prompts and right-padded answers (0 on padding, answers
    and rows without images); and `num_images`, a list with each row's image count (0 for a row without). {} when no
    row has an image.

    Raises:
        ValueError: rows whose processor outputs hold different keys.
    """
    rows = [completion.image_inputs for completion in completions]
    if not any(rows):
        return {}
    keys = {frozenset(key for key in inputs if key != "num_images") for inputs in rows if inputs}
    if len(keys) > 1:
        raise ValueError(f"the rows' image inputs hold different keys ({sorted(map(sorted, keys))}): every prompt "
                         "with images must come from the same processor")
    batch: dict[str, Any] = {}
    for key in sorted(next(iter(keys))):
        if key in PER_TOKEN_IMAGE_KEYS:
            per_token = torch.zeros(len(rows), prompt_width + completion_width, dtype=torch.long)
            for row, inputs in enumerate(rows):
                if inputs:
                    values = inputs[key].reshape(-1)
                    per_token[row, prompt_width - len(values):prompt_width] = values
            batch[key] = per_token.to(device)
        else:
            batch[key] = torch.cat([inputs[key] for inputs in rows if inputs]).to(device)
    return batch | {"num_images": [inputs["num_images"] if inputs else 0 for inputs in rows]}


def rows_for_update(num_samples: int, *, chunks: int, max_across_processes: Callable[[int], int]) -> tuple[list[int], list[float]]:
    """Which samples form this process's rows, and their loss weights: every sample, then padding rows.

    Args:
        num_samples: this process's step samples.
        chunks: the micro-batches the rows are split into (`steps_per_generation`; 1 for evaluation).
        max_across_processes: the maximum of an int over all processes.

    Returns:
        (row -> sample index, row weights: 1 for samples, 0 for padding rows). The row count is the same on every
        process: the largest sample count (at least 1), rounded up to a multiple of `chunks`.
    """
    num_rows = max(max_across_processes(num_samples), 1)
    num_rows = -(-num_rows // chunks) * chunks
    samples = list(range(num_samples))
    padding = [k % num_samples if num_samples else 0 for k in range(num_rows - num_samples)]
    return samples + padding, [1.0] * num_samples + [0.0] * len(padding)


def padded_batch(completions: Sequence[Completion], weights: Sequence[float], advantages: Sequence[float], *,
                 pad_token_id: int, pad_to_multiple_of: int | None, truncation_end_ids: Collection[int] | None,
                 device: torch.device | str) -> dict[str, torch.Tensor]:
    """The rows as GRPOTrainer's loss reads them: prompts left-padded, answers right-padded.

    Args:
        completions, weights, advantages: one per row; a row's loss weight (1 real, 0 padding) is its `tool_mask`.
        truncation_end_ids: None, or the tokens that end an answer: then an answer whose last token is not one of
            them was cut at `max_completion_length` and gets no loss (`mask_truncated_completions`).

    Returns:
        `prompt_ids`, `prompt_mask` (B, P); `completion_ids`, `completion_mask`, `tool_mask` (B, C) long;
        `advantages` (B,) float32; and `sampling_per_token_logps` (B, C) when every row has its sampling log-probs.
    """
    prompt_ids = [torch.tensor(c.prompt_ids) for c in completions]
    completion_ids = [torch.tensor(c.completion_ids) for c in completions]
    prompt_mask = pad([torch.ones_like(t) for t in prompt_ids], 0, "left", pad_to_multiple_of).to(device)
    completion_mask = pad([torch.ones_like(t) for t in completion_ids], 0, "right", pad_to_multiple_of).to(device)
    if truncation_end_ids is not None:
        finished = torch.tensor([c.completion_ids[-1] in truncation_end_ids for c in completions], device=device)
        completion_mask = completion_mask * finished.unsqueeze(1).int()
    batch = {
        "prompt_ids": pad(prompt_ids, pad_token_id, "left", pad_to_multiple_of).to(device),
        "prompt_mask": prompt_mask,
        "completion_ids": pad(completion_ids, pad_token_id, "right", pad_to_multiple_of).to(device),
        "completion_mask": completion_mask,
        # (B, C): the row's loss weight on every token
        "tool_mask": torch.tensor(weights, device=device).long().unsqueeze(1).expand_as(completion_mask).contiguous(),
        "advantages": torch.tensor(advantages, dtype=torch.float32, device=device),
    }
    if all(c.logprobs is not None for c in completions):
        logprobs = [torch.tensor(c.logprobs, dtype=torch.float32) for c in completions]
        batch["sampling_per_token_logps"] = pad(logprobs, 0.0, "right", pad_to_multiple_of).to(device)
    return batch


def importance_sampling_ratio(
    old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, mode: str,
    clip_min: float | None, clip_max: float | None,
) -> torch.Tensor:
    """vLLM importance-sampling correction `exp(old - sampling)`, as GRPOTrainer defines it.

    Args:
        old_logps, sampling_logps, mask: (B, C) trainer log-probs, vLLM sampling log-probs, loss mask.
        mode: "token_truncate" | "token_mask" (per token, (B, C)) or "sequence_truncate" |
            "sequence_mask" (summed per sequence, (B, 1)). "*_truncate" clamps to [clip_min, clip_max];
            "*_mask" zeroes ratios outside it.
    """
    difference = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)  # NaN: no sampling logprob, no correction
    if mode.startswith("sequence"):
        difference = difference.sum(dim=-1, keepdim=True)
    ratio = torch.exp(difference)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -float("inf")
    high = clip_max if clip_max is not None else float("inf")
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def sampling_statistics(old_logps: torch.Tensor, sampling_logps: torch.Tensor, ratio: torch.Tensor,
                        loss_mask: torch.Tensor) -> torch.Tensor:
    """One process's part of vLLM's `sampling/*` diagnostics, over the tokens (or, for sequence-level ratios, the
    rows) of real step samples: a token vLLM could not score (NaN) tells nothing.

    Args:
        old_logps, sampling_logps, loss_mask: (B, C). ratio: (B, C) or (B, 1).

    Returns:
        float64 (7,): sum, count and max of |old - sampling|; sum, count, min and max of the ratios. Gather them
        over processes (P, 7) for `sampling_metrics`.
    """
    mask = loss_mask.bool()
    delta = (old_logps - sampling_logps).abs()
    delta = delta[mask & ~torch.isnan(delta)]
    ratios = ratio[mask] if ratio.size(1) > 1 else ratio[mask.any(dim=1)].flatten()
    inf = torch.tensor(float("inf"), device=delta.device)
    return torch.stack([
        delta.sum(), torch.tensor(float(delta.numel()), device=delta.device), delta.max() if delta.numel() else -inf,
        ratios.sum(), torch.tensor(float(ratios.numel()), device=delta.device),
        ratios.min() if ratios.numel() else inf, ratios.max() if ratios.numel() else -inf,
    ]).double()


def sampling_metrics(parts: torch.Tensor) -> dict[str, Any]:
    """`sampling/*` metrics as GRPOTrainer logs them, from the (P, 7) `sampling_statistics` of all processes;
    those that have no token to describe are left out."""
    delta_sum, delta_count, ratio_sum, ratio_count = (parts[:, k].sum().item() for k in (0, 1, 3, 4))
    metrics = {}
    if delta_count:
        metrics["sampling/sampling_logp_difference/mean"] = delta_sum / delta_count
        metrics["sampling/sampling_logp_difference/max"] = parts[:, 2].max().item()
    if ratio_count:
        metrics["sampling/importance_sampling_ratio/min"] = parts[:, 5].min().item()
        metrics["sampling/importance_sampling_ratio/mean"] = ratio_sum / ratio_count
        metrics["sampling/importance_sampling_ratio/max"] = parts[:, 6].max().item()
    return metrics


def behaviour_weighted_advantages(advantages: torch.Tensor, proximal_logps: torch.Tensor,
                                  behaviour_logps: torch.Tensor, mask: torch.Tensor, stale: torch.Tensor, mode: str,
                                  clip_min: float | None, clip_max: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled PPO's correction of rows sampled by an older policy (the async producer's snapshot), as advantages.

    The loss of a stale row is TRL's clipped objective on the ratio to the proximal policy (the weights that train on
    it), its tokens weighted by proximal / behaviour (`importance_sampling_ratio`: per token or per sequence,
    truncated or masked to [clip_min, clip_max]). A weight w >= 0 scales a token's loss -min(r A, clip(r) A) as it
    scales its advantage (min(r wA, clip(r) wA) = w min(r A, clip(r) A)), so the weighted loss is TRL's loss with
    advantages A w. A fresh row (`stale` False) was sampled by the proximal policy itself: its weight is 1.

    Args:
        advantages: (B,) each row's advantage.
        proximal_logps, behaviour_logps, mask: (B, C) the proximal and behaviour log-probs of each answer token, the
            loss mask.
        stale: (B,) bool, the rows sampled by an older policy.

    Returns:
        The advantages, (B, C) (the rows' unchanged where no row is stale: (B,)); and the stale rows' weights, (B, C)
        or (B, 1) (for the metrics).
    """
    weights = importance_sampling_ratio(proximal_logps, behaviour_logps, mask, mode, clip_min, clip_max)
    weights = torch.where(stale.unsqueeze(1), weights, torch.ones_like(weights))
    return advantages.unsqueeze(1) * weights.expand_as(proximal_logps), weights[stale]


def loss_batch(trainer: GRPOTrainer, completions: Sequence[Completion], weights: Sequence[float],
               advantages: Sequence[float], mode: str, *, sampled: bool = True,
               staleness: Sequence[int] | None = None) -> dict[str, Any]:
    """The dict `GRPOTrainer._compute_loss` consumes: the rows padded (`padded_batch`), the global token count,
    and the old and reference log-probs and vLLM's importance-sampling ratio where GRPOTrainer would compute them,
    with the trainer's models and TRL's forward pass (`_get_per_token_logps_and_entropies`); the ratio's
    `sampling/*` metrics go to the trainer's logs.

    Args:
        trainer: the `GRPOTrainer` (a `GiGPOTrainer`) whose models score the rows.
        completions, weights, advantages: one per row (weights: 1 for samples, 0 for padding rows).
        mode: "train" or "eval".
        sampled: False when the rows were decoded greedily (a held-out evaluation): then no importance-sampling
            correction applies (a ratio of 1) and no `sampling/*` metric is logged. Greedy tokens were not drawn
            from the trainer's tempered distribution, and vLLM's log-probs of them do not describe it (measured with
            vLLM's CPU build: 0.23 apart per token, against 0.001 for sampled tokens): as a ratio they masked
            every row and zeroed the evaluation loss.
        staleness: with `async_staleness`, each row's lag behind the weights that train on it; rows that lag are
            corrected by decoupled PPO (`behaviour_weighted_advantages`, their behaviour log-probs in
            `Completion.logprobs`), with the old log-probs (the clip's anchor) those of the current weights.
    """
    device = trainer.accelerator.device
    ends = {*trainer.eos_token_ids, trainer._tokenizer.pad_token_id} if trainer.mask_truncated_completions else None
    batch = padded_batch(completions, weights, advantages, pad_token_id=trainer._tokenizer.pad_token_id,
                         pad_to_multiple_of=trainer.pad_to_multiple_of, truncation_end_ids=ends, device=device)
    loss_mask = batch["completion_mask"] * batch["tool_mask"]
    batch["num_items_in_batch"] = trainer.accelerator.gather(loss_mask.sum()).sum()

    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    logits_to_keep = batch["completion_ids"].size(1)
    forward_batch = trainer.args.max_step_samples_per_micro_batch or (
        trainer.args.per_device_train_batch_size if mode == "train" else trainer.args.per_device_eval_batch_size
    )

    images = image_batch(completions, batch["prompt_ids"].size(1), batch["completion_ids"].size(1), device)
    batch |= images

    def log_probs(model: Any) -> torch.Tensor:
        return trainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                          batch_size=forward_batch, **images)[0]

    with torch.no_grad(), disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs):
        # Same rule as GRPOTrainer: old log-probs only when updates run off-policy or vLLM sampled.
        generate_every = trainer.args.steps_per_generation * trainer.num_iterations
        loss_takes_ratio = trainer.use_vllm and trainer.vllm_importance_sampling_correction
        is_correction = loss_takes_ratio and sampled
        stale = torch.tensor([lag > 0 for lag in staleness] if staleness else [False] * len(completions), device=device)
        # every process scores and gathers alike when one of them holds stale rows (forwards and gathers are collective)
        any_stale = staleness is not None and trainer._max_across_processes(int(stale.any())) > 0
        behaviour_logps = batch.pop("sampling_per_token_logps", None) if staleness is not None else None
        if trainer.args.gradient_accumulation_steps % generate_every != 0 or is_correction or any_stale:
            batch["old_per_token_logps"] = log_probs(trainer.model)
        if any_stale:
            if behaviour_logps is None:  # fresh rows: their behaviour policy is the proximal one
                behaviour_logps = batch["old_per_token_logps"]
            batch["advantages"], behaviour = behaviour_weighted_advantages(
                batch["advantages"], batch["old_per_token_logps"], behaviour_logps, loss_mask, stale,
                trainer.vllm_importance_sampling_mode, trainer.vllm_importance_sampling_clip_min,
                trainer.vllm_importance_sampling_clip_max)
            if trainer.off_policy_mask_threshold is not None:  # TRL's off-policy mask reads the behaviour log-probs
                batch["sampling_per_token_logps"] = behaviour_logps
            for name, value in behaviour_metrics(behaviour, loss_mask[stale], trainer.accelerator.gather).items():
                trainer._metrics[mode][name].append(value)
        if is_correction:
            sampling_logps = batch.get("sampling_per_token_logps")
            if sampling_logps is None:
                raise RuntimeError("vLLM importance-sampling correction needs the sampling log-probs, but the backend returned none")
            ratio = importance_sampling_ratio(
                batch["old_per_token_logps"], sampling_logps, loss_mask, trainer.vllm_importance_sampling_mode,
                trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max,
            )
            batch["importance_sampling_ratio"] = ratio
            statistics = sampling_statistics(batch["old_per_token_logps"], sampling_logps, ratio, loss_mask)
            for name, value in sampling_metrics(trainer.accelerator.gather(statistics).view(-1, 7)).items():
                trainer._metrics[mode][name].append(value)
        elif loss_takes_ratio:  # greedy rows: TRL's loss multiplies by a ratio all the same; 1 corrects nothing
            batch["importance_sampling_ratio"] = torch.ones(len(completions), 1, device=device)
        if trainer.beta != 0.0:
            if trainer.ref_model is not None:
                batch["ref_per_token_logps"] = log_probs(trainer.ref_model)
            else:  # PEFT: the reference is the model with its adapter disabled (or a "ref" copy)
                unwrapped = trainer.accelerator.unwrap_model(trainer.model)
                with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
                    batch["ref_per_token_logps"] = log_probs(trainer.model)
    return batch


def behaviour_metrics(weights: torch.Tensor, mask: torch.Tensor, gather: Callable[[torch.Tensor], torch.Tensor]
                      ) -> dict[str, float]:
    """The stale rows' behaviour weights over all processes: their mean, min and max over the answer tokens they weigh
    (per sequence: over the rows), and the share of them masked to 0 (`*_mask` modes)."""
    values = weights[mask.bool()] if weights.size(1) > 1 else weights.flatten()
    local = torch.stack([values.sum(), torch.tensor(float(values.numel())), (values == 0).sum().float(),
                         values.min() if values.numel() else torch.tensor(float("inf")),
                         values.max() if values.numel() else torch.tensor(-float("inf"))]).double()
    parts = gather(local.to(weights.device)).view(-1, 5)
    count = parts[:, 1].sum().item()
    if not count:
        return {}
    return {ASYNC_BEHAVIOUR_RATIO + "mean": parts[:, 0].sum().item() / count,
            ASYNC_BEHAVIOUR_RATIO + "min": parts[:, 3].min().item(), ASYNC_BEHAVIOUR_RATIO + "max": parts[:, 4].max().item(),
            ASYNC_BEHAVIOUR_MASKED_SHARE: parts[:, 2].sum().item() / count}
