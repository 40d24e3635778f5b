"""Evaluation without training (`recipes/evaluate.py`): a trained checkpoint (a full model folder or a PEFT adapter
folder, played on its base model), a Hub model or the embedded model plays one or more panels of held-out tasks,
greedily and/or with k sampled copies of each task, through `GiGPOTrainer.evaluate`, the very evaluation a training
run makes periodically: the same rollout, metrics (`gigpo_trl.metrics.panel_metrics`) and records. What this module
adds is what a command needs around it: the panels by fold and task type (by default the training run's own held-out
panel), the model from a folder, each panel's episodes and a report written to a folder of the evaluation's own
(`evaluation_dir`: never among a training run's records).

    OUTPUT_DIR/episodes.jsonl     one JSON object per episode played: {"panel", "decoding", "task", "copy",
                                  "task_type", "won", "return", "length", "unplayed", "metrics"}
    OUTPUT_DIR/evaluation.json    {"model": str, "evaluations": [the record of each (panel, decoding) played, as in
                                  gigpo/evaluations.jsonl, with the pass@k asked for]}
    OUTPUT_DIR/gigpo/             the trainer's records of every rollout (`gigpo_trl.records`)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gigpo_trl.envs import FOLDS, INFO_TASK_TYPE, make_env
from gigpo_trl.metric_names import PASS_AT_PREFIX, RETURN_MEAN, SUCCESS_RATE
from gigpo_trl.metrics import PanelEpisode, panel_metrics
from gigpo_trl.models import EMBEDDED_MODEL, resolve_model
from gigpo_trl.records import holds_training_records
from gigpo_trl.tasks import TaskArguments, task_dataset

if TYPE_CHECKING:
    from datasets import Dataset

DECODINGS = ("greedy", "sampled")
# Tasks of a panel where neither the command nor the config says (`num_eval_tasks`).
DEFAULT_PANEL_TASKS = 16
EVALUATION_DIR = "evaluation"
EPISODES_FILE = "episodes.jsonl"
REPORT_FILE = "evaluation.json"


@dataclass
class EvaluationArguments:
    """What `recipes/evaluate.py` plays, parsed by TRL's `TrlParser` beside the training config's `TaskArguments` (its
    held-out panel, the default here), `GiGPOConfig` (whose environment settings, `env_name`, `env_kwargs`,
    `max_env_steps`, the prompt, should be those the model was trained with) and TRL's `ModelConfig`
    (`model_name_or_path`: the model evaluated, see `load_model`)."""

    panels: list[str] | None = field(
        default=None,
        metadata={"help": "The panels to play, each a fold ('train', 'dev', 'test'), optionally with task types "
                  "after a colon: 'dev:corridor-4,corridor-6' keeps the tasks, among the first num_tasks of the dev "
                  "fold, whose environment reports one of those types (info['task_type'] on reset). Default: the "
                  "config's eval_fold, the training run's held-out panel."},
    )
    num_tasks: int | None = field(
        default=None, metadata={"help": "Tasks of each panel: the first N seeds of its fold (of the tasks in the "
                                "config's optimal-steps range, where it sets one). Default: the config's "
                                f"num_eval_tasks, the training run's held-out panel, else {DEFAULT_PANEL_TASKS}."})
    greedy: bool = field(default=True, metadata={"help": "Play each panel once per task with greedy decoding."})
    samples: int = field(
        default=0,
        metadata={"help": "Play each panel with this many sampled copies of each task (at the config's temperature), "
                  "for the success rate of a sample and pass@k (0: none)."},
    )
    pass_at: list[int] | None = field(
        default=None,
        metadata={"help": "The k of pass@k, each at most samples: the chance that one of k sampled copies wins, "
                  "estimated without bias from the samples (1 - C(n-c, k) / C(n, k) for c wins of n). None: 1, 2, 4, "
                  "... up to samples, and samples."},
    )

    def __post_init__(self) -> None:
        for panel in self.panels or []:
            Panel.parse(panel)
        if self.num_tasks is not None and self.num_tasks < 1:
            raise ValueError(f"num_tasks must be >= 1, got {self.num_tasks}")
        if self.samples < 0 or self.samples == 1:
            raise ValueError(f"samples must be 0 (no sampled evaluation) or >= 2 copies of each task, got "
                             f"{self.samples} (one sample of a task is the greedy evaluation's job, or a pass@1 of "
                             "no use)")
        if not self.greedy and not self.samples:
            raise ValueError("nothing to play: greedy is false and samples is 0")
        for k in self.pass_at or []:
            if not 1 <= k <= self.samples:
                raise ValueError(f"pass_at {k} needs 1 <= k <= samples = {self.samples}: pass@k is estimated from the "
                                 "samples of each task, and k of them cannot be drawn from fewer")

    @property
    def decodings(self) -> list[str]:
        return [decoding for decoding, played in zip(DECODINGS, (self.greedy, self.samples > 0)) if played]


@dataclass(frozen=True)
class Panel:
    """A panel: the first tasks of a fold, of some task types only where `task_types` is not empty."""

    fold: str
    task_types: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> Panel:
        """'dev' or 'dev:type1,type2'."""
        fold, _, types = text.partition(":")
        if fold not in FOLDS:
            raise ValueError(f"panel {text!r}: unknown fold {fold!r}, the folds are {', '.join(FOLDS)}")
        task_types = tuple(t for t in types.split(",") if t)
        if ":" in text and not task_types:
            raise ValueError(f"panel {text!r}: no task type after the colon")
        return cls(fold, task_types)

    @property
    def name(self) -> str:
        return self.fold + (":" + ",".join(self.task_types) if self.task_types else "")

    def dataset(self, env: Any, env_kwargs: dict[str, Any], num_tasks: int, task_args: TaskArguments | None = None
                ) -> Dataset:
        """Its tasks: the first `num_tasks` seeds of its fold (as `task_args` draws a training run's held-out panel,
        in its optimal-steps range where it sets one), those whose reset reports one of its task types."""
        seeds = (task_args or TaskArguments()).seeds(env, self.fold, num_tasks, env_kwargs)
        if self.task_types:
            types = task_types(env, env_kwargs, seeds)
            seeds = [seed for seed in seeds if types[seed] in self.task_types]
            if not seeds:
                raise ValueError(f"panel {self.name!r}: none of the first {num_tasks} tasks of the {self.fold} fold is "
                                 f"of type {' or '.join(self.task_types)}; their types: {sorted(set(map(str, types.values())))}")
        return task_dataset(seeds)


def panel_datasets(arguments: EvaluationArguments, task_args: TaskArguments, env: Any,
                   env_kwargs: dict[str, Any]) -> dict[str, Dataset]:
    """The panels to play, by name: those `arguments` name, else the training run's held-out panel (`task_args`'
    `eval_fold`), each of `arguments.num_tasks` tasks, else of the run's `num_eval_tasks`, else `DEFAULT_PANEL_TASKS`,
    drawn as the run draws its panel."""
    num_tasks = arguments.num_tasks or task_args.num_eval_tasks or DEFAULT_PANEL_TASKS
    return {text: Panel.parse(text).dataset(env, env_kwargs, num_tasks, task_args)
            for text in arguments.panels or [task_args.eval_fold]}


def evaluation_dir(model: str, output_dir: str, output_dir_given: bool) -> Path:
    """Where an evaluation writes its episodes, report and records: `output_dir` where the command line gave it;
    otherwise a folder of its own, never the config's `output_dir` (a training run's, whose records it would set
    aside): `<model folder>/evaluation` for a saved model, `<output_dir>/evaluation-<model name>` for a Hub model or
    the embedded one.

    Raises:
        ValueError: the folder holds a training run's records.
    """
    if output_dir_given:
        folder = Path(output_dir)
    elif Path(model).is_dir():
        folder = Path(model) / EVALUATION_DIR
    else:
        folder = Path(output_dir) / f"{EVALUATION_DIR}-{model.replace(':', '/').rsplit('/', 1)[-1]}"
    if holds_training_records(folder):
        raise ValueError(f"{folder} holds the records of a training run, which an evaluation would set aside: give "
                         "the evaluation a folder of its own (--output_dir)")
    return folder


def task_types(env: Any, env_kwargs: dict[str, Any], seeds: list[int]) -> dict[int, str | None]:
    """The task type (info['task_type'] on reset) of each seed, from one environment reset for each."""
    instance = make_env(env, **env_kwargs)
    try:
        return {seed: instance.reset(seed=seed)[1].get(INFO_TASK_TYPE) for seed in seeds}
    finally:
        instance.close()


def load_model(model: str, dtype: Any = None) -> tuple[Any, Any]:
    """The model to evaluate and its tokenizer (None: the trainer loads the model's own): a folder of a full model as
    it is; a PEFT adapter folder (adapter_config.json) merged into the base model it names, with the folder's
    tokenizer; the embedded model or a Hub id ("name" or "owner/name") by name. Raises FileNotFoundError for a path
    that does not exist (one that starts with '.', '/' or '~', or has more than two parts), and ValueError for a folder
    that holds neither a model nor an adapter."""
    if model == EMBEDDED_MODEL:
        return resolve_model(model), None
    folder = Path(model)
    if not folder.exists():
        if model.startswith((".", "/", "~")) or model.count("/") > 1:
            raise FileNotFoundError(f"model {model!r}: no such folder")
        return model, None  # a Hub id, "name" or "owner/name"
    if (folder / "adapter_config.json").exists():
        from peft import PeftModel  # noqa: PLC0415 (only for an adapter)
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

        base_name = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
        base = AutoModelForCausalLM.from_pretrained(resolve_model(base_name), dtype=dtype)
        tokenizer_folder = folder if (folder / "tokenizer_config.json").exists() else resolve_model(base_name)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder, padding_side="left", truncation_side="left")
        return PeftModel.from_pretrained(base, folder).merge_and_unload(), tokenizer
    if not (folder / "config.json").exists():
        raise ValueError(f"model {model!r}: the folder holds neither a model (config.json) nor a PEFT adapter "
                         f"(adapter_config.json); a training run saves its checkpoints as output_dir/checkpoint-<step>")
    return str(folder), None


def evaluate_panels(trainer: Any, panels: dict[str, Dataset], arguments: EvaluationArguments,
                    model: str) -> list[dict[str, Any]]:
    """Play each panel with each decoding of `arguments` through `trainer.evaluate` (greedy: one copy of each task;
    sampled: `arguments.samples` copies), the evaluation a training run makes; returns the record of each (panel,
    decoding), with pass@k for `arguments.pass_at`, and writes the episodes and the report to the trainer's
    `output_dir` (main process), the report naming `model`."""
    args = trainer.args
    tasks_per_batch = max(1, args.per_device_eval_batch_size // trainer.num_generations_eval)
    records, episode_rows = [], []
    for name, dataset in panels.items():
        for decoding in arguments.decodings:
            copies = 1 if decoding == "greedy" else arguments.samples
            trainer.num_generations_eval, args.eval_greedy = copies, decoding == "greedy"
            args.per_device_eval_batch_size = copies * tasks_per_batch
            trainer.evaluate(dataset, metric_key_prefix=f"eval_{name}")
            record, episodes = trainer.last_evaluation, trainer.last_evaluation_episodes
            if arguments.pass_at and copies > 1:
                record["metrics"] = panel_metrics(episodes, arguments.pass_at)
            records.append({**record, "first_seed": dataset["seed"][0]})
            episode_rows += [{"panel": name, "decoding": decoding, **episode_row(e)} for e in episodes]
    if trainer.accelerator.is_main_process:
        output_dir = Path(args.output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / EPISODES_FILE).write_text("".join(json.dumps(row) + "\n" for row in episode_rows))
        (output_dir / REPORT_FILE).write_text(json.dumps({"model": model, "evaluations": records}, indent=1))
    return records


def episode_row(episode: PanelEpisode) -> dict[str, Any]:
    """An episode's line of episodes.jsonl."""
    row = asdict(episode)
    row["return"] = row.pop("episode_return")
    row.pop("loops")
    return row


def summary(records: list[dict[str, Any]]) -> str:
    """The lines the command prints: for each (panel, decoding) played, the panel (its fold and task types, its tasks
    and their first seed: two figures compare where these are equal), its success rate (or mean return where the
    environment does not say whether a task is won), pass@k and unplayed tasks."""
    lines = []
    for record in records:
        metrics = record["metrics"]
        figure = (f"success {metrics[SUCCESS_RATE]:.1%}" if SUCCESS_RATE in metrics
                  else f"mean return {metrics.get(RETURN_MEAN, float('nan')):.4g}")
        passes = [f"{name.removeprefix('env/')} {value:.1%}" for name, value in metrics.items()
                  if name.startswith(PASS_AT_PREFIX) and name.count("/") == 1]
        line = (f"{record['panel']} ({len(record['tasks'])} tasks from seed {record['first_seed']}, "
                f"{record['decoding']} x {record['copies']}): " + ", ".join([figure, *passes]))
        if record["unplayed"]:
            line += f"; not played: {', '.join(record['unplayed'])}"
        lines.append(line)
    return "\n".join(lines)
