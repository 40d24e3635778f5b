"""`ForkServer`: environment workers forked from a process whose only thread is its own.

A process forked while another of its threads holds a lock inherits the lock held, by a thread that does not exist in
the child. Code the child runs at its birth that takes that lock waits forever: Python's `os.register_at_fork` hooks
run there, and huggingface_hub registers one that closes its HTTP session, whose connection pool's lock a thread
sending a request (TRL's telemetry ping, a hub download, a tracking client's upload) may hold. Forking the environment
workers from a process whose threads are busy can therefore leave a worker that never starts.

The fork server has one thread and forks each worker on request. It is started in one of two ways:

- **fork** (`start_method="fork"`, or "auto" while this process runs one thread): this process is forked, which
  takes milliseconds, and the server and its workers see every class and function of this process. One thread means no
  other thread can hold a lock at the fork. `GiGPOTrainer` creates its server first thing, before TRL or vLLM start a
  thread, so a script's first trainer takes this way.
- **spawn** (`start_method="spawn"`, or "auto" while other threads run): a fresh interpreter is started (`subprocess`,
  so fork and exec: nothing of this process survives, no at-fork hook meets a held lock), with this process's
  `sys.path`, working directory and environment variables. It imports only this module; what a worker needs is
  imported in the server when its target arrives (once, shared by the workers forked after), which costs the
  interpreter's start and those imports, about half a second, once per server (bench/bench_pool_start.py).

A worker's target and arguments are pickled with cloudpickle: by reference where they can be imported by name, by
value where they cannot (classes and functions defined in `__main__`, a notebook or stdin script included, lambdas and
closures), so both ways serve the same factories. A target that cannot be pickled at all (it holds a lock or an open
file) or that the server cannot load is refused by name, and its owner forks that worker itself.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

import cloudpickle

START_METHODS = ("auto", "fork", "spawn")
# The spawned server's whole program: this process's import path, then the server on the inherited socket.
_SPAWN_PROGRAM = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
                  "from gigpo_trl.fork_server import serve_spawned; serve_spawned(int(sys.argv[2]))")


class WorkerStartError(RuntimeError):
    """The fork server did not report that it started in any of its attempts."""


class WorkerStartWarning(UserWarning):
    """A process did not report that it started within its start timeout; it was killed and forked again."""


def release_inherited_sockets(keep: int) -> None:
    """In a freshly forked child: let go of every socket it inherited but the file descriptor `keep` (its pipe to its
    parent). A child keeps a socket open for as long as it lives: the listening socket of torch.distributed's store
    (a process group's port, 29500 under TRL) would stay taken after the parent has closed it, and the next process
    group started on that port would fail (EADDRINUSE). Each is replaced by /dev/null rather than closed, so that
    objects of the parent's that still name the number in this child close /dev/null, never a file opened since.
    Linux only (its /proc/self/fd); elsewhere nothing is done."""
    try:
        descriptors = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return
    null = os.open(os.devnull, os.O_RDWR)
    for descriptor in descriptors:
        if descriptor in (0, 1, 2, keep, null):  # standard streams stay, sockets or not
            continue
        try:
            if stat.S_ISSOCK(os.fstat(descriptor).st_mode):
                os.dup2(null, descriptor)
        except OSError:  # the listing's own descriptor, closed since
            pass
    os.close(null)


def threads_at_fork() -> str:
    """The names of this process's threads, for a message about a fork that did not start: a lock one of them held
    when this process forked is the likely cause."""
    names = [thread.name for thread in threading.enumerate()]
    return f"{len(names)} thread(s) ran in the process that forked it: {', '.join(names)}"


class ForkServer:
    """A one-thread process that forks workers on request (see the module's docstring).

    Args:
        start_timeout: seconds the server may take to report that it started; one that does not is killed and started
            again, up to `attempts` times in all, then `WorkerStartError` is raised naming this process's threads.
        start_method: "fork" (this process is forked), "spawn" (a fresh interpreter) or "auto": fork while this
            process runs one thread, else spawn. The method taken is `self.start_method`.
    """

    def __init__(self, start_timeout: float = 20.0, attempts: int = 3, start_method: str = "auto"):
        if start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
        if start_method == "auto":
            start_method = "fork" if threading.active_count() == 1 else "spawn"
        self.start_method = start_method
        self._lock = threading.Lock()  # one request and its answer at a time
        self.start_failures = 0
        for _ in range(attempts):
            threads = threads_at_fork()
            self._connection, self.process = _fork_server() if start_method == "fork" else _spawn_server()
            if self._connection.poll(start_timeout):
                self._connection.recv()  # "ready"
                return
            self.process.kill()
            self.process.join(5)
            self._connection.close()
            self.start_failures += 1
            cause = ("a lock one of them held at the fork (huggingface_hub's HTTP session during a request, for one) is "
                     "the likely cause" if start_method == "fork" else "its interpreter did not start")
            warnings.warn(f"the environment fork server ({start_method}) did not start within {start_timeout:g} s and "
                          f"was killed (attempt {self.start_failures} of {attempts}); {threads}: {cause}",
                          WorkerStartWarning, stacklevel=2)
        raise WorkerStartError(f"the environment fork server ({start_method}) did not start within {start_timeout:g} s "
                               f"in {attempts} attempts; {threads}")

    def start(self, target: Callable[..., Any], args: tuple) -> tuple[ForkedProcess, multiprocessing.connection.Connection]:
        """Fork a worker running `target(connection, *args)`; its handle and this side of its pipe. Raises
        `pickle.PicklingError` or `TypeError` where `target` and `args` cannot be pickled, and
        `pickle.UnpicklingError` (the server's error, by name) where the server cannot load them."""
        payload = cloudpickle.dumps((target, args))  # raises for what cannot be pickled (a lock, an open file)
        with self._lock:
            self._connection.send(("fork", payload))
            answer = self._connection.recv()
            if answer[0] == "refused":
                raise pickle.UnpicklingError(answer[1])
            connection = multiprocessing.connection.Connection(reduction.recv_handle(self._connection))
        return ForkedProcess(self, answer[1]), connection

    def _ask(self, request: tuple) -> Any:
        """One request to the server and its answer; None where the server is gone."""
        try:
            with self._lock:
                self._connection.send(request)
                return self._connection.recv()[1]
        except (EOFError, OSError):
            return None

    def close(self) -> None:
        """Stop the server; its live workers are killed."""
        try:
            with self._lock:
                self._connection.send(("close", None))
        except (EOFError, OSError):
            pass
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self._connection.close()


class ForkedProcess:
    """A worker the fork server forked: the part of `multiprocessing.Process`'s interface a pool uses."""

    def __init__(self, server: ForkServer, pid: int):
        self.server, self.pid = server, pid
        self.exitcode: int | None = None

    def join(self, timeout: float | None = None) -> None:
        """Wait up to `timeout` seconds (None: 5) for the worker to end; sets `exitcode` if it did."""
        if self.exitcode is None:
            self.exitcode = self.server._ask(("wait", (self.pid, 5.0 if timeout is None else timeout)))

    def is_alive(self) -> bool:
        self.join(0.0)
        return self.exitcode is None and self.server.process.is_alive()

    def kill(self) -> None:
        self.server._ask(("kill", self.pid))


def _fork_server() -> tuple[multiprocessing.connection.Connection, Any]:
    """Fork this process into a fork server: this side of its pipe and its `multiprocessing.Process`."""
    context = multiprocessing.get_context("fork")
    connection, child_end = context.Pipe()
    process = context.Process(target=_serve_forks, args=(child_end,), daemon=True, name="gigpo-fork-server")
    process.start()
    child_end.close()
    return connection, process


def _spawn_server() -> tuple[multiprocessing.connection.Connection, SpawnedProcess]:
    """Start a fork server in a fresh interpreter: this side of its socket and its process."""
    ours, theirs = socket.socketpair()
    with theirs:
        process = subprocess.Popen(
            [sys.executable, "-c", _SPAWN_PROGRAM, json.dumps(sys.path), str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
    return multiprocessing.connection.Connection(ours.detach()), SpawnedProcess(process)


class SpawnedProcess:
    """A spawned fork server's `subprocess.Popen`, with the part of `multiprocessing.Process`'s interface used here."""

    def __init__(self, popen: subprocess.Popen):
        self.popen, self.pid = popen, popen.pid

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        self.popen.kill()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


def serve_spawned(descriptor: int) -> None:
    """The spawned fork server's entry point: serve on the socket inherited as file descriptor `descriptor`."""
    _serve_forks(multiprocessing.connection.Connection(descriptor))


def _serve_forks(connection: multiprocessing.connection.Connection) -> None:
    """The fork server: answer fork, wait and kill requests until told to close or the client is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    release_inherited_sockets(keep=connection.fileno())
    gc.freeze()  # the workers share this process's objects instead of copying them on garbage collection
    connection.send(("ready", None))
    exit_codes: dict[int, int | None] = {}  # pid -> exit code (None: running)
    while True:
        try:
            command, argument = connection.recv()
        except (EOFError, OSError):  # the client is gone
            break
        _reap(exit_codes)
        if command == "close":
            break
        if command == "fork":
            try:
                target, args = pickle.loads(argument)
            except Exception as exc:  # a module this server cannot import, for one
                connection.send(("refused", f"{type(exc).__name__}: {exc}"))
                continue
            parent_end, child_end = multiprocessing.Pipe()
            pid = os.fork()
            if pid == 0:
                connection.close()
                parent_end.close()
                code = 0
                try:
                    target(child_end, *args)
                except BaseException:
                    traceback.print_exc()
                    code = 1
                finally:
                    os._exit(code)
            child_end.close()
            exit_codes[pid] = None
            connection.send(("forked", pid))
            reduction.send_handle(connection, parent_end.fileno(), os.getppid())
            parent_end.close()
        elif command == "wait":
            pid, timeout = argument
            deadline = time.monotonic() + timeout
            while exit_codes.get(pid, 0) is None and time.monotonic() < deadline:
                time.sleep(0.01)
                _reap(exit_codes)
            connection.send(("status", exit_codes.get(pid)))
        elif command == "kill":
            if exit_codes.get(argument, 0) is None:
                os.kill(argument, signal.SIGKILL)
            connection.send(("killed", None))
    for pid, code in exit_codes.items():
        if code is None:
            os.kill(pid, signal.SIGKILL)


def _reap(exit_codes: dict[int, int | None]) -> None:
    """Record the exit codes of the workers that have ended (a signal's as its negative number, as
    `multiprocessing.Process.exitcode`)."""
    for pid, code in exit_codes.items():
        if code is None:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                exit_codes[pid] = os.waitstatus_to_exitcode(status)
