"""`ForkServer`: environment workers forked from a process that was forked while this one was quiet.

A process forked while another of its threads holds a lock inherits the lock held, by a thread that does not exist in
the child. Code the child runs at its birth that takes that lock waits forever: Python's `os.register_at_fork` hooks
run there, and huggingface_hub registers one that closes its HTTP session, whose connection pool's lock a thread
sending a request (TRL's telemetry ping, when a trainer is built) may hold. Forking the environment workers from a
trainer whose threads are busy can therefore leave a worker that never starts.

The fork server is forked once, when its owner creates it (`GiGPOTrainer` does so first thing, before TRL or vLLM start
any thread); it has one thread and forks each worker on request. A worker is the fork server's child: it sees every
class and function that existed in this process when the server was forked (environments defined in a notebook or in
`__main__` included), receives its target and arguments pickled (by reference), and is spoken to over a pipe whose
end the server hands back. A target the server cannot unpickle (defined after its birth, a lambda) is refused by
name, and its owner forks that worker itself.
"""

from __future__ import annotations

import gc
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import stat
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any


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
        start_timeout: seconds the server may take to report that it started; one that does not is killed and forked
            again, up to `attempts` times in all, then `WorkerStartError` is raised naming this process's threads.
    """

    def __init__(self, start_timeout: float = 20.0, attempts: int = 3):
        context = multiprocessing.get_context("fork")
        self._lock = threading.Lock()  # one request and its answer at a time
        self.start_failures = 0
        for _ in range(attempts):
            self._connection, child_end = context.Pipe()
            threads = threads_at_fork()
            self.process = context.Process(target=_serve_forks, args=(child_end, os.getpid()), daemon=True,
                                           name="gigpo-fork-server")
            self.process.start()
            child_end.close()
            if self._connection.poll(start_timeout):
                self._connection.recv()  # "ready"
                return
            self.process.kill()
            self.process.join(5)
            self._connection.close()
            self.start_failures += 1
            warnings.warn(f"the environment fork server did not start within {start_timeout:g} s and was killed "
                          f"(attempt {self.start_failures} of {attempts}); {threads}: a lock one of them held at the "
                          "fork (huggingface_hub's HTTP session during a request, for one) is the likely cause",
                          WorkerStartWarning, stacklevel=2)
        raise WorkerStartError(f"the environment fork server did not start within {start_timeout:g} s in {attempts} "
                               f"attempts; {threads}")

    def start(self, target: Callable[..., Any], args: tuple) -> tuple[ForkedProcess, multiprocessing.connection.Connection]:
        """Fork a worker running `target(connection, *args)`; its handle and this side of its pipe. Raises
        `pickle.PicklingError` (or the unpickling error, re-raised as `pickle.UnpicklingError`) where the server
        cannot receive `target` and `args`."""
        payload = pickle.dumps((target, args))  # raises for what cannot be sent by reference (a lambda)
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


def _serve_forks(connection: multiprocessing.connection.Connection, client: int) -> None:
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
            except Exception as exc:  # defined after this server's birth, or not importable here
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
            reduction.send_handle(connection, parent_end.fileno(), client)
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
