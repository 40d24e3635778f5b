"""Starting the JVM of a JVM-backed environment (TextWorldExpress, ScienceWorld), written once for both.

Their engines launch `java` themselves through py4j's `launch_gateway`, which reads the gateway's port from the
first line the JVM writes on stdout: any other line there first fails the start (`ValueError: invalid literal for
int()`). By default the JVM writes its log's warnings on stdout, e.g. `[warning][perf,memops] Cannot use file
/tmp/hsperfdata_root/1220 because it is locked by another process`, which a JVM of a pool of about 860 wrote when
another process held the performance-data file of its pid (JVMs of containers that share /tmp can have the same
pid). So every JVM starts with `START_OPTIONS`: no performance-data file (which also spares its memory) and the
log's output on stderr, which py4j discards. A start that fails anyway is tried again, `START_ATTEMPTS` times in
all, and the JVMs of the failed attempts are stopped; each failure's reason is kept: in a `JVMStartWarning` when a
later attempt succeeds, in the error when none does.

The engines take no JVM options, so the options travel in the JAVA_TOOL_OPTIONS environment variable, set for the
launch only (so one start at a time in a process): `START_OPTIONS`, then the environment's own `jvm_options`, then
the user's JAVA_TOOL_OPTIONS, which win (the JVM keeps the last of two contradicting options).
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from collections.abc import Callable, Sequence
from typing import TypeVar

import psutil  # a dependency of accelerate

T = TypeVar("T")
START_OPTIONS = ("-XX:-UsePerfData", "-Xlog:disable", "-Xlog:all=warning:stderr")
START_ATTEMPTS = 3
RETRY_PAUSE_S = 1.0  # before each new attempt: a start that failed under load may succeed a moment later
JAVA_MISSING = (
    "{environment} runs its games in a Java virtual machine, and no `java` executable is on the PATH. Install a Java "
    "runtime (version 11 or newer), e.g. `sudo apt-get install -y openjdk-17-jre-headless` on Debian/Ubuntu, "
    "`brew install openjdk@17` on macOS or `conda install -c conda-forge openjdk=17`, then check `java -version`."
)


class JVMStartWarning(UserWarning):
    """A JVM failed to start and was started again; says why."""


def require_java(environment: str) -> None:
    """Raise a RuntimeError that says how to install Java when no `java` executable is on the PATH."""
    if shutil.which("java") is None:
        raise RuntimeError(JAVA_MISSING.format(environment=environment))


def start_jvm(environment: str, start: Callable[[], T], jvm_options: Sequence[str]) -> T:
    """Call `start`, which launches `environment`'s JVM, with `START_OPTIONS`, `jvm_options` and the user's own
    options in JAVA_TOOL_OPTIONS (see the module docstring); returns what `start` returns.

    A failed `start` is called again, `START_ATTEMPTS` times in all; if none succeeds, a RuntimeError names every
    attempt's reason.
    """
    previous = os.environ.get("JAVA_TOOL_OPTIONS")
    options = " ".join([*START_OPTIONS, *jvm_options, previous or ""]).strip()
    reasons = []
    for attempt in range(1, START_ATTEMPTS + 1):
        if attempt > 1:
            warnings.warn(f"{environment}'s JVM failed to start ({reasons[-1]}); starting it again", JVMStartWarning,
                          stacklevel=3)
            time.sleep(RETRY_PAUSE_S)
        running = _gateway_processes()
        os.environ["JAVA_TOOL_OPTIONS"] = options
        try:
            return start()
        except Exception as exc:  # noqa: BLE001 (py4j, the pipe and the engines raise their own errors)
            reasons.append(f"attempt {attempt}: {type(exc).__name__}: {str(exc).strip()}")
            _stop(_gateway_processes() - running)
        finally:
            if previous is None:
                del os.environ["JAVA_TOOL_OPTIONS"]
            else:
                os.environ["JAVA_TOOL_OPTIONS"] = previous
    raise RuntimeError(f"{environment}'s JVM did not start in {START_ATTEMPTS} attempts "
                       f"(JAVA_TOOL_OPTIONS={options!r}): {'; '.join(reasons)}")


def _gateway_processes() -> set[psutil.Process]:
    """This process's child JVMs that run a py4j gateway."""
    found = set()
    for child in psutil.Process().children():
        try:
            if "py4j.GatewayServer" in child.cmdline():
                found.add(child)
        except psutil.Error:  # it ended meanwhile
            pass
    return found


def _stop(processes: set[psutil.Process]) -> None:
    """Kill the JVMs of a failed start: py4j keeps them, and their pipes open, until this process ends."""
    for process in processes:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(processes, timeout=10)
