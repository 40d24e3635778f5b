"""Benchmark of EnvPool: 128 environments stepped in worker processes against the same 128 stepped
one after the other in this process, side by side, for TextWorld cooking games, TextWorldExpress cookingworld
(its engine's default size: 11 rooms, 3 ingredients; one JVM per environment) and Sokoban; and ScienceWorld's
costs: its valid actions fetched three ways, and a pool of 16 tasks x 8 copies (128 JVMs) with its memory.

    python bench/bench_env_pool.py                       # 16 tasks x 8 copies, 20 turns each, every environment
    python bench/bench_env_pool.py --turns 5 --only sokoban scienceworld

Every turn steps all 128 environments once with one of their admissible actions (the same seeded
choices in both modes); the resets of the one-process run are timed too (games already cached). The first run generates the 16 cooking games into the cache (about 1 s each).
ScienceWorld's pool plays commands drawn from the first room's (valid actions are off by default there: thousands
of them, about 30 ms a step); its memory is the growth of the machine's used memory (MemTotal - MemAvailable) per
environment, worker process and JVM included.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from gigpo_trl.env_pool import EnvPool
from gigpo_trl.envs import env_factory
from gigpo_trl.tasks import Task

ENVIRONMENTS = {
    "textworld cooking": ("textworld", {"challenge": "cooking"}),
    "twx cookingworld": ("textworld_express", {"game": "cookingworld"}),
    "sokoban 6x6": ("sokoban", {}),
}
SCIENCEWORLD_TASK = "boil"


def play_sequentially(name: str, kwargs: dict, tasks: list[Task], group_size: int,
                      turns: int) -> tuple[float, float, int]:
    """Returns the seconds of the resets, the seconds of the turns and the steps taken."""
    make = env_factory(name, **kwargs)
    envs = [make() for _ in range(len(tasks) * group_size)]
    started = time.perf_counter()
    outputs = [env.reset(seed=tasks[i // group_size].seed) for i, env in enumerate(envs)]
    reset_s = time.perf_counter() - started
    choose = random.Random(0)
    infos = [info for _, info in outputs]
    live = set(range(len(envs)))
    steps, started = 0, time.perf_counter()
    for _ in range(turns):
        for i in sorted(live):
            _, _, terminated, truncated, infos[i] = envs[i].step(choose.choice(infos[i]["admissible_actions"]))
            steps += 1
            if terminated or truncated:
                live.discard(i)
    seconds = time.perf_counter() - started
    for env in envs:
        env.close()
    return reset_s, seconds, steps


def play_in_pool(name: str, kwargs: dict, tasks: list[Task], group_size: int, turns: int) -> tuple[float, int]:
    with EnvPool(env_factory(name, **kwargs), len(tasks), group_size, name=name) as pool:
        outputs = dict(enumerate(pool.reset(tasks)))
        choose = random.Random(0)
        live = set(range(pool.num_envs))
        steps, started = 0, time.perf_counter()
        for _ in range(turns):
            actions = {i: choose.choice(outputs[i].info["admissible_actions"]) for i in sorted(live)}
            outputs.update(pool.step(actions))
            steps += len(actions)
            live -= {i for i in actions if outputs[i].done}
        return time.perf_counter() - started, steps


def used_memory_mib() -> float:
    fields = {line.split(":")[0]: int(line.split()[1]) for line in open("/proc/meminfo")}
    return (fields["MemTotal"] - fields["MemAvailable"]) / 1024


def scienceworld_valid_actions(repeats: int = 12) -> None:
    """The valid actions of one ScienceWorld state fetched three ways, and a step with and without them, with the
    environment's JVM (JVM_OPTIONS) and with the JVM's quick JIT only (25 MB less memory per JVM)."""
    from gigpo_trl.environments.scienceworld_games import JVM_OPTIONS, ScienceWorldEnv  # noqa: PLC0415

    for label, jvm_options in (("JVM_OPTIONS", JVM_OPTIONS), ("quick JIT only", (*JVM_OPTIONS, "-XX:TieredStopAtLevel=1"))):
        env = ScienceWorldEnv(SCIENCEWORLD_TASK, admissible_actions=True, jvm_options=jvm_options)
        env.reset(seed=0)
        count = len(env.step("teleport to kitchen")[4]["admissible_actions"])
        engine = env._engine
        ways = {
            "py4j list, as the wrapper": lambda: list(engine.server.getValidActionObjectCombinations()),
            "JSON with templates": lambda: engine.get_valid_action_object_combinations_with_templates(),
            "joined in the JVM, one string": lambda: engine._gateway.jvm.java.lang.String.join(
                "\n", engine.server.getValidActionObjectCombinations()).split("\n"),
        }
        print(f"ScienceWorld {SCIENCEWORLD_TASK}, the kitchen ({count} valid actions), {label} {' '.join(jvm_options)}:")
        for way, fetch in ways.items():
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                fetch()
                times.append(time.perf_counter() - started)
            print(f"  valid actions, {way:30s} median {1e3 * statistics.median(times):6.1f} ms")
        for admissible in (False, True):
            env.admissible_actions = admissible
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                env.step("look at stove")
                times.append(time.perf_counter() - started)
            print(f"  a step {'with' if admissible else 'without'} info['admissible_actions']: median "
                  f"{1e3 * statistics.median(times):6.1f} ms")
        env.close()


def scienceworld_pool(tasks: list[Task], group_size: int, turns: int) -> None:
    """A pool of ScienceWorld environments (one worker process and one JVM each): memory and steps per second."""
    commands = ["look around", "inventory", "open door to kitchen", "go to kitchen", "teleport to kitchen",
                "pick up thermometer", "open cupboard", "look at stove", "focus on water", "wait1"]
    before = used_memory_mib()
    started = time.perf_counter()
    with EnvPool(env_factory("scienceworld", task=SCIENCEWORLD_TASK), len(tasks), group_size, step_timeout=120,
                 name="scienceworld") as pool:
        pool.reset(tasks)
        reset_s = time.perf_counter() - started
        memory = (used_memory_mib() - before) / pool.num_envs
        choose = random.Random(0)
        live, steps, started = set(range(pool.num_envs)), 0, time.perf_counter()
        for _ in range(turns):
            outputs = pool.step({i: choose.choice(commands) for i in sorted(live)})
            steps += len(outputs)
            live -= {i for i, output in outputs.items() if output.done}
        seconds = time.perf_counter() - started
        memory = max(memory, (used_memory_mib() - before) / pool.num_envs)
    print(f"  pool of {pool.num_envs} ({len(tasks)} tasks x {group_size} copies): first reset {reset_s:.0f} s (JVM "
          f"starts), {steps / seconds:.1f} steps/s ({1e3 * seconds / turns:.0f} ms per turn), {memory:.0f} MiB per "
          f"environment ({memory * pool.num_envs / 1024:.1f} GiB for the pool)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--only", nargs="+", metavar="NAME", help="environments to measure (default: all): "
                        + ", ".join([*(name for name, _ in ENVIRONMENTS.values()), "scienceworld"]))
    args = parser.parse_args()
    tasks = [Task(seed=seed) for seed in range(args.tasks)]  # seeds of every environment's train fold
    num_envs = args.tasks * args.group_size
    print(f"{num_envs} environments ({args.tasks} tasks x {args.group_size} copies), up to {args.turns} turns")
    for label, (name, kwargs) in ENVIRONMENTS.items():
        if args.only and name not in args.only:
            continue
        play_sequentially(name, kwargs, tasks, args.group_size, 1)  # generate and cache the games first
        reset_s, sequential_s, sequential_steps = play_sequentially(name, kwargs, tasks, args.group_size, args.turns)
        pool_s, pool_steps = play_in_pool(name, kwargs, tasks, args.group_size, args.turns)
        print(f"  {label:18s} one process: {sequential_steps / sequential_s:8.0f} steps/s "
              f"({1e3 * sequential_s / args.turns:6.1f} ms per turn of {num_envs})   "
              f"pool: {pool_steps / pool_s:8.0f} steps/s ({1e3 * pool_s / args.turns:6.1f} ms per turn)   "
              f"pool / one process: {(pool_steps / pool_s) / (sequential_steps / sequential_s):.2f}x   "
              f"reset: {1e3 * reset_s / num_envs:.1f} ms each")
    if not args.only or "scienceworld" in args.only:
        scienceworld_valid_actions()
        scienceworld_pool(tasks, args.group_size, args.turns)


if __name__ == "__main__":
    main()
