"""What a GiGPO run logs, records and warns of, as the trainer methods that do it: a rollout's metrics over all
processes into TRL's `_metrics` (`gigpo_trl.metrics`), its records and sample episodes for the run report
(`gigpo_trl.records`), TRL's completion logs with one entry per step sample, an evaluation's episode metrics over its
distinct tasks, and the training-health checks of a training step's log (gradient-norm spikes, the loop warning).
`GiGPOTrainer` inherits `RunLogsMixin` before `GRPOTrainer`.
"""

from __future__ import annotations

import math
import time
import warnings
from collections import defaultdict, deque
from typing import Any

import numpy as np
from accelerate.utils import gather_object

from gigpo_trl.advantages import GiGPOAdvantages
from gigpo_trl.async_rollouts import ProducedRollout
from gigpo_trl.dynamic_sampling import SamplingCounts, StdFilterCounts
from gigpo_trl.env_failures import RolloutFailures
from gigpo_trl.health import HEALTH_METRICS, HealthWarning, TrainingHealth
from gigpo_trl.metric_names import (
    ASYNC_BEHAVIOUR_MASKED_SHARE, ASYNC_BEHAVIOUR_RATIO, CONTEXT_OVERFLOW_SHARE, EXTRA_ROUNDS, GRAD_NORM_SPIKE, GROUPS_DROPPED, GROUPS_KEPT, GROUPS_MISSING, GROUPS_ROLLED,
    NUM_STEP_GROUPS, PANEL_UNPLAYED, PANEL_UNPLAYED_TASKS, SINGLETON_SHARE, evaluation_name,
)
from gigpo_trl.metrics import (
    GRAD_NORM_SPIKE_WINDOW, SINGLETON_WARNING, SINGLETON_WARNING_SHARE, PanelEpisode, RolloutSummary, RolloutTimes,
    async_metrics, panel_metrics, panel_tasks, rollout_metrics, trailing_ratio,
)
from gigpo_trl.observations import readable_messages
from gigpo_trl.records import (
    checkpoint_step, episode_records, evaluation_record, iteration_record, open_records, write_evaluation,
    write_records, write_update,
)
from gigpo_trl.report import ReportCallback
from gigpo_trl.rollout import Rollout


class RunLogsMixin:
    """The logging of `GiGPOTrainer`: `log` overrides `GRPOTrainer`'s (an evaluation's episode metrics recomputed over
    its distinct tasks; a training step's log checked for training health and recorded); the rollout -> advantages ->
    batch script calls `_log_rollout_metrics`, `_write_records` and `_log_step_samples` on each rollout and adds an
    evaluation's episodes to `_eval_episodes`. The trainer calls `_setup_run_logs` once `GRPOTrainer.__init__` has run.
    """

    def _setup_run_logs(self) -> None:
        """Start the logging state, add the run report's callback, and size TRL's completion logs for step samples."""
        args = self.args
        self._warned_singletons = False
        self._warned_context_overflow = False
        self._grad_norms: deque[float] = deque(maxlen=GRAD_NORM_SPIKE_WINDOW)  # of the latest logged training steps
        self._health = TrainingHealth()  # the training-health rules over the logged training steps
        self._rollouts_recorded: dict[str, int] | None = None  # per mode; None until the records are opened
        self._eval_episodes: list[PanelEpisode] = []  # this process's evaluation episodes since the last log
        # `timing/update_s`: the time from one training rollout's end to the next one's start, less evaluations
        self._last_rollout_end: float | None = None
        self._seconds_outside_updates = 0.0
        self.add_callback(ReportCallback())
        # TRL keeps the completion logs of the latest rollout: one entry per trajectory there, up to
        # max_env_steps step samples per trajectory (of every round of dynamic sampling) here.
        samples_per_rollout = args.generation_batch_size * args.max_env_steps * (1 + args.dynamic_sampling_max_rounds)
        self._logs = {
            key: defaultdict(lambda: deque(maxlen=samples_per_rollout)) if key in ("rewards", "extra")
            else deque(maxlen=samples_per_rollout)
            for key in self._logs
        }

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """GRPOTrainer's evaluation, of a panel named by `metric_key_prefix` past "eval_" (TRL evaluates a dict of
        eval datasets each under `eval_<name>`, and `gigpo_trl.evaluation.evaluate_panels` names its panels so): its
        metrics are logged as `eval_<panel>_<name>` and its record (`last_evaluation`) carries the panel's name. Its
        time is kept out of `timing/update_s`."""
        self._panel = metric_key_prefix.removeprefix("eval").removeprefix("_") or None
        started = time.perf_counter()
        try:
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        finally:
            self._seconds_outside_updates += time.perf_counter() - started

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """GRPOTrainer's log; an evaluation's episode metrics are first recomputed over its distinct tasks, those it
        could not play left out and named (`eval_env/panel_unplayed_tasks`, a text, logged only when there are any), and
        its record written (`last_evaluation`, its episodes `last_evaluation_episodes`); a training step's log gets `grad_norm/spike`, is checked for training
        health, and is recorded."""
        training_step = self.model.training and "loss" in logs  # not the closing summary of `train()`
        if not self.model.training:
            episodes = gather_object(self._eval_episodes)
            self._eval_episodes = []
            self.last_evaluation_episodes: list[PanelEpisode] = episodes
            metrics = panel_metrics(episodes)
            played, unplayed = panel_tasks(episodes)
            for name, value in metrics.items():
                self._metrics["eval"][name] = [value]
            panel = getattr(self, "_panel", None)
            if unplayed:
                logs[evaluation_name(f"{panel}_{PANEL_UNPLAYED_TASKS}" if panel else PANEL_UNPLAYED_TASKS)] = "; ".join(unplayed)
                if self.accelerator.is_main_process:
                    warnings.warn(_unplayed_message(played, unplayed), stacklevel=2)
            if panel:  # TRL's log prefixes "eval_" to these: eval_<panel>_<name>, as transformers' own metrics
                self._metrics["eval"] = defaultdict(list, {f"{panel}_{k}": v for k, v in self._metrics["eval"].items()})
            self.last_evaluation = evaluation_record(
                self.state.global_step, metrics, played, unplayed, panel=panel,
                copies=self.num_generations_eval, greedy=self.args.eval_greedy)
            if self.accelerator.is_main_process and metrics:
                self._open_records(self.args.resume_from_checkpoint)
                write_evaluation(self.args.output_dir, self.last_evaluation)
        said = self._check_training_health(logs) if training_step else []
        super().log(logs, start_time)  # adds the averages of `_metrics` to `logs`
        if training_step and self.accelerator.is_main_process:
            self._open_records(self.args.resume_from_checkpoint)
            write_update(self.args.output_dir, self.state.global_step, logs, said)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """GRPOTrainer's training, in a run folder whose records are this run's (`_open_records`); the async producer
        (`async_staleness`) stops with it, however it ends (Ctrl-C included)."""
        self._open_records(resume_from_checkpoint)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self.close_producer()

    def _open_records(self, resume_from_checkpoint: str | bool | None) -> None:
        """Before the run's first record (main process): the records of OUTPUT_DIR/gigpo become this run's
        (`gigpo_trl.records.open_records`): a run resuming from a checkpoint keeps those up to it, any other run sets
        the records there aside; a warning says what was set aside. `train` opens them with its checkpoint; an
        evaluation before training with `args.resume_from_checkpoint`."""
        if self._rollouts_recorded is not None or not self.accelerator.is_main_process:
            return
        output_dir = self.args.output_dir
        self._rollouts_recorded, message = open_records(output_dir, checkpoint_step(output_dir, resume_from_checkpoint))
        if message:
            warnings.warn(message, stacklevel=3)

    def _check_training_health(self, logs: dict[str, float]) -> list[HealthWarning]:
        """RAGEN's early warnings on a training step's log: the gradient norm over the median of the last
        GRAD_NORM_SPIKE_WINDOW logged before it (`grad_norm/spike`), and the training-health rules
        (`gigpo_trl.health`: no learning signal, stuck in place, back and forth), each said once and again when it
        worsens; returns the warnings said."""
        grad_norm = logs.get("grad_norm")
        if grad_norm is not None and math.isfinite(grad_norm):
            spike = trailing_ratio(grad_norm, self._grad_norms)
            if spike is not None:
                logs[GRAD_NORM_SPIKE] = spike
            self._grad_norms.append(grad_norm)
        said = self._health.check({name: self._logged_mean(name) for name in HEALTH_METRICS})
        for warning in said:
            warnings.warn(warning.message, stacklevel=3)
        return said

    def _logged_mean(self, name: str) -> float | None:
        """The mean of a training metric's values since the last log (NaN left out, as GRPOTrainer's log does)."""
        values = [value for value in self._metrics["train"].get(name, []) if not math.isnan(value)]
        return sum(values) / len(values) if values else None

    def _log_rollout_metrics(self, mode: str, rollout: Rollout, gigpo: GiGPOAdvantages, times: RolloutTimes,
                             update_seconds: float | None, update_samples: list[int],
                             sampling: SamplingCounts | None, std_filter: StdFilterCounts | None,
                             produced: ProducedRollout | None = None) -> dict[str, float]:
        """The rollout's metrics over all processes (`gigpo_trl.metrics`; with `async_staleness`, the producer's,
        `async_metrics`) into TRL's `_metrics`; returns them."""
        summary = RolloutSummary.of(rollout, gigpo, times, max_completion_length=self.max_completion_length,
                                    end_token_ids={*self.eos_token_ids, self._tokenizer.pad_token_id},
                                    update_samples=update_samples, sampling=sampling, std_filter=std_filter)
        summaries = gather_object([summary])
        metrics = rollout_metrics(summaries, update_seconds)
        if produced is not None:
            metrics |= async_metrics(gather_object([(produced.staleness, self._producer.queue_depth,
                                                     self._producer.trainer_wait_seconds,
                                                     produced.admission_wait_seconds)]))
            metrics |= {name: values[-1] for name, values in self._metrics[mode].items()
                        if name.startswith(ASYNC_BEHAVIOUR_RATIO) or name == ASYNC_BEHAVIOUR_MASKED_SHARE}
        if mode == "train":
            self.state.num_input_tokens_seen += sum(s.prompt_tokens + s.generated_tokens for s in summaries)
        for name, value in metrics.items():
            self._metrics[mode][name].append(value)
        self._metrics[mode]["num_tokens"] = [self.state.num_input_tokens_seen]

        if metrics.get(GROUPS_MISSING):
            warnings.warn(_short_update_message(metrics), stacklevel=2)
        # Evaluation plays num_generations_eval copies, often 1: its step groups say nothing about the anchors.
        singleton_share = metrics[SINGLETON_SHARE]
        if mode == "train" and metrics[NUM_STEP_GROUPS] and singleton_share > SINGLETON_WARNING_SHARE \
                and not self._warned_singletons:
            self._warned_singletons = True
            warnings.warn(SINGLETON_WARNING.format(share=singleton_share), stacklevel=2)
        if metrics[CONTEXT_OVERFLOW_SHARE] and not self._warned_context_overflow:
            self._warned_context_overflow = True
            warnings.warn(_context_overflow_message(mode, metrics[CONTEXT_OVERFLOW_SHARE], self.turns.prompt_token_limit,
                                                    self.max_completion_length), stacklevel=2)
        return metrics

    def _write_records(self, mode: str, metrics: dict[str, float], rollout: Rollout, gigpo: GiGPOAdvantages,
                       failures: RolloutFailures) -> None:
        """The rollout's record (its environment failures with it, where there were any) and sample episodes for the
        run report (see `gigpo_trl.records`)."""
        parts = gather_object([(gigpo.step_group_sizes, gigpo.episode_advantages, gigpo.step_advantages)])
        if self.accelerator.is_main_process:
            self._open_records(self.args.resume_from_checkpoint)
            record = iteration_record(self.state.global_step, mode, self._rollouts_recorded[mode], metrics, parts,
                                      episodes=failures.trajectories, answer_format=self.dialogue.answer_format,
                                      env_failures=failures.record() if failures else None)
            self._rollouts_recorded[mode] += 1
            write_records(self.args.output_dir, record, episode_records(rollout, gigpo, self.args.log_trajectories))

    def _log_step_samples(self, rollout: Rollout, advantages: np.ndarray) -> None:
        """Feed TRL's completion logs (`log_completions`): one entry per step sample, a prompt's pictures as
        `[image WxH]` (TRL writes the logs as a table, whose prompt column takes no mix of text and content blocks)."""
        steps = rollout.steps
        self._logs["prompt"].extend(gather_object([readable_messages(prompt) for prompt in steps.prompt]))
        self._logs["completion"].extend(gather_object([c.text for c in steps.completion]))
        self._logs["rewards"]["environment_reward"].extend(gather_object(steps.reward))
        self._logs["advantages"].extend(gather_object([float(a) for a in advantages]))


def _short_update_message(metrics: dict[str, float]) -> str:
    """The warning of an update that holds fewer task groups with a signal than asked: dynamic sampling's limit."""
    kept, missing = int(metrics[GROUPS_KEPT]), int(metrics[GROUPS_MISSING])
    trains_on = f"trains on those {kept}" if kept else "has no step sample with a signal: it runs on zero-weight rows"
    return (f"dynamic sampling: after {int(metrics[EXTRA_ROUNDS])} extra round(s) (the limit, "
            f"dynamic_sampling_max_rounds) the update holds {kept} task group(s) with a signal of the {kept + missing} "
            f"asked, and {trains_on}; {int(metrics[GROUPS_DROPPED])} of the "
            f"{int(metrics[GROUPS_ROLLED])} groups rolled had none (logged as dynamic_sampling/*)")


def _unplayed_message(played: list[str], unplayed: dict[str, str]) -> str:
    """The warning of an evaluation that could not play every task of its panel."""
    reasons = "; ".join(f"{task}: {reason}" for task, reason in unplayed.items())
    return (f"the evaluation played {len(played)} of its {len(played) + len(unplayed)} held-out tasks: its figures are "
            f"over those {len(played)} (logged as {evaluation_name(PANEL_UNPLAYED)}, "
            f"{evaluation_name(PANEL_UNPLAYED_TASKS)}). Could not be played, after env_reset_attempts resets each: "
            f"{reasons}")


def _context_overflow_message(mode: str, share: float, limit: int, max_completion_length: int) -> str:
    """The warning of a rollout some of whose episodes ended because a prompt would not fit the model's context."""
    return (f"{share:.0%} of the episodes of a {'training' if mode == 'train' else 'held-out'} rollout ended before a "
            f"step because its prompt had more than {limit} tokens, what the model's context leaves a prompt once "
            f"max_completion_length ({max_completion_length}) is kept for the answer: they count as truncated "
            f"(logged as env/context_overflow_share; said once a run). What to change: show fewer past steps "
            f"(history_length), a shorter prompt (prompt_template), fewer steps (max_env_steps), shorter answers "
            f"(max_completion_length), or a model with a longer context (vllm_max_model_length under vLLM, if the "
            f"model allows it).")
