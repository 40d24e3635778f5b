"""The JVM's start options (`gigpo_trl.environments.jvm.START_OPTIONS`: no performance-data file, the log on stderr)
measured against the JVM's own defaults, side by side in one run, for TextWorldExpress (cookingworld at the engine's
default size) and ScienceWorld (boil).

    python bench/bench_jvm_start.py                      # both engines, 8 environments per arm, 3 rounds
    python bench/bench_jvm_start.py --only textworld_express --envs 32 --rounds 2

"before" gives the JVM its defaults back through the user's JAVA_TOOL_OPTIONS, which come after START_OPTIONS and
win (`-XX:+UsePerfData -Xlog:all=warning:stdout`); "after" is what the environments do now. A round starts K
environments per arm, one after the other, the arms alternating start by start (before first, then after first),
so that the machine's load falls on both alike, and keeps all 2K alive. Start: the seconds from `make_env` to the
first observation (the JVM's start, the game's load and reset), and the CPU seconds the JVM had used by then (less
sensitive to other processes than the wall clock). Memory: after every environment of the round has played
`--steps` steps, the resident set (RSS) and the unique set (USS: the pages no other process shares, what one more
JVM costs) of each environment's java process. Medians over every start of an arm, the median of the paired
differences (the n-th start of each arm ran one after the other) with how often "after" was lower, and how many of
the arm's JVMs map a performance-data file (/tmp/hsperfdata_<user>/<pid>), which shows the arms differ as they
should.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import psutil

from gigpo_trl.envs import make_env

ENGINES = {
    "textworld_express": {"game": "cookingworld"},
    "scienceworld": {"task": "boil"},
}
ARMS = {
    "before": "-XX:+UsePerfData -Xlog:all=warning:stdout",  # the JVM's defaults for what START_OPTIONS change
    "after": "",
}
MIB = 2**20
MEASURES = ("start_s", "start_cpu_s", "rss_mib", "uss_mib")


def start_round(name: str, kwargs: dict, envs: int, steps: int, first: int) -> dict[str, list[dict]]:
    """Start `envs` environments per arm, one after the other, the arms alternating start by start; play `steps`
    steps in each; returns each one's start (seconds, and the CPU seconds its JVM had used by then) and its JVM's
    memory, per arm."""
    user_options = os.environ.get("JAVA_TOOL_OPTIONS")
    started = []
    try:
        for i in range(envs):
            for arm in list(ARMS)[::1 if (first + i) % 2 == 0 else -1]:
                os.environ["JAVA_TOOL_OPTIONS"] = " ".join(filter(None, [user_options, ARMS[arm]]))
                begin = time.perf_counter()
                env = make_env(name, **kwargs)
                env.reset(seed=i)
                seconds = time.perf_counter() - begin
                process = psutil.Process(env._engine._gateway.java_process.pid)
                cpu = process.cpu_times()
                started.append((arm, env, process, {"start_s": seconds, "start_cpu_s": cpu.user + cpu.system}))
        for _, env, _, _ in started:
            for _ in range(steps):
                env.step("look around")
        rows = {arm: [] for arm in ARMS}
        for arm, _, process, row in started:
            memory = process.memory_full_info()
            perf_data = any("hsperfdata" in region.path for region in process.memory_maps())
            rows[arm].append({**row, "rss_mib": memory.rss / MIB, "uss_mib": memory.uss / MIB,
                              "perf_data_files": int(perf_data)})
    finally:
        for _, env, _, _ in started:
            env.close()
        if user_options is None:
            os.environ.pop("JAVA_TOOL_OPTIONS", None)
        else:
            os.environ["JAVA_TOOL_OPTIONS"] = user_options
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=list(ENGINES), default=list(ENGINES))
    parser.add_argument("--envs", type=int, default=8, help="environments (JVMs) per arm alive at once in a round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per arm")
    parser.add_argument("--steps", type=int, default=5, help="steps each environment plays before its JVM is measured")
    parser.add_argument("--output", help="also write the medians and every measurement to this JSON file")
    args = parser.parse_args()

    results = {"arguments": vars(args), "engines": {}}
    for name in args.only:
        rows = {arm: [] for arm in ARMS}
        for round_ in range(args.rounds):
            for arm, arm_rows in start_round(name, ENGINES[name], args.envs, args.steps, first=round_).items():
                rows[arm] += arm_rows
        medians = {arm: {key: statistics.median(row[key] for row in arm_rows) for key in MEASURES}
                   for arm, arm_rows in rows.items()}
        results["engines"][name] = {"medians": medians, "rows": rows}
        print(f"\n{name} {ENGINES[name]}: {2 * args.envs} JVMs at once ({args.envs} per arm), {args.rounds} rounds "
              f"({args.envs * args.rounds} starts per arm); medians")
        print("| arm | start to first observation | the JVM's CPU time by then | RSS per JVM | USS per JVM | JVMs with a "
              "performance-data file |")
        print("|---|---|---|---|---|---|")
        for arm, median in medians.items():
            print(f"| {arm} | {median['start_s']:.3f} s | {median['start_cpu_s']:.3f} s | {median['rss_mib']:.1f} MiB | "
                  f"{median['uss_mib']:.1f} MiB | {sum(row['perf_data_files'] for row in rows[arm])} of {len(rows[arm])} |")
        paired = {key: [after[key] - before[key] for before, after in zip(rows["before"], rows["after"])]
                  for key in MEASURES}
        results["engines"][name]["paired_median_after_minus_before"] = {
            key: statistics.median(differences) for key, differences in paired.items()}
        print("after - before, start by start (the n-th start of each arm, one after the other): median "
              + ", ".join(f"{key} {statistics.median(differences):+.3f} (after lower in "
                          f"{sum(d < 0 for d in differences)} of {len(differences)})"
                          for key, differences in paired.items()))
    if args.output:
        with open(args.output, "w") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
