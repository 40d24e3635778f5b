"""How well can a policy of the current observation alone do in rooms without the hint (setting F,
research/settings/f_trap_cpu/README.md)?

    python research/memoryless_rooms.py --num-rooms 9 --steps 14      # about a minute on one core

Such a policy is a probability of "go west" per room (the observation names the room only). Its success rate, over
the two kinds of task (the treasure west or east, equally often), is computed exactly by propagating the distribution
over rooms for `steps` steps. The best one is searched by coordinate ascent on a grid of probabilities (0, 0.01, ...,
1), from `restarts` random starts; the uniformly random policy and walking always one way are printed beside it. A
policy that remembers its last move ("keep going, turn at the wall") wins every task within num_rooms // 2 +
num_rooms - 1 steps.
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def memoryless_success(p_west: np.ndarray, steps: int) -> float:
    """The success rate of the policy that goes west with probability p_west[k] in room k (shape [num_rooms]), from the
    middle room, with the treasure at either end half the time (a step into the wall stays)."""
    num_rooms = len(p_west)
    total = 0.0
    for treasure in (0, num_rooms - 1):
        where = np.zeros(num_rooms)
        where[num_rooms // 2] = 1.0
        for _ in range(steps):
            moved = np.zeros(num_rooms)
            np.add.at(moved, np.maximum(np.arange(num_rooms) - 1, 0), where * p_west)
            np.add.at(moved, np.minimum(np.arange(num_rooms) + 1, num_rooms - 1), where * (1 - p_west))
            total += moved[treasure] / 2
            moved[treasure] = 0.0
            where = moved
    return float(total)


def best_memoryless(num_rooms: int, steps: int, restarts: int = 20, seed: int = 0) -> tuple[float, list[float]]:
    """The best success rate found, and its per-room probabilities of going west."""
    grid, rng = np.linspace(0, 1, 101), np.random.default_rng(seed)
    best, best_policy = -1.0, None
    for _ in range(restarts):
        policy, value = rng.uniform(size=num_rooms), -1.0
        while True:
            before = value
            for room in range(num_rooms):
                values = [memoryless_success(np.where(np.arange(num_rooms) == room, p, policy), steps) for p in grid]
                policy[room], value = grid[int(np.argmax(values))], max(values)
            if value <= before + 1e-12:
                break
        if value > best:
            best, best_policy = value, policy.round(2).tolist()
    return best, best_policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-rooms", type=int, default=9)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--restarts", type=int, default=20)
    args = parser.parse_args()
    best, policy = best_memoryless(args.num_rooms, args.steps, args.restarts)
    print(json.dumps({
        "num_rooms": args.num_rooms, "steps": args.steps,
        "uniformly_random": memoryless_success(np.full(args.num_rooms, 0.5), args.steps),
        "always_west": memoryless_success(np.ones(args.num_rooms), args.steps),
        "best_memoryless_found": best, "its_p_west_per_room": policy,
        "with_memory": 1.0 if args.steps >= args.num_rooms // 2 + args.num_rooms - 1 else None,
    }, indent=2))


if __name__ == "__main__":
    main()
