"""Step credit on the base model's own rollouts (issues 32 and 40): does GiGPO's step advantage rank a move that brings
the agent closer to a win above one that does not, better than the episode advantage of step-wise GRPO? And does the
bootstrapped step value of docs/algorithm.md (lambda < 1) rank the moves of losing episodes, which lambda 1 ties?

    python research/credit_probe.py                                 # the design of research/settings/lambda_probe/README.md
    python research/credit_probe.py --seeds 0                       # a reduced run: the full run's first seed
    python research/credit_probe.py --configs C.yaml --model M      # other games (recipe configs) or another model

No training: for each game (a recipe config: environment, tasks, prompt template, history, temperature, answer length,
and the advantage settings gamma, norm, episode statistics, invalid-action penalty) and each seed, the model plays
`--tasks` tasks x `--copies` copies through the trainer's own rollout (`collect_rollout` with the trainer's turns,
`GiGPOTrainer.turns`, sampled at the config's temperature). Seed s plays tasks s*T .. s*T+T-1 of the config's training
tasks (its optimal-steps range applies) and samples with torch seed s, so the seeds are independent
replications on disjoint tasks.

Labels. Every step is labelled by the breadth-first distance to a win (`gigpo_trl.shortest_paths`, over the admissible
actions) of the state before and after it: progress (the distance falls), neutral (unchanged: "look", "inventory",
an idle action, text the game does not act on), regress (it rises). A state's distance is searched from the state
its trajectory's actions reach, replayed in a fresh environment of the task's seed (the replay must reach the
recorded anchors: a game that does not replay deterministically is refused), once per (task, anchor): exact for games
whose anchor is their full state, as TextWorldExpress's and rooms' are. No win within `--search-depth` steps counts
as infinitely far.

Signals. The same rows are scored under every group size N of `--group-sizes`: the copies of a task split into groups
of N (copies 0..N-1, N..2N-1, ...), so methods and group sizes are compared on the same steps, and
`compute_gigpo_advantages` with the config's settings gives every row, per N:
    GiGPO           A = A_E + A_S   (omega 1)
    GRPO (omega=0)  A = A_E         (omega 0: step-wise GRPO)
    A_S alone       the step term of GiGPO (rows of one task group taken in the same state, compared by their
                    discounted return-to-go)
and for each lambda of `--lambdas` (default 0.9, 0.5, 0), A = A_E + A_S with section 9's bootstrapped step value, the
states valued three ways:
    GiGPO lambda L           the group's estimate, V(k) = the mean return-to-go of k's step group (the engine's)
    shuffled V, lambda L     control: the same values permuted among the states of each task group (10 draws,
                             averaged): the pairs it unties should rank at chance (0.5)
    optimal V, lambda L      control: gamma ** (distance - 1) from the breadth-first distances, the true value under
                             the shortest path: at lambda 0 it ranks every pair of one state by its label

Measured per signal, N and seed (then the mean and min-max over seeds):
    sign agreement   over the directed steps (progress and regress): the share whose A has the label's sign
                     (progress A > 0, regress A < 0; A = 0 agrees with neither), and per label.
    neutral steps    have no sign of their own (under discounting a wasted step delays a win, but its advantage
                     also carries the episode's outcome): the shares of A < 0, A = 0, A > 0 are reported apart.
    mean A per label and the separation (mean A of progress - mean A of regress) / std of A over all rows, which
                     compares signals of different scales.
    pairwise ranking inside step groups: every pair of rows of one step group (one task group, one anchor, so one
                     distance before the step) with different labels, ordered progress > neutral > regress: ranked
                     right (the better label has the larger A), tied, or wrong; accuracy = right + tied / 2 (0.5:
                     no information), overall and per kind of pair.
    zero share       the share of all rows whose A is 0 (|A| <= 1e-9): groups whose copies all score the same give
                     no signal, and neither do singleton step groups to A_S.
    untied pairs     the accuracy on the pairs a signal does not tie, right / (right + wrong); and the pairs lambda 1
                     ties that it does not ("newly untied"), with the accuracy on them.
    losing episodes  the shares of progress steps and of regress steps of losing episodes whose A_S is positive.
Each also on the rows of task groups that hold a win and on the others (a group without a win ties every signal).
Reading rules (stated before the runs, research/settings/step_credit_probe/README.md): on a game, the step signal
beats the episode signal when GiGPO's pairwise ranking accuracy at N = --decide-at is above GRPO's on every seed; it loses when below on every seed;
otherwise undecided. A lambda beats lambda 1 when GiGPO's accuracy with it is above lambda 1's on every seed whose
groups hold a win (seeds that won nothing are reported, not counted; at least 2 must count); loses when below on every
such seed; otherwise undecided. The lambda for the learning comparisons: of those that beat lambda 1 on every game, the
one with the highest mean accuracy (else the highest mean, said to be unsupported).

Written to OUTPUT (JSON: the arguments, per game and seed the tasks, context, costs and figures, and their mean and
min-max over seeds) after each game, and printed as markdown tables, with progress lines as it goes;
`--report-only OUTPUT` prints the tables again; `--compare-with EARLIER` says whether the lambda-1 figures repeat an
earlier report's on the seeds both hold.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from gigpo_trl.advantages import (
    StepGroupStats, anchor_step_groups, compute_gigpo_advantages, discounted_returns, group_mean_std,
    step_group_advantages,
)
from gigpo_trl.envs import INFO_WON, TextEnv, anchor_of, make_env
from gigpo_trl.rollout import Rollout, StepColumns
from gigpo_trl.shortest_paths import shortest_path_length

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIGS = [ROOT / "research" / "configs" / "learning_coin_gpu.yaml",
                   ROOT / "research" / "configs" / "screens" / "rooms5_idle2.yaml"]
LABELS = ("progress", "neutral", "regress")
# Pairs of labels inside a step group, the better one first.
PAIR_KINDS = (("progress", "neutral"), ("progress", "regress"), ("neutral", "regress"))
SIGNALS = ("GiGPO", "GRPO (omega=0)", "A_S alone")  # the paper's step value (lambda 1) against the episode's alone
LAMBDAS = (0.9, 0.5, 0.0)  # the bootstrapped step values of docs/algorithm.md measured beside lambda 1
VALUE_SOURCES = ("", "shuffled V, ", "optimal V, ")  # the group's estimate; the controls: shuffled, breadth-first
SHUFFLES = 10  # draws of the shuffled-values control, averaged
ZERO = 1e-9  # |A| at most this is 0; two advantages this close are tied


def lambda_signal(step_lambda: float, source: str = "") -> str:
    """The name of a bootstrapped signal: "GiGPO lambda 0.5", "shuffled V, lambda 0.5", ..."""
    return f"{source}lambda {step_lambda:g}" if source else f"GiGPO lambda {step_lambda:g}"


def signal_names(lambdas: Sequence[float]) -> list[str]:
    """Every signal the probe measures, in report order."""
    return [*SIGNALS, *(lambda_signal(lam, source) for source in VALUE_SOURCES for lam in lambdas)]


# --------------------------------------------------------------------------------------------
# Labels: the distance to a win before and after every step.
# --------------------------------------------------------------------------------------------


def step_label(before: float, after: float) -> str:
    """"progress", "neutral" or "regress": the distance to a win after the step is below, equal to or above the one
    before it (math.inf for no win within reach, so inf -> inf is neutral)."""
    if math.isnan(before) or math.isnan(after):
        raise ValueError(f"a distance is NaN (before {before}, after {after})")
    return "progress" if after < before else "regress" if after > before else "neutral"


def replay_states(env: TextEnv, seed: int, actions: Sequence[str]) -> list[tuple[Hashable, bool]]:
    """The (anchor, won) of the start of the task of `seed` and of the state after each of `actions`."""
    observation, info = env.reset(seed=seed)
    states = [(anchor_of(observation, info), False)]
    for action in actions:
        observation, _, _, _, info = env.step(action)
        states.append((anchor_of(observation, info), bool(info.get(INFO_WON))))
    return states


def step_distances(env: TextEnv, rollout: Rollout, search_depth: int,
                   cache: dict[tuple[int, Hashable], float] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """For every step row of `rollout`: the fewest steps from a win of the state the action was taken in, and of the
    state after it (0 when the step won, math.inf when no win lies within `search_depth` steps).

    Each trajectory is replayed in `env` (reset with its task's seed) to find the states after its steps; the replay
    must pass through the anchors the rollout recorded. A state's distance is searched once per (seed, anchor) and kept
    in `cache` (a dict shared across calls on the same tasks)."""
    cache = {} if cache is None else cache
    steps = rollout.steps
    before, after = np.full(len(steps), np.nan), np.full(len(steps), np.nan)
    for episode in rollout.episodes:
        rows = steps.rows_of(episode.trajectory)
        if not rows:
            continue
        if episode.options:
            raise ValueError(f"task options are not replayed: trajectory {episode.trajectory} has {episode.options}")
        actions = [steps.action[row] for row in rows]
        states = replay_states(env, episode.seed, actions)
        for k, row in enumerate(rows):
            if states[k][0] != steps.anchor[row]:
                raise RuntimeError(
                    f"replaying trajectory {episode.trajectory} (seed {episode.seed}) does not reach the state its step "
                    f"{k} was taken in: the environment does not replay deterministically, so no distance can be found")
        distances = []
        for k, (anchor, won) in enumerate(states):
            key = (episode.seed, anchor)
            if key not in cache:
                length = 0 if won else shortest_path_length(env, episode.seed, search_depth, prefix=actions[:k])
                cache[key] = math.inf if length is None else float(length)
            distances.append(cache[key])
        before[rows], after[rows] = distances[:-1], distances[1:]
    return before, after


# --------------------------------------------------------------------------------------------
# The signals: the project's advantages under a group size N.
# --------------------------------------------------------------------------------------------


def subgroup_ids(steps: StepColumns, copies: int, group_size: int) -> list[tuple[int, int]]:
    """The task group of every row when the `copies` copies of each task are split into groups of `group_size`
    (copies 0..N-1, N..2N-1, ...). The pool plays copy c of task g as environment g * copies + c."""
    if group_size < 1 or copies % group_size:
        raise ValueError(f"a group size must divide the {copies} copies, got {group_size}")
    return [(group, trajectory % copies // group_size) for group, trajectory in zip(steps.group, steps.trajectory)]


def signals(steps: StepColumns, group_ids: Sequence[Hashable], settings: Any, lambdas: Sequence[float] = (),
            before: np.ndarray | None = None, seed: int = 0) -> tuple[dict[str, np.ndarray], StepGroupStats]:
    """Every row's advantage per signal under `group_ids`, from `compute_gigpo_advantages` with the advantage settings
    of `settings` (a GiGPOConfig); also the lambda-1 result's step-group statistics.

    SIGNALS: GiGPO (omega 1, lambda 1), step-wise GRPO (omega 0) and GiGPO's step term alone. For each lambda of
    `lambdas` (section 9's bootstrapped step value), `A_E + A_S` where the states' values are
        the group's estimate   (the mean return-to-go of the state's step group: `compute_gigpo_advantages`),
        shuffled               (the same values permuted among the states of each task group: a control, whose newly
                                untied pairs should rank at chance; `SHUFFLES` draws from `seed`, float [SHUFFLES, n],
                                whose measures `probe_rollout` averages),
        optimal                (`gamma ** (distance - 1)` from the breadth-first distances `before`: the ceiling).
    Float [n] in row order (the shuffled: [SHUFFLES, n])."""
    common = dict(
        rewards=steps.reward, group_ids=group_ids, trajectory_ids=steps.trajectory, step_indices=steps.step,
        anchor_keys=steps.anchor, invalid=[not valid for valid in steps.valid], gamma=settings.gamma,
        norm=settings.advantage_norm, episode_stats=settings.episode_stats,
        invalid_penalty=settings.invalid_action_penalty, similarity_threshold=settings.similarity_threshold,
    )
    gigpo = compute_gigpo_advantages(**common, step_weight=1.0)
    result = {"GiGPO": gigpo.advantages, "GRPO (omega=0)": gigpo.episode_advantages, "A_S alone": gigpo.step_advantages}
    if not lambdas:
        return result, gigpo.stats
    step_groups = anchor_step_groups(group_ids, steps.anchor, steps.step, settings.similarity_threshold)
    estimate = state_values(steps, step_groups, settings.gamma)
    shuffled = [shuffle_state_values(estimate, group_ids, step_groups, np.random.default_rng([seed, draw]))
                for draw in range(SHUFFLES)]
    optimal = optimal_state_values(before, settings.gamma) if before is not None else None
    for lam in lambdas:
        result[lambda_signal(lam)] = compute_gigpo_advantages(**common, step_lambda=lam).advantages
        result[lambda_signal(lam, "shuffled V, ")] = np.stack([gigpo.episode_advantages + bootstrapped_step_advantages(
            steps, step_groups, values, lam, settings) for values in shuffled])
        if optimal is not None:
            result[lambda_signal(lam, "optimal V, ")] = gigpo.episode_advantages + bootstrapped_step_advantages(
                steps, step_groups, optimal, lam, settings)
    return result, gigpo.stats


def _trajectory_layout(steps: StepColumns) -> tuple[np.ndarray, np.ndarray]:
    """The order that lays rows out trajectory by trajectory in step order, and every laid-out row's steps to go."""
    trajectory = pd.factorize(np.asarray(steps.trajectory))[0]
    step = np.asarray(steps.step)
    order = np.lexsort((step, trajectory))
    return order, (np.bincount(trajectory)[trajectory] - 1 - step)[order]


def state_values(steps: StepColumns, step_groups: np.ndarray, gamma: float) -> np.ndarray:
    """Section 9's estimate for every row: the value `V(k)` of the state the row's action was taken in, the mean
    discounted return-to-go of its step group. Float [n], row order."""
    order, steps_to_go = _trajectory_layout(steps)
    returns = np.empty(len(steps))
    returns[order] = discounted_returns(np.asarray(steps.reward, dtype=float)[order], steps_to_go, gamma)
    mean, _, _ = group_mean_std(returns, step_groups, int(step_groups.max()) + 1)
    return mean[step_groups]


def shuffle_state_values(values: np.ndarray, group_ids: Sequence[Hashable], step_groups: np.ndarray,
                         rng: np.random.Generator) -> np.ndarray:
    """`values` (one per row, equal within a step group) permuted among the states of each task group: every state
    of a group gets the value of another state of the same group (or its own). Float [n], row order."""
    groups = pd.factorize(pd.Series(list(group_ids), dtype=object))[0]
    codes = np.unique(step_groups)
    first_row = {code: int(np.flatnonzero(step_groups == code)[0]) for code in codes}
    new_value = {}
    for group in np.unique(groups):
        states = [code for code in codes if groups[first_row[code]] == group]
        drawn = rng.permutation([values[first_row[code]] for code in states])
        new_value.update(zip(states, drawn))
    return np.array([new_value[code] for code in step_groups], dtype=float)


def optimal_state_values(before: np.ndarray, gamma: float) -> np.ndarray:
    """The value of every row's state under the shortest path to the win (reward 1 on the winning step):
    `gamma ** (distance - 1)`, 0 when no win lies within the searched depth. Float [n]."""
    reachable = np.isfinite(before) & (before >= 1)
    return np.where(reachable, gamma ** (np.where(reachable, before, 1.0) - 1.0), 0.0)


def bootstrapped_step_advantages(steps: StepColumns, step_groups: np.ndarray, values: np.ndarray, step_lambda: float,
                                 settings: Any) -> np.ndarray:
    """Section 9's step advantage with given state values (one per row: the value of the state its action was taken
    in) in place of the group's estimate: a row bootstraps from its trajectory's next row's value. With
    `state_values(...)` it is `compute_gigpo_advantages(step_lambda=...).step_advantages` (a test checks).
    Float [n], row order."""
    order, steps_to_go = _trajectory_layout(steps)
    next_values = np.append(values[order][1:], 0.0)  # the layout's next row is the trajectory's next step
    returns = discounted_returns(np.asarray(steps.reward, dtype=float)[order], steps_to_go, settings.gamma,
                                 step_lambda, next_values)
    penalty = settings.invalid_action_penalty * ~np.asarray(steps.valid, dtype=bool)[order]
    advantages, _ = step_group_advantages(returns - penalty, step_groups[order], int(step_groups.max()) + 1,
                                          settings.advantage_norm)
    restored = np.empty_like(advantages)
    restored[order] = advantages
    return restored


# --------------------------------------------------------------------------------------------
# The measures: pure functions of advantages, labels and step groups.
# --------------------------------------------------------------------------------------------


def _share(mask: np.ndarray) -> float:
    return float(mask.mean()) if mask.size else math.nan


def sign_agreement(advantages: np.ndarray, labels: Sequence[str]) -> dict[str, float]:
    """Shares of rows whose advantage has the sign of their label: over the directed steps (progress A > 0 and
    regress A < 0 together), per label, and for neutral steps the shares of A < 0, A = 0 and A > 0."""
    advantages, labels = np.asarray(advantages, dtype=float), np.asarray(labels)
    positive, negative = advantages > ZERO, advantages < -ZERO
    progress, regress, neutral = labels == "progress", labels == "regress", labels == "neutral"
    directed = progress | regress
    agrees = (progress & positive) | (regress & negative)
    return {
        "directed": _share(agrees[directed]), "progress_positive": _share(positive[progress]),
        "regress_negative": _share(negative[regress]), "neutral_negative": _share(negative[neutral]),
        "neutral_zero": _share(~positive[neutral] & ~negative[neutral]), "neutral_positive": _share(positive[neutral]),
    }


def label_means(advantages: np.ndarray, labels: Sequence[str]) -> dict[str, float]:
    """The mean advantage of each label, and the separation: (mean of progress - mean of regress) / std of all the
    advantages (NaN where a label is absent or every advantage is 0)."""
    advantages, labels = np.asarray(advantages, dtype=float), np.asarray(labels)
    means = {label: float(advantages[labels == label].mean()) if (labels == label).any() else math.nan
             for label in LABELS}
    spread = float(advantages.std()) if advantages.size else 0.0
    means["separation"] = (means["progress"] - means["regress"]) / spread if spread > ZERO else math.nan
    return means


def pairwise_ranking(advantages: np.ndarray, labels: Sequence[str], step_groups: Sequence[int],
                     reference: np.ndarray | None = None) -> dict[str, dict]:
    """Inside every step group (`step_groups`: an int code per row, e.g. from `anchor_step_groups`), every pair of rows
    with different labels, the better label first (progress > neutral > regress): the number of pairs, the shares
    ranked right (the better row's advantage is larger), tied and wrong, the accuracy right + tied / 2, and the accuracy
    on the pairs it does not tie, right / (right + wrong); per kind of pair ("progress>neutral", ...) and over all
    ("all"). With a `reference` signal (float [n]): also the pairs the reference ties and this signal does not
    ("newly_untied") and the accuracy on them."""
    advantages, labels, codes = np.asarray(advantages, dtype=float), np.asarray(labels), np.asarray(step_groups)
    has_reference = reference is not None
    reference = np.asarray(reference if has_reference else advantages, dtype=float)
    # right, tied, wrong; then right and wrong among the pairs the reference ties
    counts = {f"{better}>{worse}": np.zeros(5, dtype=np.int64) for better, worse in PAIR_KINDS}
    order = np.argsort(codes, kind="stable")
    boundaries = np.flatnonzero(np.diff(codes[order])) + 1
    for rows in np.split(order, boundaries) if order.size else []:
        for better, worse in PAIR_KINDS:
            high, low = rows[labels[rows] == better], rows[labels[rows] == worse]
            if not high.size or not low.size:
                continue
            difference = advantages[high][:, None] - advantages[low][None, :]
            reference_tied = np.abs(reference[high][:, None] - reference[low][None, :]) <= ZERO
            counts[f"{better}>{worse}"] += [(difference > ZERO).sum(), (np.abs(difference) <= ZERO).sum(),
                                            (difference < -ZERO).sum(), (reference_tied & (difference > ZERO)).sum(),
                                            (reference_tied & (difference < -ZERO)).sum()]
    counts["all"] = sum(counts.values())
    result = {}
    for kind, (right, tied, wrong, newly_right, newly_wrong) in counts.items():
        pairs, untied, newly = int(right + tied + wrong), int(right + wrong), int(newly_right + newly_wrong)
        result[kind] = {"pairs": pairs, "right": right / pairs if pairs else math.nan,
                        "tied": tied / pairs if pairs else math.nan, "wrong": wrong / pairs if pairs else math.nan,
                        "accuracy": (right + tied / 2) / pairs if pairs else math.nan,
                        "untied_accuracy": right / untied if untied else math.nan}
        if has_reference:
            result[kind] |= {"newly_untied": newly, "newly_untied_accuracy": newly_right / newly if newly else math.nan}
    return result


def zero_share(advantages: np.ndarray) -> float:
    """The share of rows whose advantage is 0 (|A| <= ZERO)."""
    return _share(np.abs(np.asarray(advantages, dtype=float)) <= ZERO)


def losing_episode_credit(step_advantages: np.ndarray, labels: Sequence[str], won: np.ndarray) -> dict[str, float]:
    """Among the steps of losing episodes (`won`: bool [n], the row's episode won): the shares of progress steps and of
    regress steps whose step advantage is positive (A_S > 0), and how many there are. A Monte-Carlo step value gives
    none of them credit (every return-to-go of a losing episode is 0); a useful bootstrap credits progress more often
    than regress."""
    step_advantages, labels, losing = np.asarray(step_advantages, dtype=float), np.asarray(labels), ~np.asarray(won)
    progress, regress = losing & (labels == "progress"), losing & (labels == "regress")
    return {"progress_positive": _share(step_advantages[progress] > ZERO), "progress_steps": int(progress.sum()),
            "regress_positive": _share(step_advantages[regress] > ZERO), "regress_steps": int(regress.sum())}


def credit_measures(advantages: np.ndarray, labels: Sequence[str], step_groups: Sequence[int],
                    step_advantages: np.ndarray | None = None, won: np.ndarray | None = None,
                    reference: np.ndarray | None = None) -> dict[str, Any]:
    """Every measure of one signal on one set of rows (see the module docstring): with `step_advantages` and `won`
    also the credit of losing episodes' steps, with `reference` the pairs it unties."""
    measures = {"sign_agreement": sign_agreement(advantages, labels), "mean": label_means(advantages, labels),
                "pairs": pairwise_ranking(advantages, labels, step_groups, reference), "zero_share": zero_share(advantages)}
    if step_advantages is not None:
        measures["losing_episodes"] = losing_episode_credit(step_advantages, labels, won)
    return measures


def mean_of(measures: Sequence[Any]) -> Any:
    """The mean of every number over same-shaped nested dicts (NaNs left out; NaN when all are)."""
    if isinstance(measures[0], dict):
        return {key: mean_of([value[key] for value in measures]) for key in measures[0]}
    values = [value for value in measures if not math.isnan(value)]
    return float(np.mean(values)) if values else math.nan


def over_seeds(per_seed: Sequence[Any]) -> Any:
    """The mean, min and max over seeds of every number in same-shaped nested dicts (NaNs left out; NaN when every
    seed's is NaN)."""
    first = per_seed[0]
    if isinstance(first, dict):
        return {key: over_seeds([value[key] for value in per_seed]) for key in first}
    values = np.array([value for value in per_seed if not math.isnan(value)], dtype=float)
    if not values.size:
        return {"mean": math.nan, "min": math.nan, "max": math.nan}
    return {"mean": float(values.mean()), "min": float(values.min()), "max": float(values.max())}


def verdict(gigpo: Sequence[float], grpo: Sequence[float]) -> str:
    """The pre-stated reading rule on per-seed pairwise ranking accuracies: the step signal beats the episode signal
    when GiGPO's is above GRPO's on every seed, loses when below on every seed, otherwise undecided."""
    pairs = [(a, b) for a, b in zip(gigpo, grpo) if not (math.isnan(a) or math.isnan(b))]
    if not pairs or len(pairs) < len(gigpo):
        return "undecided: a seed has no pair of differently labelled steps in one step group"
    if all(a > b for a, b in pairs):
        return f"the step signal beats the episode signal (GiGPO's ranking above GRPO's on {len(pairs)} of {len(pairs)} seeds)"
    if all(a < b for a, b in pairs):
        return f"the step signal loses to the episode signal (GiGPO's ranking below GRPO's on {len(pairs)} of {len(pairs)} seeds)"
    above = sum(a > b for a, b in pairs)
    return f"undecided (GiGPO's ranking above GRPO's on {above} of {len(pairs)} seeds)"


# --------------------------------------------------------------------------------------------
# One game: rollouts, labels and measures per seed.
# --------------------------------------------------------------------------------------------


def probe_rollout(rollout: Rollout, before: np.ndarray, after: np.ndarray, copies: int, group_sizes: Sequence[int],
                  settings: Any, lambdas: Sequence[float] = (), seed: int = 0) -> dict[str, Any]:
    """The context and the measures of one rollout with its distances, per group size: every signal (`signals`) on
    all rows, on the rows of task groups that hold a win ("with_win") and on the others ("without_win"); pairs newly
    untied are counted against GiGPO at lambda 1."""
    steps = rollout.steps
    labels = np.array([step_label(b, a) for b, a in zip(before, after)])
    won_by_trajectory = {episode.trajectory: bool(episode.won) for episode in rollout.episodes}
    won = np.array([won_by_trajectory[trajectory] for trajectory in steps.trajectory], dtype=bool)
    result: dict[str, Any] = {
        "trajectories": len(rollout.episodes), "rows": len(steps),
        "success_rate": float(np.mean([episode.won for episode in rollout.episodes])),
        "invalid_share": _share(~np.asarray(steps.valid, dtype=bool)),
        "labels": {label: _share(labels == label) for label in LABELS},
        "by_group_size": {},
    }
    for group_size in group_sizes:
        group_ids = subgroup_ids(steps, copies, group_size)
        advantages, stats = signals(steps, group_ids, settings, lambdas, before, seed)
        step_groups = anchor_step_groups(group_ids, steps.anchor, steps.step, settings.similarity_threshold)
        groups_with_win = {group for group, row_won in zip(group_ids, won) if row_won}
        with_win = np.array([group in groups_with_win for group in group_ids], dtype=bool)
        figures: dict[str, Any] = {
            "step_group_size_mean": stats.step_group_size_mean, "singleton_share": stats.singleton_share,
            "groups_with_win": len(groups_with_win), "groups_without_win": len(set(group_ids) - groups_with_win),
        }
        episode, reference = advantages["GRPO (omega=0)"], advantages["GiGPO"]
        for signal, values in advantages.items():
            figures[signal] = {}
            for subset, rows in (("all", np.ones(len(steps), dtype=bool)), ("with_win", with_win),
                                 ("without_win", ~with_win)):
                draws = [
                    credit_measures(draw[rows], labels[rows], step_groups[rows], step_part(signal, draw, episode)[rows],
                                    won[rows], reference[rows])
                    for draw in np.atleast_2d(values)
                ]
                measures = mean_of(draws)
                if subset != "all":  # the split keeps what the lambda table reads
                    measures = {"pairs": {"all": measures["pairs"]["all"]}, "zero_share": measures["zero_share"],
                                "losing_episodes": measures["losing_episodes"]}
                figures[signal][subset] = measures
        result["by_group_size"][str(group_size)] = figures
    return result


def step_part(signal: str, advantages: np.ndarray, episode_advantages: np.ndarray) -> np.ndarray:
    """The step term of a signal's advantages: the signal itself for "A_S alone", none for GRPO, A - A_E otherwise."""
    if signal == "A_S alone":
        return advantages
    if signal == "GRPO (omega=0)":
        return np.zeros_like(advantages)
    return advantages - episode_advantages


def trainer_for(config: Path, model: str | None, tasks: int, copies: int, seeds: Sequence[int], output_dir: str,
                make_trainer: Callable[..., Any] | None = None) -> tuple[Any, list[int]]:
    """A GiGPOTrainer (made by `make_trainer` where given) of the recipe config `config` (model, environment, prompts,
    generation and advantage settings) whose training tasks are the first max(seeds) + 1 blocks of `tasks` tasks and whose rollout
    plays `tasks` x `copies`; no evaluation, CPU precision. Also the training tasks' seeds."""
    from trl import ModelConfig, TrlParser

    from gigpo_trl import GiGPOConfig, GiGPOTrainer, TaskArguments

    overrides = ["--output_dir", output_dir, "--num_train_tasks", str((max(seeds) + 1) * tasks), "--num_eval_tasks", "0",
                 "--eval_strategy", "no", "--num_generations", str(copies), "--per_device_train_batch_size",
                 str(tasks * copies), "--steps_per_generation", "1", "--gradient_accumulation_steps", "1",
                 "--report_to", "none", "--log_trajectories", "0", "--bf16", "false", "--use_vllm", "false"]
    if model:
        overrides += ["--model_name_or_path", model]
    task_args, args, model_args = TrlParser((TaskArguments, GiGPOConfig, ModelConfig)).parse_args_and_config(
        args=["--config", str(config), *overrides])
    if args.similarity_threshold is not None:
        raise ValueError(f"{config}: the probe's step groups are exact anchors; similarity_threshold must be unset")
    train, _ = task_args.datasets(args.env_name, args.env_kwargs)
    trainer = (make_trainer or GiGPOTrainer)(model_args.model_name_or_path, args=args, train_dataset=train)
    return trainer, list(train["seed"])


def probe_seed(trainer: Any, env: TextEnv, tasks: Sequence[int], seed: int, copies: int, group_sizes: Sequence[int],
               search_depth: int, cache: dict[tuple[int, Hashable], float],
               lambdas: Sequence[float] = ()) -> dict[str, Any]:
    """One seed of one game: `tasks` x `copies` played by the trainer's rollout, sampled with torch seed `seed`, the
    steps labelled through `env` (`cache` as in `step_distances`), the measures (`probe_rollout`) and the costs."""
    from transformers import set_seed

    from gigpo_trl.rollout import collect_rollout
    from gigpo_trl.tasks import Task

    set_seed(seed)
    clock, cpu = time.perf_counter(), time.process_time()
    with trainer.turns.rollout():
        rollout = collect_rollout(trainer._pool("train", len(tasks), copies), [Task(seed=task) for task in tasks],
                                  trainer.turns, max_env_steps=trainer.args.max_env_steps, dialogue=trainer.dialogue,
                                  show_progress=False)
    rollout_seconds, rollout_cpu_seconds = time.perf_counter() - clock, time.process_time() - cpu
    clock, searched = time.perf_counter(), len(cache)
    before, after = step_distances(env, rollout, search_depth, cache)
    result = probe_rollout(rollout, before, after, copies, group_sizes, trainer.args, lambdas, seed)
    return result | {
        "tasks": list(tasks), "distance_at_start_mean": float(np.mean([before[rollout.steps.rows_of(e.trajectory)[0]]
                                                                       for e in rollout.episodes if e.length])),
        "generated_tokens": rollout.generated_tokens, "rollout_s": rollout_seconds, "rollout_cpu_s": rollout_cpu_seconds,
        "states_searched": len(cache) - searched, "label_s": time.perf_counter() - clock,
    }


def probe_game(config: Path, *, model: str | None, seeds: Sequence[int], tasks: int, copies: int,
               group_sizes: Sequence[int], search_depth: int, lambdas: Sequence[float] = (),
               make_trainer: Callable[..., Any] | None = None,
               log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every seed of one game (`probe_seed`; seed s plays the block s of `tasks` training tasks) and the summary over
    seeds. `make_trainer`, called as GiGPOTrainer is, makes the trainer (e.g. a test's scripted one)."""
    started = time.perf_counter()
    per_seed: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as output_dir:
        trainer, task_seeds = trainer_for(config, model, tasks, copies, seeds, output_dir, make_trainer)
        settings = trainer.args
        env = make_env(settings.env_name, **settings.env_kwargs)
        log(f"{config.stem}: {settings.env_name} {settings.env_kwargs}, {tasks} tasks x {copies} copies per seed, "
            f"{settings.max_env_steps} steps, temperature {settings.temperature}; ready in "
            f"{time.perf_counter() - started:.0f} s")
        cache: dict[tuple[int, Hashable], float] = {}
        try:
            for seed in seeds:
                block = task_seeds[seed * tasks : (seed + 1) * tasks]
                log(f"  seed {seed}: playing tasks {block} ...")
                result = per_seed[str(seed)] = probe_seed(trainer, env, block, seed, copies, group_sizes,
                                                          search_depth, cache, lambdas)
                log(f"  seed {seed}: {result['rows']} steps in {result['rollout_s']:.0f} s "
                    f"({result['rollout_s'] / result['rows']:.2f} s a step, {result['rollout_cpu_s'] / result['rows']:.2f}"
                    f" s of CPU), success {result['success_rate']:.0%}, labels "
                    + ", ".join(f"{label} {share:.0%}" for label, share in result["labels"].items())
                    + f"; {result['states_searched']} states searched in {result['label_s']:.0f} s")
        finally:
            trainer.close_environments()
            env.close()
    summary = over_seeds([{key: value for key, value in result.items() if key != "tasks"}
                          for result in per_seed.values()])
    return {"config": str(config), "env_name": settings.env_name, "env_kwargs": settings.env_kwargs,
            "max_env_steps": settings.max_env_steps, "temperature": settings.temperature,
            "advantage_settings": {"gamma": settings.gamma, "norm": settings.advantage_norm,
                                   "episode_stats": settings.episode_stats,
                                   "invalid_penalty": settings.invalid_action_penalty},
            "seeds": per_seed, "over_seeds": summary, "seconds": time.perf_counter() - started}


# --------------------------------------------------------------------------------------------
# Report.
# --------------------------------------------------------------------------------------------


def _cell(spread: dict[str, float], digits: int = 2) -> str:
    """"mean (min to max)" of an over_seeds entry; the mean alone when every seed gives the same at this precision."""
    if math.isnan(spread["mean"]):
        return "-"
    low, high = f"{spread['min']:.{digits}f}", f"{spread['max']:.{digits}f}"
    return f"{spread['mean']:.{digits}f}" if low == high else f"{spread['mean']:.{digits}f} ({low} to {high})"


def _accuracies(game: dict[str, Any], decide_at: int, signal: str, subset: str = "all") -> list[float]:
    """A signal's pairwise ranking accuracy per seed at group size `decide_at`."""
    return [seed["by_group_size"][str(decide_at)][signal][subset]["pairs"]["all"]["accuracy"]
            for seed in game["seeds"].values()]


def decisions(game: dict[str, Any], decide_at: int) -> str:
    """The reading rule's verdict on one game at group size `decide_at`: the step signal against the episode's."""
    return verdict(_accuracies(game, decide_at, "GiGPO"), _accuracies(game, decide_at, "GRPO (omega=0)"))


def seeds_with_a_win(game: dict[str, Any], decide_at: int) -> list[str]:
    """The seeds whose task groups at group size `decide_at` hold a winning episode."""
    return [name for name, seed in game["seeds"].items() if seed["by_group_size"][str(decide_at)]["groups_with_win"]]


def lambda_verdict(game: dict[str, Any], decide_at: int, step_lambda: float) -> str:
    """The reading rule of the bootstrapped step value (research/settings/lambda_probe/README.md, written before the
    run): on one game at N = `decide_at`, lambda beats lambda 1 when GiGPO's ranking accuracy with it is above GiGPO's at lambda 1 on every seed
    whose groups hold a win, loses when below on every such seed, otherwise undecided; a seed that won nothing ties
    every signal and is reported, not counted; fewer than 2 counted seeds decide nothing."""
    counted = seeds_with_a_win(game, decide_at)
    names = list(game["seeds"])
    ours = dict(zip(names, _accuracies(game, decide_at, lambda_signal(step_lambda))))
    paper = dict(zip(names, _accuracies(game, decide_at, "GiGPO")))
    skipped = f"; not counted (no win): seeds {', '.join(sorted(set(names) - set(counted)))}" if len(counted) < len(names) else ""
    if len(counted) < 2:
        return f"not enough seeds with a win ({len(counted)}; 2 needed){skipped}"
    above = sum(ours[name] > paper[name] for name in counted)
    below = sum(ours[name] < paper[name] for name in counted)
    if above == len(counted):
        return f"beats lambda 1 (above on {above} of {len(counted)} seeds with a win){skipped}"
    if below == len(counted):
        return f"loses to lambda 1 (below on {below} of {len(counted)} seeds with a win){skipped}"
    return f"undecided (above on {above}, below on {below} of {len(counted)} seeds with a win){skipped}"


def chosen_lambda(games: dict[str, Any], decide_at: int, lambdas: Sequence[float]) -> dict[str, Any]:
    """The lambda the learning comparisons use (the rule written before the run): among the lambdas below 1 that beat
    lambda 1 on every game, the one with the highest ranking accuracy at N = `decide_at`, averaged over games and
    seeds (the larger lambda on a tie); if none beats on every game, the one with the highest such accuracy, marked
    as not supported by the probe."""
    def mean_accuracy(lam: float) -> float:
        return float(np.mean([np.nanmean(_accuracies(game, decide_at, lambda_signal(lam))) for game in games.values()]))

    winners = [lam for lam in lambdas if all(lambda_verdict(game, decide_at, lam).startswith("beats")
                                             for game in games.values())]
    candidates = winners or list(lambdas)
    best = max(candidates, key=lambda lam: (mean_accuracy(lam), lam))
    return {"lambda": best, "supported_by_the_probe": bool(winners), "mean_accuracy": mean_accuracy(best),
            "beats_lambda_1_on_every_game": winners}


def table(game: dict[str, Any], decide_at: int | None, lambdas: Sequence[float] = ()) -> str:
    """The report of one game, in markdown: a line of context, the step groups per group size, one row per group size
    and signal of SIGNALS (every cell the mean over seeds, with the min-max when the seeds differ), then the
    bootstrapped signals at N = `decide_at` (`lambda_table`)."""
    summary, seeds = game["over_seeds"], len(game["seeds"])
    lines = [f"**{Path(game['config']).stem}** ({game['env_name']} {game['env_kwargs']}), {seeds} seeds: success "
             f"{_cell(summary['success_rate'])}, steps per seed {_cell(summary['rows'], 0)}, off-format "
             f"{_cell(summary['invalid_share'])}; labels " + ", ".join(
                 f"{label} {_cell(summary['labels'][label])}" for label in LABELS),
             "", "| N | step-group size | singleton groups | pairs with different labels | task groups with a win / "
             "without |", "|---|---|---|---|---|"]
    for group_size, figures in summary["by_group_size"].items():
        lines.append(f"| {group_size} | {_cell(figures['step_group_size_mean'], 1)} | "
                     f"{_cell(figures['singleton_share'])} | {_cell(figures['GiGPO']['all']['pairs']['all']['pairs'], 0)} "
                     f"| {_cell(figures['groups_with_win'], 1)} / {_cell(figures['groups_without_win'], 1)} |")
    lines += ["", "| N | signal | sign agrees: directed | progress A > 0 | regress A < 0 | neutral A < 0 / = 0 / > 0 | "
              "mean A: progress / neutral / regress | separation | ranking accuracy | right / tied / wrong | A = 0 |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for group_size, figures in summary["by_group_size"].items():
        for signal in SIGNALS:
            measures = figures[signal]["all"]
            agree, means, pairs = (measures[key] for key in ("sign_agreement", "mean", "pairs"))
            lines.append(
                f"| {group_size} | {signal} | {_cell(agree['directed'])} | {_cell(agree['progress_positive'])} | "
                f"{_cell(agree['regress_negative'])} | {_cell(agree['neutral_negative'])} / {_cell(agree['neutral_zero'])}"
                f" / {_cell(agree['neutral_positive'])} | {_cell(means['progress'])} / {_cell(means['neutral'])} / "
                f"{_cell(means['regress'])} | {_cell(means['separation'])} | {_cell(pairs['all']['accuracy'])} | "
                f"{_cell(pairs['all']['right'])} / {_cell(pairs['all']['tied'])} / {_cell(pairs['all']['wrong'])} | "
                f"{_cell(measures['zero_share'])} |")
    lines.append("")
    for group_size in summary["by_group_size"]:
        gains = np.subtract(_accuracies(game, int(group_size), "GiGPO"), _accuracies(game, int(group_size), "GRPO (omega=0)"))
        lines.append(f"Ranking accuracy, GiGPO - GRPO, at N = {group_size}, per seed: "
                     + ", ".join(f"{gain:+.4f}" for gain in gains) + ".")
    if decide_at is not None:
        lines.append(f"Reading rule at N = {decide_at}: {decisions(game, decide_at)}.")
        if lambdas:
            lines += ["", lambda_table(game, decide_at, lambdas)]
    return "\n".join(lines)


def lambda_table(game: dict[str, Any], decide_at: int, lambdas: Sequence[float]) -> str:
    """The bootstrapped step values against lambda 1 on one game at N = `decide_at`, in markdown: per signal the
    ranking accuracy, the tied pairs, the accuracy on untied pairs, the pairs lambda 1 ties that it does not and the
    accuracy on them, the same in task groups with a win, and the credit of losing episodes' progress and regress
    steps; then the accuracy against lambda 1 per seed and the reading rule."""
    figures = game["over_seeds"]["by_group_size"][str(decide_at)]
    lines = [f"Bootstrapped step values at N = {decide_at} (GiGPO, A = A_E + A_S; newly untied: pairs lambda 1 ties):",
             "", "| signal | ranking accuracy | tied | accuracy, untied pairs | newly untied pairs | their accuracy | "
             "groups with a win: accuracy / tied | losing episodes: progress A_S > 0 / regress A_S > 0 |",
             "|---|---|---|---|---|---|---|---|"]
    for signal in signal_names(lambdas):
        if signal == "A_S alone" or signal not in figures:
            continue
        pairs, won = figures[signal]["all"]["pairs"]["all"], figures[signal]["with_win"]["pairs"]["all"]
        losing = figures[signal]["all"]["losing_episodes"]
        lines.append(f"| {signal} | {_cell(pairs['accuracy'], 3)} | {_cell(pairs['tied'])} | "
                     f"{_cell(pairs['untied_accuracy'], 3)} | {_cell(pairs['newly_untied'], 0)} | "
                     f"{_cell(pairs['newly_untied_accuracy'], 3)} | {_cell(won['accuracy'], 3)} / {_cell(won['tied'])} | "
                     f"{_cell(losing['progress_positive'])} / {_cell(losing['regress_positive'])} |")
    lines.append("")
    counted = seeds_with_a_win(game, decide_at)
    paper = _accuracies(game, decide_at, "GiGPO")
    for lam in lambdas:
        for source in VALUE_SOURCES:
            gains = np.subtract(_accuracies(game, decide_at, lambda_signal(lam, source)), paper)
            lines.append(f"Ranking accuracy, {lambda_signal(lam, source)} - lambda 1, per seed: " + ", ".join(
                f"{gain:+.4f}{'' if name in counted else ' (no win)'}" for name, gain in zip(game["seeds"], gains)) + ".")
        lines.append(f"Reading rule, lambda {lam:g}: {lambda_verdict(game, decide_at, lam)}.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, make_trainer: Callable[..., Any] | None = None) -> dict[str, Any]:
    """The command line (see the module docstring); returns the report it writes. `make_trainer` as in
    `probe_game`."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", type=Path, nargs="+", default=DEFAULT_CONFIGS,
                        help="one recipe config per game (default: setting D's coin collector and 5 rooms with 2 idle "
                        "actions)")
    parser.add_argument("--model", default=None, help="model id or folder (default: each config's model_name_or_path)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--tasks", type=int, default=1, help="tasks per seed and game")
    parser.add_argument("--copies", type=int, default=16, help="copies of each task (the largest group size)")
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[4, 8, 16],
                        help="group sizes N; each must divide --copies")
    parser.add_argument("--decide-at", type=int, default=8, help="the group size the reading rule reads (the recipe's)")
    parser.add_argument("--lambdas", type=float, nargs="*", default=list(LAMBDAS),
                        help="the lambdas below 1 of the bootstrapped step value measured beside lambda 1 (none: the "
                        "paper's signals only)")
    parser.add_argument("--search-depth", type=int, default=20, help="steps searched for a win from each state")
    parser.add_argument("--output", type=Path, default=ROOT / "outputs" / "credit_probe.json")
    parser.add_argument("--report-only", type=Path, metavar="JSON", help="print the tables of a report this command "
                        "wrote (also a cut-off run's) again, without running anything")
    parser.add_argument("--compare-with", type=Path, metavar="JSON", help="an earlier report: say, per game and seed "
                        "both hold, whether this run's lambda-1 signals (GiGPO, GRPO, A_S alone) give the same figures")
    parser.add_argument("--tiny", action="store_true", help="a smoke run: 1 task x 4 copies, group sizes 2 and 4, "
                        "seeds 0 and 1 (pass --model for a small model)")
    args = parser.parse_args(argv)
    earlier = json.loads(args.compare_with.read_text()) if args.compare_with else None
    if args.report_only:
        report = json.loads(args.report_only.read_text())
        print_report(report, earlier)
        return report
    if args.tiny:
        args.tasks, args.copies, args.group_sizes, args.seeds, args.decide_at = 1, 4, [2, 4], [0, 1], 4
    if any(size < 1 or args.copies % size for size in args.group_sizes):
        parser.error(f"every group size must divide --copies {args.copies}, got {args.group_sizes}")
    if args.decide_at not in args.group_sizes:
        parser.error(f"--decide-at {args.decide_at} is not one of the group sizes {args.group_sizes}")
    if min(args.seeds) < 0 or args.tasks < 1:
        parser.error("seeds must be >= 0 and --tasks >= 1")
    if any(not 0.0 <= lam < 1.0 for lam in args.lambdas):
        parser.error(f"every --lambdas value must be in [0, 1) (lambda 1 is always measured), got {args.lambdas}")

    started = time.perf_counter()
    report: dict[str, Any] = {"arguments": {key: str(value) if isinstance(value, Path) else value
                                            for key, value in vars(args).items() if key != "configs"},
                              "configs": [str(config) for config in args.configs], "games": {}}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    for config in args.configs:
        game = probe_game(config, model=args.model, seeds=args.seeds, tasks=args.tasks, copies=args.copies,
                          group_sizes=args.group_sizes, search_depth=args.search_depth, lambdas=args.lambdas,
                          make_trainer=make_trainer, log=lambda line: print(line, flush=True))
        game["decision"] = decisions(game, args.decide_at)
        game["lambda_decisions"] = {f"{lam:g}": lambda_verdict(game, args.decide_at, lam) for lam in args.lambdas}
        report["games"][config.stem] = game
        report["seconds"] = time.perf_counter() - started
        write_report(report, args.output)  # after each game: a cut-off run keeps what it did
        print(table(game, args.decide_at, args.lambdas) + "\n", flush=True)
    if args.lambdas:
        report["chosen_lambda"] = chosen_lambda(report["games"], args.decide_at, args.lambdas)
        write_report(report, args.output)
        print(chosen_lambda_line(report["chosen_lambda"]))
    if earlier:
        print("\n".join(reproduction(report, earlier)))
    print(f"done in {report['seconds']:.0f} s; written to {args.output}")
    return report


def write_report(report: dict[str, Any], path: Path) -> None:
    """The report as JSON, its figures rounded to 6 decimals (the shares and accuracies need no more)."""
    def rounded(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: rounded(item) for key, item in value.items()}
        if isinstance(value, list):
            return [rounded(item) for item in value]
        return round(value, 6) if isinstance(value, float) and math.isfinite(value) else value

    path.write_text(json.dumps(rounded(report)))


def print_report(report: dict[str, Any], earlier: dict[str, Any] | None = None) -> None:
    """The tables of a report (and its chosen lambda, and the comparison with an earlier report), again."""
    lambdas = report["arguments"].get("lambdas", [])
    for game in report["games"].values():
        print(table(game, report["arguments"]["decide_at"], lambdas) + "\n")
    if "chosen_lambda" in report:
        print(chosen_lambda_line(report["chosen_lambda"]))
    if earlier:
        print("\n".join(reproduction(report, earlier)))


def chosen_lambda_line(choice: dict[str, Any]) -> str:
    support = ("beats lambda 1 on every game" if choice["supported_by_the_probe"]
               else "no lambda beats lambda 1 on every game: the best mean, not supported by the probe")
    return (f"Chosen lambda for the learning comparisons: {choice['lambda']:g} ({support}; mean ranking accuracy "
            f"{choice['mean_accuracy']:.3f}).")


def reproduction(report: dict[str, Any], earlier: dict[str, Any]) -> list[str]:
    """Per game and seed of both reports: are the lambda-1 signals' figures (SIGNALS, every group size) equal? The
    earlier report may predate the per-subset layout (its figures directly under the signal)."""
    lines = []
    for name, game in report["games"].items():
        for seed, result in game["seeds"].items():
            old = earlier["games"].get(name, {}).get("seeds", {}).get(seed)
            if old is None:
                continue
            differing = []
            for group_size, figures in result["by_group_size"].items():
                for signal in SIGNALS:
                    before = old["by_group_size"][group_size][signal]
                    before = before.get("all", before)
                    now = {key: figures[signal]["all"][key] for key in before}
                    if not _same_figures(now, before):
                        differing.append(f"{signal} at N = {group_size}")
            same_rollout = (result["rows"], result["success_rate"]) == (old["rows"], old["success_rate"])
            lines.append(f"{name}, seed {seed}: {result['rows']} steps, success {result['success_rate']:.3f} "
                         f"({'the same rollout size and success' if same_rollout else 'a different rollout'}); lambda-1 "
                         f"figures {'equal' if not differing else 'differ: ' + ', '.join(differing)}")
    return lines


def _same_figures(now: Any, before: Any) -> bool:
    """Equal nested figures, NaN equal to NaN, numbers to 1e-9 (the earlier ones went through JSON); keys the earlier
    report lacks are not compared."""
    if isinstance(before, dict):
        return all(key in now and _same_figures(now[key], value) for key, value in before.items())
    if isinstance(before, float) and math.isnan(before):
        return isinstance(now, float) and math.isnan(now)
    return math.isclose(now, before, rel_tol=1e-9, abs_tol=1e-9)


if __name__ == "__main__":
    main()
