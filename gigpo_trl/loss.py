"""What GiGPO changes around TRL's loss, as functions of tensors: a micro-batch split into row chunks of bounded size
(the memory bound, `max_step_samples_per_micro_batch`), the entropy bonus as a token mean over the whole rollout, and
the loss's metrics repaired: its per-row metrics leave the lock-step padding rows out (`padding_free_row_metrics`), and
a micro-batch run in several passes logs one value (`merged_pass_metrics`).

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

The functions are pure; `GiGPOLossMixin`, at the end, is the trainer's loss path built on them: the `GRPOTrainer`
methods `GiGPOTrainer` overrides around the loss (it inherits the mixin before `GRPOTrainer`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from accelerate.utils import DistributedType
from trl.trainer.utils import split_pixel_values_by_grid, split_tensor_dict, unsplit_pixel_values_by_grid

from gigpo_trl.packing import joined, packed_logps_and_entropies, packing_problem, rows_by_prompt

# GRPOTrainer's loss metrics averaged over rows (not tokens) under importance_sampling_level="sequence"; "vespo/phi_seq_mean"
# always is.
SEQUENCE_LEVEL_ROW_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "cispo_clip_ratio")


def padding_free_row_metrics(logged: dict[str, float], real: int, total: int, importance_sampling_level: str) -> dict[str, float]:
    """The per-row metrics of GRPOTrainer's loss recomputed over the `real` rows of a micro-batch of `total` rows.

    GRPOTrainer averages these over rows, padding rows included. A padding row's values are known: its loss mask
    is 0 and its advantage 0, so its sequence-level importance ratio is 1, it is never clipped (0), and its VESPO
    weight phi(1) is 1. Token-level metrics need nothing: they are masked.

    Args:
        logged: metric name -> the value GRPOTrainer just logged for the micro-batch (all processes).
        real, total: the micro-batch's real and total rows, all processes.
    """
    corrected = {}
    if "vespo/phi_seq_mean" in logged:
        corrected["vespo/phi_seq_mean"] = (logged["vespo/phi_seq_mean"] * total - (total - real)) / real
    if importance_sampling_level == "sequence":
        for key in SEQUENCE_LEVEL_ROW_METRICS:
            if key in logged:
                corrected[key] = logged[key] * total / real
        if "clip_ratio/low_min" in logged:  # per-row values are 0 or 1: the minimum is 1 only if every real row is 1
            corrected["clip_ratio/low_min"] = 1.0 if corrected["clip_ratio/low_mean"] >= 1.0 - 1e-9 else 0.0
    return corrected


def merged_pass_metrics(passes: Sequence[float], rows: Sequence[int], tokens: Sequence[int], name: str,
                        importance_sampling_level: str) -> float:
    """One loss metric of a micro-batch from its values in the passes it ran in (the memory bound's row chunks), as if
    it had run in one pass: extremes (`*_min`, `*_max`) by their extreme, `policy_loss` (each pass's share of the
    rollout's token mean) by its sum, the coefficient `entropy_coef` as it is, and the means by their mean weighted
    with the real tokens (or, for the row-level ones, the real rows) of each pass.

    Args:
        passes: the metric's value in each pass that held real rows, in order.
        rows, tokens: the real rows and real completion tokens of those passes, all processes.
    """
    if name.endswith("_min"):
        return min(passes)
    if name.endswith("_max"):
        return max(passes)
    if name == "policy_loss":
        return float(sum(passes))
    if name == "entropy_coef":
        return passes[-1]
    row_level = name == "vespo/phi_seq_mean" or (importance_sampling_level == "sequence" and name in SEQUENCE_LEVEL_ROW_METRICS)
    weights = rows if row_level else tokens
    return float(np.average(passes, weights=weights))


def row_chunks(inputs: dict[str, Any], size: int | None) -> list[dict[str, Any]]:
    """A micro-batch (the dict `GRPOTrainer._compute_loss` reads) as consecutive slices of at most `size` rows.

    Every tensor with a row dimension ((B, ...) tensors) and every list (`num_images`) is sliced along it; the image
    tensors, indexed by image or patch, go with their rows (TRL's `split_pixel_values_by_grid`); anything else (the
    0-dim `num_items_in_batch`, which spans the whole rollout) is shared by every chunk. `size` None: one chunk, the
    micro-batch itself.
    """
    rows = inputs["prompt_ids"].size(0)
    if size is None or rows <= size:
        return [inputs]
    by_row = split_pixel_values_by_grid(inputs)
    return [unsplit_pixel_values_by_grid({
        key: value[start : start + size] if isinstance(value, list) or isinstance(value, torch.Tensor) and value.dim()
        else value for key, value in by_row.items()}) for start in range(0, rows, size)]


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


class GiGPOLossMixin:
    """`GRPOTrainer`'s loss path with the padding rows left out, in passes of bounded size, and with the entropy bonus
    as a token mean over the rollout; inherited by `GiGPOTrainer` before `GRPOTrainer`, whose methods `super()` calls.

    - `compute_loss` runs a training micro-batch in passes of at most `max_step_samples_per_micro_batch` rows, their
      gradients accumulated (`_loss_in_passes`), and `prediction_step` the evaluation loss likewise.
    - `_compute_loss` calls `GRPOTrainer`'s, corrects its per-row metrics for the padding rows, and subtracts the
      entropy bonus (`_entropy_bonus`, `_adapt_entropy_coef`); `_get_per_token_logps_and_entropies` keeps the entropies
      of the loss's pass for it.

    The trainer calls `_setup_loss` once `GRPOTrainer.__init__` has run.
    """

    def _setup_loss(self) -> None:
        """Take TRL's entropy bonus over and start the loss path's state."""
        # TRL's entropy bonus averages per micro-batch; GiGPO's is a token mean over the rollout (`_compute_loss`).
        self._rollout_entropy_bonus, self._entropy_bonus_enabled = self._entropy_bonus_enabled, False
        self._loss_entropies: torch.Tensor | None = None  # of the loss's latest forward pass
        self._pass_counts: list[tuple[int, int]] = []  # real rows and tokens (all processes) of a micro-batch's passes
        self._update_without_trajectories = False  # the rollout of this update: every trajectory failed by its env
        problem = packing_problem(self.model.config, self.accelerator.device.type) if self.args.packed_update else None
        self._packed_update = self.args.packed_update and problem is None
        # The rows of a rollout can be ordered by prompt in place of TRL's shuffle (more sharing per micro-batch) where
        # the update is the same whatever the split: one optimizer step per rollout, and no per-micro-batch quantile.
        self._rows_by_prompt = self._packed_update and self.args.top_entropy_quantile == 1.0 and \
            self.args.gradient_accumulation_steps == self.args.steps_per_generation
        if problem:
            warnings.warn(f"packed_update is off for this model: {problem}; every row is forwarded whole (TRL's path)",
                          stacklevel=2)

    def _prepare_inputs(self, generation_batch: dict[str, Any]) -> dict[str, Any]:
        """GRPOTrainer's micro-batch of the rollout; under the packed update, where the split changes nothing
        (`_setup_loss`), the rollout's rows are split in the order of their prompts (`rows_by_prompt`) rather than
        TRL's shuffled order, so that the rows a micro-batch packs together share more."""
        buffered = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        if self.model.training and self._rows_by_prompt and self._buffered_inputs is not buffered:  # a new rollout
            self._buffered_inputs = split_tensor_dict(rows_by_prompt(joined(self._buffered_inputs)),
                                                      self.args.steps_per_generation)
            inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]
        return inputs

    def compute_loss(self, model, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch=None):
        """GRPOTrainer's loss of a training micro-batch, in passes of at most max_step_samples_per_micro_batch rows
        (`_loss_in_passes`), whose gradients are accumulated: the same loss and gradient as one pass, with the peak
        memory of one pass."""
        if not self.model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self._update_without_trajectories and not self.is_deepspeed_enabled:
            # Every trajectory of the rollout failed by its environment, on every process: a loss with no path to the
            # parameters leaves their gradients unset, so the optimizer step moves nothing (AdamW skips a parameter
            # without a gradient; on zero gradients its momentum would still move the weights). DeepSpeed's engine
            # takes no such loss and steps on its own: there the update runs on the zero-weight rows.
            return torch.zeros((), device=self.accelerator.device, requires_grad=True)
        loss = self._loss_in_passes(model, inputs, self.args.max_step_samples_per_micro_batch, backward=True)
        if self._rollout_entropy_bonus and self.use_adaptive_entropy and self.accelerator.sync_gradients:
            self._adapt_entropy_coef()
        return loss

    def _loss_in_passes(self, model, inputs: dict[str, Any], size: int | None, *, backward: bool) -> torch.Tensor:
        """GRPOTrainer's loss of a micro-batch computed over its row chunks of at most `size` rows
        (`row_chunks`) and summed: exact for the allowed loss types, which sum over tokens and divide by
        the whole rollout's token count; every process makes the same number of passes (its row count is the same).
        With `backward`, every pass but the last is backpropagated here, its gradients accumulated without a sync or an
        optimizer step, and the last is returned for the Trainer's backward pass, carrying the earlier passes' loss as
        a constant. The loss metrics the passes log are merged into the micro-batch's (`merged_pass_metrics`)."""
        mode = "train" if self.model.training else "eval"
        logged = {key: len(values) for key, values in self._metrics[mode].items()}
        self._pass_counts = []
        chunks = row_chunks(inputs, size)
        earlier = 0.0
        for chunk in chunks[:-1]:
            loss = super().compute_loss(model, chunk)
            if backward:
                self._backward_accumulating(model, loss)
            earlier = earlier + loss.detach()
        loss = super().compute_loss(model, chunks[-1]) + earlier
        if len(chunks) > 1:
            self._merge_pass_metrics(mode, logged)
        return loss

    def _merge_pass_metrics(self, mode: str, logged: dict[str, int]) -> None:
        """One value per loss metric for a micro-batch that ran in several passes, as one pass would have logged it.
        Passes without a real row (on every process) log nothing (`_compute_loss`); a metric logged once per pass that
        held real rows is merged, any other (logged once per micro-batch) left as it is."""
        counts = [(rows, tokens) for rows, tokens in self._pass_counts if rows]
        for key, values in self._metrics[mode].items():
            passes = values[logged.get(key, 0):]
            if len(passes) > 1 and len(passes) == len(counts):
                merged = merged_pass_metrics(passes, [r for r, _ in counts], [t for _, t in counts], key,
                                             self.importance_sampling_level)
                values[logged.get(key, 0):] = [merged]

    def _backward_accumulating(self, model, loss: torch.Tensor) -> None:
        """The backward pass of a chunk that is not its micro-batch's last: the Trainer's (`accelerator.backward`),
        with the gradients kept for the next chunk: no all-reduce (DDP, FSDP), no DeepSpeed accumulation boundary,
        no optimizer step."""
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            self.accelerator.deepspeed_engine_wrapped.backward(loss, sync_gradients=False, scale_wrt_gas=False)
        else:
            with self.accelerator.no_sync(model):
                self.accelerator.backward(loss)

    def _get_per_token_logps_and_entropies(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                           logits_to_keep: int, batch_size: int | None = None,
                                           compute_entropy: bool = False, compute_aux_loss: bool = False,
                                           **multimodal: Any):
        """GRPOTrainer's forward pass (the loss's, the old and the reference log-probs'), packed where it is exact
        (`gigpo_trl.packing.packed_logps_and_entropies`); the entropies of the loss's pass (`compute_entropy`) are kept
        for the entropy bonus of `_compute_loss`."""
        if self._packed_update and not compute_aux_loss and all(value is None for value in multimodal.values()):
            outputs = packed_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy=compute_entropy,
                attention=self.model.config._attn_implementation, dtype=self.model.dtype,
                autocast=self.accelerator.autocast)
        else:
            outputs = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **multimodal)
        if compute_entropy:
            self._loss_entropies = outputs[1]
        return outputs

    def _compute_loss(self, model, inputs: dict[str, Any]) -> torch.Tensor:
        """GRPOTrainer's loss (exact under padding rows: see SUPPORTED_LOSS_TYPES) minus the entropy bonus as a token
        mean over the rollout (the module docstring), with its metrics made to leave the padding rows out: a micro-batch
        holding only padding rows (on every process) logs nothing, and the metrics with one value per row count real
        rows only."""
        mode = "train" if self.model.training else "eval"
        logged = {key: len(values) for key, values in self._metrics[mode].items()}
        loss = super()._compute_loss(model, inputs)
        entropies, self._loss_entropies = self._loss_entropies, None
        loss_mask = inputs["completion_mask"] * inputs["tool_mask"]
        real_rows = (inputs["tool_mask"].sum(dim=1) > 0).sum()
        counts = torch.stack([real_rows, torch.tensor(inputs["tool_mask"].size(0), device=real_rows.device), loss_mask.sum()])
        real, total, tokens = self.accelerator.reduce(counts, "sum").tolist()
        self._pass_counts.append((real, tokens))
        added = {key: values for key, values in self._metrics[mode].items() if len(values) > logged.get(key, 0)}
        if real == 0:
            for key, values in added.items():
                del values[logged.get(key, 0):]
        elif real < total:
            per_row = {key: values[-1] for key, values in added.items()}
            for key, value in padding_free_row_metrics(per_row, real, total, self.importance_sampling_level).items():
                self._metrics[mode][key][-1] = value
        if self._rollout_entropy_bonus:
            loss = loss - self._entropy_bonus(entropies, inputs, mode)
        return loss

    def _entropy_bonus(self, entropies: torch.Tensor, inputs: dict[str, Any], mode: str) -> torch.Tensor:
        """This micro-batch's share of `entropy_coef` times the rollout's token-mean entropy (`entropy_bonus`). Under
        `top_entropy_quantile` < 1 it acts on the tokens the policy term trains, as TRL's; under `use_adaptive_entropy`
        the coefficient applies while the previous step's entropy is at or below `entropy_target` (TRL's rule), and
        this step's entropy is summed for the next update of the coefficient (`_adapt_entropy_coef`)."""
        mask = inputs["completion_mask"] * inputs["tool_mask"]
        if self.top_entropy_quantile < 1.0:
            mask = mask * self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
        normalizer = rollout_token_normalizer(
            inputs["num_items_in_batch"], num_processes=self.accelerator.num_processes,
            # set by the Trainer's training loop only (an evaluation may run before it)
            accumulation_steps=self.current_gradient_accumulation_steps if mode == "train" else None,
            steps_per_generation=self.args.steps_per_generation)
        coef = self.entropy_coef
        if self.use_adaptive_entropy:
            coef = coef if self._last_world_entropy <= self.args.entropy_target else 0.0
            if mode == "train":
                window = torch.stack([(entropies * mask).sum(), mask.sum()]).detach()
                self._entropy_window_stats = window if self._entropy_window_stats is None else self._entropy_window_stats + window
        if mode == "train" and self.accelerator.sync_gradients and not self.use_adaptive_entropy:
            self._metrics[mode]["entropy_coef"].append(coef)
        return entropy_bonus(entropies, mask, normalizer, coef)

    def _adapt_entropy_coef(self) -> None:
        """At an optimizer step: the rollout's token-mean entropy over the step's micro-batches and processes moves the
        adaptive coefficient (`next_entropy_coef`), which the next step applies; logged as `entropy_coef`."""
        totals = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
        self._last_world_entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
        self.entropy_coef = next_entropy_coef(
            self.entropy_coef, self._last_world_entropy, target=self.args.entropy_target,
            delta=self.args.entropy_coef_delta, minimum=self.args.entropy_coef_min, maximum=self.args.entropy_coef_max)
        self._entropy_window_stats = None
        self._metrics["train"]["entropy_coef"].append(self.entropy_coef)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys: list[str] | None = None):
        """The evaluation loss of a held-out rollout (GRPOTrainer's runs every row in one forward pass)."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            size = self.args.max_step_samples_per_micro_batch or self.args.per_device_eval_batch_size
            loss = self._loss_in_passes(model, inputs, size, backward=False)
        return loss.detach(), None, None
