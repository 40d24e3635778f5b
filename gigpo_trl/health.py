"""Training health: the rules that tell a run it has stopped learning, as pure functions of the metrics of its logged
training steps.

Three stalls that users meet, each with its own rule, window and advice (docs/metrics.md, "Training health", gives the
measured runs the thresholds come from):

- **No learning signal** (`no_signal_warning`): at least NO_SIGNAL_SHARE of the task groups of the last
  NO_SIGNAL_WINDOW logged training steps carried no signal while the training success rate stayed below
  SOLVED_SUCCESS. GiGPO learns from the differences between the copies of a task; a group whose copies all got the
  same return gives none. The share is read where the update's groups are decided (`no_signal_share`): the groups
  whose copies all got the same return (`frac_reward_zero_std`); under dynamic sampling the groups it could not find
  (`dynamic_sampling/groups_missing` of the groups asked); under reward-std filtering the kept groups without spread
  (`reward_std_filter/groups_kept_zero_std` of `reward_std_filter/groups_kept`).
- **Stuck in place** (`stuck_warning`): at least STUCK_STAYS of the training steps stay in the state they were taken
  in (`loops/stay_share`: a move into a wall, an action that changes nothing) over the last LOOP_WINDOW logged
  training steps, while the policy has collapsed: a collapse into walking one way, which never loops back and forth.
- **Back and forth** (`back_and_forth_warning`): at least BACK_AND_FORTH_TURN_BACKS of the training steps go straight
  back to the state they came from (`loops/turn_back_share`) while the policy has collapsed: RAGEN's "Echo Trap".

A policy has collapsed over a window when its entropy has fallen to at most ENTROPY_FALL of its start (the mean of
the first ENTROPY_BASELINE_LOGS logged training steps; it starts afresh in a resumed run), or when at least
NO_SIGNAL_SHARE of its task groups carried no signal, the tasks unsolved (its copies play alike: the token entropy
can stay where it was, diluted by the answer's format tokens, while the one token that picks the action has
collapsed). Without either, the same loops are a random walk's, which is no stall. No rule speaks while the policy
wins at least SOLVED_SUCCESS of its training episodes (the window's mean `env/success_rate`; where the environment
does not say what is won, the rules apply as they are). A window's figures are the means of its logged steps.

`TrainingHealth` applies the rules once per logged training step and says each once, and again each time it worsens
(its figure up by WORSENING since it was last said, or the entropy at most ENTROPY_FALL of what it was then).
`replay_health` applies them to a run's records. No torch and no trainer state here.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gigpo_trl.metric_names import (
    FRAC_REWARD_ZERO_STD, GROUPS_KEPT, GROUPS_MISSING, STAY_SHARE, STD_FILTER_GROUPS_KEPT,
    STD_FILTER_GROUPS_KEPT_ZERO_STD, SUCCESS_RATE, TURN_BACK_SHARE,
)

ENTROPY_BASELINE_LOGS = 3
ENTROPY_FALL = 0.5
NO_SIGNAL_WINDOW = 10
NO_SIGNAL_SHARE = 0.9
SOLVED_SUCCESS = 0.9
LOOP_WINDOW = 5
STUCK_STAYS = 0.4
BACK_AND_FORTH_TURN_BACKS = 0.6
WORSENING = 0.1

# What the rules read of a logged training step (TRL's `entropy`, the rest `gigpo_trl.metrics.rollout_metrics`').
ENTROPY = "entropy"  # TRL's: the policy's mean token entropy over the update's answers
HEALTH_METRICS = (
    ENTROPY, SUCCESS_RATE, FRAC_REWARD_ZERO_STD, GROUPS_KEPT, GROUPS_MISSING, STD_FILTER_GROUPS_KEPT,
    STD_FILTER_GROUPS_KEPT_ZERO_STD, STAY_SHARE, TURN_BACK_SHARE,
)
COLLAPSE_ADVICE = (
    "What to change: show the policy its past steps (history_length), sample more widely (temperature), reward "
    "entropy (entropy_coef), clip less on the way up (epsilon_high), and train on the groups with a signal "
    "(dynamic_sampling_max_rounds, which drops the groups whose returns are all equal, or reward_std_filter_ratio, "
    "which keeps those whose returns spread most)."
)
NO_SIGNAL_ADVICE = {
    FRAC_REWARD_ZERO_STD: (
        "What to change: sample more widely (temperature, num_generations: more copies of a task are likelier to "
        "differ), make returns differ where outcomes do (a reward for progress, invalid_action_penalty), start from "
        "easier tasks, or train on the groups with a signal (dynamic_sampling_max_rounds, reward_std_filter_ratio)."
    ),
    GROUPS_MISSING: (
        "What to change: let dynamic sampling look further (dynamic_sampling_max_rounds), sample more widely "
        "(temperature, num_generations), make returns differ where outcomes do (a reward for progress, "
        "invalid_action_penalty), or start from easier tasks."
    ),
    STD_FILTER_GROUPS_KEPT_ZERO_STD: (
        "What to change: roll more groups for the filter to choose from (per_device_train_batch_size), sample more "
        "widely (temperature, num_generations), make returns differ where outcomes do (a reward for progress, "
        "invalid_action_penalty), or start from easier tasks."
    ),
}
NO_SIGNAL_MEANING = {
    FRAC_REWARD_ZERO_STD: "the share of task groups whose copies all got the same return",
    GROUPS_MISSING: "the share of the task groups asked that dynamic sampling could not find "
                                       "with a signal within dynamic_sampling_max_rounds extra rounds",
    STD_FILTER_GROUPS_KEPT_ZERO_STD: "the share of the groups kept by reward_std_filter_ratio whose copies "
                                              "all got the same return",
}


@dataclass(frozen=True)
class HealthWarning:
    """What a rule said at a logged training step: the rule, its figure and the entropy then (None where the rule does
    not read it), and the message, which names the metric, the window and what to change."""

    rule: str
    figure: float
    entropy: float | None
    message: str


def no_signal_share(metrics: Mapping[str, float]) -> tuple[float, str] | None:
    """The share of an update's task groups that carry no signal, and the metric it is read from (None: not logged).
    Under reward-std filtering, the kept groups whose copies all got the same return; under dynamic sampling, the
    groups it could not find (a group it kept always has a signal); with both, the larger; otherwise
    `frac_reward_zero_std`."""
    shares = []
    if GROUPS_MISSING in metrics:
        missing = metrics[GROUPS_MISSING]
        asked = metrics[GROUPS_KEPT] + missing
        shares.append((missing / asked if asked else 1.0, GROUPS_MISSING))
    if STD_FILTER_GROUPS_KEPT_ZERO_STD in metrics:
        kept = metrics[STD_FILTER_GROUPS_KEPT]
        zero_std = metrics[STD_FILTER_GROUPS_KEPT_ZERO_STD]
        shares.append((zero_std / kept if kept else 1.0, STD_FILTER_GROUPS_KEPT_ZERO_STD))
    if shares:
        return max(shares)
    if FRAC_REWARD_ZERO_STD in metrics:
        return metrics[FRAC_REWARD_ZERO_STD], FRAC_REWARD_ZERO_STD
    return None


def no_signal_warning(history: Sequence[Mapping[str, float]]) -> HealthWarning | None:
    """The no-signal rule (the module docstring) on the logged training steps so far, the latest last."""
    window = history[-NO_SIGNAL_WINDOW:]
    shares = [no_signal_share(metrics) for metrics in window]
    if len(window) < NO_SIGNAL_WINDOW or None in shares:
        return None
    share = statistics.fmean(share for share, _ in shares)
    success = _window_mean(window, SUCCESS_RATE)
    if share < NO_SIGNAL_SHARE or (success is not None and success >= SOLVED_SUCCESS):
        return None
    metric = shares[-1][1]
    success_text = f"{success:.0%}" if success is not None else "not reported by the environment"
    message = (
        f"no learning signal: over the last {NO_SIGNAL_WINDOW} logged training steps, {share:.0%} of the task groups "
        f"carried none ({metric}: {NO_SIGNAL_MEANING[metric]}), with a training success rate of {success_text}. "
        f"GiGPO learns from the differences between the copies of a task: where they all lose, or all win the tasks "
        f"the policy has settled on, there is nothing to learn from, and the run stands still. "
        f"{NO_SIGNAL_ADVICE[metric]}"
    )
    return HealthWarning("no_signal", share, None, message)


def stuck_warning(history: Sequence[Mapping[str, float]]) -> HealthWarning | None:
    """The stuck-in-place rule (the module docstring) on the logged training steps so far, the latest last."""
    return _collapse_warning(
        history, STAY_SHARE, STUCK_STAYS, "stuck",
        lambda share, evidence: (
            f"the policy is stuck in place: over the last {LOOP_WINDOW} logged training steps, {share:.0%} of its "
            f"steps stay in the state they were taken in (loops/stay_share: a move into a wall, an action that changes "
            f"nothing) while {evidence}. A policy that has become deterministic repeats one action where it cannot "
            f"tell that it does not help: it walks one way into a wall, or repeats an answer that changes nothing. "
            f"{COLLAPSE_ADVICE}"))


def back_and_forth_warning(history: Sequence[Mapping[str, float]]) -> HealthWarning | None:
    """The back-and-forth rule (the module docstring) on the logged training steps so far, the latest last."""
    return _collapse_warning(
        history, TURN_BACK_SHARE, BACK_AND_FORTH_TURN_BACKS, "back_and_forth",
        lambda share, evidence: (
            f"the policy walks back and forth: over the last {LOOP_WINDOW} logged training steps, {share:.0%} of its "
            f"steps go straight back to the state they came from (loops/turn_back_share) while {evidence}. A policy "
            f"that has become deterministic repeats itself where it cannot tell where it came from (RAGEN's Echo "
            f"Trap). {COLLAPSE_ADVICE}"))


RULES: tuple[Callable[[Sequence[Mapping[str, float]]], HealthWarning | None], ...] = (
    no_signal_warning, stuck_warning, back_and_forth_warning,
)


def _collapse_warning(history: Sequence[Mapping[str, float]], metric: str, threshold: float, rule: str,
                      message: Callable[[float, str], str]) -> HealthWarning | None:
    """A loop metric's mean over the last LOOP_WINDOW logged steps at least `threshold` while the policy shows that it
    has collapsed: its entropy's mean over them at most ENTROPY_FALL of its start (the window lies after the
    baseline's logged steps), or at least NO_SIGNAL_SHARE of its task groups without signal (their copies play alike).
    Never while the policy wins at least SOLVED_SUCCESS of its training episodes: it has learned (the idle steps of
    a policy that wins stay, and its entropy falls as it becomes sure)."""
    if len(history) < ENTROPY_BASELINE_LOGS + LOOP_WINDOW:
        return None
    window = history[-LOOP_WINDOW:]
    share, success = _window_mean(window, metric), _window_mean(window, SUCCESS_RATE)
    if share is None or share < threshold or (success is not None and success >= SOLVED_SUCCESS):
        return None
    start, entropy = _window_mean(history[:ENTROPY_BASELINE_LOGS], ENTROPY), _window_mean(window, ENTROPY)
    if start is not None and entropy is not None and entropy <= ENTROPY_FALL * start:
        fell = f"its entropy fell from {start:.3g} to {entropy:.3g}"
        return HealthWarning(rule, share, entropy, message(share, fell))
    shares = [no_signal_share(metrics) for metrics in window]
    if None in shares:
        return None
    tied = statistics.fmean(share for share, _ in shares)
    if tied < NO_SIGNAL_SHARE:
        return None
    evidence = (f"{tied:.0%} of its task groups carried no signal ({shares[-1][1]}): the copies of a task play "
                f"alike")
    return HealthWarning(rule, share, entropy, message(share, evidence))


def _window_mean(window: Sequence[Mapping[str, float]], name: str) -> float | None:
    """The mean of a metric over the logged steps of a window, or None unless every one logged it."""
    values = [metrics.get(name) for metrics in window]
    return statistics.fmean(values) if window and None not in values else None


class TrainingHealth:
    """The metrics of a run's logged training steps and what each rule last said. `check` once per logged step."""

    def __init__(self) -> None:
        self.history: list[dict[str, float]] = []
        self.said: dict[str, HealthWarning] = {}

    def check(self, metrics: Mapping[str, float | None]) -> list[HealthWarning]:
        """Apply every rule to the logged steps so far, this one (its `HEALTH_METRICS`; None and NaN left out) the
        latest; return the warnings due: a rule that holds for the first time, or holds worse than when last said."""
        self.history.append({name: float(value) for name, value in metrics.items()
                             if name in HEALTH_METRICS and value is not None and math.isfinite(value)})
        due = []
        for rule in RULES:
            warning = rule(self.history)
            last = self.said.get(warning.rule) if warning is not None else None
            if warning is not None and (last is None or _worse(warning, last)):
                self.said[warning.rule] = warning
                due.append(warning)
        return due


def _worse(warning: HealthWarning, last: HealthWarning) -> bool:
    if warning.figure >= last.figure + WORSENING:
        return True
    return warning.entropy is not None and last.entropy is not None and warning.entropy <= ENTROPY_FALL * last.entropy


def training_steps(iterations: Iterable[Mapping[str, Any]],
                   updates: Iterable[Mapping[str, Any]]) -> list[dict[str, float]]:
    """A run's logged training steps as the trainer's log saw them, from its records (`gigpo_trl.records`): each
    update record's metrics with the means of the training rollouts since the previous one (those recorded at its
    step or after, before this one's step)."""
    rollouts = [record for record in iterations if record["mode"] == "train"]
    steps, previous = [], -1
    for update in updates:
        since = [record["metrics"] for record in rollouts if previous <= record["step"] < update["step"]]
        sums: dict[str, list[float]] = defaultdict(list)
        for metrics in since:
            for name, value in metrics.items():
                sums[name].append(value)
        steps.append({**{name: statistics.fmean(values) for name, values in sums.items()}, **update["metrics"]})
        previous = update["step"]
    return steps


def replay_health(steps: Iterable[Mapping[str, float]]) -> list[tuple[int, HealthWarning]]:
    """The warnings a run's logged training steps (`training_steps`) would give, each with the index of the logged
    step it comes at."""
    health = TrainingHealth()
    return [(index, warning) for index, metrics in enumerate(steps) for warning in health.check(metrics)]
