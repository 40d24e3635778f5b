"""The JVM of TextWorldExpress and ScienceWorld starts even when it writes a warning on stdout first, keeps no
performance-data file, and a start that fails is tried again a bounded number of times with every reason kept:
real engines in real JVMs.

The failure these reproduce: py4j reads the gateway's port from the JVM's first line on stdout, and a JVM of a pool
of about 860 wrote `[warning][perf,memops] Cannot use file .../hsperfdata_root/1220 because it is locked by another
process` there first (`ValueError: invalid literal for int()`). Here a JVM option makes the JVM write a warning of
the same kind (the unified log's, on stdout by default) before the port."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.skipif(shutil.which("java") is None, reason="the JVM engines need a Java runtime (java)"),
              pytest.mark.timeout(300)]

from gigpo_trl.env_pool import INFO_ENV_ERROR, EnvironmentFailureWarning, EnvPool  # noqa: E402
from gigpo_trl.environments.jvm import START_ATTEMPTS, START_OPTIONS, JVMStartWarning, start_jvm  # noqa: E402
from gigpo_trl.envs import env_factory, make_env  # noqa: E402
from gigpo_trl.tasks import Task  # noqa: E402

# name -> (package, make_env keyword arguments, the engine's name in messages)
ENGINES = {
    "textworld_express": ("textworld_express", {"game": "coin", "numLocations": 3}, "TextWorldExpress"),
    "scienceworld": ("scienceworld", {"task": "boil"}, "ScienceWorld"),
}
# Options after which a JVM writes a warning of its unified log first, on stdout by default: string deduplication
# under the serial collector both engines use (Java 17; from 18 on it deduplicates strings), large pages on a
# machine that has none configured.
STDOUT_WARNINGS = ("-XX:+UseStringDeduplication", "-XX:+UseLargePages")
# The user's own options come last and win: with this one the JVM's log is on stdout again, so every start fails.
LOG_ON_STDOUT = "-Xlog:all=warning:stdout"
BAD_PORT_LINE = r"ValueError: invalid literal for int\(\) with base 10: b'\[[^']*\]\[warning\]"


@pytest.fixture(params=list(ENGINES))
def engine(request):
    """(make_env name, kwargs, the engine's name); skips an engine whose package is not installed."""
    package, kwargs, title = ENGINES[request.param]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"needs {package}")
    return request.param, kwargs, title


@pytest.fixture(scope="module")
def warning_on_stdout() -> str:
    """A JVM option with which this machine's `java` writes a warning line on stdout before anything else."""
    for option in STDOUT_WARNINGS:
        run = subprocess.run(["java", "-XX:+UseSerialGC", option, "-version"], capture_output=True, text=True)
        if "[warning]" in run.stdout.partition("\n")[0]:
            return option
    pytest.skip(f"this `java` writes no warning on stdout with any of {STDOUT_WARNINGS}")


def gateway_jvms() -> set[int]:
    """Pids of this process's child JVMs that run a py4j gateway."""
    pids = set()
    for child in psutil.Process().children():
        try:
            if "py4j.GatewayServer" in child.cmdline():
                pids.add(child.pid)
        except psutil.Error:  # ended meanwhile
            pass
    return pids


def test_a_jvm_that_writes_a_warning_on_stdout_first_still_starts_and_plays(engine, warning_on_stdout, monkeypatch):
    name, kwargs, _ = engine
    monkeypatch.setenv("JAVA_TOOL_OPTIONS", warning_on_stdout)
    env = make_env(name, **kwargs)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", JVMStartWarning)  # the first start must work, not a retry
            observation, info = env.reset(seed=0)
        assert observation and info["anchor"]
        observation, _, _, _, step_info = env.step("look around")
        assert observation and step_info["anchor"]
    finally:
        env.close()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the JVM's memory map from /proc")
def test_the_jvm_keeps_no_performance_data_file(engine):
    name, kwargs, _ = engine
    env = make_env(name, **kwargs)
    try:
        env.reset(seed=0)
        pid = env._engine._gateway.java_process.pid
        assert "hsperfdata" not in Path(f"/proc/{pid}/maps").read_text()
    finally:
        env.close()


def test_a_jvm_that_never_starts_fails_naming_every_attempt_and_leaves_no_jvm(engine, warning_on_stdout, monkeypatch):
    name, kwargs, title = engine
    monkeypatch.setenv("JAVA_TOOL_OPTIONS", f"{warning_on_stdout} {LOG_ON_STDOUT}")
    running = gateway_jvms()
    env = make_env(name, **kwargs)
    with pytest.warns(JVMStartWarning), pytest.raises(RuntimeError) as error:
        env.reset(seed=0)
    message = str(error.value)
    assert message.startswith(f"{title}'s JVM did not start in {START_ATTEMPTS} attempts")
    assert re.findall(rf"attempt (\d): {BAD_PORT_LINE}", message) == [str(i) for i in range(1, START_ATTEMPTS + 1)]
    assert not gateway_jvms() - running  # the failed attempts' JVMs are gone
    assert os.environ["JAVA_TOOL_OPTIONS"] == f"{warning_on_stdout} {LOG_ON_STDOUT}"  # restored


def test_a_pool_reports_a_jvm_that_never_starts_as_its_environment_s_error(warning_on_stdout, monkeypatch):
    pytest.importorskip("textworld_express")
    monkeypatch.setenv("JAVA_TOOL_OPTIONS", f"{warning_on_stdout} {LOG_ON_STDOUT}")  # the workers inherit it
    make = env_factory("textworld_express", **ENGINES["textworld_express"][1])
    with EnvPool(make, num_groups=1, group_size=2, name="textworld_express") as pool:
        with pytest.warns(EnvironmentFailureWarning, match="JVM did not start"):
            outputs = pool.reset([Task(seed=0)])
    for output in outputs:
        assert output.truncated
        error = output.info[INFO_ENV_ERROR]
        assert error.startswith(f"environment raised RuntimeError: TextWorldExpress's JVM did not start in "
                                f"{START_ATTEMPTS} attempts")
        assert len(re.findall(rf"attempt \d: {BAD_PORT_LINE}", error)) == START_ATTEMPTS
        assert error.endswith(f"environment restarted (the reset failed all {pool.reset_attempts} attempts)")


def test_a_start_that_fails_once_is_tried_again_with_the_reason_in_a_warning(warning_on_stdout):
    pytest.importorskip("textworld_express")
    from textworld_express import TextWorldExpressEnv as Engine

    from gigpo_trl.environments.textworld_express_games import JVM_OPTIONS

    launched_with = []

    def start():
        launched_with.append(os.environ["JAVA_TOOL_OPTIONS"])
        if len(launched_with) == 1:  # the first JVM writes its warning on stdout, before the port
            os.environ["JAVA_TOOL_OPTIONS"] += f" {warning_on_stdout} {LOG_ON_STDOUT}"
        return Engine(envStepLimit=100)

    before, running = os.environ.get("JAVA_TOOL_OPTIONS"), gateway_jvms()
    with pytest.warns(JVMStartWarning, match=rf"^TextWorldExpress's JVM failed to start \(attempt 1: {BAD_PORT_LINE}"):
        engine = start_jvm("TextWorldExpress", start, JVM_OPTIONS)
    try:
        assert gateway_jvms() - running == {engine._gateway.java_process.pid}  # the first attempt's JVM is gone
        engine.load("coin", "numLocations=3")
        observation, _ = engine.reset(seed=0, gameFold="train")
        assert "You are in" in observation
    finally:
        engine.close()
    assert len(launched_with) == 2 and launched_with[0] == launched_with[1]
    assert launched_with[0].startswith(" ".join([*START_OPTIONS, *JVM_OPTIONS]))
    assert os.environ.get("JAVA_TOOL_OPTIONS") == before

