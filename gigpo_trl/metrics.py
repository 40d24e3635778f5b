"""The metrics a GiGPO run logs, as pure functions of what the rollouts and evaluations produced.

A process summarizes its own rollout (`RolloutSummary.of`); the trainer gathers the summaries of all processes and
`rollout_metrics` turns them into the logged numbers (`env/*`, `gigpo/*`, `loops/*`, `timing/*`, `dynamic_sampling/*`,
`reward_std_filter/*`, TRL's `reward`, ...), so a metric means the same on one process and on many. An episode whose
environment failed before its first action (`unplayed`) is in no mean, only in `env/env_error_share`. Evaluations count
every held-out (task, copy) once, over the tasks they could play (`panel_metrics`, `panel_tasks`). No torch and no trainer state
here.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from gigpo_trl.advantages import GiGPOAdvantages, StepGroupStats
from gigpo_trl.dynamic_sampling import SamplingCounts, StdFilterCounts
from gigpo_trl.loops import EpisodeLoops, LoopCounts
from gigpo_trl.metric_names import (
    ADVANTAGES_S, ASYNC_PRODUCER_WAIT_S, ASYNC_QUEUE_DEPTH, ASYNC_STALENESS_MAX, ASYNC_STALENESS_MEAN,
    ASYNC_TRAINER_WAIT_S, CONTEXT_OVERFLOW_SHARE, CONTEXT_TRIMMED_SHARE, ENV_ERROR_SHARE, ENV_PREFIX, ENV_S, EPISODE_LENGTH_MEAN,
    FRAC_REWARD_ZERO_STD, GENERATION_S, GROUP_RETURN_STD, INVALID_ACTION_RATE, INVALID_MAPPED_RATE,
    NONZERO_ADVANTAGE_SHARE, NUM_ROWS, PANEL_TASKS, PANEL_UNPLAYED, PASS_AT_PREFIX, PREFILL_TOKENS, PROMPT_TOKENS,
    RETURN_MEAN, RETURN_STD, ROLLOUT_S, STEP_SAMPLES, SUCCESS_RATE, TOKENS_PER_S, TRUNCATED_SHARE, UPDATE_S,
    UPDATE_STEP_SAMPLES,
)
from gigpo_trl.rollout import Episode, Rollout

# `grad_norm/spike`: a training step's gradient norm over the median of the last this many logged before it.
GRAD_NORM_SPIKE_WINDOW = 20
# Above this share of singleton step groups, step advantages are almost all 0: GiGPO ~ GRPO.
SINGLETON_WARNING_SHARE = 0.9
SINGLETON_WARNING = (
    "{share:.0%} of step groups are singletons: their step advantage is 0, so GiGPO is close to step-wise GRPO here. "
    "States rarely repeat across the copies of a task; check that the environment's anchor ignores move counters and "
    "decoration, or set similarity_threshold for text anchors."
)


@dataclass(frozen=True)
class RolloutTimes:
    """Where one rollout's time went, in seconds (`generation` and `env` are parts of `rollout`)."""

    rollout: float
    generation: float
    env: float
    advantages: float


@dataclass(frozen=True)
class EnvMetricTotals:
    """The environment's own metrics of a set of episodes (each episode's latest `info["metrics"]` values, see
    `gigpo_trl.envs.info_metrics`) as sums and counts per name and per name and task type ("name/type"), which add up
    over processes (`combine`)."""

    sums: dict[str, float]
    counts: dict[str, int]

    @classmethod
    def of(cls, episodes: Iterable[tuple[str | None, Mapping[str, float]]]) -> EnvMetricTotals:
        """From (task type, metrics) per episode."""
        sums: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        for task_type, metrics in episodes:
            for name, value in metrics.items():
                for key in (name, f"{name}/{task_type}") if task_type is not None else (name,):
                    sums[key] += value
                    counts[key] += 1
        return cls(dict(sums), dict(counts))

    @classmethod
    def combine(cls, parts: Iterable[EnvMetricTotals]) -> EnvMetricTotals:
        sums: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        for part in parts:
            for key, value in part.sums.items():
                sums[key] += value
                counts[key] += part.counts[key]
        return cls(dict(sums), dict(counts))

    def as_metrics(self) -> dict[str, float]:
        """`env/<name>` and `env/<name>/<task type>`: the mean over the episodes that reported the metric."""
        return {f"{ENV_PREFIX}{key}": self.sums[key] / self.counts[key] for key in sorted(self.sums)}


@dataclass(frozen=True)
class RolloutSummary:
    """What one process's rollout contributes to the logged metrics: sums and counts, which add up over processes,
    extremes and times, whose maximum over processes is logged, and the step-group statistics of its advantages."""

    episodes: int  # played: those whose environment did not fail before their first action (`unplayed`)
    unplayed: int
    won: int
    success_known: int  # episodes whose environment said whether they were won (`Episode.won` is not None)
    return_sum: float
    return_squares: float
    length_sum: int
    truncated: int
    env_errors: int  # played episodes ended by their environment's failure
    context_overflows: int  # episodes ended as a step's prompt would not fit the model's context
    context_trimmed: int  # step samples whose prompt dropped the conversation's oldest exchanges to fit it
    task_groups: int
    equal_return_groups: int  # task groups whose copies all got the same return: no episode advantage
    spread_groups: int  # task groups of two trajectories or more
    group_return_std_sum: float  # summed over those: the std (ddof 1) of their trajectories' returns
    steps: int
    invalid: int
    invalid_mapped: int  # of those, the answers the lenient parser mapped onto an admissible action
    reward_sum: float
    reward_squares: float
    clipped: int  # answers cut at max_completion_length
    shortest_answer: float  # tokens (inf: no answer)
    longest_answer: float  # tokens (-inf: no answer)
    prompt_tokens: int
    prefill_tokens: int | None  # the prompt tokens forwarded (`Rollout.prefill_tokens`; None: not known)
    generated_tokens: int
    update_samples: int  # step samples that are rows of the update (padding rows aside)
    update_nonzero: int  # of those, the samples whose advantage is not 0
    times: RolloutTimes
    step_groups: StepGroupStats
    sampling: SamplingCounts | None  # what dynamic sampling did (None: off)
    std_filter: StdFilterCounts | None  # what reward-std filtering did, over all processes (None: off)
    loops: LoopCounts | None  # revisits and cycles (None: no episode's anchors are states)
    env_metrics: EnvMetricTotals  # the environment's own metrics (info["metrics"])

    @classmethod
    def of(cls, rollout: Rollout, gigpo: GiGPOAdvantages, times: RolloutTimes, *, max_completion_length: int,
           end_token_ids: Collection[int], update_samples: Sequence[int],
           sampling: SamplingCounts | None = None, std_filter: StdFilterCounts | None = None) -> RolloutSummary:
        """Summarize a rollout, its advantages (`compute_gigpo_advantages` of its step columns) and its times.

        Args:
            end_token_ids: the tokens that end an answer (EOS, padding): an answer of `max_completion_length`
                tokens that does not end with one was cut.
            update_samples: the step samples (indices into the rollout's) that are rows of the update.
            sampling: what dynamic sampling did, when it is on.
            std_filter: what reward-std filtering did, when it is on (the same on every process).
        """
        episodes, steps = [e for e in rollout.episodes if not unplayed(e)], rollout.steps
        returns = np.array([e.episode_return for e in episodes], dtype=np.float64)
        rewards = np.asarray(steps.reward, dtype=np.float64)
        answer_lengths = [len(c.completion_ids) for c in steps.completion]
        returns_by_group: dict[int, list[float]] = defaultdict(list)
        for episode in episodes:
            returns_by_group[episode.group].append(episode.episode_return)
        loops = [figures for figures in rollout.loops() if figures is not None]
        return cls(
            episodes=len(episodes),
            unplayed=len(rollout.episodes) - len(episodes),
            won=sum(e.won is True for e in episodes),
            success_known=sum(e.won is not None for e in episodes),
            return_sum=float(returns.sum()),
            return_squares=float((returns**2).sum()),
            length_sum=sum(e.length for e in episodes),
            truncated=sum(e.truncated for e in episodes),
            env_errors=sum(e.env_error is not None for e in episodes),
            context_overflows=sum(e.context_overflow is not None for e in episodes),
            context_trimmed=sum(c.dropped_exchanges > 0 for c in steps.completion),
            task_groups=len(returns_by_group),
            equal_return_groups=sum(bool(np.isclose(np.std(group), 0.0)) for group in returns_by_group.values()),
            spread_groups=sum(len(group) > 1 for group in returns_by_group.values()),
            group_return_std_sum=sum(statistics.stdev(group) for group in returns_by_group.values() if len(group) > 1),
            steps=len(steps),
            invalid=steps.valid.count(False),
            invalid_mapped=sum(not valid and match is not None for valid, match in zip(steps.valid, steps.action_match)),
            reward_sum=float(rewards.sum()),
            reward_squares=float((rewards**2).sum()),
            clipped=sum(n >= max_completion_length and c.completion_ids[-1] not in end_token_ids
                        for n, c in zip(answer_lengths, steps.completion)),
            shortest_answer=min(answer_lengths, default=np.inf),
            longest_answer=max(answer_lengths, default=-np.inf),
            prompt_tokens=sum(len(c.prompt_ids) for c in steps.completion),
            prefill_tokens=rollout.prefill_tokens,
            generated_tokens=rollout.generated_tokens,
            update_samples=len(update_samples),
            update_nonzero=int(np.count_nonzero(gigpo.advantages[np.asarray(update_samples, dtype=np.int64)])),
            times=times,
            step_groups=gigpo.stats,
            sampling=sampling,
            std_filter=std_filter,
            loops=LoopCounts.of(loops) if loops else None,
            env_metrics=EnvMetricTotals.of((e.task_type, e.metrics) for e in episodes),
        )


def rollout_metrics(summaries: Sequence[RolloutSummary], update_seconds: float | None = None) -> dict[str, float]:
    """The logged metrics of a rollout made of the rollouts of several processes (one summary each).

    Args:
        summaries: one per process.
        update_seconds: the time of the update before this rollout (training only), logged as `timing/update_s`.
    """

    def total(name: str) -> float:
        return float(sum(getattr(s, name) for s in summaries))

    def slowest(name: str) -> float:
        return max(getattr(s.times, name) for s in summaries)

    episodes, steps = total("episodes"), total("steps")
    shortest, longest = min(s.shortest_answer for s in summaries), max(s.longest_answer for s in summaries)
    generation_seconds = slowest("generation")
    step_groups = StepGroupStats.combine([s.step_groups for s in summaries]).as_metrics()
    del step_groups[NUM_ROWS]  # logged as env/step_samples
    metrics = {
        **_success_rate(total("won"), total("success_known")),
        RETURN_MEAN: total("return_sum") / max(episodes, 1),
        RETURN_STD: _bessel_std(total("return_sum"), total("return_squares"), episodes),
        EPISODE_LENGTH_MEAN: total("length_sum") / max(episodes, 1),
        TRUNCATED_SHARE: total("truncated") / max(episodes, 1),
        ENV_ERROR_SHARE: (total("env_errors") + total("unplayed")) / max(episodes + total("unplayed"), 1),
        CONTEXT_OVERFLOW_SHARE: total("context_overflows") / max(episodes, 1),
        CONTEXT_TRIMMED_SHARE: total("context_trimmed") / max(steps, 1),
        INVALID_ACTION_RATE: total("invalid") / max(steps, 1),
        INVALID_MAPPED_RATE: total("invalid_mapped") / max(steps, 1),
        STEP_SAMPLES: steps,
        **step_groups,
        UPDATE_STEP_SAMPLES: total("update_samples"),
        NONZERO_ADVANTAGE_SHARE: total("update_nonzero") / max(total("update_samples"), 1),
        ROLLOUT_S: slowest("rollout"),
        GENERATION_S: generation_seconds,
        ENV_S: slowest("env"),
        ADVANTAGES_S: slowest("advantages"),
        TOKENS_PER_S: total("generated_tokens") / max(generation_seconds, 1e-9),
        PROMPT_TOKENS: total("prompt_tokens"),
        # GRPOTrainer's standard metrics in GiGPO's terms: the step reward is the per-sample reward; a task group
        # whose returns are all equal gets no episode advantage.
        "completions/mean_length": total("generated_tokens") / max(steps, 1),
        "completions/min_length": shortest if np.isfinite(shortest) else 0.0,
        "completions/max_length": longest if np.isfinite(longest) else 0.0,
        "completions/clipped_ratio": total("clipped") / max(steps, 1),
        "reward": total("reward_sum") / max(steps, 1),
        "reward_std": _bessel_std(total("reward_sum"), total("reward_squares"), steps),
        FRAC_REWARD_ZERO_STD: total("equal_return_groups") / max(total("task_groups"), 1),
    }
    if total("spread_groups"):  # a group of one trajectory (one copy: evaluation's default) has no spread
        metrics[GROUP_RETURN_STD] = total("group_return_std_sum") / total("spread_groups")
    if update_seconds is not None:
        metrics[UPDATE_S] = update_seconds
    if all(s.prefill_tokens is not None for s in summaries):
        metrics[PREFILL_TOKENS] = total("prefill_tokens")
    if summaries[0].sampling is not None:
        metrics.update(SamplingCounts.combine([s.sampling for s in summaries]).as_metrics())
    if summaries[0].std_filter is not None:  # over all processes already
        metrics.update(summaries[0].std_filter.as_metrics())
    loops = [s.loops for s in summaries if s.loops is not None]
    if loops:
        metrics.update(LoopCounts.combine(loops).as_metrics())
    metrics.update(EnvMetricTotals.combine([s.env_metrics for s in summaries]).as_metrics())
    return metrics


def trailing_ratio(value: float, trailing: Sequence[float]) -> float | None:
    """`value / median(trailing)`, e.g. a gradient norm over the median of those logged before it
    (`grad_norm/spike`: about 1 while training is steady, far above at a spike). None without a trailing value or
    when their median is 0."""
    if not trailing:
        return None
    median = statistics.median(trailing)
    return value / median if median > 0 else None


@dataclass(frozen=True)
class PanelEpisode:
    """What evaluation keeps of an episode: its task, which of the task's copies it was, and its outcome."""

    task: str  # the task's name: "seed 7", or "seed 7, options {...}" (its options as JSON)
    copy: int
    task_type: str | None
    won: bool | None  # None: the environment did not say
    episode_return: float
    length: int
    unplayed: str | None = None  # why it could not be played: its environment failed before the first action
    loops: LoopCounts | None = None  # its revisits and cycles (None: its anchors are not states)
    metrics: dict[str, float] = field(default_factory=dict)  # the environment's own metrics (info["metrics"])

    @classmethod
    def of(cls, episode: Episode, group_size: int, loops: EpisodeLoops | None = None) -> PanelEpisode:
        """`loops`: the episode's entry of `Rollout.loops()`."""
        return cls(task_name(episode.seed, episode.options), episode.trajectory % group_size, episode.task_type,
                   episode.won, episode.episode_return, episode.length,
                   episode.env_error if unplayed(episode) else None,
                   LoopCounts.of([loops]) if loops is not None else None, dict(episode.metrics))


def unplayed(episode: Episode) -> bool:
    """Whether an episode was never played: its environment failed before the first action (every reset attempt).
    Such an episode is no episode of the means (a return of 0 in 0 steps it never had), only an environment failure."""
    return episode.length == 0 and episode.env_error is not None


def task_name(seed: int | None, options: dict | None) -> str:
    """How evaluations name a task: "seed 7", or "seed 7, options {...}" with its options as JSON."""
    return f"seed {seed}" + (f", options {json.dumps(options, sort_keys=True)}" if options else "")


def panel_tasks(episodes: Sequence[PanelEpisode]) -> tuple[list[str], dict[str, str]]:
    """The tasks of an evaluation that were played (sorted), and those that could not be, each with why: a task could
    not be played when the environment of one of its copies failed before the first action, every reset attempt
    (`env_reset_attempts`). As in `panel_metrics`, the first play of each (task, copy) counts."""
    first_plays = _first_plays(episodes)
    unplayed: dict[str, str] = {}
    for episode in first_plays:
        if episode.unplayed is not None:
            unplayed.setdefault(episode.task, episode.unplayed)
    return sorted({episode.task for episode in first_plays} - unplayed.keys()), dict(sorted(unplayed.items()))


def panel_metrics(episodes: Sequence[PanelEpisode], pass_ks: Sequence[int] | None = None) -> dict[str, float]:
    """Success rate, mean return and mean episode length over the distinct (task, copy) pairs of the tasks an evaluation
    played, overall and per task type (`env/success_rate/<type>`); with two copies or more of each task, pass@k
    (`env/pass@k`, `env/pass@k/<type>` for each k of `pass_ks`, see `pass_rates`); the environment's own metrics
    (`env/<name>`); the loop metrics (`loops/*`) of those whose anchors
    are states, the number of distinct tasks (`env/panel_tasks`) and of those that could not be played
    (`env/panel_unplayed`, see `panel_tasks`): every figure is over the `env/panel_tasks - env/panel_unplayed` tasks
    played, so that one that could not start counts neither as a loss nor as an episode of length 0. The success rates
    count the episodes whose environment said whether they were won, and are left out where none did.

    To give every process whole batches, the evaluation dataloader plays some tasks twice when the task count is
    not a multiple of the tasks per step of all processes; the first play of each (task, copy) counts, the others
    do not, so the figures are those of the panel itself whatever the number of processes and the batch sizes.
    """
    first_plays = _first_plays(episodes)
    if not first_plays:
        return {}
    played, unplayed = panel_tasks(first_plays)
    metrics = {PANEL_TASKS: float(len(played) + len(unplayed)), PANEL_UNPLAYED: float(len(unplayed))}
    kept = [e for e in first_plays if e.task not in unplayed]
    if not kept:
        return metrics
    metrics |= {
        **_success_rate(sum(e.won is True for e in kept), sum(e.won is not None for e in kept)),
        RETURN_MEAN: float(np.mean([e.episode_return for e in kept])),
        EPISODE_LENGTH_MEAN: float(np.mean([e.length for e in kept])),
    }
    metrics |= pass_rates(kept, pass_ks)
    for task_type in sorted({e.task_type for e in kept if e.task_type is not None}):
        of_type = [e for e in kept if e.task_type == task_type]
        metrics.update(_success_rate(sum(e.won is True for e in of_type), sum(e.won is not None for e in of_type),
                                     name=f"{SUCCESS_RATE}/{task_type}"))
        metrics.update(pass_rates(of_type, pass_ks, suffix=f"/{task_type}"))
    loops = [e.loops for e in kept if e.loops is not None]
    if loops:
        metrics.update(LoopCounts.combine(loops).as_metrics())
    metrics.update(EnvMetricTotals.of((e.task_type, e.metrics) for e in kept).as_metrics())
    return metrics


def pass_at_k(copies: int, wins: int, k: int) -> float:
    """The chance that at least one of k copies of a task wins, estimated without bias from `copies` played copies of
    which `wins` won: 1 - C(copies - wins, k) / C(copies, k) (Chen et al. 2021, "Evaluating Large Language Models
    Trained on Code"), for 1 <= k <= copies."""
    if not 1 <= k <= copies or not 0 <= wins <= copies:
        raise ValueError(f"pass@k needs 1 <= k <= copies and 0 <= wins <= copies, got k={k}, copies={copies}, "
                         f"wins={wins}")
    return 1.0 - math.comb(copies - wins, k) / math.comb(copies, k)


def pass_rates(episodes: Sequence[PanelEpisode], ks: Sequence[int] | None = None, suffix: str = "") -> dict[str, float]:
    """`env/pass@k` (+ `suffix`) for each k of `ks`, the mean over tasks of `pass_at_k`, where every task was played in
    two copies or more, each saying whether it was won; {} otherwise. `ks` None: 1, 2, 4, ... up to the fewest copies
    of a task, and that number. Raises ValueError for a k above the fewest copies."""
    wins: dict[str, list[bool]] = defaultdict(list)
    for episode in episodes:
        wins[episode.task].append(episode.won)
    if not wins or any(None in outcomes for outcomes in wins.values()):
        return {}
    copies = min(len(outcomes) for outcomes in wins.values())
    if copies < 2:
        return {}
    if ks is None:
        ks = sorted({*(2**power for power in range(copies.bit_length()) if 2**power <= copies), copies})
    return {f"{PASS_AT_PREFIX}{k}{suffix}": float(np.mean([pass_at_k(len(outcomes), sum(outcomes), k)
                                                           for outcomes in wins.values()])) for k in ks}


def _first_plays(episodes: Sequence[PanelEpisode]) -> list[PanelEpisode]:
    """The first play of each (task, copy), in order."""
    distinct: dict[tuple[str, int], PanelEpisode] = {}
    for episode in episodes:
        distinct.setdefault((episode.task, episode.copy), episode)
    return list(distinct.values())


def _success_rate(won: float, known: float, name: str = SUCCESS_RATE) -> dict[str, float]:
    """{name: won / known} over the episodes whose success is known; {} when none is: a success rate of 0 would say
    "never won" where the environment said nothing."""
    return {name: won / known} if known else {}


def _bessel_std(total: float, squares: float, count: float) -> float:
    """Sample standard deviation (ddof 1, as TRL's nanstd) from a sum and a sum of squares; 0 below 2 values."""
    if count < 2:
        return 0.0
    return max((squares - total * total / count) / (count - 1), 0.0) ** 0.5


def async_metrics(parts: Sequence[tuple[int, int, float, float]]) -> dict[str, float]:
    """The async producer's metrics of a consumed rollout (`async_staleness`), from each process's (staleness, queue
    depth, seconds the trainer waited for the rollout, seconds the producer waited for its admission)."""
    staleness, depth, trainer_wait, producer_wait = (np.asarray(column, dtype=np.float64) for column in zip(*parts))
    return {ASYNC_STALENESS_MEAN: float(staleness.mean()), ASYNC_STALENESS_MAX: float(staleness.max()),
            ASYNC_QUEUE_DEPTH: float(depth.mean()), ASYNC_TRAINER_WAIT_S: float(trainer_wait.max()),
            ASYNC_PRODUCER_WAIT_S: float(producer_wait.max())}
