"""Benchmark of `compute_gigpo_advantages` against straightforward Python, side by side in one run.

    python bench/bench_advantages.py            # full run (about a minute on 2 cores)
    python bench/bench_advantages.py --quick    # smaller, for a smoke test

1. Exact grouping: 6,400 rows (16 groups x 8 trajectories x 50 steps) and 100,000 rows, anchors
   repeating as in real play, vs `naive_gigpo_advantages` (per-row Python loops over dicts); and the
   bootstrapped step value (`step_lambda=0.5`, docs/algorithm.md) beside the paper's (`step_lambda=1`).
2. Similarity grouping on text anchors vs a greedy `difflib.SequenceMatcher` baseline, with a
   check that both give the same clusters.

Times are medians of repeated runs in one process pinned to a single CPU core (Linux), so the
figures are single-core figures; rapidfuzz runs with workers=1.
"""

from __future__ import annotations

import argparse
import difflib
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from gigpo_trl.advantages import anchor_step_groups, compute_gigpo_advantages

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script (python bench/bench_advantages.py): the tests' oracle
    sys.path.insert(0, str(ROOT))
from tests.naive_advantages import naive_gigpo_advantages  # noqa: E402

# --------------------------------------------------------------------------------------------
# Baseline: plain Python, one row at a time. The exact path's baseline is the tests' oracle,
# tests/naive_advantages.py; the similarity baseline is difflib's.
# --------------------------------------------------------------------------------------------


def difflib_similarity_clusters(group_ids, step_indices, anchor_texts, threshold, autojunk=False):
    """Greedy clustering with difflib's ratio: per group, distinct anchors in (first step, text) order,
    each joins the first cluster whose seed has ratio >= threshold. Returns a cluster label per row.

    `autojunk=False` gives difflib's plain Ratcliff/Obershelp ratio; difflib's default `autojunk=True`
    is a speed heuristic that, on texts of 200+ characters, ignores characters occurring in more
    than 1% of positions when seeding matches, which lowers the ratio of near-identical texts."""
    first_step = {}
    for g, t, a in zip(group_ids, step_indices, anchor_texts):
        first_step[(g, a)] = min(t, first_step.get((g, a), t))
    anchors_of_group = defaultdict(list)
    for (g, a), t in first_step.items():
        anchors_of_group[g].append((t, a))
    label_of = {}
    for g, anchors in anchors_of_group.items():
        seeds = []
        for _, text in sorted(anchors):
            for k, seed in enumerate(seeds):
                if difflib.SequenceMatcher(None, text, seed, autojunk=autojunk).ratio() >= threshold:
                    label_of[(g, text)] = (g, k)
                    break
            else:
                label_of[(g, text)] = (g, len(seeds))
                seeds.append(text)
    return [label_of[(g, a)] for g, a in zip(group_ids, anchor_texts)]


def same_partition(labels_a, labels_b) -> bool:
    """True when two labelings put exactly the same rows together."""
    pairs = set(zip(labels_a, labels_b))
    return len(pairs) == len(set(labels_a)) == len(set(labels_b))


# --------------------------------------------------------------------------------------------
# Workloads.
# --------------------------------------------------------------------------------------------


def exact_rows(target_rows: int, num_steps: int, group_size: int, seed: int) -> dict:
    """Rows as the trainer produces them: N copies of a task walk a small state graph (states repeat
    across trajectories and within one), sparse success reward at the end, 5% invalid answers."""
    num_groups = target_rows // (group_size * num_steps)
    rng = np.random.default_rng(seed)
    n = num_groups * group_size * num_steps
    trajectory = np.repeat(np.arange(num_groups * group_size), num_steps)
    group = trajectory // group_size
    step = np.tile(np.arange(num_steps), num_groups * group_size)
    # Random walk on a 100-state graph per task: anchors repeat across and within trajectories.
    num_states = 100
    moves = rng.integers(0, num_states, size=(num_groups, num_states, 4))
    anchors = np.empty(n, dtype=np.int64)
    state = np.zeros(num_groups * group_size, dtype=np.int64)
    for t in range(num_steps):
        anchors[step == t] = group[step == t] * num_states + state
        state = moves[np.arange(num_groups * group_size) // group_size, state, rng.integers(0, 4, state.size)]
    won = rng.random(num_groups * group_size) < 0.4
    rewards = np.where((step == num_steps - 1) & won[trajectory], 10.0, 0.0)
    return {
        "rewards": rewards, "group_ids": group, "trajectory_ids": trajectory, "step_indices": step,
        "anchor_keys": anchors, "invalid": rng.random(n) < 0.05,
    }


def text_rows(num_groups: int, group_size: int, num_steps: int, seed: int = 0) -> dict:
    """Text anchors like TextWorld observations: a room description plus a varying detail (a coin
    counter, a carried item), so similar-but-not-identical states are common."""
    rng = np.random.default_rng(seed)
    rooms = [
        f"-= {name} =- You are in a {name.lower()}. "
        + " ".join(f"You see a {thing} here." for thing in rng.choice(THINGS, size=6, replace=False))
        for name in ROOMS
    ]
    columns = defaultdict(list)
    for g in range(num_groups):
        for j in range(group_size):
            for t in range(num_steps):
                room = rooms[int(rng.integers(0, len(rooms)))]
                columns["group_ids"].append(g)
                columns["trajectory_ids"].append(g * group_size + j)
                columns["step_indices"].append(t)
                columns["anchor_keys"].append(room + f" You carry {int(rng.integers(0, 4))} coins and a {rng.choice(THINGS)}.")
    columns["rewards"] = [0.0] * len(columns["group_ids"])
    return columns


ROOMS = ["Kitchen", "Pantry", "Garden", "Cellar", "Attic", "Bedroom", "Study", "Hallway", "Bathroom", "Garage"]
THINGS = ["red apple", "rusty key", "wooden chest", "knife", "carrot", "cookbook", "lamp", "coin purse",
          "shovel", "blue box", "potato", "old map", "fridge", "oven", "table", "chair"]


# --------------------------------------------------------------------------------------------
# Timing.
# --------------------------------------------------------------------------------------------


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_exact(rows: dict, repeats: int, naive_repeats: int, step_lambda: float = 0.5) -> tuple[float, float]:
    columns = [rows[k] for k in ("rewards", "group_ids", "trajectory_ids", "step_indices", "anchor_keys", "invalid")]
    lists = [c.tolist() for c in columns]
    for lam in (1.0, step_lambda):
        fast = compute_gigpo_advantages(*columns, step_lambda=lam)
        slow = naive_gigpo_advantages(*lists, step_lambda=lam)
        np.testing.assert_allclose(fast.advantages, slow[0], rtol=1e-9, atol=1e-9)
        np.testing.assert_array_equal(fast.step_group_sizes, slow[3])
    t_fast = median_seconds(lambda: compute_gigpo_advantages(*columns), repeats)
    t_lists = median_seconds(lambda: compute_gigpo_advantages(*lists), repeats)
    t_lambda = median_seconds(lambda: compute_gigpo_advantages(*columns, step_lambda=step_lambda), repeats)
    t_naive = median_seconds(lambda: naive_gigpo_advantages(*lists), naive_repeats)
    print(f"  {len(columns[0]):>7,} rows  engine {t_fast * 1e3:7.2f} ms (numpy input), {t_lists * 1e3:7.2f} ms (list input)"
          f"   naive Python {t_naive * 1e3:8.1f} ms   ratio {t_naive / t_fast:5.0f}x / {t_naive / t_lists:4.0f}x"
          f"   singleton share {fast.stats.singleton_share:.2f}")
    print(f"           step_lambda {step_lambda}: {t_lambda * 1e3:7.2f} ms (numpy input), {t_lambda / t_fast:.2f}x "
          "the paper's step value (step_lambda 1)")
    return max(t_fast, t_lists), t_naive


def bench_similarity(rows: dict, threshold: float, repeats: int) -> tuple[float, float, bool]:
    group_ids, steps, anchors = rows["group_ids"], rows["step_indices"], rows["anchor_keys"]
    labels = anchor_step_groups(group_ids, anchors, steps, similarity_threshold=threshold).tolist()
    t_fast = median_seconds(lambda: anchor_step_groups(group_ids, anchors, steps, similarity_threshold=threshold), repeats)
    columns = [rows[k] for k in ("rewards", "group_ids", "trajectory_ids", "step_indices", "anchor_keys")]
    t_full = median_seconds(lambda: compute_gigpo_advantages(*columns, similarity_threshold=threshold), repeats)
    print(f"  {len(anchors):>7,} text rows (about {len(anchors[0])} chars), threshold {threshold}: "
          f"engine clustering {t_fast * 1e3:.1f} ms, {max(labels) + 1} clusters "
          f"(whole compute_gigpo_advantages: {t_full * 1e3:.1f} ms)")
    results = {}
    for autojunk in (False, True):
        baseline = lambda: difflib_similarity_clusters(group_ids, steps, anchors, threshold, autojunk)  # noqa: E731
        t_base = median_seconds(baseline, 1)
        results[autojunk] = (t_base, same_partition(labels, baseline()))
        print(f"    difflib greedy, autojunk={autojunk!s:5}: {t_base * 1e3:9.1f} ms   ratio {t_base / t_fast:6.1f}x   "
              f"same clusters: {results[autojunk][1]}")
    # The speed claim is against the faster baseline, the equality claim against the exact ratio.
    return t_fast, min(t for t, _ in results.values()), results[False][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats (smoke test)")
    args = parser.parse_args()
    repeats = 5 if args.quick else 50
    if hasattr(os, "sched_setaffinity"):
        core = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {core})
        print(f"Pinned to CPU core {core}.")

    print("Exact anchor grouping (engine vs per-row Python):")
    t_6400, naive_6400 = bench_exact(exact_rows(6_400, num_steps=50, group_size=8, seed=0), repeats, 1 if args.quick else 5)
    if not args.quick:
        bench_exact(exact_rows(100_000, num_steps=50, group_size=8, seed=1), 10, 2)
    print("Similarity grouping on text anchors (engine vs difflib greedy):")
    sim_rows = text_rows(num_groups=2 if args.quick else 16, group_size=8, num_steps=10 if args.quick else 50)
    t_sim, t_difflib, same = bench_similarity(sim_rows, threshold=0.95, repeats=1 if args.quick else 3)
    print(f"Targets (slower input kind): 6,400 rows <= 5 ms: {t_6400 * 1e3:.2f} ms; >= 20x naive: {naive_6400 / t_6400:.0f}x; "
          f">= 20x difflib: {t_difflib / t_sim:.0f}x; same clusters as difflib (exact ratio): {same}")


if __name__ == "__main__":
    main()
