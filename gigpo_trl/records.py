"""What a training run leaves on disk for its report (`python -m gigpo_trl.report OUTPUT_DIR`). The success rates
(`env/success_rate...`) are in the metrics only where the environment says whether its tasks are won (`info["won"]`).

    OUTPUT_DIR/gigpo/iterations.jsonl            one JSON object per rollout (train and eval):
        {"step": int, "mode": "train" | "eval", "rollout": int (count per mode), "metrics": {name: float},
         "step_group_sizes": {size: number of step groups of that size},
         "advantage_bins": [edges], "episode_advantage_counts": [...], "step_advantage_counts": [...]}
    OUTPUT_DIR/gigpo/evaluations.jsonl           one JSON object per evaluation (all its rollouts, each task once):
        {"step": int, "metrics": {"env/success_rate": float, "env/success_rate/<task type>": float, ...,
                                  "env/panel_tasks": float, "env/panel_unplayed": float},
         "tasks": [the names of the tasks played, "seed 7", ...],
         "unplayed": {name of a task that could not be played: why}}   (the metrics are over the tasks played)
    OUTPUT_DIR/gigpo/updates.jsonl               one JSON object per logged training step (`UPDATE_METRICS`):
        {"step": int, "metrics": {"loss": float, "entropy": float, "grad_norm": float, "grad_norm/spike": float, ...}}
    OUTPUT_DIR/gigpo/trajectories/{mode}-{rollout:05d}.json   sample episodes of that rollout:
        [{"group", "trajectory", "seed", "length", "return", "won" (null: the environment did not say), "truncated",
          "env_error", "ends_in_cycle", "distinct_states",
          "steps": [{"step", "observation", "completion", "action", "valid", "reward", "step_group_size",
                     "episode_advantage", "step_advantage", "advantage", "next_state", "revisit", "reversal"}]}]
        The loop fields (`gigpo_trl.loops.EpisodeLoops`) are null where unknown or not counted, and everywhere in an
        episode whose anchors are not states.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gigpo_trl.advantages import GiGPOAdvantages
from gigpo_trl.metric_names import GRAD_NORM_SPIKE
from gigpo_trl.rollout import Rollout

# Histogram bins of the advantages, centred on 0 (exact zeros are common: every singleton step group);
# values outside the range are counted in the outer bins.
ADVANTAGE_BINS = np.linspace(-4.125, 4.125, 34)
RECORDS_DIR = "gigpo"
# What TRL logs of a training step that the report draws (those logged; `grad_norm/spike` is GiGPOTrainer's).
UPDATE_METRICS = ("loss", "entropy", "grad_norm", GRAD_NORM_SPIKE, "learning_rate")


def iteration_record(step: int, mode: str, rollout: int, metrics: dict[str, float],
                     parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> dict[str, Any]:
    """One rollout's record, from the (step_group_sizes, episode_advantages, step_advantages) of each process's
    advantages, one entry per step sample each."""
    sizes, episode_advantages, step_advantages = (np.concatenate([np.asarray(part[k]) for part in parts]) for k in range(3))
    rows_per_size = Counter(int(size) for size in sizes)
    return {
        "step": step,
        "mode": mode,
        "rollout": rollout,
        "metrics": metrics,
        "step_group_sizes": {size: rows // size for size, rows in sorted(rows_per_size.items())},
        "advantage_bins": ADVANTAGE_BINS.tolist(),
        "episode_advantage_counts": _histogram(episode_advantages),
        "step_advantage_counts": _histogram(step_advantages),
    }


def episode_records(rollout: Rollout, gigpo: GiGPOAdvantages, limit: int) -> list[dict[str, Any]]:
    """The first `limit` episodes of a rollout with their steps, advantages and loops, for the trajectory viewer."""
    samples = rollout.steps
    records = []
    for episode, loops in zip(rollout.episodes[:limit], rollout.loops()):
        steps = [
            {
                "step": samples.step[row], "observation": samples.observation[row],
                "completion": samples.completion[row].text, "action": samples.action[row], "valid": samples.valid[row],
                "reward": samples.reward[row], "step_group_size": int(gigpo.step_group_sizes[row]),
                "episode_advantage": float(gigpo.episode_advantages[row]),
                "step_advantage": float(gigpo.step_advantages[row]), "advantage": float(gigpo.advantages[row]),
                "next_state": loops.next_state[t] if loops else None, "revisit": loops.revisit[t] if loops else None,
                "reversal": loops.reversal[t] if loops else None,
            }
            for t, row in enumerate(samples.rows_of(episode.trajectory))
        ]
        records.append({
            "group": episode.group, "trajectory": episode.trajectory, "seed": episode.seed, "length": episode.length,
            "return": episode.episode_return, "won": episode.won, "truncated": episode.truncated,
            "env_error": episode.env_error, "ends_in_cycle": loops.ends_in_cycle if loops else None,
            "distinct_states": loops.distinct_states if loops else None, "steps": steps,
        })
    return records


def write_records(output_dir: str | Path, record: dict[str, Any], episodes: list[dict[str, Any]]) -> None:
    """Append an iteration record and write its sample episodes."""
    directory = Path(output_dir) / RECORDS_DIR
    (directory / "trajectories").mkdir(parents=True, exist_ok=True)
    with open(directory / "iterations.jsonl", "a") as file:
        file.write(json.dumps(record) + "\n")
    path = directory / "trajectories" / f"{record['mode']}-{record['rollout']:05d}.json"
    staging = path.with_suffix(".json.partial")
    staging.write_text(json.dumps(episodes))
    staging.replace(path)  # atomic: a report drawn during training never reads half a file


def write_evaluation(output_dir: str | Path, step: int, metrics: dict[str, float], tasks: Sequence[str],
                     unplayed: dict[str, str]) -> None:
    """Append the record of one evaluation (`GiGPOTrainer.evaluate`) at training step `step`: its metrics, the tasks it
    played and those it could not play, with why (`gigpo_trl.metrics.panel_tasks`)."""
    _append(output_dir, "evaluations.jsonl", {"step": step, "metrics": metrics, "tasks": list(tasks), "unplayed": unplayed})


def read_evaluations(output_dir: str | Path) -> list[dict[str, Any]]:
    """The evaluation records of a run, in order (none when it was never evaluated)."""
    return _read(output_dir, "evaluations.jsonl")


def write_update(output_dir: str | Path, step: int, logs: dict[str, float]) -> None:
    """Append the record of one logged training step: the `UPDATE_METRICS` of its log, those logged."""
    metrics = {name: float(logs[name]) for name in UPDATE_METRICS if logs.get(name) is not None}
    _append(output_dir, "updates.jsonl", {"step": step, "metrics": metrics})


def read_updates(output_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run's logged training steps, in order (none in a run recorded before they were written)."""
    return _read(output_dir, "updates.jsonl")


def _append(output_dir: str | Path, name: str, record: dict[str, Any]) -> None:
    directory = Path(output_dir) / RECORDS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / name, "a") as file:
        file.write(json.dumps(record) + "\n")


def _read(output_dir: str | Path, name: str) -> list[dict[str, Any]]:
    path = Path(output_dir) / RECORDS_DIR / name
    return _complete_records(path) if path.is_file() else []


def count_rollouts(output_dir: str | Path) -> dict[str, int]:
    """Rollouts already recorded per mode, so that a resumed run continues the numbering."""
    path = Path(output_dir) / RECORDS_DIR / "iterations.jsonl"
    counts = {"train": 0, "eval": 0}
    for record in _complete_records(path) if path.is_file() else []:
        counts[record["mode"]] = max(counts.get(record["mode"], 0), record["rollout"] + 1)
    return counts


def read_iterations(output_dir: str | Path) -> list[dict[str, Any]]:
    """All iteration records of a run, in order (sizes as ints)."""
    path = Path(output_dir) / RECORDS_DIR / "iterations.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no GiGPO records in {output_dir}: {path} is missing (was it a GiGPOTrainer output_dir?)")
    records = _complete_records(path)
    for record in records:
        record["step_group_sizes"] = {int(size): count for size, count in record["step_group_sizes"].items()}
    return records


def read_trajectories(output_dir: str | Path) -> dict[str, list[dict[str, Any]]]:
    """Sample episodes of every recorded rollout: {"train-00000": [...], "eval-00000": [...], ...}."""
    directory = Path(output_dir) / RECORDS_DIR / "trajectories"
    return {path.stem: json.loads(path.read_text()) for path in sorted(directory.glob("*.json"))}


def _complete_records(path: Path) -> list[dict[str, Any]]:
    """The records of a jsonl file, without a last line still being written."""
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _histogram(values: np.ndarray) -> list[int]:
    clipped = np.clip(np.asarray(values, dtype=np.float64), ADVANTAGE_BINS[0], ADVANTAGE_BINS[-1])
    return np.histogram(clipped, bins=ADVANTAGE_BINS)[0].tolist()
