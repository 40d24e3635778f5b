"""GiGPO advantages: an episode advantage and an anchor-state step advantage for every step row.

Group-in-Group Policy Optimization (arXiv 2505.10978), as docs/algorithm.md specifies it:

    s_t   = R - p * invalid_t                           episode score of row t   (R = sum_t r_t)
    G_t   = r_t + gamma * G_{t+1},  G_T = 0             discounted return-to-go
    v_t   = G_t - p * invalid_t                         step value of row t
    A_E   = norm(s_t; S_episode(g))                     episode advantage, S over the task group g
    A_S   = norm(v_t; {v of rows of g with the same anchor})   step advantage (0 for singletons)
    A     = A_E + omega * A_S

With `step_lambda` < 1 (docs/algorithm.md, "Bootstrapped step value"; beyond the paper), the step value
bootstraps from the states a trajectory reaches, valued by the group itself:

    V(k)  = mean of G_j over the rows j of g whose anchor is k     (the mean of k's step group)
    Gl_t  = r_t + gamma * ((1 - lambda) * V(k_{t+1}) + lambda * Gl_{t+1}),   Gl_{T-1} = r_{T-1}
    v_t   = Gl_t - p * invalid_t                        (lambda = 1: Gl = G, the paper exactly)

    norm(x; S) = (x - mean(S)) / (std(S) + 1e-6)        "mean_std" (std with Bessel's correction)
               =  x - mean(S)                           "mean"

Everything here is a pure function of numpy arrays: no torch, no trainer state. The exact path is
vectorized (no Python loop over rows; the only loop is over the position in the trajectory, as in
the return recursion). Results do not depend on the order of the rows: every sum is taken in an
order fixed by the data itself (step order within a trajectory, value order within a group).
"""

from __future__ import annotations

import numbers
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, fields

import numpy as np
import pandas as pd
from rapidfuzz import process
from rapidfuzz.distance import Indel

from gigpo_trl.metric_names import GIGPO_PREFIX
from gigpo_trl.options import EPISODE_STATS_MODES, NORM_MODES

EPSILON = 1e-6


@dataclass(frozen=True)
class StepGroupStats:
    """Step-group statistics of one advantage pass, for logging.

    A step group is the set of rows of one task group that share an anchor state. If almost all
    step groups are singletons, every step advantage is 0 and GiGPO reduces to step-wise GRPO.
    """

    num_rows: int
    num_step_groups: int
    singleton_share: float  # fraction of step groups with exactly one row
    step_group_size_mean: float  # mean rows per step group
    step_group_size_max: int
    nonzero_step_advantage_share: float  # fraction of rows whose A_S != 0
    episode_advantage_mean: float
    episode_advantage_std: float
    step_advantage_mean: float
    step_advantage_std: float

    @classmethod
    def combine(cls, parts: Sequence[StepGroupStats]) -> StepGroupStats:
        """The statistics of the union of disjoint sets of rows (e.g. the rollouts of several processes), from the
        statistics of each set alone: counts add up, maxima are maxima, shares and means are weighted by the step
        groups or rows behind them, and standard deviations (ddof 0) pool each set's variance and the spread of its
        mean around the whole mean, `sum_i n_i (std_i^2 + (mean_i - mean)^2) / n`. Exact up to rounding."""
        parts = [part for part in parts if part.num_rows]
        if not parts:
            return _empty_result().stats
        rows = np.array([part.num_rows for part in parts], dtype=np.float64)
        groups = np.array([part.num_step_groups for part in parts], dtype=np.float64)

        def pooled(mean: str, std: str) -> tuple[float, float]:
            means = np.array([getattr(part, mean) for part in parts])
            stds = np.array([getattr(part, std) for part in parts])
            total_mean = float(rows @ means / rows.sum())
            return total_mean, float(np.sqrt(rows @ (stds**2 + (means - total_mean) ** 2) / rows.sum()))

        episode_mean, episode_std = pooled("episode_advantage_mean", "episode_advantage_std")
        step_mean, step_std = pooled("step_advantage_mean", "step_advantage_std")
        return cls(
            num_rows=int(rows.sum()),
            num_step_groups=int(groups.sum()),
            singleton_share=float(groups @ [part.singleton_share for part in parts] / groups.sum()),
            step_group_size_mean=float(rows.sum() / groups.sum()),
            step_group_size_max=max(part.step_group_size_max for part in parts),
            nonzero_step_advantage_share=float(rows @ [part.nonzero_step_advantage_share for part in parts] / rows.sum()),
            episode_advantage_mean=episode_mean,
            episode_advantage_std=episode_std,
            step_advantage_mean=step_mean,
            step_advantage_std=step_std,
        )

    def as_metrics(self, prefix: str = GIGPO_PREFIX) -> dict[str, float]:
        """The statistics as a flat `{prefix + name: float}` dict, ready for a logger."""
        return {prefix + f.name: float(getattr(self, f.name)) for f in fields(self)}


@dataclass(frozen=True)
class GiGPOAdvantages:
    """Result of `compute_gigpo_advantages`; every array has one entry per input row, in input order."""

    advantages: np.ndarray  # float64 [n]: episode_advantages + step_weight * step_advantages
    episode_advantages: np.ndarray  # float64 [n]: A_E
    step_advantages: np.ndarray  # float64 [n]: A_S
    step_group_sizes: np.ndarray  # int64 [n]: number of rows in the row's step group
    stats: StepGroupStats

    @classmethod
    def concatenate(cls, parts: Sequence[GiGPOAdvantages]) -> GiGPOAdvantages:
        """The advantages of the rows of several passes, one part after the other: what one pass over all the rows
        gives when no task group has rows in two parts (the rounds of dynamic sampling play different groups)."""
        arrays = (np.concatenate([getattr(part, name) for part in parts])
                  for name in ("advantages", "episode_advantages", "step_advantages", "step_group_sizes"))
        return cls(*arrays, stats=StepGroupStats.combine([part.stats for part in parts]))


# --------------------------------------------------------------------------------------------
# The math: small pure functions, one per equation.
# --------------------------------------------------------------------------------------------


def discounted_returns(
    rewards: np.ndarray,
    steps_to_go: np.ndarray,
    gamma: float,
    lam: float = 1.0,
    next_values: np.ndarray | None = None,
) -> np.ndarray:
    """Lambda-return `Gl_t = r_t + gamma * ((1 - lam) * V_{t+1} + lam * Gl_{t+1})`, `Gl_{T-1} = r_{T-1}`, for all
    trajectories at once. With `lam = 1` (the default) it is the return-to-go `G_t = r_t + gamma * G_{t+1}`, `G_T = 0`.

    Args:
        rewards: float [n], rows laid out trajectory after trajectory, each in step order.
        steps_to_go: int [n], `T - 1 - t`: how many rows follow the row in its trajectory.
        gamma: discount factor.
        lam: lambda in [0, 1], the weight of the trajectory's own continuation against the bootstrap.
        next_values: float [n], `V_{t+1}`: the value of the state the row's action led to (read only for rows that
            have a next row); None (only with `lam = 1`): no bootstrap.

    Returns:
        float64 [n]: `Gl_t` of every row.
    """
    if next_values is None and lam != 1.0:
        raise ValueError(f"a lambda-return with lambda {lam} bootstraps: next_values are needed")
    returns = np.array(rewards, dtype=np.float64)
    if returns.size == 0:
        return returns
    # Rows with k steps to go, for k = 1, 2, ...: their successor (the next row) is already final.
    by_steps_to_go = np.argsort(steps_to_go, kind="stable")
    bounds = np.searchsorted(steps_to_go[by_steps_to_go], np.arange(int(steps_to_go.max()) + 2))
    for k in range(1, len(bounds) - 1):
        rows = by_steps_to_go[bounds[k] : bounds[k + 1]]
        if next_values is None:
            returns[rows] += gamma * returns[rows + 1]
        else:
            returns[rows] += gamma * ((1.0 - lam) * next_values[rows] + lam * returns[rows + 1])
    return returns


def group_mean_std(values: np.ndarray, groups: np.ndarray, num_groups: int) -> tuple[np.ndarray, ...]:
    """Mean, Bessel-corrected std and size of the values of every group.

    Sums run over each group's values in sorted order, shifted by the group's minimum: the result
    is independent of row order, and a group of equal values has mean equal to that value exactly
    and std 0 exactly.

    Args:
        values: float [m].
        groups: int [m] in `[0, num_groups)`.
        num_groups: number of groups G.

    Returns:
        `(mean, std, count)`, each [G]; std is 0 for groups of size 1, mean and std are 0 for empty groups.
    """
    count = np.bincount(groups, minlength=num_groups)
    order = np.lexsort((values, groups))
    sorted_values, sorted_groups = values[order], groups[order]
    starts = np.concatenate(([0], np.cumsum(count)[:-1]))
    present = count > 0
    minimum = np.zeros(num_groups)
    minimum[present] = sorted_values[starts[present]]
    shifted = sorted_values - minimum[sorted_groups]
    shifted_mean = _segment_sums(shifted, starts, present) / np.maximum(count, 1)
    squared = (shifted - shifted_mean[sorted_groups]) ** 2
    variance = _segment_sums(squared, starts, present) / np.maximum(count - 1, 1)
    return minimum + shifted_mean, np.sqrt(variance), count


def normalize(values: np.ndarray, mean: np.ndarray, std: np.ndarray, norm: str) -> np.ndarray:
    """`norm(x; S)`: `(x - mean(S)) / (std(S) + 1e-6)` for "mean_std", `x - mean(S)` for "mean".

    `mean` and `std` are already broadcast to the rows of `values` (all float [n]).
    """
    centered = values - mean
    return centered / (std + EPSILON) if norm == "mean_std" else centered


def step_group_advantages(
    step_values: np.ndarray, step_group: np.ndarray, num_step_groups: int, norm: str
) -> tuple[np.ndarray, np.ndarray]:
    """Step advantage `A_S = norm(v_t; values v of the row's step group)`, 0 exactly for singleton step groups.

    Args:
        step_values: float [n], `v_t`.
        step_group: int [n] in `[0, num_step_groups)`, the row's step group.
        num_step_groups: number of step groups.
        norm: "mean_std" or "mean".

    Returns:
        `(A_S, sizes)`: float64 [n], and int64 [num_step_groups] the number of rows of each step group.
    """
    mean, std, sizes = group_mean_std(step_values, step_group, num_step_groups)
    step_advantages = normalize(step_values, mean[step_group], std[step_group], norm)
    step_advantages[sizes[step_group] == 1] = 0.0  # singleton step groups get 0 exactly
    return step_advantages, sizes


def greedy_similarity_clusters(texts: Sequence[str], threshold: float) -> np.ndarray:
    """Greedy clustering of texts, in the given order: each text joins the first existing cluster
    whose first member (its seed) is similar enough, else it starts a new cluster.

    Similarity is the normalized Indel similarity `2 * LCS(a, b) / (len(a) + len(b))` (rapidfuzz),
    the longest-common-subsequence form of difflib's `SequenceMatcher.ratio()`: equal to it whenever
    difflib's block matching finds the longest common subsequence, never below it. Two texts are
    similar when that ratio is >= `threshold`. Since the ratio is at most
    `2 * min(len) / (len(a) + len(b))`, seeds whose length rules them out are never compared.

    Args:
        texts: k strings, in the order the greedy pass visits them.
        threshold: similarity in (0, 1].

    Returns:
        int64 [k]: cluster index of every text; clusters are numbered in order of creation.
    """
    labels = np.empty(len(texts), dtype=np.int64)
    seeds: list[str] = []
    seed_lengths = np.empty(len(texts), dtype=np.float64)
    for i, text in enumerate(texts):
        length = len(text)
        lengths = seed_lengths[: len(seeds)]
        candidates = np.flatnonzero(2.0 * np.minimum(lengths, length) >= threshold * (lengths + length))
        label = -1
        if candidates.size:
            scores = process.cdist(
                [text],
                [seeds[c] for c in candidates],
                scorer=Indel.normalized_similarity,
                score_cutoff=threshold,
                dtype=np.float64,
                workers=1,
            )[0]
            hits = np.flatnonzero(scores >= threshold)
            if hits.size:
                label = int(candidates[hits[0]])
        if label < 0:
            label = len(seeds)
            seed_lengths[label] = length
            seeds.append(text)
        labels[i] = label
    return labels


def anchor_step_groups(
    group_ids: Sequence[Hashable],
    anchor_keys: Sequence[Hashable],
    step_indices: Sequence[int],
    similarity_threshold: float | None = None,
) -> np.ndarray:
    """Step groups: rows of the same task group whose anchor states are equal (or similar) share one.

    Args:
        group_ids: hashable [n], the task group of each row; step groups never cross task groups.
        anchor_keys: hashable [n], the state each row's action was taken in.
        step_indices: int [n], the row's step in its trajectory (orders the greedy similarity pass).
        similarity_threshold: None for exact equality of anchors. Otherwise anchors must be str;
            each group's distinct anchors are visited in order of the first step they appear at,
            then alphabetically (so the result does not depend on row order), and clustered by
            `greedy_similarity_clusters`.

    Returns:
        int64 [n]: a dense step-group code per row (0..number of step groups - 1).
    """
    return _anchor_step_groups(_factorize(group_ids, "group_ids"), anchor_keys, np.asarray(step_indices), similarity_threshold)


# --------------------------------------------------------------------------------------------
# The public function.
# --------------------------------------------------------------------------------------------


def compute_gigpo_advantages(
    rewards: Sequence[float],
    group_ids: Sequence[Hashable],
    trajectory_ids: Sequence[Hashable],
    step_indices: Sequence[int],
    anchor_keys: Sequence[Hashable],
    invalid: Sequence[bool] | None = None,
    *,
    gamma: float = 0.95,
    step_weight: float = 1.0,
    norm: str = "mean_std",
    episode_stats: str = "steps",
    invalid_penalty: float = 0.1,
    similarity_threshold: float | None = None,
    step_lambda: float = 1.0,
) -> GiGPOAdvantages:
    """GiGPO advantages of n step rows (docs/algorithm.md).

    Args:
        rewards: float [n], `r_t`: the environment reward received after the row's action.
        group_ids: hashable [n], the task group of each row (the N copies of one task).
        trajectory_ids: hashable [n], the episode of each row; a trajectory lies in one group.
        step_indices: int [n], `t`: 0-based position of the row in its trajectory; every trajectory
            must hold steps `0..T-1` exactly once.
        anchor_keys: hashable [n], the environment state the row's action was taken in.
        invalid: bool [n] or None (all valid): the row's answer broke the required format.
        gamma: discount of the return-to-go, in [0, 1].
        step_weight: omega, the weight of the step advantage (0 gives step-wise GRPO).
        norm: "mean_std" (divide by std + 1e-6) or "mean" (mean-centering only).
        episode_stats: "steps": the episode statistics run over the scores of all step rows of the
            group; "trajectories": over one score per trajectory (the mean of its rows' scores,
            i.e. its return minus the penalty averaged over its rows). A group with a single
            element keeps raw scores (mean 0, std 1).
        invalid_penalty: p, subtracted from the score and the step value of invalid rows.
        similarity_threshold: None for exact anchor grouping; else text anchors of one group share
            a step group when similar enough (see `anchor_step_groups`).
        step_lambda: lambda in [0, 1] of the bootstrapped step value (docs/algorithm.md): 1 (the paper) ranks
            the rows of a step group by their own return-to-go; below 1 the return bootstraps from the value the
            group gives the states each trajectory reaches (the mean return-to-go of their step groups), so a move of
            a losing episode into a state from which other copies won gets credit. A_E does not change.

    Returns:
        `GiGPOAdvantages` with float64 [n] `advantages`, `episode_advantages`, `step_advantages`,
        int64 [n] `step_group_sizes` (input row order) and the `StepGroupStats` of the pass.

    Raises:
        ValueError: naming the problem, for mismatched lengths, non-finite rewards, non-integer or
            negative steps, duplicate or missing steps in a trajectory, a trajectory in two groups,
            unhashable or missing (None/NaN) keys, unknown modes, out-of-range parameters, or
            non-text anchors with similarity grouping.
    """
    _check_options(gamma, step_weight, norm, episode_stats, invalid_penalty, similarity_threshold, step_lambda)
    rewards, steps, invalid = _check_row_arrays(rewards, group_ids, trajectory_ids, step_indices, anchor_keys, invalid)
    n = rewards.size
    if n == 0:
        return _empty_result()
    group_codes = _factorize(group_ids, "group_ids")
    trajectory_codes = _factorize(trajectory_ids, "trajectory_ids")

    # Lay rows out trajectory by trajectory in step order; all math below runs in this layout.
    order = np.lexsort((steps, trajectory_codes))
    trajectory = trajectory_codes[order]
    group = group_codes[order]
    step = steps[order]
    steps_to_go = _check_trajectories(trajectory, step, group, order, trajectory_ids, group_ids)
    reward, penalty = rewards[order], invalid_penalty * invalid[order]

    # Rewards and returns: returns and episode scores s_t.
    returns_to_go = discounted_returns(reward, steps_to_go, gamma)  # G_t
    # R = sum_t r_t, summed in step order over each trajectory's contiguous rows (codes are 0, 1, ... in layout order).
    episode_return = np.add.reduceat(reward, np.flatnonzero(step == 0))[trajectory]
    episode_scores = episode_return - penalty  # s_t = R - p * invalid_t

    # The episode advantage A_E over the task group.
    num_groups = int(group.max()) + 1
    if episode_stats == "steps":
        mean, std, count = group_mean_std(episode_scores, group, num_groups)
    else:
        num_trajectories = int(trajectory.max()) + 1
        trajectory_scores, _, _ = group_mean_std(episode_scores, trajectory, num_trajectories)
        group_of_trajectory = np.zeros(num_trajectories, dtype=np.int64)
        group_of_trajectory[trajectory] = group
        mean, std, count = group_mean_std(trajectory_scores, group_of_trajectory, num_groups)
    episode_advantages = normalize(episode_scores, mean[group], std[group], norm)
    single = (count == 1)[group]  # S has one element: mean 0, std 1, the row keeps its raw score
    episode_advantages[single] = episode_scores[single]

    # The step advantage A_S over the rows of the group that share an anchor state.
    step_group = _anchor_step_groups(group_codes, anchor_keys, steps, similarity_threshold)[order]
    num_step_groups = int(step_group.max()) + 1
    step_returns = returns_to_go  # lambda = 1: the row's own return-to-go, the paper's
    if step_lambda < 1.0:
        # Bootstrapped step value: V(k) = the mean G of k's step group; the layout's next row is the trajectory's
        # next step, so V(k_{t+1}) is the value of the next row's step group (not read for a trajectory's last row).
        state_values, _, _ = group_mean_std(returns_to_go, step_group, num_step_groups)
        next_values = np.append(state_values[step_group][1:], 0.0)
        step_returns = discounted_returns(reward, steps_to_go, gamma, step_lambda, next_values)  # Gl_t
    step_values = step_returns - penalty  # v_t = Gl_t - p * invalid_t
    step_advantages, step_group_size = step_group_advantages(step_values, step_group, num_step_groups, norm)

    advantages = episode_advantages + step_weight * step_advantages
    # Reductions over sorted values, so the logged numbers do not depend on row order either.
    episode_sorted, step_sorted = np.sort(episode_advantages), np.sort(step_advantages)
    stats = StepGroupStats(
        num_rows=n,
        num_step_groups=num_step_groups,
        singleton_share=float(np.mean(step_group_size == 1)),
        step_group_size_mean=float(np.mean(step_group_size)),
        step_group_size_max=int(step_group_size.max()),
        nonzero_step_advantage_share=float(np.mean(step_advantages != 0.0)),
        episode_advantage_mean=float(np.mean(episode_sorted)),
        episode_advantage_std=float(np.std(episode_sorted)),
        step_advantage_mean=float(np.mean(step_sorted)),
        step_advantage_std=float(np.std(step_sorted)),
    )
    return GiGPOAdvantages(
        advantages=_unsort(advantages, order),
        episode_advantages=_unsort(episode_advantages, order),
        step_advantages=_unsort(step_advantages, order),
        step_group_sizes=_unsort(step_group_size[step_group], order),
        stats=stats,
    )


# --------------------------------------------------------------------------------------------
# Grouping and input checks.
# --------------------------------------------------------------------------------------------


def _anchor_step_groups(
    group: np.ndarray, anchor_keys: Sequence[Hashable], step: np.ndarray, threshold: float | None
) -> np.ndarray:
    """`anchor_step_groups` on group codes (int64 [n]) instead of group ids."""
    anchor_codes = _factorize(anchor_keys, "anchor_keys")
    pair = _factorize_pairs(group, anchor_codes)  # one code per distinct (group, anchor)
    if threshold is None:
        return pair
    anchor_texts = _key_array(anchor_keys)
    not_text = [i for i, anchor in enumerate(anchor_texts) if not isinstance(anchor, str)]
    if not_text:
        raise ValueError(
            f"similarity_threshold needs text anchors, but an anchor key is a {type(anchor_texts[not_text[0]]).__name__} "
            f"({anchor_texts[not_text[0]]!r}); use exact grouping (similarity_threshold=None) for non-text anchors"
        )
    num_pairs = int(pair.max()) + 1
    first_step = np.full(num_pairs, np.iinfo(np.int64).max)
    np.minimum.at(first_step, pair, step)
    row_of_pair = np.empty(num_pairs, dtype=np.int64)
    row_of_pair[pair] = np.arange(pair.size)
    pair_group, pair_text = group[row_of_pair], anchor_texts[row_of_pair]

    cluster_of_pair = np.empty(num_pairs, dtype=np.int64)
    num_clusters = 0
    by_group = np.argsort(pair_group, kind="stable")
    for pairs in np.split(by_group, np.flatnonzero(np.diff(pair_group[by_group])) + 1):
        visit = sorted(pairs, key=lambda p: (first_step[p], pair_text[p]))  # canonical, row-order free
        labels = greedy_similarity_clusters([pair_text[p] for p in visit], threshold)
        cluster_of_pair[visit] = labels + num_clusters
        num_clusters += int(labels.max()) + 1
    return cluster_of_pair[pair]


def _factorize_pairs(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Dense int64 codes [n] of the pairs (first[i], second[i]) of two non-negative int arrays."""
    if first.size == 0:
        return np.zeros(0, dtype=np.int64)
    codes, _ = pd.factorize(first * (int(second.max()) + 1) + second)
    return codes.astype(np.int64, copy=False)


def _segment_sums(sorted_values: np.ndarray, starts: np.ndarray, present: np.ndarray) -> np.ndarray:
    """Sum of each contiguous segment of `sorted_values`; 0 for empty segments."""
    sums = np.zeros(starts.size)
    if present.any():
        sums[present] = np.add.reduceat(sorted_values, starts[present])
    return sums


def _unsort(values: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Back from the trajectory layout to input row order."""
    restored = np.empty_like(values)
    restored[order] = values
    return restored


def _key_array(values: Sequence[Hashable]) -> np.ndarray:
    """A 1-D array of keys; tuples stay single keys (object array)."""
    if isinstance(values, np.ndarray) and values.ndim == 1:
        return values
    return np.fromiter(values, dtype=object, count=len(values))


def _factorize(values: Sequence[Hashable], name: str) -> np.ndarray:
    """Dense int64 codes [n] of hashable keys: equal keys (as in a dict) get equal codes."""
    keys = _key_array(values)
    missing = np.flatnonzero(pd.isna(keys))
    if missing.size:
        i = missing[0]
        raise ValueError(f"{name}[{i}] is {keys[i]!r}: a missing key cannot identify a group, trajectory or state")
    try:
        codes, _ = pd.factorize(keys, use_na_sentinel=False)
    except TypeError:
        i = next(i for i, key in enumerate(keys) if not isinstance(key, Hashable) or _unhashable(key))
        raise ValueError(f"{name} must hold hashable keys, but {name}[{i}] is a {type(keys[i]).__name__}") from None
    return codes.astype(np.int64, copy=False)


def _unhashable(key: object) -> bool:
    try:
        hash(key)
    except TypeError:
        return True
    return False


def _check_trajectories(
    trajectory: np.ndarray,
    step: np.ndarray,
    group: np.ndarray,
    order: np.ndarray,
    trajectory_ids: Sequence[Hashable],
    group_ids: Sequence[Hashable],
) -> np.ndarray:
    """Check that every trajectory holds steps 0..T-1 once each and lies in one group.

    `trajectory`, `step`, `group` are in trajectory layout (sorted by trajectory code, then step);
    `order[i]` is the input row of layout row i. Returns `steps_to_go = T - 1 - t`, int64 [n].
    """
    length = np.bincount(trajectory)
    start = np.cumsum(length) - length
    position = np.arange(trajectory.size) - start[trajectory]
    bad = np.flatnonzero(step != position)
    if bad.size:
        code = trajectory[bad[0]]
        name = trajectory_ids[order[bad[0]]]
        steps = step[start[code] : start[code] + length[code]]
        duplicates = np.unique(steps[1:][np.diff(steps) == 0])
        if duplicates.size:
            raise ValueError(f"trajectory {name!r} has duplicate step indices {duplicates.tolist()} (each (trajectory, step) pair must be unique)")
        missing = sorted(set(range(int(steps.max()) + 1)) - set(steps.tolist()))
        raise ValueError(f"trajectory {name!r} has a gap in its step indices: step(s) {missing} missing (steps must be 0..T-1)")
    split = np.flatnonzero(group != group[start[trajectory]])
    if split.size:
        row = split[0]
        name, first_group = trajectory_ids[order[row]], group_ids[order[start[trajectory[row]]]]
        raise ValueError(
            f"trajectory {name!r} has rows in two groups ({first_group!r} and {group_ids[order[row]]!r}); "
            "a trajectory belongs to exactly one group"
        )
    return length[trajectory] - 1 - position


def _check_options(
    gamma: float,
    step_weight: float,
    norm: str,
    episode_stats: str,
    invalid_penalty: float,
    similarity_threshold: float | None,
    step_lambda: float,
) -> None:
    if norm not in NORM_MODES:
        raise ValueError(f"unknown norm {norm!r}; expected one of {NORM_MODES}")
    if episode_stats not in EPISODE_STATS_MODES:
        raise ValueError(f"unknown episode_stats {episode_stats!r}; expected one of {EPISODE_STATS_MODES}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma!r}")
    if not np.isfinite(step_weight):
        raise ValueError(f"step_weight must be a finite number, got {step_weight!r}")
    if not (np.isfinite(invalid_penalty) and invalid_penalty >= 0.0):
        raise ValueError(f"invalid_penalty must be a finite number >= 0, got {invalid_penalty!r}")
    if similarity_threshold is not None and not 0.0 < similarity_threshold <= 1.0:
        raise ValueError(f"similarity_threshold must be None or in (0, 1], got {similarity_threshold!r}")
    if not (isinstance(step_lambda, numbers.Real) and 0.0 <= step_lambda <= 1.0):
        raise ValueError(f"step_lambda must be a number in [0, 1], got {step_lambda!r}")


def _check_row_arrays(
    rewards: Sequence[float],
    group_ids: Sequence[Hashable],
    trajectory_ids: Sequence[Hashable],
    step_indices: Sequence[int],
    anchor_keys: Sequence[Hashable],
    invalid: Sequence[bool] | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Check lengths and value types; return rewards (float64), steps (int64), invalid (float64 0/1)."""
    columns = {"rewards": rewards, "group_ids": group_ids, "trajectory_ids": trajectory_ids,
               "step_indices": step_indices, "anchor_keys": anchor_keys}
    if invalid is not None:
        columns["invalid"] = invalid
    lengths = {}
    for name, column in columns.items():
        try:
            lengths[name] = len(column)
        except TypeError:
            raise ValueError(f"{name} must be a sequence with one entry per step row, got {type(column).__name__}") from None
    if len(set(lengths.values())) > 1:
        raise ValueError("length mismatch: " + ", ".join(f"{name} has {length}" for name, length in lengths.items()))
    n = lengths["rewards"]

    try:
        reward_array = np.asarray(rewards, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError("rewards must be numbers") from None
    if reward_array.shape != (n,):
        raise ValueError(f"rewards must be one number per row (shape ({n},)), got shape {reward_array.shape}")
    not_finite = np.flatnonzero(~np.isfinite(reward_array))
    if not_finite.size:
        raise ValueError(f"rewards must be finite, but rewards[{not_finite[0]}] is {reward_array[not_finite[0]]}")

    step_array = np.asarray(step_indices) if n else np.zeros(0, dtype=np.int64)
    if step_array.shape != (n,) or step_array.dtype.kind not in "iu":
        raise ValueError(f"step_indices must be integers, one per row; got dtype {step_array.dtype}, shape {step_array.shape}")
    if n and step_array.min() < 0:
        raise ValueError(f"step_indices must be >= 0, but step_indices[{int(np.argmin(step_array))}] is {step_array.min()}")

    if invalid is None:
        invalid_array = np.zeros(n)
    else:
        invalid_array = np.asarray(invalid) if n else np.zeros(0, dtype=bool)
        flags = invalid_array.dtype.kind == "b" or (invalid_array.dtype.kind in "iu" and np.isin(invalid_array, (0, 1)).all())
        if invalid_array.shape != (n,) or not flags:
            raise ValueError("invalid must be None or one bool (or 0/1) per row")
        invalid_array = invalid_array.astype(np.float64)
    return reward_array, step_array.astype(np.int64, copy=False), invalid_array


def _empty_result() -> GiGPOAdvantages:
    empty = np.zeros(0)
    stats = StepGroupStats(0, 0, 0.0, 0.0, 0, 0.0, 0.0, 0.0, 0.0, 0.0)
    return GiGPOAdvantages(empty, empty.copy(), empty.copy(), np.zeros(0, dtype=np.int64), stats)
