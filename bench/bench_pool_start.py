"""Time to an `EnvPool`'s first reset, by how its fork server starts (`gigpo_trl.fork_server`), with and without
another thread holding huggingface_hub's HTTP session lock while the pool is built.

    python bench/bench_pool_start.py                       # 4 and 32 workers, 3 rounds
    python bench/bench_pool_start.py --workers 4 --rounds 5 --start-timeout 5

Arms: "fork" forks this process into the fork server (what every pool did before the server could be spawned, and
what "auto" still does while this process runs one thread); "spawn" starts it as a fresh interpreter (what "auto"
does while other threads run). Each measurement runs in a fresh Python reading its script from standard input, as a
notebook cell would: the environment is a class of its `__main__` (sent by value), or compass by its registered name.
Measured: seconds from `EnvPool(...)` to the first reset's observations (the server's start, every worker's fork and
start, and one reset each), and the process's CPU seconds over the same span (the server's and workers' not
included). A pool that does not start reports the error and the seconds until it was raised. The arms alternate
within a round (fork first in even rounds), so the machine's load falls on both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SCRIPT = '''
import json, sys, threading, time
from huggingface_hub.utils import get_session

class Corridor:
    """Walk right to the end of a corridor of 4 cells."""
    def reset(self, *, seed=None, options=None):
        self.cell = 0
        return f"You are in cell {{self.cell}}.", {{"anchor": self.cell}}
    def step(self, action):
        self.cell += action == "right"
        won = self.cell == 3
        return f"You are in cell {{self.cell}}.", float(won), won, False, {{"anchor": self.cell, "won": won}}
    def close(self):
        pass

lock, held, release = get_session()._transport._pool._optional_thread_lock, threading.Event(), threading.Event()
def hold():
    with lock:
        held.set()
        release.wait()
if {hold_lock}:
    threading.Thread(target=hold, name="hub-request-in-flight", daemon=True).start()
    held.wait()
from gigpo_trl import EnvPool
from gigpo_trl.envs import env_factory
from gigpo_trl.fork_server import ForkServer
from gigpo_trl.tasks import Task
factory = Corridor if {environment!r} == "main" else env_factory("compass")
started, cpu = time.perf_counter(), time.process_time()
try:
    server = ForkServer(start_timeout={start_timeout}, start_method={method!r})
    pool = EnvPool(factory, num_groups={workers} // 4, group_size=4, fork_server=server)
    observations = pool.reset([Task(seed=seed) for seed in range({workers} // 4)])
    result = {{"seconds": time.perf_counter() - started, "cpu_s": time.process_time() - cpu, "error": None}}
    pool.close()
    server.close()
except Exception as exc:
    result = {{"seconds": time.perf_counter() - started, "cpu_s": time.process_time() - cpu,
               "error": type(exc).__name__}}
release.set()
print(json.dumps(result))
'''


def measure(method: str, workers: int, hold_lock: bool, environment: str, start_timeout: float) -> dict:
    """One pool's start in a fresh Python; its seconds, CPU seconds and error (None if it started)."""
    script = SCRIPT.format(method=method, workers=workers, hold_lock=hold_lock, environment=environment,
                           start_timeout=start_timeout)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CI", None)
    finished = subprocess.run([sys.executable, "-"], input=textwrap.dedent(script), capture_output=True, text=True,
                              env=env, cwd=REPO, check=True)
    return json.loads(finished.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[4, 32], help="pool sizes (multiples of 4)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--start-timeout", type=float, default=20.0, help="ForkServer's (the default: 20 s)")
    parser.add_argument("--environments", nargs="+", default=["main", "compass"], choices=["main", "compass"])
    args = parser.parse_args()
    rows = []
    for environment in args.environments:
        for workers in args.workers:
            for hold_lock in (False, True):
                results: dict[str, list[dict]] = {"fork": [], "spawn": []}
                for round_ in range(args.rounds):
                    for method in ("fork", "spawn")[:: 1 if round_ % 2 == 0 else -1]:
                        if hold_lock and method == "fork" and results["fork"]:
                            continue  # it fails every time, after 3 start timeouts: once is enough
                        results[method].append(measure(method, workers, hold_lock, environment, args.start_timeout))
                for method, runs in results.items():
                    errors = {run["error"] for run in runs} - {None}
                    row = {"environment": environment, "workers": workers, "lock held": hold_lock, "method": method,
                           "runs": len(runs), "median s": statistics.median(run["seconds"] for run in runs),
                           "min s": min(run["seconds"] for run in runs), "max s": max(run["seconds"] for run in runs),
                           "median CPU s (this process)": statistics.median(run["cpu_s"] for run in runs),
                           "error": ", ".join(sorted(errors)) or "-"}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    print("\n| " + " | ".join(rows[0]) + " |\n|" + "---|" * len(rows[0]))
    for row in rows:
        print("| " + " | ".join(f"{value:.2f}" if isinstance(value, float) else str(value) for value in row.values())
              + " |")


if __name__ == "__main__":
    main()
