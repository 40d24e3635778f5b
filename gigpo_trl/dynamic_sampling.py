"""Dynamic sampling (DAPO, arXiv 2503.14476, section 3.2; docs/algorithm.md): every update learns.

A task group whose copies all got the same return (typically: none won) teaches the task nothing: it costs its rollout
and its share of the update. Which groups count as carrying a signal (`dynamic_sampling_signal`):
- "returns" (the default; DAPO's rule): the returns `R = sum_t r_t` of the group's
  trajectories are not all equal. A group of equal returns is dropped even where its advantages are not all 0: copies
  that all lost but gave different numbers of off-format answers (the invalid-answer penalty), or copies that all won,
  some sooner (gamma < 1 and omega > 0: the sooner copies' steps have the larger returns-to-go).
- "advantages": some step sample's advantage `A = A_E + omega * A_S` is not 0, so exactly the groups that add
  nothing to the policy gradient are dropped, and those of equal returns with a penalty or discount signal are kept.
  The group normalizations give exact zeros for equal values, so "is 0" is an exact test.
A group left with a single trajectory (its other copies failed at reset) is dropped under "returns" (one return is
compared with nothing) and kept under "advantages" when its raw score, which it keeps as its advantage
(docs/algorithm.md, "The episode advantage"), is not 0. A group without any step sample (every copy failed at reset)
is dropped under both. Dynamic sampling never changes the advantage of a sample that reaches the update.

After a training rollout, each process drops its groups without signal and plays extra rounds of further tasks, drawn
from the training set, as many tasks a round as its first rollout had, until it holds that many groups with a signal
or `dynamic_sampling_max_rounds` extra rounds were played; the update then trains on what it has. Groups with a signal
beyond that number are left out as well (DAPO's rule: the update keeps its configured size). Every process plays the
same rounds, decided together after each one, so generation stays in lock-step: a process that already holds enough
plays no task in a round and only makes the generation calls of the others' turns; one that holds none at the limit
trains on zero-weight rows.

Reward-std filtering (RAGEN's `rollout_filter_ratio` with its "std" type, arXiv 2504.20073; `reward_std_filter_ratio`)
is the other rule: of the n task groups of a training rollout over all processes (those dynamic sampling kept, when it
is on too), only the `k = ceil(p * n)` whose trajectories' returns have the largest standard deviation reach the update;
the rest are dropped and nothing is played to replace them. The selection is made over every process's groups (each
process ranks the same gathered stds and keeps its own), so a process may keep none and train on zero-weight rows.
Nothing here imports torch or the trainer.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import numpy as np

from gigpo_trl.advantages import GiGPOAdvantages
from gigpo_trl.metric_names import DYNAMIC_SAMPLING_PREFIX, REWARD_STD_FILTER_PREFIX
from gigpo_trl.options import SIGNAL_MODES, std_filter_kept_count
from gigpo_trl.rollout import Rollout, concatenate_rollouts

@dataclass(frozen=True)
class SamplingCounts:
    """What dynamic sampling did in an iteration: task groups rolled = kept + dropped + surplus, and the groups asked
    for = kept + missing. Counts add up over processes; the extra rounds are the same on every process and their time
    (rollouts and advantages) is the slowest process's."""

    groups_rolled: int  # played, every round
    groups_kept: int  # reach the update
    groups_dropped: int  # no signal: every step sample's advantage is 0
    groups_surplus: int  # a signal, but found after enough others: left out
    groups_missing: int  # the update holds this many fewer groups than asked: the limit was reached
    extra_rounds: int
    extra_rollout_s: float

    @classmethod
    def combine(cls, parts: Sequence[SamplingCounts]) -> SamplingCounts:
        """The counts of an iteration over all processes, from each process's."""
        counts = {f.name: sum(getattr(part, f.name) for part in parts) for f in fields(cls) if f.name.startswith("groups_")}
        return cls(**counts, extra_rounds=max(part.extra_rounds for part in parts),
                   extra_rollout_s=max(part.extra_rollout_s for part in parts))

    def as_metrics(self, prefix: str = DYNAMIC_SAMPLING_PREFIX) -> dict[str, float]:
        """The counts as a flat `{prefix + name: float}` dict, ready for a logger."""
        return {prefix + f.name: float(getattr(self, f.name)) for f in fields(self)}


@dataclass
class SampledGroups:
    """The outcome of dynamic sampling on one process."""

    rollout: Rollout  # every round's, one after the other (`concatenate_rollouts`)
    advantages: GiGPOAdvantages  # of every step sample of `rollout`
    samples: list[int]  # the step samples of the kept groups: those that may become rows of the update
    counts: SamplingCounts


def groups_with_unequal_returns(groups: Sequence[int], returns: Sequence[float]) -> list[int]:
    """The task groups whose trajectories' returns are not all equal (DAPO's rule), in increasing order.

    Args:
        groups: int [m], the task group of each trajectory (those with at least one step sample).
        returns: float [m], each trajectory's return `R = sum_t r_t`.
    """
    groups, returns = np.asarray(groups, dtype=np.int64), np.asarray(returns, dtype=np.float64)
    if groups.size == 0:
        return []
    lowest, highest = np.full(groups.max() + 1, np.inf), np.full(groups.max() + 1, -np.inf)
    np.minimum.at(lowest, groups, returns)
    np.maximum.at(highest, groups, returns)
    return np.flatnonzero(lowest < highest).tolist()


def groups_with_nonzero_advantages(groups: Sequence[int], advantages: np.ndarray) -> list[int]:
    """The task groups of which some step sample has a nonzero advantage, in increasing order.

    Args:
        groups: int [n], the task group of each step sample.
        advantages: float [n], each sample's advantage `A = A_E + omega * A_S`.
    """
    signal = np.asarray(advantages) != 0
    return np.unique(np.asarray(groups, dtype=np.int64)[signal]).tolist()


def groups_with_signal(rollout: Rollout, advantages: GiGPOAdvantages, signal: str = "returns") -> list[int]:
    """The task groups of a rollout that carry a signal by the rule `signal` (one of `SIGNAL_MODES`), in increasing
    order; `advantages` are those of the rollout's step samples."""
    if signal == "returns":
        played = [episode for episode in rollout.episodes if episode.length]
        return groups_with_unequal_returns([e.group for e in played], [e.episode_return for e in played])
    if signal == "advantages":
        return groups_with_nonzero_advantages(rollout.steps.group, advantages.advantages)
    raise ValueError(f"unknown dynamic sampling signal {signal!r}; expected one of {SIGNAL_MODES}")


def extra_task_rows(num_rows: int, count: int, *, seed: int, step: int, process: int, round_: int) -> list[int]:
    """The training-set rows of the tasks of extra round `round_` (1, 2, ...): the round's `count` consecutive entries
    of a permutation of the `num_rows` rows drawn by a generator seeded with the run's seed, the global step and the
    process index. So a run draws the same tasks whenever it reaches the same step, after a resume too, TRL's sampler
    is left alone, and the rounds of an iteration repeat no row before every row was drawn (the first rollout's tasks,
    TRL's draw, may come up again)."""
    order = np.random.default_rng([seed, step, process]).permutation(num_rows)
    start = (round_ - 1) * count
    return [int(order[(start + k) % num_rows]) for k in range(count)]


def sample_groups(
    rollout: Rollout,
    advantages: GiGPOAdvantages,
    play_round: Callable[[int, bool], Rollout],
    score: Callable[[Rollout], GiGPOAdvantages],
    *,
    max_rounds: int,
    signal: str = "returns",
    max_across_processes: Callable[[int], int] = lambda n: n,
) -> SampledGroups:
    """Keep this process's groups with a signal, playing extra rounds until it holds as many as its first rollout's
    tasks, or `max_rounds` extra rounds (see the module docstring).

    Args:
        rollout, advantages: the iteration's first rollout and its advantages; its task count is the groups asked for.
        play_round: `play_round(k, needed)` plays extra round k (1, 2, ...) and returns its rollout: as many further
            tasks as the first rollout's when `needed`, else none (this process holds enough; it only generates in
            lock-step with the others).
        score: the advantages of a rollout (`compute_gigpo_advantages` of its step columns).
        max_rounds: extra rounds at most (`dynamic_sampling_max_rounds`).
        signal: what makes a group worth keeping, one of `SIGNAL_MODES` (`dynamic_sampling_signal`).
        max_across_processes: the maximum of an int over all processes (identity on one process): a round is played
            while any process lacks groups, by every process.

    Returns:
        Every round's rollout and advantages as one, the step samples of the kept groups, and the counts.
    """
    asked = rollout.num_groups
    rollouts, scores, kept, with_signal = [], [], [], 0
    extra_seconds = 0.0
    while True:
        offset = sum(part.num_groups for part in rollouts)
        found = groups_with_signal(rollout, advantages, signal)
        kept += [offset + group for group in found[: asked - len(kept)]]
        with_signal += len(found)
        rollouts.append(rollout)
        scores.append(advantages)
        extra_rounds = len(rollouts) - 1
        if extra_rounds == max_rounds or max_across_processes(asked - len(kept)) == 0:
            break
        started = time.perf_counter()
        rollout = play_round(extra_rounds + 1, len(kept) < asked)
        advantages = score(rollout)
        extra_seconds += time.perf_counter() - started

    merged = concatenate_rollouts(rollouts)
    kept_groups = set(kept)
    rolled = merged.num_groups
    counts = SamplingCounts(
        groups_rolled=rolled, groups_kept=len(kept), groups_dropped=rolled - with_signal,
        groups_surplus=with_signal - len(kept), groups_missing=asked - len(kept), extra_rounds=extra_rounds,
        extra_rollout_s=extra_seconds,
    )
    samples = [k for k, group in enumerate(merged.steps.group) if group in kept_groups]
    return SampledGroups(merged, GiGPOAdvantages.concatenate(scores), samples, counts)


# ------------------------------------------------------------------------------------------
# Reward-std filtering (RAGEN's rule).
# ------------------------------------------------------------------------------------------


def group_return_stds(groups: Sequence[int], returns: Sequence[float]) -> dict[int, float]:
    """The standard deviation of each task group's trajectory returns: Bessel's (ddof 1), as RAGEN's `torch.std`.

    Taken over the returns in increasing order, so that groups of the same returns in another order tie exactly. A
    group of a single trajectory (its other copies failed at reset) has 0: its spread is unknown.

    Args:
        groups: int [m], the task group of each trajectory (those with at least one step sample).
        returns: float [m], each trajectory's return `R = sum_t r_t`.

    Returns:
        {group: std} for every group of `groups`.
    """
    by_group: dict[int, list[float]] = defaultdict(list)
    for group, episode_return in zip(groups, returns):
        by_group[int(group)].append(float(episode_return))
    return {group: float(np.std(sorted(values), ddof=1)) if len(values) > 1 else 0.0
            for group, values in by_group.items()}


def top_std_groups(stds: Sequence[Sequence[float]], ratio: float, *, seed: int, step: int) -> list[list[int]]:
    """RAGEN's reward-std filter over the task groups of all processes: the `std_filter_kept_count(n, ratio)` groups of
    the largest return std among the n groups of every process.

    Ties between equal stds are broken by a permutation of the n groups drawn by a generator seeded with the run's
    seed and the global step: the same on every process and in a rerun (or a resumed run), fair between processes
    and between a rollout's tasks, and another draw at the next step. A group of a larger std is never left out for
    one of a smaller std.

    Args:
        stds: per process (in process order), the return std of each of its groups (`group_return_stds`); processes
            may hold different numbers of groups.
        ratio: the share of the groups kept, in (0, 1] (`reward_std_filter_ratio`).
        seed, step: the run's seed and the global step, which break ties.

    Returns:
        Per process, the positions (into its list of `stds`) of its kept groups, in increasing order.
    """
    owners = [(process, position) for process, part in enumerate(stds) for position in range(len(part))]
    flat = np.array([std for part in stds for std in part], dtype=np.float64)
    tie_break = np.random.default_rng([seed, step]).permutation(len(owners))
    ranked = np.lexsort((tie_break, -flat))  # largest std first; among equal stds, by the drawn permutation
    kept: list[list[int]] = [[] for _ in stds]
    for index in ranked[: std_filter_kept_count(len(owners), ratio)]:
        process, position = owners[index]
        kept[process].append(position)
    return [sorted(positions) for positions in kept]


@dataclass(frozen=True)
class StdFilterCounts:
    """What the reward-std filter did in an iteration, over all processes: the same on every process, which all rank
    the same gathered stds."""

    groups_ranked: int  # the groups it chose from: the rollout's (those with a step sample), or dynamic sampling's kept
    groups_kept: int  # reach the update: ceil(ratio * groups_ranked)
    groups_dropped: int
    groups_kept_zero_std: int  # kept though their returns are all equal: fewer groups than kept carry a return signal
    std_threshold: float  # the smallest std kept (0 when none was kept)
    kept_std_mean: float  # the mean return std of the kept groups (0 when none)
    dropped_std_mean: float  # and of the dropped ones (0 when none)

    @classmethod
    def of(cls, stds: Sequence[Sequence[float]], kept: Sequence[Sequence[int]]) -> StdFilterCounts:
        """The counts of a selection `kept` (`top_std_groups`) from the groups of `stds` (one list per process)."""
        kept_stds = [part[position] for part, positions in zip(stds, kept) for position in positions]
        dropped_stds = [std for part, positions in zip(stds, map(set, kept)) for position, std in enumerate(part)
                        if position not in positions]
        return cls(groups_ranked=len(kept_stds) + len(dropped_stds), groups_kept=len(kept_stds),
                   groups_dropped=len(dropped_stds), groups_kept_zero_std=kept_stds.count(0.0),
                   std_threshold=min(kept_stds, default=0.0),
                   kept_std_mean=float(np.mean(kept_stds)) if kept_stds else 0.0,
                   dropped_std_mean=float(np.mean(dropped_stds)) if dropped_stds else 0.0)

    def as_metrics(self, prefix: str = REWARD_STD_FILTER_PREFIX) -> dict[str, float]:
        """The counts as a flat `{prefix + name: float}` dict, ready for a logger."""
        return {prefix + f.name: float(getattr(self, f.name)) for f in fields(self)}


def filter_by_return_std(
    rollout: Rollout,
    samples: Sequence[int],
    ratio: float,
    *,
    seed: int,
    step: int,
    process: int = 0,
    gather: Callable[[list[float]], list[list[float]]] = lambda stds: [stds],
) -> tuple[list[int], StdFilterCounts]:
    """Keep the step samples of the task groups that the reward-std filter keeps over all processes.

    Args:
        rollout: this process's rollout (every round of dynamic sampling).
        samples: the step samples that may reach the update (all, or those of dynamic sampling's kept groups); the
            groups they belong to are the ones ranked.
        ratio: `reward_std_filter_ratio`.
        seed, step: the run's seed and the global step (`top_std_groups` breaks ties with them).
        process: this process's index.
        gather: a list of floats of every process, in process order, from this process's (`gather_object`; on one
            process, itself alone).

    Returns:
        The samples of this process's kept groups (in the order of `samples`), and the filter's counts.
    """
    group_of = rollout.steps.group
    ranked = sorted({group_of[sample] for sample in samples})
    played = [episode for episode in rollout.episodes if episode.length]
    stds = group_return_stds([e.group for e in played], [e.episode_return for e in played])
    everyone = gather([stds[group] for group in ranked])
    kept_positions = top_std_groups(everyone, ratio, seed=seed, step=step)
    kept = {ranked[position] for position in kept_positions[process]}
    return [sample for sample in samples if group_of[sample] in kept], StdFilterCounts.of(everyone, kept_positions)
