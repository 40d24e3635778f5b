"""Benchmark of EnvPool: 128 environments stepped in worker processes against the same 128 stepped
one after the other in this process, side by side, for TextWorld cooking games, TextWorldExpress cookingworld
(its engine's default size: 11 rooms, 3 ingredients; one JVM per environment) and Sokoban.

    python bench/bench_env_pool.py            # 16 tasks x 8 copies, 20 turns each
    python bench/bench_env_pool.py --turns 5  # quicker

Every turn steps all 128 environments once with one of their admissible actions (the same seeded
choices in both modes). The first run generates the 16 cooking games into the cache (about 1 s each).
"""

from __future__ import annotations

import argparse
import random
import time

from gigpo_trl.env_pool import EnvPool
from gigpo_trl.envs import env_factory
from gigpo_trl.tasks import Task

ENVIRONMENTS = {
    "textworld cooking": ("textworld", {"challenge": "cooking"}),
    "twx cookingworld": ("textworld_express", {"game": "cookingworld"}),
    "sokoban 6x6": ("sokoban", {}),
}


def play_sequentially(name: str, kwargs: dict, tasks: list[Task], group_size: int, turns: int) -> tuple[float, int]:
    make = env_factory(name, **kwargs)
    envs = [make() for _ in range(len(tasks) * group_size)]
    outputs = [env.reset(seed=tasks[i // group_size].seed) for i, env in enumerate(envs)]
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
    return seconds, steps


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--turns", type=int, default=20)
    args = parser.parse_args()
    tasks = [Task(seed=seed) for seed in range(args.tasks)]  # seeds of every environment's train fold
    num_envs = args.tasks * args.group_size
    print(f"{num_envs} environments ({args.tasks} tasks x {args.group_size} copies), up to {args.turns} turns")
    for label, (name, kwargs) in ENVIRONMENTS.items():
        play_sequentially(name, kwargs, tasks, args.group_size, 1)  # generate and cache the games first
        sequential_s, sequential_steps = play_sequentially(name, kwargs, tasks, args.group_size, args.turns)
        pool_s, pool_steps = play_in_pool(name, kwargs, tasks, args.group_size, args.turns)
        print(f"  {label:18s} one process: {sequential_steps / sequential_s:8.0f} steps/s "
              f"({1e3 * sequential_s / args.turns:6.1f} ms per turn of {num_envs})   "
              f"pool: {pool_steps / pool_s:8.0f} steps/s ({1e3 * pool_s / args.turns:6.1f} ms per turn)   "
              f"pool / one process: {(pool_steps / pool_s) / (sequential_steps / sequential_s):.2f}x")


if __name__ == "__main__":
    main()
