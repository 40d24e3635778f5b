"""What the recipe scripts share once their trainer is built: the held-out panel played before and after training,
the model saved, the environments stopped, the report written."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from gigpo_trl.metric_names import (
    PANEL_TASKS, PANEL_UNPLAYED, PANEL_UNPLAYED_TASKS, RETURN_MEAN, SUCCESS_RATE, evaluation_name,
)
from gigpo_trl.records import read_evaluations
from gigpo_trl.report import write_report


@dataclass(frozen=True)
class RunOutcome:
    """Held-out metrics before and after training (None without an eval_dataset), and the report's folder (None on
    processes other than the main one)."""

    before: dict[str, float] | None
    after: dict[str, float] | None
    report: Path | None


class Evaluations(TrainerCallback):
    """Keeps the training step and metrics of every evaluation of a run."""

    def __init__(self) -> None:
        self.made: list[tuple[int, dict[str, float]]] = []

    def on_evaluate(self, args, state, control, metrics: dict[str, float] | None = None, **kwargs) -> None:
        self.made.append((state.global_step, metrics))


def resume_target(resume_from_checkpoint: str | bool | None) -> str | bool | None:
    """`--resume_from_checkpoint` as transformers' `train()` takes it. The command line gives a string, and `train()`
    reads any string as a checkpoint folder ("Can't find a valid checkpoint at true"): "true" resumes from the last
    checkpoint in the output folder, "false" (or nothing) starts afresh, anything else names a checkpoint folder."""
    if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.lower() in ("true", "false", ""):
        return resume_from_checkpoint.lower() == "true" or None
    return resume_from_checkpoint


def train_and_report(trainer: Any, resume_from_checkpoint: str | bool | None = None,
                     panel: str = "Held-out success rate", evaluate_first: bool = True) -> RunOutcome:
    """Evaluate (if the trainer has held-out tasks, and `evaluate_first`), train, evaluate again, save the model, stop
    the environments and write the run report (`gigpo_trl.report`); the main process prints `panel` with the success
    rates before and after (`held_out_line`), and where the report is.

    The first evaluation runs as training starts (`eval_on_start`), on the model as `train()` prepared it (and as a
    checkpoint it resumes from left it): under DeepSpeed, an `evaluate()` before `train()` leaves transformers'
    Trainer an engine without an optimizer, and training then fails at its first backward pass. The evaluation after
    training is the periodic one of the last step where the run made one there (`eval_steps` dividing `max_steps`):
    the same weights, the same panel, not played twice. A run that resumes from a checkpoint does not play the panel
    before training again (it would be the checkpoint's, recorded as a second evaluation of that step): its figure
    before training is the one its records hold for step 0."""
    held_out = trainer.eval_dataset is not None
    checkpoint = resume_target(resume_from_checkpoint)
    resuming = checkpoint not in (None, False)
    # a resumed run played its panel before training when it first started: its record says what it showed
    play_first = held_out and evaluate_first and not resuming
    evaluations = Evaluations()
    if held_out:
        trainer.args.eval_on_start = play_first
        trainer.add_callback(evaluations)
    trainer.train(resume_from_checkpoint=checkpoint)
    if play_first:
        before = evaluations.made[0][1] if evaluations.made else None
    else:
        before = recorded_evaluation(trainer.args.output_dir, step=0) if held_out and evaluate_first else None
    after = None
    if held_out:
        last_step, last = evaluations.made[-1] if evaluations.made else (None, None)
        training_made_it = last_step == trainer.state.global_step and len(evaluations.made) > int(play_first)
        after = last if training_made_it else trainer.evaluate()
    trainer.save_model(trainer.args.output_dir)
    trainer.close_environments()
    if not trainer.accelerator.is_main_process:
        return RunOutcome(before, after, None)
    report = write_report(trainer.args.output_dir)
    if held_out:
        print(held_out_line(panel, before, after, not_played_because="evaluate_before_training false" if not resuming
                            else "resumed, and the run's records hold no evaluation of its panel at step 0"))
    print(f"Report: {report / 'index.html'}")
    return RunOutcome(before, after, report)


def recorded_evaluation(output_dir: str | Path, step: int) -> dict[str, float | str] | None:
    """The metrics of the run's recorded evaluation of its own held-out panel at training step `step`, named as
    `evaluate()` returned them (the run's first one, if it played its panel more than once there); None without one."""
    for record in read_evaluations(output_dir):
        if record["step"] == step and record.get("panel") is None:
            metrics: dict[str, float | str] = {evaluation_name(name): value for name, value in record["metrics"].items()}
            if record.get("unplayed"):
                metrics[evaluation_name(PANEL_UNPLAYED_TASKS)] = "; ".join(record["unplayed"])
            return metrics
    return None


def held_out_line(panel: str, before: dict[str, Any] | None, after: dict[str, Any],
                  not_played_because: str = "evaluate_before_training false") -> str:
    """`panel` with the held-out success rates before and after training (the mean returns where the environment does
    not say whether a task is won), each over the tasks its evaluation played: where one could not play every task,
    how many it played and which it could not follow, e.g. "19.0% before training (63 of 64 tasks played; 1 could not
    be: seed 1000023) -> 26.6% after". `before` is None where the panel was not played before training, which the line
    says with `not_played_because`."""
    success = evaluation_name(SUCCESS_RATE) in (before or {}) or evaluation_name(SUCCESS_RATE) in after
    name = evaluation_name(SUCCESS_RATE) if success else evaluation_name(RETURN_MEAN)

    def figure(metrics: dict[str, Any] | None, when: str) -> str:
        if metrics is None:
            return f"not played {when} ({not_played_because})"
        text = (f"{metrics[name]:.1%}" if success else f"{metrics[name]:.4g}") if name in metrics else "nothing played"
        text += f" {when}"
        unplayed = int(metrics.get(evaluation_name(PANEL_UNPLAYED), 0))
        if unplayed:
            tasks = int(metrics[evaluation_name(PANEL_TASKS)])
            text += (f" ({tasks - unplayed} of {tasks} tasks played; {unplayed} could not be: "
                     f"{metrics[evaluation_name(PANEL_UNPLAYED_TASKS)]})")
        return text

    prefix = f"{panel}: " if success else f"{panel}: success not reported by the environment (no `won`); mean return "
    return f"{prefix}{figure(before, 'before training')} -> {figure(after, 'after')}"
