"""How many steps a task takes at best, and the tasks of a fold that take a given number.

`shortest_path_length` searches breadth-first over an environment's admissible actions (`info["admissible_actions"]`),
telling states apart by their anchors and replaying every path from `reset(seed=...)`: it needs an environment whose
replays are deterministic (the same seed and actions give the same states), as the contract already asks of a task's
copies. A game's `walkthrough` is no substitute: TextWorldExpress's coin collector walks at random to the coin. With a
`prefix` of actions it searches from the state those actions reach instead of the start: the distance to a win of any
state an episode visited (`research/credit_probe.py` labels a step by the distances before and after it).

`seeds_by_optimal_steps` picks the tasks of a fold whose fewest winning steps lie in a range (e.g. a benchmark
setting where every task needs at least 4 steps). A search replays O(states x actions x depth) steps, about a second a
task for a 6-room coin collector, so the lengths found are cached on disk (`cache_root()/shortest_paths`) per
environment name, arguments and depth, and a second call, in any process, reads them.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Hashable, Iterable, Sequence
from pathlib import Path
from typing import Any

from gigpo_trl.envs import (
    DEFAULT_FOLD_STARTS,
    FOLDS,
    INFO_ADMISSIBLE_ACTIONS,
    INFO_WON,
    EnvFactory,
    TextEnv,
    anchor_of,
    make_env,
)
from gigpo_trl.paths import cache_root

# How many seeds of an endless default fold are searched, per task asked for, before giving up.
SEARCH_SEEDS_PER_TASK = 100


def shortest_path_length(env: TextEnv, seed: int, limit: int, *, prefix: Sequence[str] = ()) -> int | None:
    """The fewest steps that win the task of `seed` (a step whose `info["won"]` is true), or None when no path of at
    most `limit` steps wins. With a `prefix`, the search starts from the state that playing those actions from the
    start reaches (any text the environment takes, admissible or not): 0 when the prefix's last step won, None when
    it ended the episode otherwise. Raises a ValueError when the environment lists no admissible actions."""
    if not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be an int >= 1, got {limit!r}")
    prefix = tuple(prefix)

    def replay(path: tuple[str, ...]) -> tuple[Hashable, list[str], bool, bool]:
        """After playing the prefix and `path` from the start: the state's anchor, its admissible actions, whether
        the last step won, whether the episode goes on."""
        observation, info = env.reset(seed=seed)
        terminated = truncated = False
        for action in (*prefix, *path):
            observation, _, terminated, truncated, info = env.step(action)
        if INFO_ADMISSIBLE_ACTIONS not in info:
            raise ValueError(f"{type(env).__name__} gives no info['{INFO_ADMISSIBLE_ACTIONS}']: a shortest path "
                             "is searched over the admissible actions")
        return anchor_of(observation, info), info[INFO_ADMISSIBLE_ACTIONS], bool(info.get(INFO_WON)), not (
            terminated or truncated)

    start, _, won, going_on = replay(())
    if won:
        return 0
    if not going_on:
        return None
    seen, frontier = {start}, [()]
    for depth in range(1, limit + 1):
        next_frontier = []
        for path in frontier:
            for action in replay(path)[1]:
                anchor, _, won, going_on = replay((*path, action))
                if won:
                    return depth
                if going_on and anchor not in seen:
                    seen.add(anchor)
                    next_frontier.append((*path, action))
        frontier = next_frontier
    return None


def seeds_by_optimal_steps(env: str | EnvFactory, fold: str, count: int, min_steps: int, max_steps: int, /,
                           **kwargs: Any) -> list[int]:
    """The first `count` seeds of `fold` of `make_env(env, **kwargs)` (in `fold_seeds`' order) whose tasks are won
    in at best `min_steps` to `max_steps` steps. Deterministic, so the same arguments give the same panel everywhere.
    Lengths are cached when `env` is a registered name. Raises a ValueError when the fold runs out first."""
    from tqdm.auto import tqdm  # noqa: PLC0415 (`import gigpo_trl` stays light)

    if fold not in FOLDS:
        raise ValueError(f"fold must be one of {FOLDS}, got {fold!r}")
    if not (isinstance(min_steps, int) and isinstance(max_steps, int) and 1 <= min_steps <= max_steps):
        raise ValueError(f"need 1 <= min_steps <= max_steps, got min_steps={min_steps!r}, max_steps={max_steps!r}")
    cache = _cache_file(env, kwargs, max_steps)
    lengths = _read_cache(cache)
    instance = make_env(env, **kwargs)
    found: list[int] = []
    try:
        own_seeds = getattr(instance, "fold_seeds", None)
        candidates: Iterable[int] = (own_seeds(fold) if own_seeds is not None else itertools.islice(
            itertools.count(DEFAULT_FOLD_STARTS[fold]), count * SEARCH_SEEDS_PER_TASK))
        searched = 0
        with tqdm(total=count, desc=f"{fold} tasks of {min_steps}-{max_steps} optimal steps", unit="task") as bar:
            for seed in candidates:
                if len(found) == count:
                    break
                if str(seed) not in lengths:
                    lengths[str(seed)] = shortest_path_length(instance, seed, max_steps)
                    searched += 1
                    if searched % 50 == 0:
                        _write_cache(cache, lengths)
                length = lengths[str(seed)]
                if length is not None and length >= min_steps:
                    found.append(seed)
                    bar.update()
    finally:
        instance.close()
        if searched:
            _write_cache(cache, lengths)
    if len(found) < count:
        raise ValueError(f"the {fold} fold of {env!r} holds {len(found)} tasks won in {min_steps}-{max_steps} "
                         f"optimal steps among the seeds searched, fewer than the {count} asked for")
    return found


def _cache_file(env: str | EnvFactory, kwargs: dict[str, Any], max_steps: int) -> Path | None:
    """Where the lengths of `make_env(env, **kwargs)` searched to depth `max_steps` are kept (None: a factory, which
    has no stable name)."""
    if not isinstance(env, str):
        return None
    key = json.dumps({"env": env, "kwargs": kwargs, "max_steps": max_steps}, sort_keys=True, default=str)
    return cache_root() / "shortest_paths" / f"{env}-{hashlib.sha1(key.encode()).hexdigest()[:16]}.json"


def _read_cache(cache: Path | None) -> dict[str, int | None]:
    if cache is None or not cache.is_file():
        return {}
    try:
        return json.loads(cache.read_text())
    except json.JSONDecodeError:  # a file cut off by a crash: search again
        return {}


def _write_cache(cache: Path | None, lengths: dict[str, int | None]) -> None:
    """Atomically, so processes searching at once never read a half-written file."""
    if cache is None:
        return
    cache.parent.mkdir(parents=True, exist_ok=True)
    partial = cache.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(lengths))
    os.replace(partial, cache)
