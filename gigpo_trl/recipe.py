"""What the recipe scripts share once their trainer is built: the held-out panel played before and after training,
the model saved, the environments stopped, the report written."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from gigpo_trl.report import write_report


@dataclass(frozen=True)
class RunOutcome:
    """Held-out metrics before and after training (None without an eval_dataset), and the report's folder (None on
    processes other than the main one)."""

    before: dict[str, float] | None
    after: dict[str, float] | None
    report: Path | None


class FirstEvaluation(TrainerCallback):
    """Keeps the metrics of a training run's first evaluation."""

    def __init__(self) -> None:
        self.metrics: dict[str, float] | None = None

    def on_evaluate(self, args, state, control, metrics: dict[str, float] | None = None, **kwargs) -> None:
        if self.metrics is None:
            self.metrics = metrics


def train_and_report(trainer: Any, resume_from_checkpoint: str | bool | None = None,
                     panel: str = "Held-out success rate") -> RunOutcome:
    """Evaluate (if the trainer has held-out tasks), train, evaluate again, save the model, stop the environments and
    write the run report (`gigpo_trl.report`); the main process prints `panel` with the success rates before and
    after (the mean returns where the environment does not say whether a task is won), and where the report is.

    The first evaluation runs as training starts (`eval_on_start`), on the model as `train()` prepared it (and as a
    checkpoint it resumes from left it): under DeepSpeed, an `evaluate()` before `train()` leaves transformers'
    Trainer an engine without an optimizer, and training then fails at its first backward pass."""
    held_out = trainer.eval_dataset is not None
    first = FirstEvaluation()
    if held_out:
        trainer.args.eval_on_start = True
        trainer.add_callback(first)
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    before = first.metrics
    after = trainer.evaluate() if held_out else None
    trainer.save_model(trainer.args.output_dir)
    trainer.close_environments()
    if not trainer.accelerator.is_main_process:
        return RunOutcome(before, after, None)
    report = write_report(trainer.args.output_dir)
    if held_out and "eval_env/success_rate" in before:
        print(f"{panel}: {before['eval_env/success_rate']:.1%} before training -> {after['eval_env/success_rate']:.1%} after")
    elif held_out:
        print(f"{panel}: success not reported by the environment (no `won`); mean return {before['eval_env/return_mean']:.4g} "
              f"before training -> {after['eval_env/return_mean']:.4g} after")
    print(f"Report: {report / 'index.html'}")
    return RunOutcome(before, after, report)
