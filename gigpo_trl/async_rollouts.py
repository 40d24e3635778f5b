"""Rollouts that run ahead of the update (`GiGPOConfig.async_staleness`): a producer thread plays the rollouts of the
next task batches with a snapshot of the policy, while the trainer updates on the rollouts already played.

**Whole task groups, never dropped.** The producer plays the batches the trainer's dataloader will hand it, in the
same order (its own copy of the dataloader, one batch of each generation: the same sampler and seed), each batch a
whole rollout of every copy of its tasks, and hands them over in order. Rollout k (the k-th generation of the run)
may be played with the policy after `version` rollouts were trained only if `version >= k - staleness`
(admission, as AReaL's and SkyRL's gates): the producer waits rather than run further ahead, and nothing it played is
dropped for its age. Its lag, `k - version`, is the rollout's staleness (at most `staleness`). At staleness 0 the
producer plays rollout k once the trainer has trained rollout k - 1 and waits for it: the synchronous run, through the
producer.

**What the update corrects.** The producer records, for every step sample, the log-probs its snapshot gave each
answer token (the behaviour policy's, `Completion.logprobs`). The trainer scores the rows with its current weights
(the proximal policy) when it consumes them, and the loss is decoupled PPO: TRL's clip on the ratio to the proximal
policy, each stale row's tokens weighted by proximal / behaviour, truncated or masked with TRL's importance-sampling
modes and thresholds (`vllm_importance_sampling_mode`, `_clip_min`, `_clip_max`; `gigpo_trl.batch`). A row whose
staleness is 0 was sampled by the proximal policy itself: its weight is 1 and nothing about it changes.

**The snapshot.** A copy of the model the trainer made when the producer started (`policy_snapshot`: TRL's patched
forwards re-pointed at the copy); after each consumed rollout the
trainer publishes its weights (every parameter, or a LoRA model's trainable ones: the adapter), and the producer loads
the newest published weights before each rollout it plays. It generates through the prefix cache, with its own copy
of the tokenizer, and in its own environment pool.

A producer that raises stops the run: the trainer's next `take` raises with the producer's traceback. `close()` stops
the producer at its next turn and closes its environments.
"""

from __future__ import annotations

import copy
import threading
import time
import traceback
import types
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from gigpo_trl.rollout import Rollout


class ProducerStopped(Exception):
    """Raised inside the producer's rollout when it is closed: the rollout is abandoned."""


class ProducerFailed(RuntimeError):
    """The rollout producer raised: the run stops with its traceback."""


@dataclass
class ProducedRollout:
    """A rollout the producer played: its generation `index`, the task `rows` it played (those the trainer's dataloader
    holds at that generation), the rollout (each answer with its behaviour log-probs), the `version` of the weights it
    was played with (the policy after `version` rollouts were trained), and how long the producer played it and how
    long it waited for admission before."""

    index: int
    rows: list[dict[str, Any]]
    rollout: Rollout
    retried_resets: Counter[str]  # the resets its environments tried again, by reason
    version: int
    play_seconds: float
    admission_wait_seconds: float

    @property
    def staleness(self) -> int:
        """The updates between the policy that played it and the one that trains on it."""
        return self.index - self.version


@dataclass
class _Published:
    version: int
    weights: dict[str, torch.Tensor] = field(default_factory=dict)


class RolloutProducer:
    """The producer thread (see the module docstring).

    Args:
        play: plays one batch of task rows with the weights loaded into the snapshot: `play(rows, stopped, stale)`
            returns the rollout and the resets its environments tried again (`stopped()` is True once the producer is
            closed, and a long rollout checks it every turn; `stale`: the snapshot lags the update that will train on
            the rollout, whose answers then need their behaviour log-probs).
        load: loads published weights into the snapshot.
        batches: the task batches, one a generation, from generation `first_index` on.
        staleness: S, how many updates the snapshot may lag the trainer.
        first_index: the generation the first batch is for (a resumed run's).
        version: the version of the weights the snapshot holds now.
        on_close: called once the producer has stopped (its environments closed).
    """

    def __init__(self, play: Callable[[list[dict[str, Any]], Callable[[], bool], bool], tuple[Rollout, Counter[str]]],
                 load: Callable[[dict[str, torch.Tensor]], None], batches: Iterator[list[dict[str, Any]]], *,
                 staleness: int, first_index: int, version: int, on_close: Callable[[], None] = lambda: None) -> None:
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        self._play, self._load, self._batches, self.staleness = play, load, batches, staleness
        self._on_close = on_close
        self._next_index, self._loaded = first_index, version
        self._published = _Published(version)
        self._ready: deque[ProducedRollout] = deque()
        self._condition = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None
        self._error_text = ""
        self._thread = threading.Thread(target=self._run, name="gigpo-rollout-producer", daemon=True)
        self.trainer_wait_seconds = 0.0

    def start(self) -> None:
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        """Rollouts played and not yet taken."""
        with self._condition:
            return len(self._ready)

    def publish(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """New weights for the snapshot: the policy after `version` rollouts were trained (main thread)."""
        with self._condition:
            self._published = _Published(version, weights)
            self._condition.notify_all()

    def take(self, index: int) -> ProducedRollout:
        """Rollout `index`, waiting for it (main thread); `trainer_wait_seconds` holds the wait.

        Raises:
            ProducerFailed: the producer raised (with its traceback), or it was closed.
        """
        started = time.perf_counter()
        with self._condition:
            while not self._ready and self._error is None and not self._closed:
                self._condition.wait()
            self.trainer_wait_seconds = time.perf_counter() - started
            if self._error is not None:
                raise ProducerFailed(f"the rollout producer raised while it played rollout {self._next_index}; its "
                                     f"traceback:\n{self._error_text}") from self._error
            if not self._ready:
                raise ProducerFailed("the rollout producer was closed")
            produced = self._ready.popleft()
            self._condition.notify_all()
        if produced.index != index:
            raise ProducerFailed(f"the rollout producer handed over rollout {produced.index} where the trainer is at "
                                 f"rollout {index}: they went out of step")
        return produced

    def close(self, timeout: float = 60.0) -> None:
        """Stop the producer (at its next turn) and wait for it."""
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._on_close()

    def _stopped(self) -> bool:
        return self._closed

    def _run(self) -> None:
        try:
            for rows in self._batches:
                index = self._next_index
                waited = time.perf_counter()
                with self._condition:  # admission: no further ahead than `staleness` updates
                    while not self._closed and self._published.version < index - self.staleness:
                        self._condition.wait()
                    if self._closed:
                        return
                    published = self._published
                waited = time.perf_counter() - waited
                if published.version != self._loaded:
                    self._load(published.weights)
                    self._loaded = published.version
                started = time.perf_counter()
                rollout, retried = self._play(rows, self._stopped, self._loaded < index)
                produced = ProducedRollout(index, rows, rollout, retried, self._loaded, time.perf_counter() - started,
                                           waited)
                with self._condition:
                    self._ready.append(produced)
                    self._next_index += 1
                    self._condition.notify_all()
        except ProducerStopped:
            return
        except BaseException as exc:  # handed to the trainer, which raises it with this traceback
            with self._condition:
                self._error, self._error_text = exc, "".join(traceback.format_exception(exc))
                self._condition.notify_all()


def generation_batches(loader: Any, every: int, skip: int) -> Iterator[list[dict[str, Any]]]:
    """The batches of a trainer's dataloader that start a generation (one of each `every` consecutive ones, which TRL's
    sampler repeats for the micro-batches of a rollout), epoch after epoch, the first `skip` generations left out.
    The batches are drawn under a fork of torch's global generator (a DataLoader's iterator draws a seed from it at
    an epoch's first batch), so that the run's random numbers (the answers' sampling, TRL's shuffle) are those of the
    synchronous run."""
    generation = 0
    while True:
        batches, position = iter(loader), 0
        while True:
            with torch.random.fork_rng(devices=[]):  # an iterator draws its seed at its first batch
                batch = next(batches, None)
            if batch is None:
                break
            if position % every == 0:
                if generation >= skip:
                    yield batch
                generation += 1
            position += 1


def policy_snapshot(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` that reads only its own weights, in eval mode, without gradients or activation checkpointing.

    `copy.deepcopy` copies modules and tensors but not functions: a forward patched onto an instance keeps the closure
    it was made with, so the copy's forward would still call the original model (TRL's fused LM head keeps the
    original's bound `forward`, its fp32 LM head cast keeps the original `lm_head`). Every such closure is rebuilt with
    the copies of the objects it held (`_rebound`).
    """
    copied: dict[int, Any] = {}
    snapshot = copy.deepcopy(model, copied)
    for module in snapshot.modules():
        if "forward" in module.__dict__:
            module.forward = _rebound(module.__dict__["forward"], copied)
    if getattr(snapshot, "is_gradient_checkpointing", False):  # it would drop the key-value cache generation keeps
        snapshot.gradient_checkpointing_disable()
    return snapshot.eval().requires_grad_(False)


def _rebound(value: Any, copied: dict[int, Any]) -> Any:
    """`value` with every object of the original that `copy.deepcopy` copied (its memo, `copied`) replaced by its copy,
    through bound methods and function closures."""
    if id(value) in copied:
        return copied[id(value)]
    if isinstance(value, types.MethodType):
        return types.MethodType(_rebound(value.__func__, copied), _rebound(value.__self__, copied))
    if isinstance(value, types.FunctionType) and value.__closure__:
        cells = tuple(types.CellType(_rebound(cell.cell_contents, copied)) if _filled(cell) else cell
                      for cell in value.__closure__)
        function = types.FunctionType(value.__code__, value.__globals__, value.__name__, value.__defaults__, cells)
        function.__kwdefaults__, function.__dict__ = value.__kwdefaults__, dict(value.__dict__)
        function.__qualname__, function.__doc__ = value.__qualname__, value.__doc__
        return function
    return value


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a variable the function closes over that was never assigned
        return False
    return True


def trainable_weights(model: torch.nn.Module, trainable_only: bool) -> dict[str, torch.Tensor]:
    """A copy of the model's weights to publish: every parameter, or the trainable ones only (a LoRA adapter)."""
    return {name: parameter.detach().clone() for name, parameter in model.named_parameters()
            if parameter.requires_grad or not trainable_only}


def load_weights(snapshot: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy published weights into the snapshot, by parameter name."""
    parameters = dict(snapshot.named_parameters())
    with torch.no_grad():
        for name, value in weights.items():
            parameters[name].copy_(value)
