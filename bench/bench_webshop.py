"""WebShop (`gigpo_trl.environments.webshop`): one task group's step groups under both anchors, and what a step, a
search, a rollout turn and a worker's memory cost, in one script.

    python bench/bench_webshop.py --step-groups    # one task group's step groups under both anchors
    python bench/bench_webshop.py                  # costs: a step per page kind, a search, a pool's turn, a worker

`--step-groups`: four copies of one task of the generated shop (one option group a product), played by scripts: the
oracle (search the instruction, click the goal's product, its option, buy); the same search, then a near miss over the
price, bought; the same search and the goal's product bought without its option; a search of the product type alone,
its first result bought. Their steps are grouped as GiGPO groups them under `anchor="state"` (the exact page state) and
`anchor="observation"` (verl-agent's: the page's text after the instruction), with each step's reward and step
advantage (gamma 0.95, mean-std normalisation, the state anchor's groups).

The costs (no flag): a step's time on each page kind (median over 200 tasks of the default shop, in process); BM25 per
query at 1,000 and 100,000 generated products (the instructions of 200 tasks, one query a call); one rollout turn of
`--envs` live episodes searching, through an `EnvPool`; and the memory of a worker (`--memory-workers` of them, started
as fresh interpreters) whose shop's index is its own in memory, or the index saved once per machine and memory-mapped.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

from gigpo_trl.advantages import anchor_step_groups, compute_gigpo_advantages
from gigpo_trl.env_pool import EnvPool
from gigpo_trl.environments.retrieval import BM25Retriever, Passage
from gigpo_trl.environments.webshop import ANALYZER, ShopSettings, WebShopEnv, generate_shop, generated_catalogue
from gigpo_trl.fork_server import ForkServer
from gigpo_trl.paths import CACHE_ENV_VAR
from gigpo_trl.tasks import Task

MIB = 1 << 20


def step_groups(seed: int) -> None:
    env = WebShopEnv()
    env.reset(seed=seed)
    search, target, option, buy = env.walkthrough
    env.step(search)
    prices = env.catalogue.prices
    shown = [action for action in env._session.admissible_actions() if action.startswith("click[b0")]
    over_price = next(action for action in shown if prices[action[6:-1].upper()] > env.goal.price_upper)
    scripts = {"oracle": env.walkthrough, "a near miss over the price": [search, over_price, buy],
               "the goal's product, no option": [search, target, buy],
               "the type alone, first result": [f"search[{env.goal.query}]", None, buy]}
    rows = []  # (copy, step, page, action, state anchor, observation anchor, reward)
    for copy, (name, actions) in enumerate(scripts.items()):
        anchors = {}
        for anchor in ("state", "observation"):
            play = WebShopEnv(anchor=anchor)
            _, info = play.reset(seed=seed)
            steps = []
            for step, action in enumerate(actions):
                if action is None:  # the first product of the page
                    action = next(a for a in info["admissible_actions"] if a.startswith("click[b0"))
                page = play._session.page
                before = info["anchor"]
                _, reward, done, _, info = play.step(action)
                steps.append((step, page, action, before, reward))
                if done:
                    break
            anchors[anchor] = steps
        for (step, page, action, state, reward), (_, _, _, observation, _) in zip(anchors["state"],
                                                                                 anchors["observation"]):
            rows.append((copy, name, step, page, action, state, observation, reward))
    groups = {anchor: anchor_step_groups([0] * len(rows), [row[5 + k] for row in rows], [row[2] for row in rows])
              for k, anchor in enumerate(("state", "observation"))}
    advantages = compute_gigpo_advantages([row[7] for row in rows], [0] * len(rows), [row[0] for row in rows],
                                          [row[2] for row in rows], [row[5] for row in rows])
    print(f"Task {seed}: {env.goal.instruction}\n")
    print("| copy | step | page | action | reward | step group (state) | step group (observation) | step advantage |")
    print("|---|---|---|---|---|---|---|---|")
    for k, (copy, name, step, page, action, *_, reward) in enumerate(rows):
        print(f"| {copy}: {name} | {step} | {page} | `{action[:60]}` | {reward:.2f} | {groups['state'][k]} | "
              f"{groups['observation'][k]} | {advantages.step_advantages[k]:+.2f} |")


def costs(envs: int, memory_workers: int, repeats: int) -> None:
    print(f"CPU: {_cpu()}; {psutil.cpu_count()} cores\n")
    env = WebShopEnv()
    timings: dict[str, list[float]] = {"search page (a search)": [], "results page (a product)": [],
                                       "item page (an option)": [], "item page (buy now)": [],
                                       "item page (a sub-page)": []}
    for seed in range(200):
        env.reset(seed=seed)
        search, product, option, buy = env.walkthrough
        timings["search page (a search)"].append(_seconds(lambda: env.step(search)))
        timings["results page (a product)"].append(_seconds(lambda: env.step(product)))
        timings["item page (a sub-page)"].append(_seconds(lambda: env.step("click[features]")))
        env.step("click[< prev]")
        timings["item page (an option)"].append(_seconds(lambda: env.step(option)))
        timings["item page (buy now)"].append(_seconds(lambda: env.step(buy)))
    print("A step on each page kind (the default shop of 1,000 products, median of 200 tasks)\n")
    print("| step | time |")
    print("|---|---|")
    for name, values in timings.items():
        print(f"| {name} | {1e3 * statistics.median(values):.2f} ms |")

    print("\n| generated shop | generated | indexed once per machine | one query a call (median of 200 instructions) |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        os.environ[CACHE_ENV_VAR] = str(Path(folder) / "cache")  # a cold cache: the index is built here
        for size in (1_000, 100_000):
            settings = ShopSettings(num_products=size)
            started = time.perf_counter()
            generate_shop(settings)
            generated = time.perf_counter() - started
            started = time.perf_counter()
            catalogue = generated_catalogue(settings)
            indexed = time.perf_counter() - started
            queries = [catalogue.goal_of(seed).instruction.lower() for seed in range(200)]
            one = statistics.median(_seconds(lambda q=q: catalogue.search(q, 50)) for q in queries)
            print(f"| {size:,} products | {generated:.2f} s | {indexed:.1f} s | {1e3 * one:.2f} ms |")

        searches = {k: [f"search[{WebShopEnv().reset(seed=k)[1]['task'].lower()}]"] for k in range(envs)}
        print(f"\nOne rollout turn of {envs} live episodes, each a search, through an EnvPool (median of {repeats})\n")
        print("| shop | the turn | per episode |")
        print("|---|---|---|")
        with EnvPool(WebShopEnv, envs, 1) as pool:
            turn = []
            for _ in range(repeats):
                pool.reset([Task(seed=k) for k in range(envs)])
                turn.append(_seconds(lambda: pool.step({k: actions[0] for k, actions in searches.items()})))
        print(f"| 1,000 products, the index memory-mapped | {1e3 * statistics.median(turn):.1f} ms | "
              f"{1e3 * statistics.median(turn) / envs:.2f} ms |")

        print(f"\nA worker's memory after one search, 100,000 products (median of {memory_workers} workers, each a "
              "fresh interpreter)\n")
        print("| index | RSS | USS |")
        print("|---|---|---|")
        arms = {"its own, in memory": functools.partial(_own_index_env, 100_000),
                "saved once, memory-mapped": functools.partial(WebShopEnv, num_products=100_000)}
        for arm, factory in arms.items():
            fork_server = ForkServer(start_method="spawn")
            try:
                with EnvPool(factory, memory_workers, 1, fork_server=fork_server, reset_timeout=1200) as pool:
                    pool.reset([Task(seed=k) for k in range(memory_workers)])
                    pool.step({k: searches[k][0] for k in range(memory_workers)})
                    memory = [psutil.Process(worker.process.pid).memory_full_info() for worker in pool._workers]
            finally:
                fork_server.close()
            print(f"| {arm} | {statistics.median(m.rss for m in memory) / MIB:.0f} MiB | "
                  f"{statistics.median(m.uss for m in memory) / MIB:.0f} MiB |")


def _own_index_env(num_products: int) -> WebShopEnv:
    """A WebShop environment whose worker indexes its shop in its own memory (no saved index)."""
    env = WebShopEnv(num_products=num_products)
    products = env.catalogue.products.values()
    own = BM25Retriever([Passage(product.asin, product.document) for product in products], ANALYZER)
    env.catalogue = dataclasses.replace(env.catalogue, search_index=own)
    return env


def _seconds(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def _cpu() -> str:
    lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout.splitlines()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name")), "unknown")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-groups", action="store_true", help="one task group's step groups under both anchors")
    parser.add_argument("--seed", type=int, default=2, help="the task (--step-groups)")
    parser.add_argument("--envs", type=int, default=64, help="live episodes of the pool's turn")
    parser.add_argument("--memory-workers", type=int, default=4, help="workers whose memory is measured, an arm")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats of a turn")
    options = parser.parse_args(argv)
    if options.step_groups:
        step_groups(options.seed)
    else:
        costs(options.envs, options.memory_workers, options.repeats)


if __name__ == "__main__":
    main()
