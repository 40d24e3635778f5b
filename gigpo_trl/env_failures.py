"""Environment failures over a run: one report a rollout, and the rule that stops a run that cannot play.

A rollout's failures (`RolloutFailures.of`, on each process): the trajectories that ended because their environment
raised, crashed, hung or could not start (`Episode.env_error`), and the resets that failed and were tried again
(`EnvPool.take_retried_resets`). The processes' are merged into one report (`merge`), said once a rollout (`message`)
and written into the rollout's record (`record`) with every failed trajectory's reason.

A run that cannot play stops: when every trajectory of `limit` training rollouts in a row failed by its environment
(`FailureStreak`), the trainer saves a checkpoint and raises `EnvironmentUnavailableError`, which names the
environment, the reasons, and how to resume.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gigpo_trl.metric_names import ENV_ERROR_SHARE
from gigpo_trl.rollout import Episode


class EnvironmentUnavailableError(RuntimeError):
    """Every trajectory of several training rollouts in a row failed by its environment: the run stopped, its state
    saved in a checkpoint to resume from."""


@dataclass
class RolloutFailures:
    """The environment failures of a rollout (of one process, or merged over all of them).

    Attributes:
        trajectories: the trajectories played.
        failed: why trajectories failed -> the trajectories that failed so ("#3" on one process, "process 1 #3" on
            several), in rollout order.
        retried_resets: why resets failed and were tried again -> how many times (the copies then started).
    """

    trajectories: int = 0
    failed: dict[str, list[str]] = field(default_factory=dict)
    retried_resets: Counter[str] = field(default_factory=Counter)

    @classmethod
    def of(cls, episodes: Sequence[Episode], retried_resets: Mapping[str, int], process: int | None = None
           ) -> RolloutFailures:
        """The failures of one process's rollout; `process` (None on one process) prefixes its trajectories' names."""
        failed: dict[str, list[str]] = {}
        for episode in episodes:
            if episode.env_error is not None:
                name = f"#{episode.trajectory}" if process is None else f"process {process} #{episode.trajectory}"
                failed.setdefault(episode.env_error, []).append(name)
        return cls(len(episodes), failed, Counter(retried_resets))

    @property
    def num_failed(self) -> int:
        return sum(len(names) for names in self.failed.values())

    @property
    def all_failed(self) -> bool:
        """Every trajectory played failed by its environment (none played: False)."""
        return self.trajectories > 0 and self.num_failed == self.trajectories

    def __bool__(self) -> bool:
        return bool(self.failed or self.retried_resets)

    def message(self, env_name: str, what: str) -> str:
        """The report of the failures of `what` ("the training rollout of step 3"), said once."""
        parts = []
        if self.failed:
            first = next(iter(self.failed.values()))[0]
            reasons = "; ".join(f"{len(names)} x {reason}" for reason, names in self.failed.items())
            parts.append(f"{self.num_failed} of the {self.trajectories} trajectories of {what} failed and ended there "
                         f"(the first: {first}): {reasons}")
        if self.retried_resets:
            resets = "; ".join(f"{count} x {reason}" for reason, count in self.retried_resets.items())
            parts.append(f"{sum(self.retried_resets.values())} reset(s) of {what} failed and were tried again: {resets}")
        return (f"environment {env_name!r}: " + ". ".join(parts) + f" (logged as {ENV_ERROR_SHARE}; each failed "
                "trajectory's reason is in the rollout's record, OUTPUT_DIR/gigpo/iterations.jsonl)")

    def record(self) -> dict[str, Any]:
        """What the rollout's record holds of them: every failed trajectory under its reason."""
        return {"trajectories": self.trajectories, "failed": self.num_failed,
                "reasons": [{"reason": reason, "trajectories": names} for reason, names in self.failed.items()],
                "retried_resets": [{"reason": reason, "count": count} for reason, count in self.retried_resets.items()]}


def merge(parts: Sequence[RolloutFailures]) -> RolloutFailures:
    """The failures of a rollout over all processes (each process's part, in process order)."""
    merged = RolloutFailures()
    for part in parts:
        merged.trajectories += part.trajectories
        for reason, names in part.failed.items():
            merged.failed.setdefault(reason, []).extend(names)
        merged.retried_resets.update(part.retried_resets)
    return merged


@dataclass
class FailureStreak:
    """The training rollouts in a row in which every trajectory failed by its environment.

    Args:
        limit: the streak at which the run stops (0: never).
    """

    limit: int
    steps: list[int] = field(default_factory=list)  # the training steps of the streak's rollouts
    reasons: Counter[str] = field(default_factory=Counter)

    def add(self, step: int, failures: RolloutFailures) -> bool:
        """Count a training rollout; True when the run must stop (the streak reached the limit)."""
        if not failures.all_failed:
            self.steps, self.reasons = [], Counter()
            return False
        self.steps.append(step)
        self.reasons.update({reason: len(names) for reason, names in failures.failed.items()})
        return self.limit > 0 and len(self.steps) >= self.limit

    def stop_message(self, env_name: str, checkpoint: str) -> str:
        """What the run says as it stops."""
        steps = f"steps {self.steps[0]}-{self.steps[-1]}" if len(self.steps) > 1 else f"step {self.steps[0]}"
        reasons = "; ".join(f"{count} x {reason}" for reason, count in self.reasons.most_common())
        return (f"environment {env_name!r} failed every trajectory of {len(self.steps)} training rollout(s) in a row "
                f"(those of {steps}; stop_after_failed_rollouts={self.limit}): {reasons}. The run stopped: it cannot "
                f"play. Its state is saved in {checkpoint} (the updates of those rollouts trained on nothing and did not "
                "step the optimizer). Once the environment (or the service it calls) works again, resume with "
                f"resume_from_checkpoint={checkpoint!r} (recipes: --resume_from_checkpoint {checkpoint}).")
