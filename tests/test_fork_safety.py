"""A worker forked while another thread of the process holds a lock must still start (issues: the first rollout froze
for 10 minutes outside CI; a pool built while other threads ran failed after a minute). Each scenario runs as a
script read from standard input in a process of its own, as a notebook cell or a user's run would: its environment is
defined in its `__main__`, which no other process can import, and the locks it holds on purpose, huggingface_hub's
HTTP session's, would stay held in the test process otherwise.

The lock held is the one the first issue's stack dump showed: the connection pool's lock of huggingface_hub's HTTP
session, which TRL's telemetry thread holds during a request (TRL sends its ping when a trainer is built, unless `CI`
is set), as any hub request in flight does, and which the hub's at-fork hook takes in every forked child.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import pytest
from toy_envs import Corridor

from gigpo_trl.env_pool import EnvPool
from gigpo_trl.fork_server import ForkServer
from gigpo_trl.tasks import Task

REPO = Path(__file__).resolve().parent.parent

# An environment defined in the script itself (its __main__), as a user plugs in their own, and the hub lock holder.
PREAMBLE = '''
import json, sys, threading, time, warnings
from huggingface_hub.utils import get_session

class CompassGrid:
    """Walk north to the exit, 2 rooms away; other moves waste the turn."""
    def reset(self, *, seed=None, options=None):
        self.distance = 2
        return self._observation(), self._info()
    def step(self, action):
        if action == "north":
            self.distance -= 1
        won = self.distance == 0
        return self._observation(), float(won), won, False, self._info()
    def close(self):
        pass
    def _observation(self):
        return f"The exit is {self.distance} rooms north."
    def _info(self):
        return {"anchor": self.distance, "admissible_actions": ["north", "south"], "won": self.distance == 0}

def hold_hub_session_lock(until):
    """A thread holds the connection pool's lock of huggingface_hub's HTTP session until the event `until`."""
    lock, held, released = get_session()._transport._pool._optional_thread_lock, threading.Event(), threading.Event()
    def hold():
        with lock:
            held.set()
            until.wait()
        released.set()
    threading.Thread(target=hold, name="hub-request-in-flight", daemon=True).start()
    held.wait()
    return released
'''


def run_script(body: str, tmp_path: Path, timeout: float, environment: dict | None = None) -> dict:
    """Run PREAMBLE + `body` read from standard input by a fresh Python, outside CI (no `CI`, telemetry on); the
    JSON of its last line."""
    env = {name: value for name, value in os.environ.items()
           if name not in ("CI", "HF_HUB_OFFLINE", "HF_HUB_DISABLE_TELEMETRY")}
    env.update(PYTHONPATH=str(REPO), **(environment or {}))
    try:
        finished = subprocess.run([sys.executable, "-"], input=PREAMBLE + textwrap.dedent(body), capture_output=True,
                                  text=True, timeout=timeout, env=env, cwd=tmp_path)
    except subprocess.TimeoutExpired as stopped:
        pytest.fail(f"the scenario did not end within {timeout:g} s (a worker never started?): "
                    f"{(stopped.stderr or b'')[-2000:]!r}")
    assert finished.returncode == 0, finished.stderr[-3000:]
    return json.loads(finished.stdout.strip().splitlines()[-1])


@pytest.fixture
def black_hole_endpoint():
    """A Hub endpoint on localhost whose connections hang, as where a cluster's network drops packets: a listening
    socket whose queue of pending connections is full and that never accepts."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(server.getsockname())
        fillers.append(filler)
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    for filler in fillers:
        filler.close()
    server.close()


@pytest.mark.timeout(400)
def test_a_trainer_built_outside_ci_plays_its_first_rollout_while_a_thread_holds_the_hubs_session(
        tmp_path, tiny_model_path, black_hole_endpoint):
    """The issue's run: an environment registered from the user's script, a trainer built with `CI` unset (TRL's
    telemetry ping starts, to an endpoint that never answers), then, while a thread holds the hub session's lock,
    `evaluate()` forks 8 workers. Before the fix every worker waited on that lock in the hub's at-fork hook and the
    first rollout stood still for `reset_timeout` (600 s); the workers are now forked by the trainer's fork server,
    forked before any thread of the trainer started."""
    result = run_script(f'''
        from gigpo_trl import GiGPOConfig, GiGPOTrainer, register_env, task_dataset
        register_env("compass_grid", CompassGrid)
        config = GiGPOConfig(output_dir="out", env_name="compass_grid", num_generations=2, per_device_train_batch_size=4,
                             per_device_eval_batch_size=8, max_env_steps=4, max_completion_length=8, report_to=[],
                             bf16=False, eval_greedy=True)
        trainer = GiGPOTrainer({tiny_model_path!r}, args=config, train_dataset=task_dataset(range(8)),
                               eval_dataset=task_dataset(range(8)))
        telemetry = [t.name for t in threading.enumerate() if "telemetry" in t.name]
        release = threading.Event()
        hold_hub_session_lock(release)
        started = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            metrics = trainer.evaluate()
        seconds = time.perf_counter() - started
        release.set()
        trainer.close_environments()
        print(json.dumps({{"seconds": seconds, "telemetry_threads": telemetry, "keys": sorted(metrics),
                          "warnings": [str(w.message) for w in caught if "did not start" in str(w.message)]}}))
    ''', tmp_path, timeout=300, environment={"HF_ENDPOINT": black_hole_endpoint})

    assert result["telemetry_threads"], "TRL sent no telemetry ping: the scenario did not run TRL's path outside CI"
    assert "eval_env/success_rate" in result["keys"]
    assert result["warnings"] == []  # every worker started at its first fork
    assert result["seconds"] < 60


@pytest.mark.timeout(300)
def test_a_worker_that_does_not_start_is_replaced_after_the_start_timeout_and_the_warning_names_the_threads(tmp_path):
    """Forked from a process whose thread holds the hub session's lock (here: a factory that cannot be pickled, so
    the pool forks its workers itself), a worker never starts; after `start_timeout` it is killed, counted and forked
    again, and the warning names the threads that ran at the fork. The lock is released when the first warning is
    shown: the second fork starts, and the pool plays its episodes."""
    result = run_script('''
        from gigpo_trl.env_pool import EnvPool
        from gigpo_trl.fork_server import ForkServer
        from gigpo_trl.tasks import Task
        guard = threading.Lock()
        def make_compass_grid():  # reads a lock, so cloudpickle cannot send it: the pool forks its workers itself
            with guard:
                return CompassGrid()
        server = ForkServer()  # born before the lock is taken
        release = threading.Event()
        released = hold_hub_session_lock(release)
        shown = []
        def show(message, category, *args, **kwargs):
            shown.append(str(message))
            if "did not start" in str(message):
                release.set()
                released.wait()
        warnings.showwarning = show
        warnings.simplefilter("always")
        started = time.perf_counter()
        pool = EnvPool(make_compass_grid, 1, 2, start_timeout=2.0, fork_server=server)
        outputs = pool.reset([Task(seed=0)])
        stepped = pool.step({0: "north", 1: "south"})
        print(json.dumps({"seconds": time.perf_counter() - started, "start_failures": pool.num_start_failures,
                          "observations": [o.observation for o in outputs] + [stepped[i].observation for i in (0, 1)],
                          "shown": shown}))
        pool.close()
        server.close()
    ''', tmp_path, timeout=240)

    assert result["start_failures"] >= 1
    assert result["observations"] == ["The exit is 2 rooms north."] * 2 + ["The exit is 1 rooms north.",
                                                                           "The exit is 2 rooms north."]
    assert any("cannot be sent to the environment fork server" in message for message in result["shown"])
    start_warnings = [message for message in result["shown"] if "did not start within 2 s" in message]
    assert start_warnings and "hub-request-in-flight" in start_warnings[0] and "forked again" in start_warnings[0]
    assert result["seconds"] < 60


@pytest.mark.timeout(300)
def test_a_fork_server_forked_while_a_thread_holds_the_lock_is_started_again_once_it_is_free(tmp_path):
    """A fork server told to fork this process (`start_method="fork"`) while another thread holds the lock does not
    start; it is killed and forked again after the start timeout, with a warning naming the threads; then its workers
    serve an environment defined in the script."""
    result = run_script('''
        from gigpo_trl.env_pool import EnvPool
        from gigpo_trl.fork_server import ForkServer
        from gigpo_trl.tasks import Task
        release = threading.Event()
        released = hold_hub_session_lock(release)
        shown = []
        def show(message, category, *args, **kwargs):
            shown.append(str(message))
            release.set()
            released.wait()
        warnings.showwarning = show
        warnings.simplefilter("always")
        server = ForkServer(start_timeout=2.0, start_method="fork")
        pool = EnvPool(CompassGrid, 2, 2, fork_server=server)
        outputs = pool.reset([Task(seed=0), Task(seed=1)])
        print(json.dumps({"server_start_failures": server.start_failures, "shown": shown,
                          "observations": [o.observation for o in outputs]}))
        pool.close()
        server.close()
    ''', tmp_path, timeout=240)

    assert result["server_start_failures"] == 1
    assert len(result["shown"]) == 1 and "hub-request-in-flight" in result["shown"][0]
    assert result["observations"] == ["The exit is 2 rooms north."] * 4


# In the three scenarios below a thread holds the hub session's lock from before the pool, the trainer or the command
# is built until after its first reset has been played: longer than the start timeouts (20 s, 3 attempts), which a fork
# of this process would spend waiting before WorkerStartError. The environment is the script's own, in __main__.
HOLD_THROUGHOUT = '''
release = threading.Event()
released = hold_hub_session_lock(release)
caught = warnings.catch_warnings(record=True)
shown = caught.__enter__()
warnings.simplefilter("always")
'''
REPORT = '''
still_held = not released.is_set()
release.set()
caught.__exit__(None, None, None)
print(json.dumps({"still_held": still_held, "start_method": server.start_method, "seconds": seconds,
                  "observations": observations,
                  "start_warnings": [str(w.message) for w in shown if "did not start" in str(w.message)]}))
'''


def assert_started_beside_the_held_lock(result: dict, observations: list[str]) -> None:
    assert result["still_held"]  # the first reset was played while the lock was held
    assert result["start_method"] == "spawn"  # threads ran: a fresh interpreter, not a fork of this process
    assert result["start_warnings"] == []  # the server and every worker started at their first try
    assert result["observations"] == observations


@pytest.mark.timeout(300)
def test_a_pool_built_directly_while_a_thread_holds_the_lock_plays_its_first_reset_at_once(tmp_path):
    """`EnvPool(MyEnv, ...)` built while a thread holds the hub session's lock (the issue's scenario): the pool's own
    fork server starts as a fresh interpreter, receives the `__main__` class by value, and its workers reset and
    step."""
    result = run_script(HOLD_THROUGHOUT + '''
from gigpo_trl import EnvPool
from gigpo_trl.tasks import Task
started = time.perf_counter()
pool = EnvPool(CompassGrid, num_groups=2, group_size=2)
server = pool._fork_server
observations = [o.observation for o in pool.reset([Task(seed=0), Task(seed=1)])]
observations.append(pool.step({0: "north"})[0].observation)
seconds = time.perf_counter() - started
pool.close()
''' + REPORT, tmp_path, timeout=240)

    assert_started_beside_the_held_lock(result, ["The exit is 2 rooms north."] * 4 + ["The exit is 1 rooms north."])


@pytest.mark.timeout(400)
def test_a_second_trainer_built_while_a_thread_holds_the_lock_plays_its_first_rollout(
        tmp_path, tiny_model_path, black_hole_endpoint):
    """A second `GiGPOTrainer` in one process (a notebook's next cell) built while a hub request is in flight: its
    fork server is started while threads run (the first trainer's telemetry ping, the lock holder), as a fresh
    interpreter, and its evaluation plays the environment registered from `__main__`."""
    result = run_script(f'''
from gigpo_trl import GiGPOConfig, GiGPOTrainer, register_env, task_dataset
register_env("compass_grid", CompassGrid)
def build(name):
    config = GiGPOConfig(output_dir=name, env_name="compass_grid", num_generations=2, per_device_train_batch_size=4,
                         per_device_eval_batch_size=4, max_env_steps=2, max_completion_length=4, report_to=[],
                         bf16=False, eval_greedy=True)
    return GiGPOTrainer({tiny_model_path!r}, args=config, train_dataset=task_dataset(range(4)),
                        eval_dataset=task_dataset(range(4)))
first = build("first")
''' + HOLD_THROUGHOUT + '''
started = time.perf_counter()
second = build("second")
server = second._fork_server
metrics = second.evaluate()
seconds = time.perf_counter() - started
observations = [key for key in metrics if key == "eval_env/success_rate"]
second.close_environments()
first.close_environments()
''' + REPORT, tmp_path, timeout=300, environment={"HF_ENDPOINT": black_hole_endpoint})

    assert_started_beside_the_held_lock(result, ["eval_env/success_rate"])


@pytest.mark.timeout(400)
def test_the_evaluation_command_run_while_a_thread_holds_the_lock_plays_its_panel(
        tmp_path, tiny_model_path, black_hole_endpoint):
    """The evaluation command (recipes/evaluate.py's `main`) run from a script while a thread holds the lock: the
    trainer it builds starts its fork server as a fresh interpreter, and it plays a panel of an environment registered
    from `__main__`."""
    result = run_script(HOLD_THROUGHOUT + f'''
import importlib.util
from gigpo_trl import register_env
register_env("compass_grid", CompassGrid)
spec = importlib.util.spec_from_file_location("evaluate_recipe", {str(REPO / "recipes" / "evaluate.py")!r})
command = sys.modules.setdefault("evaluate_recipe", importlib.util.module_from_spec(spec))
spec.loader.exec_module(command)
servers = []
built = command.GiGPOTrainer.__init__
def build_and_keep_its_server(self, *args, **kwargs):
    built(self, *args, **kwargs)
    servers.append(self._fork_server)
command.GiGPOTrainer.__init__ = build_and_keep_its_server
started = time.perf_counter()
command.main(*command.parse(["--model_name_or_path", {tiny_model_path!r}, "--output_dir", "evaluation",
                             "--env_name", "compass_grid", "--max_env_steps", "2", "--panels", "dev", "--num_tasks",
                             "2", "--max_completion_length", "4", "--num_generations", "2",
                             "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "2",
                             "--report_to", "none", "--bf16", "false"]))
seconds = time.perf_counter() - started
server = servers[0]
observations = [json.loads(line)["panel"] for line in open("evaluation/episodes.jsonl")]
''' + REPORT, tmp_path, timeout=300, environment={"HF_ENDPOINT": black_hole_endpoint})

    assert_started_beside_the_held_lock(result, ["dev", "dev"])


def corridor_reading(lock: threading.Lock) -> Corridor:
    """A corridor factory that holds a lock once bound to one: cloudpickle cannot send it to a fork server."""
    with lock:
        return Corridor()


@pytest.mark.parametrize("forked_by", ["a forked fork server", "a spawned fork server", "this process"])
def test_no_worker_or_fork_server_keeps_a_port_the_trainer_has_closed(forked_by):
    """A child keeps the sockets it inherited open for as long as it lives: torch.distributed's store, listening on the
    process group's port when a pool forks, stayed taken after its process group ended, and the next one failed
    (EADDRINUSE; found running the vLLM tests two at a time). Workers forked by either kind of fork server, and those
    forked by this process (a factory that cannot be pickled), let go of every inherited socket."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    server = ForkServer(start_method="spawn" if forked_by == "a spawned fork server" else "fork")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the locked factory's "cannot be sent to the environment fork server"
        factory = functools.partial(corridor_reading, threading.Lock()) if forked_by == "this process" else Corridor
        pool = EnvPool(factory, 1, 2, fork_server=server)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the lambda's "cannot be sent to the fork server"
        pool = EnvPool(Corridor if forked_by == "the fork server" else lambda: Corridor(), 1, 2)
    assert pool.reset([Task(seed=0)])[0].observation.startswith("You are in cell 0")
    listener.close()
    again = socket.socket()
    again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        again.bind(("127.0.0.1", port))  # EADDRINUSE while a child still holds the listening socket
        again.listen()
    finally:
        again.close()
        pool.close()
        server.close()
