"""What a training run leaves on disk for its report (`python -m gigpo_trl.report OUTPUT_DIR`). The success rates
(`env/success_rate...`) are in the metrics only where the environment says whether its tasks are won (`info["won"]`).

    OUTPUT_DIR/gigpo/iterations.jsonl            one JSON object per rollout (train and eval):
        {"step": int, "mode": "train" | "eval", "rollout": int (count per mode), "episodes": int (all processes),
         "answer_format": str (what a well-formed answer is, "exactly one <action> block"), "metrics": {name: float},
         "step_group_sizes": {size: number of step groups of that size},
         "advantage_bins": [edges], "episode_advantage_counts": [...], "step_advantage_counts": [...],
         "env_failures": {"trajectories": int, "failed": int,        (only for a rollout with environment failures)
                          "reasons": [{"reason": str, "trajectories": ["#3", ...]}],
                          "retried_resets": [{"reason": str, "count": int}]}}
    OUTPUT_DIR/gigpo/evaluations.jsonl           one JSON object per evaluation (all its rollouts, each task once):
        {"step": int, "panel": str | null (the eval_dataset's name; null: the trainer's one eval_dataset),
         "copies": int (per task), "decoding": "greedy" | "sampled",
         "metrics": {"env/success_rate": float, "env/success_rate/<task type>": float, "env/pass@k": float, ...,
                     "env/panel_tasks": float, "env/panel_unplayed": float},
         "tasks": [the names of the tasks played, "seed 7", ...],
         "unplayed": {name of a task that could not be played: why}}   (the metrics are over the tasks played)
    OUTPUT_DIR/gigpo/updates.jsonl               one JSON object per logged training step (`UPDATE_METRICS`):
        {"step": int, "metrics": {"loss": float, "entropy": float, "grad_norm": float, "grad_norm/spike": float, ...},
         "warnings": [{"rule": str, "message": str}]}   (the training-health warnings it gave; only when any)
    OUTPUT_DIR/gigpo/trajectories/{mode}-{rollout:05d}.json   sample episodes of that rollout:
        [{"group", "trajectory", "seed", "length", "return", "won" (null: the environment did not say), "truncated",
          "env_error", "context_overflow" (why a step's prompt did not fit the context; null), "ends_in_cycle",
          "distinct_states",
          "steps": [{"step", "observation", "completion", "action", "valid", "action_match", "reward", "step_group_size",
                     "episode_advantage", "step_advantage", "advantage", "next_state", "revisit", "stay",
                     "turn_back"}]}]
        The loop fields (`gigpo_trl.loops.EpisodeLoops`) are null where unknown or not counted, and everywhere in an
        episode whose anchors are not states.
    OUTPUT_DIR/gigpo/set_aside-<time>/           records that are not this run's (`open_records`), in the same layout

A run never appends to another's records (`open_records`, when the trainer first writes): one that resumes from a
checkpoint keeps the records up to the checkpoint's step and sets aside those written after it by the run that was
stopped; one that starts afresh where records exist sets them all aside. Either way it says so.
"""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from transformers.trainer_utils import get_last_checkpoint

from gigpo_trl.advantages import GiGPOAdvantages
from gigpo_trl.health import HealthWarning
from gigpo_trl.metric_names import GRAD_NORM_SPIKE
from gigpo_trl.rollout import Rollout

# Histogram bins of the advantages, centred on 0 (exact zeros are common: every singleton step group);
# values outside the range are counted in the outer bins.
ADVANTAGE_BINS = np.linspace(-4.125, 4.125, 34)
RECORDS_DIR = "gigpo"
RECORD_FILES = ("iterations.jsonl", "evaluations.jsonl", "updates.jsonl")
# The keys every record of each file holds: a line without them is not one of this project's records.
RECORD_KEYS = {"iterations.jsonl": ("step", "mode", "rollout", "metrics"), "evaluations.jsonl": ("step", "metrics"),
               "updates.jsonl": ("step", "metrics")}
SET_ASIDE_PREFIX = "set_aside-"
# What TRL logs of a training step that the report draws (those logged; `grad_norm/spike` is GiGPOTrainer's).
UPDATE_METRICS = ("loss", "entropy", "grad_norm", GRAD_NORM_SPIKE, "learning_rate")


def iteration_record(step: int, mode: str, rollout: int, metrics: dict[str, float],
                     parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]], *, episodes: int,
                     answer_format: str | None = None, env_failures: dict[str, Any] | None = None) -> dict[str, Any]:
    """One rollout's record, from the (step_group_sizes, episode_advantages, step_advantages) of each process's
    advantages, one entry per step sample each: its `episodes` (all processes; an evaluation's chunks are summed up
    by them), the answer format its answers were held to (`Dialogue.answer_format`), and its environment failures
    where there were any (`gigpo_trl.env_failures.RolloutFailures.record`)."""
    sizes, episode_advantages, step_advantages = (np.concatenate([np.asarray(part[k]) for part in parts]) for k in range(3))
    rows_per_size = Counter(int(size) for size in sizes)
    failures = {"env_failures": env_failures} if env_failures else {}
    return {
        "step": step,
        "mode": mode,
        "rollout": rollout,
        "episodes": episodes,
        **({"answer_format": answer_format} if answer_format else {}),
        "metrics": metrics,
        "step_group_sizes": {size: rows // size for size, rows in sorted(rows_per_size.items())},
        "advantage_bins": ADVANTAGE_BINS.tolist(),
        "episode_advantage_counts": _histogram(episode_advantages),
        "step_advantage_counts": _histogram(step_advantages),
        **failures,
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
                "action_match": samples.action_match[row],
                "reward": samples.reward[row], "step_group_size": int(gigpo.step_group_sizes[row]),
                "episode_advantage": float(gigpo.episode_advantages[row]),
                "step_advantage": float(gigpo.step_advantages[row]), "advantage": float(gigpo.advantages[row]),
                "next_state": loops.next_state[t] if loops else None, "revisit": loops.revisit[t] if loops else None,
                "stay": loops.stay[t] if loops else None, "turn_back": loops.turn_back[t] if loops else None,
            }
            for t, row in enumerate(samples.rows_of(episode.trajectory))
        ]
        records.append({
            "group": episode.group, "trajectory": episode.trajectory, "seed": episode.seed, "length": episode.length,
            "return": episode.episode_return, "won": episode.won, "truncated": episode.truncated,
            "env_error": episode.env_error, "context_overflow": episode.context_overflow,
            "ends_in_cycle": loops.ends_in_cycle if loops else None,
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


def evaluation_record(step: int, metrics: dict[str, float], tasks: Sequence[str], unplayed: dict[str, str], *,
                      panel: str | None = None, copies: int = 1, greedy: bool = True) -> dict[str, Any]:
    """The record of one evaluation (`GiGPOTrainer.evaluate`) at training step `step`: its metrics, the tasks it played
    and those it could not play, with why (`gigpo_trl.metrics.panel_tasks`), the panel's name (None: the trainer's
    eval_dataset), and how it played: `copies` of each task, greedily or sampled."""
    return {"step": step, "panel": panel, "copies": copies, "decoding": "greedy" if greedy else "sampled",
            "metrics": metrics, "tasks": list(tasks), "unplayed": unplayed}


def write_evaluation(output_dir: str | Path, record: dict[str, Any]) -> None:
    """Append the record of one evaluation (`evaluation_record`)."""
    _append(output_dir, "evaluations.jsonl", record)


def read_evaluations(output_dir: str | Path) -> list[dict[str, Any]]:
    """The evaluation records of a run, in order (none when it was never evaluated)."""
    return _read(output_dir, "evaluations.jsonl")


def write_update(output_dir: str | Path, step: int, logs: dict[str, float],
                 warnings: Sequence[HealthWarning] = ()) -> None:
    """Append the record of one logged training step: the `UPDATE_METRICS` of its log, those logged, and the
    training-health warnings it gave (`gigpo_trl.health`), if any."""
    metrics = {name: float(logs[name]) for name in UPDATE_METRICS if logs.get(name) is not None}
    record = {"step": step, "metrics": metrics}
    if warnings:
        record["warnings"] = [{"rule": warning.rule, "message": warning.message} for warning in warnings]
    _append(output_dir, "updates.jsonl", record)


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


def checkpoint_step(output_dir: str | Path, resume_from_checkpoint: str | bool | None) -> int | None:
    """The global step of the checkpoint a run resumes from, as transformers' `Trainer.train(resume_from_checkpoint)`
    reads it (True: the last checkpoint in `output_dir`); None for a run that starts afresh."""
    if not resume_from_checkpoint:
        return None
    checkpoint = get_last_checkpoint(output_dir) if resume_from_checkpoint is True else resume_from_checkpoint
    if checkpoint is None:
        raise ValueError(f"No valid checkpoint found in output directory ({output_dir})")
    state = Path(checkpoint) / "trainer_state.json"
    if not state.is_file():
        raise FileNotFoundError(f"cannot resume from {checkpoint}: it holds no trainer_state.json (is it a checkpoint "
                                "folder, checkpoint-<step>, of a training run?)")
    return int(json.loads(state.read_text())["global_step"])


def open_records(output_dir: str | Path, resume_step: int | None) -> tuple[dict[str, int], str | None]:
    """Make OUTPUT_DIR/gigpo ready for a run's records, so that they are never mixed with another run's.

    A run that resumes from the checkpoint of step S (`resume_step`, `checkpoint_step`) keeps what the stopped run
    recorded up to that checkpoint: its logged training steps and evaluations up to step S and its training rollouts
    before S (the rollout recorded at step S was played for update S + 1, after the checkpoint was saved). Everything
    later is set aside. A run that starts afresh (`resume_step` None) sets aside every record there. What is set aside
    moves to OUTPUT_DIR/gigpo/set_aside-<time>/, in the same layout.

    Returns:
        The rollouts kept per mode ({"train": n, "eval": m}: the numbering goes on from them), and a message saying
        what was set aside (None when nothing was).
    """
    directory = Path(output_dir) / RECORDS_DIR
    files = [directory / name for name in RECORD_FILES if (directory / name).is_file()]
    trajectories = sorted((directory / "trajectories").glob("*.json"))
    if not any(path.read_text().strip() for path in files) and not trajectories:
        return {"train": 0, "eval": 0}, None
    aside = directory / time.strftime(f"{SET_ASIDE_PREFIX}%Y%m%d-%H%M%S")
    while aside.exists():  # two runs started within the second
        aside = aside.with_name(aside.name + "+")
    if resume_step is None:
        return {"train": 0, "eval": 0}, _set_all_aside(directory, files, trajectories, aside)
    records = {path.name: _complete_records(path) for path in files}

    def later(name: str, record: dict[str, Any]) -> bool:
        if name == "iterations.jsonl" and record["mode"] == "train":
            return record["step"] >= resume_step
        return record["step"] > resume_step

    moved = {name: [record for record in all_ if later(name, record)] for name, all_ in records.items()}
    kept = {name: [record for record in all_ if not later(name, record)] for name, all_ in records.items()}
    kept_rollouts = {f"{r['mode']}-{r['rollout']:05d}" for r in kept.get("iterations.jsonl", [])}
    trajectories_aside = [path for path in trajectories if path.stem not in kept_rollouts]
    for name in records:  # rewritten whole: a last line the stopped run left half written is dropped
        _write_lines(directory / name, kept[name])
    if not any(moved.values()) and not trajectories_aside:
        return count_rollouts(output_dir), None
    (aside / "trajectories").mkdir(parents=True)
    for name in records:
        _write_lines(aside / name, moved[name])
    for path in trajectories_aside:
        shutil.move(path, aside / "trajectories" / path.name)
    training = [r["step"] for r in moved.get("iterations.jsonl", []) if r["mode"] == "train"]
    what = (f"{sum(len(records_aside) for records_aside in moved.values())} records"
            + (f" (training rollouts of steps {min(training)}-{max(training)})" if training else ""))
    return count_rollouts(output_dir), (f"resuming from the checkpoint of step {resume_step}: the {what} that the "
                                        f"stopped run wrote after it were moved to {aside}; the records continue from "
                                        "the checkpoint.")


def _set_all_aside(directory: Path, files: list[Path], trajectories: list[Path], aside: Path) -> str:
    """A fresh run's start where records exist: every record file and sample episode moves to `aside` as it is (lines
    that are not this project's records too, whatever wrote them); returns what the warning says."""
    (aside / "trajectories").mkdir(parents=True)
    lines = [line for path in files for line in path.read_text().splitlines() if line.strip()]
    training = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("mode") == "train" and isinstance(record.get("step"), int):
            training.append(record["step"])
    for path in files:
        shutil.move(path, aside / path.name)
        _write_lines(path, [])
    for path in trajectories:
        shutil.move(path, aside / "trajectories" / path.name)
    what = f"{len(lines)} records" + (f" (training rollouts of steps {min(training)}-{max(training)})" if training else "")
    return (f"{directory} held the records of an earlier run: its {what} were moved to {aside}, and this run's "
            "records start afresh. To continue that run instead, resume it from one of its checkpoints "
            "(resume_from_checkpoint).")


def holds_training_records(output_dir: str | Path) -> bool:
    """Whether OUTPUT_DIR/gigpo holds what a training run records: a training rollout or a logged training step."""
    directory = Path(output_dir) / RECORDS_DIR
    iterations = _complete_records(directory / "iterations.jsonl") if (directory / "iterations.jsonl").is_file() else []
    return any(record["mode"] == "train" for record in iterations) or bool(read_updates(output_dir))


def _write_lines(path: Path, records: list[dict[str, Any]]) -> None:
    """Write a jsonl file whole, atomically (a report drawn meanwhile reads the old file or the new one)."""
    staging = path.with_suffix(".jsonl.partial")
    staging.write_text("".join(json.dumps(record) + "\n" for record in records))
    staging.replace(path)


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
    """The records of a jsonl file of `RECORD_FILES`, without a last line still being written (not JSON yet).

    Raises:
        ValueError: another line is not one of the file's records (not a JSON object holding `RECORD_KEYS`): a file
            of another version or of someone else's, which a run must neither take for its own nor drop; the error
            names the file and the line.
    """
    lines = path.read_text().splitlines()
    keys = RECORD_KEYS.get(path.name, ())
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                continue
            record = None
        if not isinstance(record, dict) or any(key not in record for key in keys):
            raise ValueError(f"{path}, line {number}, is not a GiGPO record (a JSON object with {', '.join(keys)}): "
                             f"{line[:120]!r}. Move the file away, or train and report in another output_dir.")
        records.append(record)
    return records


def _histogram(values: np.ndarray) -> list[int]:
    clipped = np.clip(np.asarray(values, dtype=np.float64), ADVANTAGE_BINS[0], ADVANTAGE_BINS[-1])
    return np.histogram(clipped, bins=ADVANTAGE_BINS)[0].tolist()
