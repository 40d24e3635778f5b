"""`EnvPool`: G tasks x N identically-seeded copies, stepped in parallel, isolated from each other.

Every environment lives in its own worker process. A step that raises, crashes the process
(segfault, `os._exit`) or does not answer within `step_timeout` ends only that environment's
trajectory: its output is marked truncated with the reason in `info["env_error"]`, its worker is
replaced by a fresh one (a new environment is created at the next reset), and the rest of the
batch goes on. A reset that fails is tried again on the fresh environment, up to `reset_attempts`
times in all, before the episode's first turn (so no generation call is added); a copy that still
cannot start comes back truncated with the reason. With `processes=False` environments run in this
process instead: exceptions are still caught, but a crash or a hang is not survivable (use it for
pure-Python environments).

Workers are forked by a `ForkServer` (the trainer's, or the pool's own), not by this process, whose threads may hold
locks that a child forked from it would wait on forever; the server is forked from this process while it runs one
thread, else started as a fresh interpreter (`gigpo_trl.fork_server`). Every worker reports that it started; one that
does not within `start_timeout` is killed, counted (`num_start_failures`) and forked again.

An environment that waits out an outage of a service it calls (`gigpo_trl.services.wait_out`) tells the pool so from
its worker: the step is then given the time of the wait instead of being taken for a hang, and the pool says once per
batch of requests what its environments wait for, and how the wait ended.

Failures are warned one by one (`EnvironmentFailureWarning`), or, with `warn_each_failure=False` (the trainer's pools),
left to the caller to report once a rollout: the trajectories' reasons are in their outputs, and the resets that
failed and were tried again are counted in `retried_resets` (`take_retried_resets`).
"""

from __future__ import annotations

import functools
import gc
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import time
import warnings
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from gigpo_trl.envs import ANCHOR_KINDS, INFO_ANCHOR_KIND, EnvOutput, TextEnv
from gigpo_trl.fork_server import ForkServer, release_inherited_sockets, threads_at_fork
from gigpo_trl.metric_names import ENV_ERROR_SHARE
from gigpo_trl.observations import split_observation
from gigpo_trl.services import ServiceWait, logger, waits_reported_to
from gigpo_trl.tasks import Task

INFO_ENV_ERROR = "env_error"
START_ATTEMPTS = 3  # times a worker that did not report its start is forked again before its requests fail
ENDS_HERE = f"its trajectory ends here (the run goes on; logged as {ENV_ERROR_SHARE})"


class GroupStartMismatchWarning(UserWarning):
    """The N copies of a task did not start in the same state: GiGPO's step groups degrade."""


class EnvironmentFailureWarning(UserWarning):
    """An environment raised, crashed or hung: its trajectory ended there (the run goes on); says why."""


class EnvPool:
    """G x N environments; copies `g * N ... g * N + N - 1` play task g.

    Args:
        env_fn: zero-argument callable creating one environment (e.g. `gigpo_trl.envs.env_factory(...)`).
            With process isolation it runs in the worker, so it can create unpicklable environments.
        num_groups: G, the number of tasks per batch.
        group_size: N, the number of copies of each task.
        step_timeout: seconds a step may take before its environment is declared hung.
        reset_timeout: seconds a reset may take (first resets may generate games on disk).
        reset_attempts: times a copy's reset is tried, each on a fresh environment, before the copy counts as
            unable to start (an engine that fails under load, a port taken): at most `reset_attempts *
            reset_timeout` seconds for a reset that hangs every time.
        processes: one worker process per environment (True) or everything in this process (False).
        start_method: multiprocessing start method; default "fork" where available (fast, and works
            with environments defined in a notebook), else "spawn". With "fork" the workers are forked by
            `fork_server`, or by a fork server of the pool's own, started with the pool.
        start_timeout: seconds a new worker may take to report that it started before it is killed and forked
            again (`START_ATTEMPTS` times in all).
        fork_server: the fork server of the pool's owner (`GiGPOTrainer` starts one before any thread of its own);
            the pool does not close it. Without one the pool starts its own (`ForkServer`'s "auto" start method).
        name: the environment's name, used in warnings.
        warn_each_failure: warn of every failure as it happens (True), or leave the report to the caller (the reasons
            are in the outputs; resets tried again are counted in `retried_resets`).
    """

    def __init__(
        self,
        env_fn: Callable[[], TextEnv],
        num_groups: int,
        group_size: int,
        *,
        step_timeout: float = 30.0,
        reset_timeout: float = 600.0,
        reset_attempts: int = 3,
        processes: bool = True,
        start_method: str | None = None,
        start_timeout: float = 20.0,
        fork_server: ForkServer | None = None,
        name: str | None = None,
        warn_each_failure: bool = True,
    ):
        if num_groups < 1 or group_size < 1:
            raise ValueError(f"num_groups and group_size must be >= 1, got {num_groups} and {group_size}")
        if step_timeout <= 0 or reset_timeout <= 0 or start_timeout <= 0:
            raise ValueError(f"timeouts must be > 0, got step_timeout={step_timeout}, reset_timeout={reset_timeout}, "
                             f"start_timeout={start_timeout}")
        if reset_attempts < 1:
            raise ValueError(f"reset_attempts must be >= 1, got {reset_attempts}")
        self.env_fn = env_fn
        self.num_groups, self.group_size = num_groups, group_size
        self.step_timeout, self.reset_timeout, self.reset_attempts = step_timeout, reset_timeout, reset_attempts
        self.start_timeout = start_timeout
        self.processes = processes
        self.name = name or getattr(env_fn, "__name__", repr(env_fn))
        self.num_restarts = self.num_start_failures = 0
        self.warn_each_failure = warn_each_failure
        self.retried_resets: Counter[str] = Counter()  # reason -> resets that failed and were tried again
        self._last_observations: list[tuple[str, tuple[Any, ...]]] = [("", ())] * self.num_envs
        if processes:
            method = start_method or ("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
            self._context = multiprocessing.get_context(method)
            self._own_fork_server = method == "fork" and fork_server is None
            self._fork_server = (ForkServer(start_timeout) if self._own_fork_server else fork_server) if method == "fork" else None
            self._workers = [self._new_worker() for _ in range(self.num_envs)]
            self._check_started(range(self.num_envs))
        else:
            self._inline_envs: list[TextEnv | None] = [None] * self.num_envs

    @property
    def num_envs(self) -> int:
        return self.num_groups * self.group_size

    def group_of(self, env_id: int) -> int:
        return env_id // self.group_size

    def take_retried_resets(self) -> Counter[str]:
        """The resets that failed and were tried again since the last call, by reason; the count starts afresh."""
        retried, self.retried_resets = self.retried_resets, Counter()
        return retried

    def reset(self, tasks: Sequence[Task]) -> list[EnvOutput]:
        """Reset all G x N environments, N copies per task; returns one output per environment.

        A copy whose reset fails is reset again on a fresh environment, up to `reset_attempts` times in
        all; one that fails every time comes back truncated with `info["env_error"]`. If the copies of a
        task do not start in the same state, a `GroupStartMismatchWarning` names the environment.
        """
        if len(tasks) != self.num_groups:
            raise ValueError(f"reset needs one task per group: got {len(tasks)} tasks for {self.num_groups} groups")
        # The first copy of every task first: work an environment does once per task (generating and
        # caching a game) then happens once, not N times at the same moment.
        first_copies = range(0, self.num_envs, self.group_size)
        outputs = self._reset(first_copies, tasks)
        outputs |= self._reset([i for i in range(self.num_envs) if i % self.group_size], tasks)
        self._check_group_starts(tasks, outputs)
        return [outputs[i] for i in range(self.num_envs)]

    def step(self, actions: Mapping[int, str]) -> dict[int, EnvOutput]:
        """Step the environments named by `actions` (env id -> action text) in parallel."""
        unknown = [i for i in actions if not 0 <= i < self.num_envs]
        if unknown:
            raise ValueError(f"unknown environment ids {unknown}; the pool has ids 0..{self.num_envs - 1}")
        return self._run({i: ("step", action) for i, action in actions.items()}, self.step_timeout)

    def close(self) -> None:
        if self.processes:
            for worker in self._workers:
                worker.close()
            if self._own_fork_server and self._fork_server is not None:
                self._fork_server.close()
        else:
            for env in self._inline_envs:
                if env is not None:
                    env.close()

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------------------

    def _reset(self, env_ids: Sequence[int], tasks: Sequence[Task]) -> dict[int, EnvOutput]:
        """Reset these environments to their tasks, each failed one again (on the fresh environment that replaced
        it) until it starts or has failed `reset_attempts` times."""
        outputs, pending = {}, list(env_ids)
        for attempt in range(1, self.reset_attempts + 1):
            retried = f"its reset is tried again (attempt {attempt + 1} of {self.reset_attempts})"
            then = ENDS_HERE if attempt == self.reset_attempts else retried
            outputs |= self._run({i: ("reset", tasks[self.group_of(i)]) for i in pending}, self.reset_timeout, then,
                                 stacklevel=4)
            pending = [i for i in pending if INFO_ENV_ERROR in outputs[i].info]
            if not pending:
                break
            if attempt < self.reset_attempts:
                self.retried_resets.update(outputs[i].info[INFO_ENV_ERROR] for i in pending)
        if self.reset_attempts > 1:
            for i in pending:
                outputs[i].info[INFO_ENV_ERROR] += f" (the reset failed all {self.reset_attempts} attempts)"
        return outputs

    def _run(self, requests: dict[int, tuple[str, Any]], timeout: float, then: str = ENDS_HERE,
             stacklevel: int = 3) -> dict[int, EnvOutput]:
        """Send the requests, wait for the replies; a failure comes back truncated with the reason, and is warned about
        (at the pool's caller, `stacklevel`) with `then`, what happens next."""
        replies = self._run_in_processes(requests, timeout) if self.processes else self._run_inline(requests)
        outputs = {}
        for i, (status, payload) in replies.items():
            if status == "ok":
                outputs[i] = payload
                self._last_observations[i] = payload.observation, payload.images
            else:
                text, images = self._last_observations[i]
                outputs[i] = EnvOutput(text, truncated=True, info={INFO_ENV_ERROR: payload}, images=images)
                if self.warn_each_failure:
                    warnings.warn(f"environment {self.name!r} #{i} failed and {then}: {payload}",
                                  EnvironmentFailureWarning, stacklevel=stacklevel)
        return outputs

    def _run_inline(self, requests: dict[int, tuple[str, Any]]) -> dict[int, tuple[str, Any]]:
        replies, waits = {}, _Waits(self.name)
        for i, (command, argument) in requests.items():
            try:
                with waits_reported_to(functools.partial(waits.heard, i)):
                    if self._inline_envs[i] is None:
                        self._inline_envs[i] = self.env_fn()
                    replies[i] = ("ok", _execute(self._inline_envs[i], command, argument))
            except Exception as exc:  # an environment's failure ends only its own trajectory
                replies[i] = ("error", _describe(exc))
                self._inline_envs[i] = None
                self.num_restarts += 1
        waits.ended(replies)
        return replies

    def _run_in_processes(self, requests: dict[int, tuple[str, Any]], timeout: float) -> dict[int, tuple[str, Any]]:
        """Each environment's reply within `timeout` seconds, or within the time of the service waits it reports."""
        replies, pending, waits = {}, {}, _Waits(self.name)
        for i, request in requests.items():
            if self._workers[i].send(request):
                pending[self._workers[i].connection] = i
            else:
                replies[i] = ("error", self._replace_worker(i, "worker process was dead before the request", died=True))
        now = time.monotonic()
        deadlines = {i: now + timeout for i in pending.values()}
        while pending:
            remaining = min(deadlines[i] for i in pending.values()) - time.monotonic()
            for connection in multiprocessing.connection.wait(list(pending), timeout=max(remaining, 0)):
                i = pending[connection]
                reply = self._workers[i].receive()
                if reply is not None and reply[0] == "waiting":  # a service outage, waited out: not a hang
                    waits.heard(i, reply[1])
                    wait = reply[1]
                    deadlines[i] = max(deadlines[i], time.monotonic() + wait.seconds_left + wait.call_timeout + timeout)
                    continue
                del pending[connection]
                if reply is None:
                    replies[i] = ("error", self._replace_worker(i, "worker process died", died=True))
                elif reply[0] == "error":  # the environment may be in any state now: start afresh
                    replies[i] = ("error", self._replace_worker(i, reply[1]))
                else:
                    replies[i] = reply
            now = time.monotonic()
            for connection, i in [(c, i) for c, i in pending.items() if deadlines[i] <= now]:
                del pending[connection]
                after = " after the service wait it reported" if i in waits.envs else ""
                replies[i] = ("error", self._replace_worker(i, f"no answer within {timeout:g} s{after} (hung)"))
        waits.ended(replies)
        return replies

    def _replace_worker(self, env_id: int, reason: str, died: bool = False) -> str:
        """Kill the worker of `env_id` (`died`: it is exiting by itself), start a fresh one; returns the
        reason with the exit status."""
        status = self._workers[env_id].kill(grace=5.0 if died else 0.0)
        self._workers[env_id] = self._new_worker()
        self.num_restarts += 1
        self._check_started([env_id])
        return f"{reason}{status}; environment restarted"

    def _new_worker(self) -> _Worker:
        """A worker process serving a fresh environment, forked by the fork server where there is one and it can
        receive `env_fn`, else by this process."""
        if self._fork_server is not None:
            try:
                return _Worker(*self._fork_server.start(_serve, (self.env_fn,)))
            except (pickle.PickleError, AttributeError, TypeError) as exc:  # it holds a lock, an open file, ...
                warnings.warn(
                    f"environment {self.name!r}: its factory cannot be sent to the environment fork server ({exc}); "
                    "its workers are forked from this process instead, where a lock another thread holds at the fork "
                    f"can stop a worker's start (it is then forked again after start_timeout={self.start_timeout:g} s). "
                    "Give the pool a factory that can be pickled (cloudpickle: no lock, socket or open file in it).",
                    EnvironmentFailureWarning, stacklevel=4)
                if self._own_fork_server:
                    self._fork_server.close()
                self._fork_server = None
        connection, child_end = self._context.Pipe()
        process = self._context.Process(target=_serve, args=(child_end, self.env_fn), daemon=True)
        gc.freeze()  # the forked worker then shares this process's objects instead of copying them on gc
        try:
            process.start()
        finally:
            gc.unfreeze()
        child_end.close()
        return _Worker(process, connection)

    def _check_started(self, env_ids: Sequence[int]) -> None:
        """Wait for each new worker of `env_ids` to report that it started; one that does not within
        `start_timeout` is killed, counted, warned about and forked again, `START_ATTEMPTS` times in all (then its
        next request fails at once and it is replaced)."""
        pending = list(env_ids)
        for attempt in range(1, START_ATTEMPTS + 1):
            cause = ("it was forked by the environment fork server" if self._fork_server is not None else
                     f"it was forked from this process while {threads_at_fork()}: a lock one of them held at the fork "
                     "(huggingface_hub's HTTP session during a request, for one) is the likely cause")
            deadline = time.monotonic() + self.start_timeout
            waiting, died = {self._workers[i].connection: i for i in pending}, []
            while waiting and (remaining := deadline - time.monotonic()) > 0:
                for connection in multiprocessing.connection.wait(list(waiting), timeout=remaining):
                    i = waiting.pop(connection)
                    if self._workers[i].receive() is None:  # died before it could report
                        died.append(i)
            pending = sorted([*waiting.values(), *died])
            for i in pending:
                self._workers[i].kill()
                self.num_start_failures += 1
                self.num_restarts += 1
                again = (f"forked again (attempt {attempt + 1} of {START_ATTEMPTS})" if attempt < START_ATTEMPTS else
                         "left stopped: its next request fails and starts it again")
                warnings.warn(f"environment {self.name!r} #{i}: its worker process did not start within "
                              f"{self.start_timeout:g} s ({cause}); {again}", EnvironmentFailureWarning, stacklevel=4)
                if attempt < START_ATTEMPTS:
                    self._workers[i] = self._new_worker()
            if not pending:
                return

    def _check_group_starts(self, tasks: Sequence[Task], outputs: dict[int, EnvOutput]) -> None:
        for g, task in enumerate(tasks):
            copies = [outputs[i] for i in range(g * self.group_size, (g + 1) * self.group_size)]
            anchors = [output.anchor for output in copies if INFO_ENV_ERROR not in output.info]
            unhashable = [anchor for anchor in anchors if not isinstance(anchor, Hashable)]
            if unhashable:
                raise TypeError(f"environment {self.name!r}: info['anchor'] must be hashable (a str, a tuple, ...), "
                                f"got a {type(unhashable[0]).__name__}: {unhashable[0]!r}")
            kinds = {output.info[INFO_ANCHOR_KIND] for output in copies if INFO_ANCHOR_KIND in output.info}
            if kinds - set(ANCHOR_KINDS):
                raise ValueError(f"environment {self.name!r}: info['anchor_kind'] must be one of {ANCHOR_KINDS}, got "
                                 f"{sorted(map(repr, kinds - set(ANCHOR_KINDS)))}")
            distinct = len(set(anchors))
            if distinct > 1:
                warnings.warn(
                    f"environment {self.name!r}: the {len(anchors)} copies of task {g} (seed {task.seed}, options "
                    f"{task.options}) started in {distinct} different states. The environment ignores its seed or "
                    "options, so copies cannot share anchor states and GiGPO degrades to GRPO.",
                    GroupStartMismatchWarning,
                    stacklevel=3,
                )


class _Waits:
    """The service waits the environments of one batch of requests report (`gigpo_trl.services`): the first wait for
    each service said as it starts, and how the batch's waits for it ended said once."""

    def __init__(self, env_name: str) -> None:
        self.env_name = env_name
        self.waiting: dict[str, list[int]] = {}  # service -> the environments that waited for it
        self.answered: dict[str, set[int]] = {}  # service -> those it answered again

    @property
    def envs(self) -> set[int]:
        return {i for envs in self.waiting.values() for i in envs}

    def heard(self, env_id: int, wait: ServiceWait) -> None:
        if wait.seconds_left == 0:
            self.answered.setdefault(wait.service, set()).add(env_id)
            return
        if wait.service not in self.waiting:
            logger.warning(f"environment {self.env_name!r} #{env_id}: {wait.message}")
        self.waiting.setdefault(wait.service, []).append(env_id)

    def ended(self, replies: Mapping[int, tuple[str, Any]]) -> None:
        for service, envs in self.waiting.items():
            answered = self.answered.get(service, set())
            failed = [i for i in envs if i not in answered and replies.get(i, ("error",))[0] == "error"]
            outcome = (f"{len(envs) - len(failed)} went on" + (f", {len(failed)} failed (the wait's bound passed)"
                                                               if failed else ""))
            logger.warning(f"environment {self.env_name!r}: {len(envs)} environment(s) waited for {service}: {outcome}")


def _execute(env: TextEnv, command: str, argument: Any) -> EnvOutput:
    """Run one reset or step on `env` and normalize what it returns."""
    if command == "reset":
        observation, info = env.reset(seed=argument.seed, options=argument.options)
        text, images = split_observation(observation, "reset()'s observation")
        return EnvOutput(text, info=dict(info), images=images)
    observation, reward, terminated, truncated, info = env.step(argument)
    if not math.isfinite(float(reward)):  # would poison the group's advantages: a failure of this trajectory
        raise ValueError(f"step returned a non-finite reward ({reward})")
    text, images = split_observation(observation, "step()'s observation")
    return EnvOutput(text, float(reward), bool(terminated), bool(truncated), dict(info), images)


def _describe(exc: BaseException) -> str:
    return f"environment raised {type(exc).__name__}: {exc}"


class _Worker:
    """One worker process owning one environment, spoken to over a pipe: a `multiprocessing.Process` or a
    `ForkedProcess` of the fork server."""

    def __init__(self, process: Any, connection: multiprocessing.connection.Connection):
        self.process, self.connection = process, connection

    def send(self, request: tuple[str, Any]) -> bool:
        try:
            self.connection.send(request)
        except (BrokenPipeError, OSError):
            return False
        return True

    def receive(self) -> tuple[str, Any] | None:
        try:
            return self.connection.recv()
        except (EOFError, OSError):
            return None

    def kill(self, grace: float = 0.0) -> str:
        """Stop the process for good, after waiting `grace` seconds for it to end by itself; returns how it
        had ended by itself (e.g. " (killed by SIGSEGV)") or "" if it had to be killed."""
        self.process.join(timeout=grace)
        killed_here = self.process.is_alive()
        if killed_here:
            self.process.kill()
        self.process.join(timeout=5)
        self.connection.close()
        code = self.process.exitcode
        if killed_here or not code:
            return ""
        return f" (killed by {signal.Signals(-code).name})" if code < 0 else f" (exit code {code})"

    def close(self) -> None:
        if self.send(("close", None)):
            self.process.join(timeout=5)
        self.kill()


def _serve(connection: multiprocessing.connection.Connection, env_fn: Callable[[], TextEnv]) -> None:
    """Worker process: create the environment on first use, answer requests until told to close."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    release_inherited_sockets(keep=connection.fileno())  # a process group's port, say, stays the trainer's alone
    parent = os.getppid()
    connection.send_bytes(pickle.dumps(("ready", os.getpid())))  # the pool waits for it (`_check_started`)
    env = None
    while True:
        if not connection.poll(1.0):
            if os.getppid() != parent:  # the trainer is gone
                return
            continue
        try:
            command, argument = connection.recv()
        except EOFError:
            return
        if command == "close":
            if env is not None:
                env.close()
            return
        try:
            with waits_reported_to(lambda wait: connection.send_bytes(pickle.dumps(("waiting", wait)))):
                if env is None:
                    env = env_fn()
                reply = pickle.dumps(("ok", _execute(env, command, argument)))
        except Exception as exc:  # reported to the pool, which restarts this worker
            reply = pickle.dumps(("error", _describe(exc)))
        connection.send_bytes(reply)
