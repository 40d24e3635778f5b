"""The run report: plots and a trajectory viewer, from the records a GiGPO run leaves in OUTPUT_DIR/gigpo/.

    python -m gigpo_trl.report OUTPUT_DIR      ->  OUTPUT_DIR/report/index.html, with its PNG plots beside it

The page is self-contained (no network, no external CSS or JS): open it in any browser, or copy the
report folder elsewhere. Plots use matplotlib's Agg renderer through `Figure` objects, never pyplot, so
writing a report leaves the caller's plotting state alone (e.g. in a notebook).
"""

from __future__ import annotations

import argparse
import html
import re
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from transformers import TrainerCallback

from gigpo_trl.metric_names import (
    CYCLE_END_SHARE, DISTINCT_STATES_MEAN, DYNAMIC_SAMPLING_PREFIX, ENV_ERROR_SHARE, EPISODE_ADVANTAGE_STD,
    EPISODE_LENGTH_MEAN, EXTRA_ROLLOUT_S, EXTRA_ROUNDS, GRAD_NORM_SPIKE, GROUPS_DROPPED, GROUPS_KEPT, GROUPS_MISSING,
    GROUPS_ROLLED, GROUPS_SURPLUS, GROUP_RETURN_STD, INVALID_ACTION_RATE, INVALID_MAPPED_RATE, LOOPS_PREFIX, NONZERO_ADVANTAGE_SHARE,
    NONZERO_STEP_ADVANTAGE_SHARE, NUM_STEP_GROUPS, PANEL_TASKS, PANEL_UNPLAYED, RETURN_MEAN, REVISIT_SHARE, ROLLOUT_S,
    SINGLETON_SHARE, STAY_SHARE, STEP_ADVANTAGE_STD, STEP_GROUP_SIZE_MAX, STEP_GROUP_SIZE_MEAN, STEP_SAMPLES,
    SUCCESS_RATE, TOKENS_PER_S, TRUNCATED_SHARE, TURN_BACK_SHARE, UPDATE_STEP_SAMPLES,
)
from gigpo_trl.metrics import GRAD_NORM_SPIKE_WINDOW
from gigpo_trl.records import RECORDS_DIR, read_evaluations, read_iterations, read_trajectories, read_updates

REPORT_DIR = "report"
# Sample episodes can be long (8 episodes x max_env_steps steps per rollout): the page shows those of
# the last few rollouts of each mode only.
DEFAULT_ROLLOUTS_SHOWN = 10
STEP_AXIS_LABEL = "training step (optimizer updates so far)"
MODE_NAMES = {"train": "Training", "eval": "Evaluation"}

PLOT_CAPTIONS = {
    "outcomes.png": "Success rate, mean return and mean episode length of every rollout.",
    "step_groups.png": "Step groups: the states that several copies of a task reached, whose steps GiGPO compares.",
    "advantages.png": "Distributions of the episode advantage A_E and of the step advantage A_S over step samples.",
    "loops.png": "Loops, counted from the anchors: the share of steps that go back to a state their episode had "
                 "visited, of steps that stay where they were (a move into a wall, an action that changes nothing), "
                 "of steps that turn straight back to the state they came from, of episodes cut off inside a cycle, "
                 "and the distinct states per episode (docs/metrics.md). Not applicable where the environment's "
                 "anchors are histories, not states.",
}
# Drawn when the run recorded its training steps' logs (gigpo/updates.jsonl).
HEALTH_CAPTION = ("health.png", "Early warnings of a collapse (RAGEN's): the policy entropy and the gradient norm of "
                  "every logged training step, the gradient norm over the median of the "
                  f"{GRAD_NORM_SPIKE_WINDOW} logged before it (a spike stands far above 1), and the mean over task "
                  "groups of the standard deviation of their copies' returns (no signal at 0).")
# Drawn when the run was evaluated (GiGPOTrainer.evaluate) and its environment says whether a task is won.
PANEL_CAPTION = ("panel.png", "Held-out success rate of every evaluation, each task counted once: overall and per task "
                 "type (info[\"task_type\"]).")
# Drawn when the run trained with dynamic sampling (dynamic_sampling_max_rounds).
DYNAMIC_SAMPLING_CAPTION = ("dynamic_sampling.png", "Dynamic sampling: the task groups of every training iteration "
                            "(rolled over all rounds, kept for the update, dropped without signal, asked), its extra "
                            "rounds, and the rollout time they cost.")
# In the success plot of a run whose environment does not say whether a task is won (no success rate is logged).
SUCCESS_NOT_REPORTED = "not reported:\nthe environment does not say\nwhether a task is won (info[\"won\"])"
# In the loop plot of a run whose anchors are not states (info["anchor_kind"] "history": no loop metric is logged).
LOOPS_NOT_APPLICABLE = ("not applicable:\nthe environment's anchors are\nhistories, not states\n(info[\"anchor_kind\"]; or "
                        "records\nwritten before loops/* were)")

# The metrics of the table at the top of the page, with what they mean.
KEY_METRICS = {
    SUCCESS_RATE: "share of episodes won",
    RETURN_MEAN: "mean episode return",
    EPISODE_LENGTH_MEAN: "mean episode length (environment steps)",
    TRUNCATED_SHARE: "share of episodes cut off (step limit or environment failure)",
    ENV_ERROR_SHARE: "share of episodes ended by an environment error",
    INVALID_ACTION_RATE: "share of answers that broke the answer format (not {answer_format}): each is charged "
                         "invalid_action_penalty",
    INVALID_MAPPED_RATE: "share of answers that broke the format yet named an admissible action, which the lenient "
                         "parser took and the environment played (counted in the invalid share above)",
    GROUP_RETURN_STD: "mean over task groups of the standard deviation of their copies' returns",
    REVISIT_SHARE: "share of steps that go back to a state their episode had visited",
    STAY_SHARE: "share of steps that stay in the state they were taken in",
    TURN_BACK_SHARE: "share of steps straight back to the state they came from",
    CYCLE_END_SHARE: "share of episodes cut off inside a cycle",
    DISTINCT_STATES_MEAN: "distinct states per episode",
    STEP_SAMPLES: "step samples (one per environment step)",
    STEP_GROUP_SIZE_MEAN: "mean step-group size (step samples per group of equal states)",
    STEP_GROUP_SIZE_MAX: "largest step group",
    SINGLETON_SHARE: "share of step groups of size 1 (their step advantage is 0)",
    NONZERO_STEP_ADVANTAGE_SHARE: "share of step samples with a nonzero step advantage A_S",
    NONZERO_ADVANTAGE_SHARE: "share of the update's step samples with a nonzero advantage A",
    EPISODE_ADVANTAGE_STD: "standard deviation of the episode advantage A_E",
    STEP_ADVANTAGE_STD: "standard deviation of the step advantage A_S",
    ROLLOUT_S: "rollout time (seconds)",
    TOKENS_PER_S: "generation throughput (tokens per second)",
}
# Added to the table of a run that trained with dynamic sampling.
DYNAMIC_SAMPLING_METRICS = {
    GROUPS_ROLLED: "task groups rolled (every round)",
    GROUPS_KEPT: "task groups in the update (with a signal)",
    GROUPS_DROPPED: "task groups dropped (every step sample's advantage 0)",
    GROUPS_SURPLUS: "task groups with a signal left out (more than asked)",
    GROUPS_MISSING: "task groups the update lacks (the limit was reached)",
    EXTRA_ROUNDS: "extra rollout rounds",
    EXTRA_ROLLOUT_S: "rollout time of the extra rounds (seconds)",
}

# How a figure of an evaluation's rollouts (its chunks) sums up to the panel's, where the panel's record does not hold it:
# weighted by the chunks' episodes or by one of their metrics (what the figure is a share or a mean of), added up, or
# the maximum. The standard deviations, times and throughputs do not sum up this way: not shown as the panel's.
CHUNK_WEIGHTS = {
    TRUNCATED_SHARE: "episodes", ENV_ERROR_SHARE: "episodes", GROUP_RETURN_STD: "episodes",
    INVALID_ACTION_RATE: STEP_SAMPLES, INVALID_MAPPED_RATE: STEP_SAMPLES, NONZERO_STEP_ADVANTAGE_SHARE: STEP_SAMPLES,
    NONZERO_ADVANTAGE_SHARE: UPDATE_STEP_SAMPLES, STEP_GROUP_SIZE_MEAN: NUM_STEP_GROUPS, SINGLETON_SHARE: NUM_STEP_GROUPS,
    STEP_SAMPLES: "sum", NUM_STEP_GROUPS: "sum", UPDATE_STEP_SAMPLES: "sum", STEP_GROUP_SIZE_MAX: "max",
}
# C0/C1 control characters (tabs and newlines aside) are not allowed in HTML text; small models emit them.
CONTROL_CHARACTERS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def write_report(output_dir: str | Path, max_rollouts: int = DEFAULT_ROLLOUTS_SHOWN) -> Path:
    """Write the report of a GiGPO run into OUTPUT_DIR/report/ and return that folder.

    Args:
        output_dir: the `output_dir` of a `GiGPOTrainer` run (it holds gigpo/iterations.jsonl).
        max_rollouts: the trajectory viewer shows the sample episodes of the last `max_rollouts`
            training rollouts and of the last `max_rollouts` evaluation rollouts (0: none).

    Raises:
        FileNotFoundError: the run has no records, or none yet.
    """
    records = read_iterations(output_dir)
    if not records:
        raise FileNotFoundError(f"no GiGPO records in {output_dir}: {RECORDS_DIR}/iterations.jsonl is empty (no rollout has finished yet)")
    train = [record for record in records if record["mode"] == "train"]
    evaluations = read_evaluations(output_dir)
    # an evaluation's figures are its panel's (every episode once), however many rollouts (chunks) played it
    evaluation = panel_records([record for record in records if record["mode"] == "eval"], evaluations)

    report_dir = Path(output_dir) / REPORT_DIR
    report_dir.mkdir(parents=True, exist_ok=True)
    _plot_outcomes(train, evaluation).savefig(report_dir / "outcomes.png", dpi=100)
    _plot_step_groups(train, evaluation).savefig(report_dir / "step_groups.png", dpi=100)
    _plot_advantages(train, evaluation).savefig(report_dir / "advantages.png", dpi=100)
    _plot_loops(train, evaluation).savefig(report_dir / "loops.png", dpi=100)
    captions = dict(PLOT_CAPTIONS)
    updates = read_updates(output_dir)
    if updates:
        _plot_health(updates, train, evaluation).savefig(report_dir / HEALTH_CAPTION[0], dpi=100)
        captions[HEALTH_CAPTION[0]] = HEALTH_CAPTION[1]
    if any(SUCCESS_RATE in record["metrics"] for record in evaluations):
        _plot_panel(evaluations).savefig(report_dir / PANEL_CAPTION[0], dpi=100)
        captions[PANEL_CAPTION[0]] = PANEL_CAPTION[1]
    sampled = [record for record in train if _dynamic_sampling(record)]
    if sampled:
        _plot_dynamic_sampling(sampled).savefig(report_dir / DYNAMIC_SAMPLING_CAPTION[0], dpi=100)
        captions[DYNAMIC_SAMPLING_CAPTION[0]] = DYNAMIC_SAMPLING_CAPTION[1]

    page = _page(Path(output_dir), records, _metrics_table(train, evaluation),
                 _trajectory_viewer(records, read_trajectories(output_dir), max_rollouts),
                 captions, _health_warnings(updates) + _unplayed_tasks(evaluations) + _environment_failures(records))
    (report_dir / "index.html").write_text(page, encoding="utf-8")
    return report_dir


# ------------------------------------------------------------------------------------------
# An evaluation's panel as one record.
# ------------------------------------------------------------------------------------------


def panel_records(rollouts: Sequence[dict[str, Any]], evaluations: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per evaluation, in the shape of a rollout's record, with the panel's figures: those its record in
    `evaluations.jsonl` holds (every episode of the panel counted once, as the printed line counts them), then the
    others summed up over the evaluation rollouts (chunks) that played it (`CHUNK_WEIGHTS`; its step-group sizes and
    advantage histograms added up), where they can be told apart: the rollouts of the evaluation's step when it is the
    only evaluation of that step. A figure neither holds is not shown as the panel's."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for record in rollouts:
        by_step.setdefault(record["step"], []).append(record)
    evaluations_at = {step: sum(e["step"] == step for e in evaluations) for step in {e["step"] for e in evaluations}}
    panels = []
    for evaluation in evaluations:
        chunks = by_step.get(evaluation["step"], []) if evaluations_at[evaluation["step"]] == 1 else []
        record = {"step": evaluation["step"], "mode": "eval", "panel": evaluation.get("panel"),
                  "metrics": {**_summed_up(chunks), **evaluation["metrics"]}, "step_group_sizes": {}}
        if chunks:
            sizes: dict[int, int] = {}
            for chunk in chunks:
                for size, count in chunk["step_group_sizes"].items():
                    sizes[size] = sizes.get(size, 0) + count
            record |= {"step_group_sizes": dict(sorted(sizes.items())), "advantage_bins": chunks[0]["advantage_bins"],
                       **{key: np.sum([chunk[key] for chunk in chunks], axis=0).tolist()
                          for key in ("episode_advantage_counts", "step_advantage_counts")}}
        panels.append(record)
    return panels


def _summed_up(chunks: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The figures of an evaluation's rollouts summed up over them, each as `CHUNK_WEIGHTS` says: a share or a mean
    weighted by what it is a share or mean of, a count added up, a maximum taken."""
    figures = {}
    for metric, weight in CHUNK_WEIGHTS.items():
        values = [chunk["metrics"].get(metric) for chunk in chunks]
        if not chunks or None in values:
            continue
        if weight == "sum":
            figures[metric] = float(sum(values))
        elif weight == "max":
            figures[metric] = float(max(values))
        else:
            weights = [chunk.get("episodes") if weight == "episodes" else chunk["metrics"].get(weight) for chunk in chunks]
            if None not in weights and sum(weights) > 0:
                figures[metric] = float(np.average(values, weights=weights))
    return figures


# ------------------------------------------------------------------------------------------
# Plots.
# ------------------------------------------------------------------------------------------


def _answer_format(records: list[dict[str, Any]]) -> str:
    """What a well-formed answer was in the run (the latest record that says it), e.g. "exactly one <action> block"."""
    return next((record["answer_format"] for record in reversed(records) if record.get("answer_format")),
                "the template's answer format")


def _plot_outcomes(train: list[dict[str, Any]], evaluation: list[dict[str, Any]]) -> Figure:
    panels = (
        (SUCCESS_RATE, "Success rate", "share of episodes won"),
        (RETURN_MEAN, "Mean episode return", "return (sum of rewards)"),
        (EPISODE_LENGTH_MEAN, "Mean episode length", "environment steps per episode"),
        (INVALID_ACTION_RATE, "Off-format answers",
         textwrap.fill(f"share of answers not {_answer_format(train)}", 40) + "\n(thin lines: those still played)"),
    )
    figure = _metric_panels(train, evaluation, panels, {SUCCESS_RATE: SUCCESS_NOT_REPORTED}, shares=(0, 3))
    mapped = figure.axes[3]  # the off-format answers the lenient parser mapped onto an admissible action
    for records, style in ((train, "-"), (evaluation, "--")):
        if records:
            mapped.plot([r["step"] for r in records], [r["metrics"].get(INVALID_MAPPED_RATE, np.nan) for r in records],
                        linestyle=style, linewidth=0.8, color="gray")
    return figure


def _plot_loops(train: list[dict[str, Any]], evaluation: list[dict[str, Any]]) -> Figure:
    panels = (
        (REVISIT_SHARE, "Revisits", "share of steps back to a visited state"),
        (STAY_SHARE, "Stays", "share of steps that stay in their state"),
        (TURN_BACK_SHARE, "Turn-backs", "share of steps back to the state they came from"),
        (CYCLE_END_SHARE, "Episodes ending in a cycle", "share of episodes cut off in a visited state"),
        (DISTINCT_STATES_MEAN, "Distinct states", "states per episode (the start included)"),
    )
    applicable = any(name.startswith(LOOPS_PREFIX) for record in train + evaluation for name in record["metrics"])
    not_reported = {} if applicable else {metric: LOOPS_NOT_APPLICABLE for metric, _, _ in panels}
    return _metric_panels(train, evaluation, panels, not_reported, shares=(0, 1, 2, 3))


def _metric_panels(train: list[dict[str, Any]], evaluation: list[dict[str, Any]], panels: Sequence[tuple[str, str, str]],
                   not_reported: dict[str, str], shares: Sequence[int]) -> Figure:
    """A row of panels, one per (metric, title, unit): the metric against the training step, or the text
    `not_reported[metric]` where no record holds it; the panels numbered in `shares` on a 0-1 axis."""
    figure = Figure(figsize=(20, 4.2), layout="constrained")
    for axes, (metric, title, unit) in zip(figure.subplots(1, len(panels)), panels):
        if metric in not_reported and not any(metric in record["metrics"] for record in train + evaluation):
            axes.text(0.5, 0.5, not_reported[metric], ha="center", va="center", transform=axes.transAxes)
        else:
            _plot_metric(axes, train, evaluation, metric)
        axes.set(title=title, xlabel=STEP_AXIS_LABEL, ylabel=unit)
    for share in shares:
        figure.axes[share].set_ylim(-0.05, 1.05)
    return figure


def _plot_health(updates: list[dict[str, Any]], train: list[dict[str, Any]], evaluation: list[dict[str, Any]]) -> Figure:
    """The logged training steps' entropy, gradient norm and its spike ratio; the rollouts' in-group return std."""
    figure = Figure(figsize=(20, 4.2), layout="constrained")
    entropy_axes, norm_axes, spike_axes, spread_axes = figure.subplots(1, 4)
    steps = [record["step"] for record in updates]
    for axes, metric, title, unit in (
        (entropy_axes, "entropy", "Policy entropy", "mean per completion token"),
        (norm_axes, "grad_norm", "Gradient norm", "before clipping"),
        (spike_axes, GRAD_NORM_SPIKE, "Gradient-norm spikes", f"over the median of the last {GRAD_NORM_SPIKE_WINDOW}"),
    ):
        axes.plot(steps, [record["metrics"].get(metric, np.nan) for record in updates], marker="o", markersize=4,
                  label="logged training steps")
        axes.set(title=title, xlabel=STEP_AXIS_LABEL, ylabel=unit)
        _step_axis(axes, steps)
        axes.legend()
    spike_axes.axhline(1.0, color="black", linestyle=":", linewidth=1)
    _plot_metric(spread_axes, train, evaluation, GROUP_RETURN_STD)
    spread_axes.set(title="Return spread within task groups", xlabel=STEP_AXIS_LABEL,
                    ylabel="mean std of the copies' returns")
    return figure


def _plot_step_groups(train: list[dict[str, Any]], evaluation: list[dict[str, Any]]) -> Figure:
    figure = Figure(figsize=(13, 4.2), layout="constrained")
    sizes_axes, singletons_axes = figure.subplots(1, 2)

    compared = _first_and_last(train, evaluation)
    width = 0.8 / len(compared)
    for position, (label, record) in enumerate(compared):
        groups = record["step_group_sizes"]
        total = max(sum(groups.values()), 1)
        offset = (position - (len(compared) - 1) / 2) * width
        sizes_axes.bar([size + offset for size in groups], [count / total for count in groups.values()], width=width, label=label)
    sizes = [size for _, record in compared for size in record["step_group_sizes"]]
    if sizes:
        sizes_axes.set_xlim(min(sizes) - 0.5, max(sizes) + 0.5)
    sizes_axes.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    sizes_axes.margins(y=0.2)  # room for the legend above the bars
    sizes_axes.set(title="Step-group sizes", xlabel="step-group size (step samples taken in the same state)",
                   ylabel="share of the rollout's step groups")
    sizes_axes.legend()

    _plot_metric(singletons_axes, train, evaluation, SINGLETON_SHARE)
    singletons_axes.set(title="Singleton step groups (step advantage 0)", xlabel=STEP_AXIS_LABEL,
                        ylabel="share of step groups of size 1", ylim=(-0.05, 1.05))
    return figure


def _plot_advantages(train: list[dict[str, Any]], evaluation: list[dict[str, Any]]) -> Figure:
    figure = Figure(figsize=(13, 4.2), layout="constrained")
    panels = (
        ("episode_advantage_counts", "Episode advantage A_E", "A_E"),
        ("step_advantage_counts", "Step advantage A_S", "A_S"),
    )
    compared = _first_and_last(train, evaluation)
    for axes, (counts_key, title, symbol) in zip(figure.subplots(1, 2), panels):
        for position, (label, record) in enumerate(compared):
            counts = np.asarray(record[counts_key], dtype=np.float64)
            shares = counts / max(counts.sum(), 1.0)
            filled = position == 0  # the first rollout filled, the last one outlined on top of it
            axes.stairs(shares, record["advantage_bins"], label=label, fill=filled, alpha=0.4 if filled else 1.0,
                        linewidth=2, color=f"C{position}")
        axes.grid(alpha=0.3)
        axes.margins(y=0.15)  # room for the legend above the bars
        axes.set(title=title, xlabel=f"{symbol} (values beyond ±4 are counted in the outer bins)",
                 ylabel="share of the rollout's step samples")
        axes.legend()
    return figure


def _plot_panel(evaluations: list[dict[str, Any]]) -> Figure:
    """Held-out success against the training step: all tasks, and each task type."""
    figure = Figure(figsize=(10, 4.2), layout="constrained")
    axes = figure.subplots()
    steps = [record["step"] for record in evaluations]
    names = sorted({name for record in evaluations for name in record["metrics"] if name.startswith(SUCCESS_RATE)})
    for name in names:
        label = "all tasks" if name == SUCCESS_RATE else name.removeprefix(f"{SUCCESS_RATE}/")
        style = {"linewidth": 3, "color": "black"} if name == SUCCESS_RATE else {"linestyle": "--"}
        axes.plot(steps, [record["metrics"].get(name, np.nan) for record in evaluations], marker="s", label=label,
                  **style)
    counts = {(int(m.get(PANEL_TASKS, 0)), int(m.get(PANEL_UNPLAYED, 0))) for m in
              (record["metrics"] for record in evaluations)}
    tasks = ", ".join(f"{total - unplayed} of {total} tasks played" if unplayed else f"{total} tasks"
                      for total, unplayed in sorted(counts))
    axes.set(title=f"Held-out success ({tasks})", xlabel=STEP_AXIS_LABEL, ylabel="share of episodes won",
             ylim=(-0.05, 1.05))
    _step_axis(axes, steps)
    axes.legend()
    return figure


def _plot_dynamic_sampling(train: list[dict[str, Any]]) -> Figure:
    """The task groups of every training iteration, its extra rounds and their rollout time."""
    figure = Figure(figsize=(20, 4.2), layout="constrained")
    groups_axes, rounds_axes, time_axes = figure.subplots(1, 3)
    steps = [record["step"] for record in train]

    def values(metric: str) -> list[float]:
        return [record["metrics"][metric] for record in train]

    for name, label, style in (("groups_rolled", "rolled (every round)", {"marker": "o"}),
                               ("groups_kept", "kept for the update", {"marker": "o", "linewidth": 3}),
                               ("groups_dropped", "dropped: no signal", {"marker": "x"})):
        groups_axes.plot(steps, values(DYNAMIC_SAMPLING_PREFIX + name), label=label, **style)
    asked = [kept + missing for kept, missing in zip(values(GROUPS_KEPT), values(GROUPS_MISSING))]
    groups_axes.plot(steps, asked, linestyle="--", color="black", label="asked (the rollout's tasks)")
    groups_axes.set(title="Task groups", xlabel=STEP_AXIS_LABEL, ylabel="task groups, all processes")
    rounds_axes.bar(steps, values(EXTRA_ROUNDS))
    rounds_axes.set(title="Extra rollout rounds", xlabel=STEP_AXIS_LABEL, ylabel="rounds after the first")
    time_axes.plot(steps, values(ROLLOUT_S), marker="o", label="whole rollout (every round)")
    time_axes.plot(steps, values(EXTRA_ROLLOUT_S), marker="o", label="extra rounds")
    time_axes.set(title="Rollout time", xlabel=STEP_AXIS_LABEL, ylabel="seconds")
    for axes in (groups_axes, rounds_axes, time_axes):
        _step_axis(axes, steps)
    rounds_axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    groups_axes.legend()
    time_axes.legend()
    return figure


def _dynamic_sampling(record: dict[str, Any]) -> bool:
    return GROUPS_ROLLED in record["metrics"]


def _plot_metric(axes: Axes, train: list[dict[str, Any]], evaluation: list[dict[str, Any]], metric: str) -> None:
    """One metric against the training step: training rollouts as a line, evaluations as hollow squares
    (a training point at the same step stays visible inside)."""
    for records, label, style in (
        (train, "training rollouts", {"marker": "o", "markersize": 4}),
        (evaluation, "evaluation (held-out tasks)",
         {"marker": "s", "markersize": 9, "markerfacecolor": "none", "markeredgewidth": 1.5, "linestyle": "--"}),
    ):
        if records:
            values = [record["metrics"].get(metric, np.nan) for record in records]
            axes.plot([record["step"] for record in records], values, label=label, **style)
    _step_axis(axes, [record["step"] for record in train + evaluation])
    axes.legend()


def _step_axis(axes: Axes, steps: list[int]) -> None:
    """Training steps on the x axis: whole steps (around a single one rather than fractions of a step), a grid."""
    if min(steps) == max(steps):
        axes.set_xlim(steps[0] - 1, steps[0] + 1)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(alpha=0.3)


def _first_and_last(train: list[dict[str, Any]], evaluation: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """The rollouts whose distributions the plots compare: the first and last training rollouts
    (evaluation rollouts in a run without training records), with their legend labels."""
    records, kind = (train, "training") if train else (evaluation, "evaluation")
    if len(records) == 1:
        return [(f"{kind} rollout (step {records[0]['step']})", records[0])]
    return [(f"first {kind} rollout (step {records[0]['step']})", records[0]),
            (f"last {kind} rollout (step {records[-1]['step']})", records[-1])]


# ------------------------------------------------------------------------------------------
# The page.
# ------------------------------------------------------------------------------------------


def _page(output_dir: Path, records: list[dict[str, Any]], table: str, viewer: str, captions: dict[str, str],
          notices: str) -> str:
    counts = {mode: sum(record["mode"] == mode for record in records) for mode in MODE_NAMES}
    steps = [record["step"] for record in records]
    figures = "\n".join(
        f'<figure><img src="{name}" alt="{_escape(caption)}"><figcaption>{_escape(caption)}</figcaption></figure>'
        for name, caption in captions.items()
    )
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>GiGPO report: {_escape(output_dir.name)}</title>
<style>{STYLE}</style>
</head>
<body>
<h1>GiGPO run report</h1>
<p>Run <code>{_escape(output_dir.resolve())}</code>: {counts["train"]} training and {counts["eval"]} evaluation
rollouts recorded, training steps {min(steps)} to {max(steps)}.</p>
{notices}<h2>Latest metrics</h2>
{table}
<h2>Plots</h2>
{figures}
<h2>Trajectories</h2>
{viewer}
</body>
</html>
"""


def _health_warnings(updates: list[dict[str, Any]]) -> str:
    """The training-health warnings the run gave (`gigpo_trl.health`), each at its logged training step; "" when it
    gave none."""
    items = [f"<li>step {record['step']}: {_escape(warning['message'])}</li>"
             for record in updates for warning in record.get("warnings", [])]
    if not items:
        return ""
    return ('<div class="health"><p>Training health: the run said it had stopped learning (docs/metrics.md, '
            '"Training health").</p>\n<ul>' + "\n".join(items) + "</ul></div>\n")


def _unplayed_tasks(evaluations: list[dict[str, Any]]) -> str:
    """A warning listing, per evaluation, the held-out tasks it could not play and why; "" when every evaluation played
    its whole panel."""
    items = [f"<li>step {record['step']}: {len(record['tasks'])} of {len(record['tasks']) + len(record['unplayed'])} "
             f"tasks played; could not be played: "
             + "; ".join(f"<b>{_escape(task)}</b> ({_escape(reason)})" for task, reason in record["unplayed"].items())
             + "</li>" for record in evaluations if record.get("unplayed")]
    if not items:
        return ""
    return ('<div class="unplayed"><p>Held-out tasks that could not be played (their environment failed before the '
            "first action, every reset attempt): each evaluation's figures are over the tasks it played.</p>\n<ul>"
            + "\n".join(items) + "</ul></div>\n")


def _environment_failures(records: list[dict[str, Any]]) -> str:
    """Per rollout with environment failures (its record's `env_failures`), how many trajectories failed and why, each
    reason once; "" when no rollout had any."""
    items = []
    for record in records:
        failures = record.get("env_failures")
        if not failures:
            continue
        reasons = "; ".join(f"{len(entry['trajectories'])} x {_escape(entry['reason'])} (the first: "
                            f"{_escape(entry['trajectories'][0])})" for entry in failures["reasons"])
        resets = "; ".join(f"{entry['count']} x {_escape(entry['reason'])}" for entry in failures["retried_resets"])
        items.append(f"<li>{MODE_NAMES[record['mode']].lower()} rollout of step {record['step']}: {failures['failed']} of "
                     f"{failures['trajectories']} trajectories failed" + (f": {reasons}" if reasons else "")
                     + (f"; resets tried again: {resets}" if resets else "") + "</li>")
    if not items:
        return ""
    return ('<div class="failures"><p>Environment failures (each failed trajectory ended there; every one is listed '
            'under its reason in gigpo/iterations.jsonl):</p>\n<ul>' + "\n".join(items) + "</ul></div>\n")


def _metrics_table(train: list[dict[str, Any]], panels: list[dict[str, Any]]) -> str:
    """The key metrics of the last training rollout and of the last evaluation's panel (`panel_records`), side by side;
    a figure the panel's record does not hold and its rollouts cannot sum up to is shown as "-"."""
    columns = [("last training rollout", train[-1])] if train else []
    if panels:
        panel = panels[-1]
        name = f" {_escape(panel['panel'])}" if panel.get("panel") else ""
        tasks = panel["metrics"].get(PANEL_TASKS)
        count = f", {int(tasks)} task{'s' if tasks != 1 else ''}" if tasks else ""
        columns.append((f"held-out panel{name}{count}", panel))
    header = "".join(f"<th>{title}<br>(step {record['step']})</th>" for title, record in columns)
    answer_format = _answer_format(train)
    rows = []
    records = [record for _, record in columns]
    shown = KEY_METRICS | (DYNAMIC_SAMPLING_METRICS if any(_dynamic_sampling(record) for record in train) else {})
    for metric, meaning in shown.items():
        cells = "".join(f"<td>{_number(record['metrics'].get(metric))}</td>" for record in records)
        meaning = meaning.format(answer_format=answer_format) if metric == INVALID_ACTION_RATE else meaning
        rows.append(f"<tr><td>{_escape(meaning)}</td><td><code>{_escape(metric)}</code></td>{cells}</tr>")
    return f'<table class="metrics"><tr><th>metric</th><th>logged as</th>{header}</tr>\n' + "\n".join(rows) + "\n</table>"


def _trajectory_viewer(records: list[dict[str, Any]], trajectories: dict[str, list[dict[str, Any]]], max_rollouts: int) -> str:
    """Each mode's last `max_rollouts` rollouts, newest first; each expands into its sample episodes,
    and each episode into its steps."""
    # A resumed run restarts the rollout count and rewrites the trajectory file: the latest record matches it.
    record_of = {f"{record['mode']}-{record['rollout']:05d}": record for record in records}
    sections = []
    for mode, mode_name in MODE_NAMES.items():
        names = [name for name in trajectories if name.startswith(f"{mode}-")]
        if not names:
            continue
        shown = names[-max_rollouts:] if max_rollouts else []
        left_out = len(names) - len(shown)
        note = f" ({left_out} older left out; <code>--rollouts</code> sets how many are shown)" if left_out else ""
        sections.append(f"<h3>{mode_name} rollouts</h3>\n<p>Sample episodes of the last {len(shown)} of {len(names)} "
                        f"recorded {mode_name.lower()} rollouts{note}, newest first.</p>")
        for position, name in enumerate(reversed(shown)):
            sections.append(_rollout_details(mode_name, name, record_of.get(name), trajectories[name], open_=position == 0))
    if not sections:
        return "<p>The run recorded no sample episodes.</p>"
    return "\n".join([
        "<p>Each rollout lists its sample episodes (the trainer records the first <code>log_trajectories</code> "
        "episodes of every rollout); open an episode to see its steps in order. Rows of off-format answers are shaded "
        "(red: sent as written; yellow: the lenient parser found an admissible action in them, which the environment "
        "played; both are charged <code>invalid_action_penalty</code>); the state after each step is numbered in the order the episode first visited it, and a step back to a "
        "visited state is marked (stay, turn back, or revisit); "
        "A = A_E + step_advantage_weight &times; A_S is the advantage of the loss.</p>",
        '<p><button type="button" onclick="setAll(true)">expand all</button> '
        '<button type="button" onclick="setAll(false)">collapse all</button></p>',
        "<script>function setAll(open) { document.querySelectorAll('details').forEach(d => d.open = open); }</script>",
        *sections,
    ])


def _rollout_details(mode_name: str, name: str, record: dict[str, Any] | None, episodes: list[dict[str, Any]], open_: bool) -> str:
    index = int(name.split("-")[1])
    summary = f"{mode_name} rollout {index}"
    if record is not None:
        metrics = record["metrics"]
        summary += (f" · step {record['step']} · success rate {_number(metrics.get(SUCCESS_RATE))}"
                    f" · mean return {_number(metrics.get(RETURN_MEAN))}")
    summary += f" · {len(episodes)} sample episodes"
    answer_format = _answer_format([record] if record is not None else [])
    body = "\n".join(_episode_details(episode, answer_format) for episode in episodes) or "<p>No sample episodes recorded.</p>"
    return f'<details class="rollout"{" open" if open_ else ""}><summary>{summary}</summary>\n{body}\n</details>'


def _episode_details(episode: dict[str, Any], answer_format: str) -> str:
    # won is None where the environment did not say whether the task was won
    said, style = {True: ("won", "won"), False: ("not won", "lost"), None: ("success not reported", "")}[episode["won"]]
    outcome = [said]
    if episode["truncated"]:
        outcome.append("truncated")
    if episode.get("ends_in_cycle"):
        outcome.append("ends in a cycle")
    if episode["env_error"] is not None:
        outcome.append(f"environment error: {_escape(episode['env_error'])}")
    if episode.get("context_overflow"):
        outcome.append(f"ended as {_escape(episode['context_overflow'])}")
    distinct = episode.get("distinct_states")
    summary = (f"task group {episode['group']} · environment {episode['trajectory']} · seed {_escape(episode['seed'])}"
               f" · return {episode['return']:.3f} · {episode['length']} steps · "
               + (f"{distinct} distinct states · " if distinct is not None else "")
               + f'<span class="{style}">{", ".join(outcome)}</span>')
    header = "".join(
        f'<th title="{_escape(explanation)}">{label}</th>'
        for label, explanation in (
            ("step", "t, 0-based"),
            ("observation", "what the environment showed before the answer"),
            ("answer", "the model's completion"),
            ("action sent", "what the environment received"),
            ("state after", "the state the action led to, numbered in the order the episode first visited its states "
                            "(#0: the start); 'stay': the state the step was taken in; 'turn back': the state it came "
                            "from; 'revisit': visited earlier in the episode (docs/metrics.md)"),
            ("valid", f"the answer was {answer_format}; 'no, played' where it broke the format but named "
                      "an admissible action, which the lenient parser took"),
            ("reward", "r_t, received after the action"),
            ("step group", "how many step samples of the task group were taken in this state"),
            ("A_E", "episode advantage"),
            ("A_S", "step advantage (0 in a step group of size 1)"),
            ("A", "A_E + step_advantage_weight * A_S, the advantage of the loss"),
        )
    )
    rows = [
        f'<tr class="{_validity(step)[0]}{" revisit" if step.get("revisit") else ""}">'
        f'<td>{step["step"]}</td>'
        f'<td><pre>{_escape(step["observation"])}</pre></td><td><pre>{_escape(step["completion"])}</pre></td>'
        f'<td><pre>{_escape(step["action"])}</pre></td><td>{_state_after(step)}</td><td>{_validity(step)[1]}</td>'
        f'<td>{step["reward"]:.3f}</td><td>{step["step_group_size"]}</td><td>{step["episode_advantage"]:.3f}</td>'
        f'<td>{step["step_advantage"]:.3f}</td><td>{step["advantage"]:.3f}</td></tr>'
        for step in episode["steps"]
    ]
    table = f'<table class="steps"><tr>{header}</tr>\n' + "\n".join(rows) + "\n</table>"
    return f'<details class="episode"><summary>{summary}</summary>\n{table}\n</details>'


def _validity(step: dict[str, Any]) -> tuple[str, str]:
    """A step's row class and "valid" cell: well-formed; off-format but mapped onto an admissible action by the
    lenient parser (and played); off-format and sent as written."""
    if step["valid"]:
        return "valid", "yes"
    if step.get("action_match"):
        return "mapped", f"no, played ({step['action_match']})"
    return "invalid", "no"


def _state_after(step: dict[str, Any]) -> str:
    """'#k', with 'stay', 'turn back' or 'revisit' where the step went back; '–' where unknown or not a state."""
    number = step.get("next_state")
    if number is None:
        return "–"
    mark = (" stay" if step.get("stay") else " turn back" if step.get("turn_back")
            else " revisit" if step.get("revisit") else "")
    return f"#{number}{mark}"


def _escape(value: Any) -> str:
    """Record text as HTML text: escaped, with control characters shown as \\xNN."""
    text = CONTROL_CHARACTERS.sub(lambda match: f"\\x{ord(match.group()):02x}", str(value))
    return html.escape(text)


def _number(value: float | None) -> str:
    return "–" if value is None else f"{value:.4g}"


STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1400px; padding: 0 1em; color: #222; }
h2 { border-bottom: 1px solid #ccc; margin-top: 2em; }
table { border-collapse: collapse; margin: 0.5em 0; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.5em; vertical-align: top; text-align: left; }
th { background: #f3f3f3; }
table.metrics td:nth-child(n+3), table.steps td:nth-child(n+5) { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 1em 0; }
figure img { max-width: 100%; }
figcaption { color: #555; }
details { margin: 0.3em 0; }
details.rollout { border: 1px solid #ccc; border-radius: 4px; padding: 0.3em 0.6em; }
details.episode { margin-left: 1.5em; }
summary { cursor: pointer; }
pre { margin: 0; white-space: pre-wrap; word-break: break-word; max-height: 20em; overflow: auto; font-size: 0.85em; }
tr.invalid { background: #fff3f3; }
tr.mapped { background: #fffbea; }
.unplayed, .health, .failures { border: 2px solid #c60; background: #fff6e8; padding: 0 1em; }
tr.revisit td:nth-child(5) { background: #fff1c2; font-weight: bold; }
.won { color: #17702a; font-weight: bold; }
.lost { color: #a33; }
"""


# ------------------------------------------------------------------------------------------
# Command line.
# ------------------------------------------------------------------------------------------


class ReportCallback(TrainerCallback):
    """Draws the run report into output_dir/report when training ends (`GiGPOTrainer` adds it)."""

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            write_report(args.output_dir)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m gigpo_trl.report OUTPUT_DIR`: write the report and print the path of its index.html."""
    parser = argparse.ArgumentParser(
        prog="python -m gigpo_trl.report",
        description="Write the report of a GiGPO training run (plots of success rate, return, episode length, "
        "step groups, advantages, loops and early warnings, and a trajectory viewer) into OUTPUT_DIR/report/, and "
        "print the path of its index.html.",
    )
    parser.add_argument("output_dir", metavar="OUTPUT_DIR", help="the output_dir of a GiGPOTrainer run (it holds gigpo/iterations.jsonl)")
    parser.add_argument("--rollouts", type=int, default=DEFAULT_ROLLOUTS_SHOWN, metavar="N",
                        help="show the sample episodes of the last N training and last N evaluation rollouts "
                        f"(default: {DEFAULT_ROLLOUTS_SHOWN}; 0: none)")
    args = parser.parse_args(argv)
    if args.rollouts < 0:
        parser.error(f"--rollouts must be >= 0, got {args.rollouts}")
    try:
        report_dir = write_report(args.output_dir, max_rollouts=args.rollouts)
    except FileNotFoundError as error:
        parser.exit(1, f"{parser.prog}: error: {error}\n")
    print(report_dir / "index.html")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
