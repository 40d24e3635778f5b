"""Tasks: what a dataset row of `GiGPOTrainer` is, how a batch of rows becomes the tasks of a rollout, and which
tasks a recipe trains and evaluates on.

A task is a `seed` and optional `options`, passed to `env.reset(seed=..., options=...)`. A training batch holds
`num_generations` consecutive copies of each task row (TRL's `RepeatSampler`), which become one `Task` played by
that many identically-seeded environments. Rows in TRL's shape (a `prompt` and any other columns, for the classes of
TRL's `environment_factory`) are tasks too: `row_tasks`. Nothing here imports TRL: building a task dataset is cheap.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gigpo_trl.envs import EnvFactory, fold_seeds
from gigpo_trl.shortest_paths import seeds_by_optimal_steps

if TYPE_CHECKING:
    from datasets import Dataset


@dataclass(frozen=True)
class Task:
    """One task of a batch: every copy of it is reset with this seed and these options."""

    seed: int | None
    options: dict[str, Any] | None = None


def task_dataset(seeds: Sequence[int], options: Sequence[dict[str, Any] | None] | None = None) -> Dataset:
    """A dataset of tasks: one row per task, with its `seed` and (JSON-encoded) `options`."""
    from datasets import Dataset  # noqa: PLC0415 (`import gigpo_trl` stays light)

    options = options if options is not None else [None] * len(seeds)
    if len(options) != len(seeds):
        raise ValueError(f"got {len(seeds)} seeds but {len(options)} options")
    return Dataset.from_dict({"seed": list(seeds), "options": [json.dumps(o) if o is not None else "" for o in options]})


def check_task_datasets(train_dataset: Dataset | None, eval_dataset: Dataset | None, tasks_per_rollout: int, *,
                        seeds: bool = True, indexed: bool = False) -> None:
    """A training dataset must hold at least the distinct tasks of one rollout; with `seeds`, every dataset needs a
    `seed` column (one task per row); with `indexed` (dynamic sampling draws tasks by row index), the training dataset
    must have a length and rows by index. Raises a ValueError that says which dataset falls short."""
    if train_dataset is None:
        raise ValueError("train_dataset is required: a dataset of tasks with a 'seed' column (see gigpo_trl.task_dataset)")
    if indexed and not (hasattr(train_dataset, "__len__") and hasattr(train_dataset, "__getitem__")):
        raise ValueError(f"dynamic_sampling_max_rounds draws further tasks from train_dataset by row index, and this "
                         f"train_dataset ({type(train_dataset).__name__}) has no rows by index: pass a datasets.Dataset, "
                         "or leave dynamic sampling off")
    for name, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
        if seeds and dataset is not None and "seed" not in dataset.column_names:
            raise ValueError(f"{name} needs a 'seed' column (one task per row); it has {dataset.column_names}")
    if hasattr(train_dataset, "__len__") and len(train_dataset) < tasks_per_rollout:
        raise ValueError(f"train_dataset has {len(train_dataset)} tasks, but one rollout needs generation_batch_size / "
                         f"num_generations = {tasks_per_rollout} distinct tasks")


def tasks_from_rows(rows: Sequence[dict[str, Any]], group_size: int) -> list[Task]:
    """The tasks of a batch of dataset rows, which holds `group_size` consecutive copies of each task."""
    if len(rows) % group_size:
        raise RuntimeError(f"a batch of {len(rows)} rows cannot hold whole groups of {group_size} copies")
    tasks = []
    for start in range(0, len(rows), group_size):
        copies = [(row.get("seed"), options_of(row)) for row in rows[start : start + group_size]]
        if any(copy != copies[0] for copy in copies):
            raise RuntimeError(
                f"rows {start}..{start + group_size - 1} of the batch should be {group_size} copies of one task, got "
                f"{copies}; the copies of a task were split across processes (check per_device_train_batch_size, "
                "steps_per_generation and num_generations)"
            )
        tasks.append(Task(seed=copies[0][0], options=copies[0][1]))
    return tasks


def row_tasks(rows: Sequence[dict[str, Any]], group_size: int, salt: str) -> list[Task]:
    """The tasks of a batch of rows in TRL's shape (any columns, no `seed` needed), `group_size` consecutive copies
    each: every copy of a task is reset with the whole row as its options and one seed, a hash of `salt`, the row
    and how many identical rows came before it in the batch. The same salt and rows give the same seeds on every
    machine (a held-out panel is fixed); a new salt per training step gives a fresh draw each step, as TRL's
    environments draw at every reset."""
    if len(rows) % group_size:
        raise RuntimeError(f"a batch of {len(rows)} rows cannot hold whole groups of {group_size} copies")
    tasks, seen = [], Counter()
    for start in range(0, len(rows), group_size):
        copies = [json.dumps(row, sort_keys=True, default=str) for row in rows[start : start + group_size]]
        if any(copy != copies[0] for copy in copies):
            raise RuntimeError(
                f"rows {start}..{start + group_size - 1} of the batch should be {group_size} copies of one task; the "
                "copies of a task were split across processes (check per_device_train_batch_size, "
                "steps_per_generation and num_generations)"
            )
        key = f"{salt}|{seen[copies[0]]}|{copies[0]}"
        seen[copies[0]] += 1
        tasks.append(Task(seed=int(hashlib.sha1(key.encode()).hexdigest()[:8], 16), options=dict(rows[start])))
    return tasks


def options_of(row: dict[str, Any]) -> dict[str, Any] | None:
    """The reset options of a dataset row: its `options` column as a dict (a JSON object string is decoded)."""
    options = row.get("options")
    if options is None or options == "":
        return None
    if isinstance(options, str):
        try:
            options = json.loads(options)
        except json.JSONDecodeError as exc:
            raise ValueError(f"task options must be a dict or a JSON object string, got {options!r}: {exc}") from None
    if not isinstance(options, dict):
        raise ValueError(f"task options must be a dict, got {type(options).__name__}")
    return options


@dataclass
class TaskArguments:
    """Which tasks a recipe trains and evaluates on: seeds of the folds of the environment (`env_name`,
    `env_kwargs`), see `gigpo_trl.fold_seeds`. The held-out panel is fixed by `eval_fold` and `num_eval_tasks`
    alone, so every run is evaluated on the same tasks whatever its seed, batch sizes or number of processes.
    Parsed by TRL's `TrlParser` beside `GiGPOConfig` and `ModelConfig` (`recipes/train_gigpo.py`, the benches)."""

    num_train_tasks: int = field(default=1000, metadata={"help": "Training tasks: the first N seeds of the train fold."})
    num_eval_tasks: int = field(
        default=0, metadata={"help": "Held-out tasks evaluated before and after training: the first N seeds of "
                             "eval_fold (0: no evaluation)."}
    )
    eval_fold: str = field(default="dev", metadata={"help": "Fold of the held-out tasks: 'dev' or 'test'."})
    evaluate_before_training: bool = field(
        default=True, metadata={"help": "Play the held-out panel before training too, the figure training is measured "
                                "against. False skips it where that figure is known: runs that start from the same "
                                "weights get the same figure from a greedy evaluation of the same panel, so a "
                                "comparison of several runs needs it once."}
    )
    min_optimal_steps: int = field(
        default=0, metadata={"help": "Keep only tasks whose fewest winning steps are at least this many, found by a "
                             "breadth-first search over the admissible actions (gigpo_trl.shortest_paths, cached on "
                             "disk); 0 keeps every task. Needs max_optimal_steps."}
    )
    max_optimal_steps: int = field(
        default=0, metadata={"help": "With min_optimal_steps: the search's depth; tasks not won within it are "
                             "skipped (e.g. max_env_steps)."}
    )

    def __post_init__(self) -> None:
        if self.min_optimal_steps < 0 or self.max_optimal_steps < 0:
            raise ValueError("min_optimal_steps and max_optimal_steps must be >= 0")
        if bool(self.min_optimal_steps) != bool(self.max_optimal_steps):
            raise ValueError("min_optimal_steps and max_optimal_steps go together (the range of the tasks' fewest "
                             f"winning steps), got {self.min_optimal_steps} and {self.max_optimal_steps}")
        if self.min_optimal_steps > self.max_optimal_steps:
            raise ValueError(f"min_optimal_steps={self.min_optimal_steps} exceeds "
                             f"max_optimal_steps={self.max_optimal_steps}")

    def datasets(self, env: str | EnvFactory, env_kwargs: dict[str, Any]) -> tuple[Dataset, Dataset | None]:
        """The training tasks and the held-out panel (None without evaluation) of `make_env(env, **env_kwargs)`."""
        train = task_dataset(self.seeds(env, "train", self.num_train_tasks, env_kwargs))
        if not self.num_eval_tasks:
            return train, None
        return train, task_dataset(self.seeds(env, self.eval_fold, self.num_eval_tasks, env_kwargs))

    def seeds(self, env: str | EnvFactory, fold: str, count: int, env_kwargs: dict[str, Any]) -> list[int]:
        """The first `count` seeds of `fold`, of the tasks in the optimal-steps range when one is set."""
        if not self.min_optimal_steps:
            return fold_seeds(env, fold, count, **env_kwargs)
        return seeds_by_optimal_steps(env, fold, count, self.min_optimal_steps, self.max_optimal_steps, **env_kwargs)
