"""Loops in an episode's walk through states: revisits, stays, turn-backs, endings inside a cycle, distinct states.

A policy that collapses into a deterministic back-and-forth (RAGEN's "Echo Trap") keeps its success rate flat while
its episodes walk in circles; one that collapses into walking one way bumps into the wall for the rest of every
episode. Every GiGPO step carries the exact, hashable anchor of the state its action was taken in, so both can be
counted exactly, from the anchors the rollout already holds.

An episode of T steps visits the states s_0 (the start), s_1, ..., s_T: step t is taken in s_t and leads to s_{t+1}.
States are compared by their anchors, exactly (`similarity_threshold` plays no part here).

- Step t **revisits** when s_{t+1} is in {s_0, ..., s_t}, the start included: turning back, and staying where it is
  (an action that changes nothing), both revisit.
- Step t **stays** when s_{t+1} == s_t: a move into a wall, an action that changes nothing.
- Step t >= 1 **turns back** when s_{t+1} == s_{t-1} != s_t: straight back to the state it came from (a stay is
  never a turn-back).
- The **counted steps** are all steps but two kinds of last step: one that terminated the episode (it leads to a
  terminal state, where nothing more is played: a tool environment's final answer without a tool call leaves the
  state as it was and is no loop), and one whose environment failed (the state it led to is unknown).
- The episode **ends in a cycle** when it was cut off (by the step limit, not terminated: a won episode never ends in
  a cycle) in a state it had visited before: s_T is in {s_0, ..., s_{T-1}}. Unknown when its environment failed.
- **Distinct states**: the number of different states among s_0, ..., s_T. Unknown when its environment failed.

A rollout's figures pool its episodes (`LoopCounts`): the revisit and stay shares are over the counted steps, the
turn-back share over the counted steps with t >= 1, the cycle share and the mean of distinct states over the episodes
whose last state is known. A share with nothing to count is left out, not 0. The warnings that read these figures are
in `gigpo_trl.health`. No torch and no trainer state here.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, fields

from gigpo_trl.metric_names import LOOPS_PREFIX


@dataclass(frozen=True)
class EpisodeLoops:
    """The loop figures of one episode of T steps (the module docstring defines them). Per step t, one entry each:
    `next_state` numbers s_{t+1} in the order the episode first visited its states (s_0 is 0; None: unknown);
    `revisit`, `stay` and `turn_back` are None for a step that is not counted (and `turn_back` at t = 0)."""

    next_state: tuple[int | None, ...]
    revisit: tuple[bool | None, ...]
    stay: tuple[bool | None, ...]
    turn_back: tuple[bool | None, ...]
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
    next_state, revisit, stay, turn_back = [], [], [], []
    seen: set[Hashable] = set(known[:1])
    for t in range(steps):
        if t + 1 >= len(known):  # the failed last step: its state is unknown
            next_state.append(None)
            revisit.append(None)
            stay.append(None)
            turn_back.append(None)
            continue
        before, now, after = known[t - 1] if t >= 1 else None, known[t], known[t + 1]
        counted = not (terminated and t == steps - 1)
        next_state.append(numbers[after])
        revisit.append(after in seen if counted else None)
        stay.append(after == now if counted else None)
        turn_back.append(after == before and after != now if counted and t >= 1 else None)
        seen.add(after)
    if failed:
        return EpisodeLoops(tuple(next_state), tuple(revisit), tuple(stay), tuple(turn_back), None, None)
    ends_in_cycle = not terminated and steps >= 1 and known[-1] in known[:-1]
    return EpisodeLoops(tuple(next_state), tuple(revisit), tuple(stay), tuple(turn_back), ends_in_cycle, len(numbers))


@dataclass(frozen=True)
class LoopCounts:
    """The loop figures of a set of episodes as counts, which add up over processes (`combine`)."""

    steps: int  # counted steps
    revisits: int
    stays: int
    turn_back_steps: int  # counted steps with t >= 1
    turn_backs: int
    ended: int  # episodes whose last state is known
    cycle_endings: int
    distinct_states: int  # summed over the `ended` episodes

    @classmethod
    def of(cls, episodes: Iterable[EpisodeLoops]) -> LoopCounts:
        episodes = list(episodes)
        revisits = [flag for e in episodes for flag in e.revisit if flag is not None]
        turn_backs = [flag for e in episodes for flag in e.turn_back if flag is not None]
        ended = [e for e in episodes if e.ends_in_cycle is not None]
        return cls(
            steps=len(revisits), revisits=sum(revisits), stays=sum(flag is True for e in episodes for flag in e.stay),
            turn_back_steps=len(turn_backs), turn_backs=sum(turn_backs), ended=len(ended),
            cycle_endings=sum(e.ends_in_cycle for e in ended), distinct_states=sum(e.distinct_states for e in ended),
        )

    @classmethod
    def combine(cls, parts: Iterable[LoopCounts]) -> LoopCounts:
        parts = list(parts)
        return cls(**{f.name: sum(getattr(part, f.name) for part in parts) for f in fields(cls)})

    def as_metrics(self, prefix: str = LOOPS_PREFIX) -> dict[str, float]:
        """`loops/revisit_share`, `loops/stay_share`, `loops/turn_back_share`, `loops/cycle_end_share`,
        `loops/distinct_states_mean`; each left out where it has nothing to count."""
        metrics = {}
        if self.steps:
            metrics[f"{prefix}revisit_share"] = self.revisits / self.steps
            metrics[f"{prefix}stay_share"] = self.stays / self.steps
        if self.turn_back_steps:
            metrics[f"{prefix}turn_back_share"] = self.turn_backs / self.turn_back_steps
        if self.ended:
            metrics[f"{prefix}cycle_end_share"] = self.cycle_endings / self.ended
            metrics[f"{prefix}distinct_states_mean"] = self.distinct_states / self.ended
        return metrics
