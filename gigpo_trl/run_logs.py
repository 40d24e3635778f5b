"""What a GiGPO run logs, records and warns of, as the trainer methods that do it: a rollout's metrics over all
processes into TRL's `_metrics` (`gigpo_trl.metrics`), its records and sample episodes for the run report
(`gigpo_trl.records`), TRL's completion logs with one entry per step sample, an evaluation's episode metrics over its
distinct tasks, and the training-health checks of a training step's log (gradient-norm spikes, the loop warning).
`GiGPOTrainer` inherits `RunLogsMixin` before `GRPOTrainer`.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict, deque

import numpy as np
from accelerate.utils import gather_object

from gigpo_trl.advantages import GiGPOAdvantages
from gigpo_trl.dynamic_sampling import SamplingCounts, StdFilterCounts
from gigpo_trl.loops import LOOP_WARNING, LoopAlarm, entropy_baseline, loop_warning_due
from gigpo_trl.metric_names import (
    EXTRA_ROUNDS, GRAD_NORM_SPIKE, GROUPS_DROPPED, GROUPS_KEPT, GROUPS_MISSING, GROUPS_ROLLED, NUM_STEP_GROUPS,
    PANEL_UNPLAYED, PANEL_UNPLAYED_TASKS, REVISIT_SHARE, SINGLETON_SHARE, evaluation_name,
)
from gigpo_trl.metrics import (
    GRAD_NORM_SPIKE_WINDOW, SINGLETON_WARNING, SINGLETON_WARNING_SHARE, PanelEpisode, RolloutSummary, RolloutTimes,
    panel_metrics, panel_tasks, rollout_metrics, trailing_ratio,
)
from gigpo_trl.records import count_rollouts, episode_records, iteration_record, write_evaluation, write_records, write_update
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
        self._grad_norms: deque[float] = deque(maxlen=GRAD_NORM_SPIKE_WINDOW)  # of the latest logged training steps
        self._logged_entropies: list[float] = []  # the policy entropy of every logged training step
        self._loop_alarm: LoopAlarm | None = None  # the last loop warning
        self._rollouts_recorded = count_rollouts(args.output_dir)
        self._eval_episodes: list[PanelEpisode] = []  # this process's evaluation episodes since the last log
        self.add_callback(ReportCallback())
        # TRL keeps the completion logs of the latest rollout: one entry per trajectory there, up to
        # max_env_steps step samples per trajectory (of every round of dynamic sampling) here.
        samples_per_rollout = args.generation_batch_size * args.max_env_steps * (1 + args.dynamic_sampling_max_rounds)
        self._logs = {
            key: defaultdict(lambda: deque(maxlen=samples_per_rollout)) if key in ("rewards", "extra")
            else deque(maxlen=samples_per_rollout)
            for key in self._logs
        }

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """GRPOTrainer's log; an evaluation's episode metrics are first recomputed over its distinct tasks, those it
        could not play left out and named (`eval_env/panel_unplayed_tasks`, a text, logged only when there are any); a
        training step's log gets `grad_norm/spike`, is checked for a policy that loops, and is recorded."""
        training_step = self.model.training and "loss" in logs  # not the closing summary of `train()`
        if not self.model.training:
            episodes = gather_object(self._eval_episodes)
            self._eval_episodes = []
            metrics = panel_metrics(episodes)
            played, unplayed = panel_tasks(episodes)
            for name, value in metrics.items():
                self._metrics["eval"][name] = [value]
            if unplayed:
                logs[evaluation_name(PANEL_UNPLAYED_TASKS)] = "; ".join(unplayed)
                if self.accelerator.is_main_process:
                    warnings.warn(_unplayed_message(played, unplayed), stacklevel=2)
            if self.accelerator.is_main_process and metrics:
                write_evaluation(self.args.output_dir, self.state.global_step, metrics, played, unplayed)
        elif training_step:
            self._check_training_health(logs)
        super().log(logs, start_time)  # adds the averages of `_metrics` to `logs`
        if training_step and self.accelerator.is_main_process:
            write_update(self.args.output_dir, self.state.global_step, logs)

    def _check_training_health(self, logs: dict[str, float]) -> None:
        """RAGEN's early warnings on a training step's log: the gradient norm over the median of the last
        GRAD_NORM_SPIKE_WINDOW logged before it (`grad_norm/spike`), and the loop warning (`loop_warning_due`: the
        training rollouts' revisit share high while the entropy falls), once and again each time it worsens."""
        grad_norm = logs.get("grad_norm")
        if grad_norm is not None and math.isfinite(grad_norm):
            spike = trailing_ratio(grad_norm, self._grad_norms)
            if spike is not None:
                logs[GRAD_NORM_SPIKE] = spike
            self._grad_norms.append(grad_norm)
        entropy, revisit_share = (self._logged_mean(name) for name in ("entropy", REVISIT_SHARE))
        if entropy is None:
            return
        self._logged_entropies.append(entropy)
        if revisit_share is not None and loop_warning_due(revisit_share, self._logged_entropies, self._loop_alarm):
            self._loop_alarm = LoopAlarm(revisit_share, entropy)
            warnings.warn(LOOP_WARNING.format(revisit=revisit_share, entropy=entropy,
                                              start_entropy=entropy_baseline(self._logged_entropies)), stacklevel=2)

    def _logged_mean(self, name: str) -> float | None:
        """The mean of a training metric's values since the last log (NaN left out, as GRPOTrainer's log does)."""
        values = [value for value in self._metrics["train"].get(name, []) if not math.isnan(value)]
        return sum(values) / len(values) if values else None

    def _log_rollout_metrics(self, mode: str, rollout: Rollout, gigpo: GiGPOAdvantages, times: RolloutTimes,
                             update_seconds: float | None, update_samples: list[int],
                             sampling: SamplingCounts | None, std_filter: StdFilterCounts | None) -> dict[str, float]:
        """The rollout's metrics over all processes (`gigpo_trl.metrics`) into TRL's `_metrics`; returns them."""
        summary = RolloutSummary.of(rollout, gigpo, times, max_completion_length=self.max_completion_length,
                                    end_token_ids={*self.eos_token_ids, self._tokenizer.pad_token_id},
                                    update_samples=update_samples, sampling=sampling, std_filter=std_filter)
        summaries = gather_object([summary])
        metrics = rollout_metrics(summaries, update_seconds)
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
        return metrics

    def _write_records(self, mode: str, metrics: dict[str, float], rollout: Rollout, gigpo: GiGPOAdvantages) -> None:
        """The rollout's record and sample episodes for the run report (see `gigpo_trl.records`)."""
        parts = gather_object([(gigpo.step_group_sizes, gigpo.episode_advantages, gigpo.step_advantages)])
        if self.accelerator.is_main_process:
            record = iteration_record(self.state.global_step, mode, self._rollouts_recorded[mode], metrics, parts)
            self._rollouts_recorded[mode] += 1
            write_records(self.args.output_dir, record, episode_records(rollout, gigpo, self.args.log_trajectories))

    def _log_step_samples(self, rollout: Rollout, advantages: np.ndarray) -> None:
        """Feed TRL's completion logs (`log_completions`): one entry per step sample."""
        steps = rollout.steps
        self._logs["prompt"].extend(gather_object(steps.prompt))
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
