"""Loops in an episode's walk through states: revisits, immediate reversals, endings inside a cycle, distinct states.

A policy that collapses into a deterministic back-and-forth (RAGEN's "Echo Trap") keeps its success rate flat while
its episodes walk in circles. Every GiGPO step carries the exact, hashable anchor of the state its action was taken
in, so the circles can be counted exactly, from the anchors the rollout already holds.

An episode of T steps visits the states s_0 (the start), s_1, ..., s_T: step t is taken in s_t and leads to s_{t+1}.
States are compared by their anchors, exactly (`similarity_threshold` plays no part here).

- Step t **revisits** when s_{t+1} is in {s_0, ..., s_t}, the start included: walking back, and staying where it is
  (an action that changes nothing), both revisit.
- Step t >= 1 is an **immediate reversal** when s_{t+1} == s_{t-1}: back to the state of two states before (a state
  kept over two steps counts too).
- The **counted steps** are all steps but two kinds of last step: one that terminated the episode (it leads to a
  terminal state, where nothing more is played: a tool environment's final answer without a tool call leaves the
  state as it was and is no loop), and one whose environment failed (the state it led to is unknown).
- The episode **ends in a cycle** when it was cut off (by the step limit, not terminated: a won episode never ends in
  a cycle) in a state it had visited before: s_T is in {s_0, ..., s_{T-1}}. Unknown when its environment failed.
- **Distinct states**: the number of different states among s_0, ..., s_T. Unknown when its environment failed.

A rollout's figures pool its episodes (`LoopCounts`): the revisit share is revisits / counted steps, the reversal
share reversals / counted steps with t >= 1, the cycle share and the mean of distinct states are over the episodes
whose last state is known. A share with nothing to count is left out, not 0.

`loop_warning_due` is the rule of the trainer's warning that the policy loops. No torch and no trainer state here.
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, fields

from gigpo_trl.metric_names import LOOPS_PREFIX

# The loop warning: the revisit share at or above LOOP_REVISIT_SHARE while the policy's entropy has fallen to at most
# LOOP_ENTROPY_FALL times its value at the start of the run (the mean of its first ENTROPY_BASELINE_LOGS logged
# training steps). A back-and-forth over T steps revisits (T - 1) / T of them (0.9 over 10); a uniformly random walk
# on a line of rooms about 0.63 (0.76 with idle actions), high too but with a high entropy (docs/metrics.md). Once,
# and again each time it worsens: the revisit share up by LOOP_WORSENING since the last warning, or the entropy down
# by LOOP_ENTROPY_FALL again.
LOOP_REVISIT_SHARE = 0.8
LOOP_ENTROPY_FALL = 0.5
LOOP_WORSENING = 0.1
ENTROPY_BASELINE_LOGS = 3
LOOP_WARNING = (
    "the policy walks in loops: {revisit:.0%} of the training steps go back to a state their episode was already in "
    "(loops/revisit_share) while its entropy fell from {start_entropy:.3g} to {entropy:.3g}. A policy that has become deterministic repeats itself "
    "where it cannot tell where it came from (RAGEN's Echo Trap). What to change: show it its past steps "
    "(history_length), sample more widely (temperature), reward entropy (entropy_coef), clip less on the way up "
    "(epsilon_high), and train on the groups with a signal (dynamic_sampling_max_rounds, which drops the groups whose "
    "returns are all equal, or reward_std_filter_ratio, which keeps those whose returns spread most)."
)


@dataclass(frozen=True)
class EpisodeLoops:
    """The loop figures of one episode of T steps (the module docstring defines them). Per step t, one entry each:
    `next_state` numbers s_{t+1} in the order the episode first visited its states (s_0 is 0; None: unknown);
    `revisit` and `reversal` are None for a step that is not counted (and `reversal` at t = 0)."""

    next_state: tuple[int | None, ...]
    revisit: tuple[bool | None, ...]
    reversal: tuple[bool | None, ...]
    ends_in_cycle: bool | None  # None: the last state is unknown
    distinct_states: int | None  # None: the last state is unknown


def episode_loops(states: Sequence[Hashable], *, terminated: bool, failed: bool = False) -> EpisodeLoops:
    """The loop figures of an episode from the anchors of its states.

    Args:
        states: s_0, ..., s_T, the anchors of the start state and of the state each of its T steps led to (for a
            failed last step, whatever stands there is ignored).
        terminated: the episode ended by termination (its last step is not counted; it does not end in a cycle).
        failed: its environment failed at the last step (T >= 1) or at reset (T = 0, nothing is known).
    """
    steps = len(states) - 1
    known = list(states[:-1] if failed else states)
    numbers: dict[Hashable, int] = {}
    for state in known:
        numbers.setdefault(state, len(numbers))
    next_state, revisit, reversal = [], [], []
    seen: set[Hashable] = set(known[:1])
    for t in range(steps):
        if t + 1 >= len(known):  # the failed last step: its state is unknown
            next_state.append(None)
            revisit.append(None)
            reversal.append(None)
            continue
        after = known[t + 1]
        counted = not (terminated and t == steps - 1)
        next_state.append(numbers[after])
        revisit.append(after in seen if counted else None)
        reversal.append(after == known[t - 1] if counted and t >= 1 else None)
        seen.add(after)
    if failed:
        return EpisodeLoops(tuple(next_state), tuple(revisit), tuple(reversal), None, None)
    ends_in_cycle = not terminated and steps >= 1 and known[-1] in known[:-1]
    return EpisodeLoops(tuple(next_state), tuple(revisit), tuple(reversal), ends_in_cycle, len(numbers))


@dataclass(frozen=True)
class LoopCounts:
    """The loop figures of a set of episodes as counts, which add up over processes (`combine`)."""

    steps: int  # counted steps
    revisits: int
    reversal_steps: int  # counted steps with t >= 1
    reversals: int
    ended: int  # episodes whose last state is known
    cycle_endings: int
    distinct_states: int  # summed over the `ended` episodes

    @classmethod
    def of(cls, episodes: Iterable[EpisodeLoops]) -> LoopCounts:
        episodes = list(episodes)
        revisits = [flag for e in episodes for flag in e.revisit if flag is not None]
        reversals = [flag for e in episodes for flag in e.reversal if flag is not None]
        ended = [e for e in episodes if e.ends_in_cycle is not None]
        return cls(
            steps=len(revisits), revisits=sum(revisits), reversal_steps=len(reversals), reversals=sum(reversals),
            ended=len(ended), cycle_endings=sum(e.ends_in_cycle for e in ended),
            distinct_states=sum(e.distinct_states for e in ended),
        )

    @classmethod
    def combine(cls, parts: Iterable[LoopCounts]) -> LoopCounts:
        parts = list(parts)
        return cls(**{f.name: sum(getattr(part, f.name) for part in parts) for f in fields(cls)})

    def as_metrics(self, prefix: str = LOOPS_PREFIX) -> dict[str, float]:
        """`loops/revisit_share`, `loops/reversal_share`, `loops/cycle_end_share`, `loops/distinct_states_mean`;
        each left out where it has nothing to count."""
        metrics = {}
        if self.steps:
            metrics[f"{prefix}revisit_share"] = self.revisits / self.steps
        if self.reversal_steps:
            metrics[f"{prefix}reversal_share"] = self.reversals / self.reversal_steps
        if self.ended:
            metrics[f"{prefix}cycle_end_share"] = self.cycle_endings / self.ended
            metrics[f"{prefix}distinct_states_mean"] = self.distinct_states / self.ended
        return metrics


@dataclass(frozen=True)
class LoopAlarm:
    """What the last loop warning said: the revisit share and the entropy it was issued at."""

    revisit_share: float
    entropy: float


def loop_warning_due(revisit_share: float, entropies: Sequence[float], last: LoopAlarm | None) -> bool:
    """Whether the policy loops and the run should be told (again): the revisit share is at least
    LOOP_REVISIT_SHARE while the latest entropy is at most LOOP_ENTROPY_FALL times the baseline (the mean of the first
    ENTROPY_BASELINE_LOGS entropies), and either no warning was given yet (`last` None) or it has worsened since: the
    revisit share up by LOOP_WORSENING or the entropy at most LOOP_ENTROPY_FALL times the last warning's.

    Args:
        revisit_share: the training rollouts' `loops/revisit_share` now.
        entropies: the policy entropy of every logged training step so far, the latest last; the baseline needs
            ENTROPY_BASELINE_LOGS of them before the latest.
        last: the last warning, if any.
    """
    if len(entropies) <= ENTROPY_BASELINE_LOGS:
        return False
    entropy = entropies[-1]
    looping = (revisit_share >= LOOP_REVISIT_SHARE
               and entropy <= LOOP_ENTROPY_FALL * entropy_baseline(entropies))
    if not looping or last is None:
        return looping
    return revisit_share >= last.revisit_share + LOOP_WORSENING or entropy <= LOOP_ENTROPY_FALL * last.entropy


def entropy_baseline(entropies: Sequence[float]) -> float:
    """The entropy at the start of the run: the mean of the first ENTROPY_BASELINE_LOGS logged values."""
    return statistics.fmean(entropies[:ENTROPY_BASELINE_LOGS])

