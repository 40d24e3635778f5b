"""The fewest steps that win a task (breadth-first over admissible actions) and the tasks chosen by it."""

from __future__ import annotations

import json

import pytest

from gigpo_trl import TaskArguments, make_env, register_env
from gigpo_trl.paths import cache_root
from gigpo_trl.shortest_paths import seeds_by_optimal_steps, shortest_path_length
from tests.toy_envs import Corridor


class CountedCorridor(Corridor):
    """A corridor with idle actions that lead nowhere (states the search must not revisit), counting its steps."""

    steps = 0

    def step(self, action):
        CountedCorridor.steps += 1
        return super().step(action)

    def _info(self):
        return {**super()._info(), "admissible_actions": ["left", "wait", "right", "look"]}


register_env("counted_corridor", CountedCorridor, overwrite=True)


def test_the_shortest_path_is_the_distance_to_the_goal():
    env = CountedCorridor()
    # A corridor of L = 3 + seed % 4 cells is won in L - 1 steps to the right.
    assert [shortest_path_length(env, seed, limit=10) for seed in range(6)] == [2, 3, 4, 5, 2, 3]
    assert shortest_path_length(env, 3, limit=4) is None  # 5 steps needed
    assert shortest_path_length(env, 3, limit=5) == 5


def test_a_real_game_is_won_sooner_than_its_walkthrough_says():
    """TextWorldExpress's coin walkthrough wanders; the search finds a path no longer than it, and playing the
    shortest-path length of moves never wins earlier (the search is breadth-first)."""
    env = make_env("textworld_express", game="coin", numLocations=6, includeDoors=0, numDistractorItems=0)
    try:
        seeds = env.fold_seeds("dev")[:6]
        lengths = [shortest_path_length(env, seed, limit=8) for seed in seeds]
        walkthroughs = []
        for seed in seeds:
            env.reset(seed=seed)
            walkthroughs.append(len(env.walkthrough) - 1)  # its first action, "look around", changes nothing
    finally:
        env.close()
    assert all(length is not None and 1 <= length <= walked for length, walked in zip(lengths, walkthroughs))
    assert any(length < walked for length, walked in zip(lengths, walkthroughs))


def test_an_environment_without_admissible_actions_is_refused():
    class Silent(Corridor):
        def _info(self):
            return {"anchor": (self.length, self.position), "won": self.position == self.length - 1}

    with pytest.raises(ValueError, match="gives no info\\['admissible_actions'\\]"):
        shortest_path_length(Silent(), 0, limit=3)
    with pytest.raises(ValueError, match="limit must be an int >= 1"):
        shortest_path_length(Corridor(), 0, limit=0)


def test_seeds_in_a_range_of_optimal_steps_are_the_fold_s_first_ones_searched_once():
    # The train fold of an environment without folds counts from 0; lengths cycle 2, 3, 4, 5.
    assert seeds_by_optimal_steps("counted_corridor", "train", 4, 3, 4) == [1, 2, 5, 6]
    assert seeds_by_optimal_steps("counted_corridor", "dev", 2, 5, 5) == [1_000_003, 1_000_007]
    caches = [json.loads(path.read_text()) for path in (cache_root() / "shortest_paths").glob("counted_corridor-*")]
    assert len(caches) == 2  # one per search depth
    assert {"0": 2, "1": 3, "2": 4} in [{seed: c[seed] for seed in ("0", "1", "2") if seed in c} for c in caches]

    CountedCorridor.steps = 0
    assert seeds_by_optimal_steps("counted_corridor", "train", 4, 3, 4) == [1, 2, 5, 6]
    assert CountedCorridor.steps == 0  # read from the cache
    assert seeds_by_optimal_steps("counted_corridor", "train", 5, 3, 4) == [1, 2, 5, 6, 9]
    assert CountedCorridor.steps > 0  # the seeds past the cached ones were searched


def test_a_range_no_task_of_the_fold_falls_in_is_refused():
    with pytest.raises(ValueError, match="holds 0 tasks won in 6-6 optimal steps"):
        seeds_by_optimal_steps(CountedCorridor, "train", 1, 6, 6)
    with pytest.raises(ValueError, match="need 1 <= min_steps <= max_steps"):
        seeds_by_optimal_steps(CountedCorridor, "train", 1, 4, 3)


def test_task_arguments_keep_only_tasks_in_the_optimal_steps_range():
    train, panel = TaskArguments(num_train_tasks=3, num_eval_tasks=2, min_optimal_steps=5,
                                 max_optimal_steps=5).datasets(CountedCorridor, {})
    assert train["seed"] == [3, 7, 11] and panel["seed"] == [1_000_003, 1_000_007]
    with pytest.raises(ValueError, match="go together"):
        TaskArguments(min_optimal_steps=4)
    with pytest.raises(ValueError, match="exceeds"):
        TaskArguments(min_optimal_steps=4, max_optimal_steps=3)


def test_a_prefix_searches_from_the_state_it_reaches():
    env = CountedCorridor()  # seed 3: a corridor of 6 cells, won in cell 5
    assert shortest_path_length(env, 3, limit=10, prefix=("right", "right")) == 3
    assert shortest_path_length(env, 3, limit=10, prefix=("right", "left", "wait")) == 5
    assert shortest_path_length(env, 3, limit=10, prefix=("right", "jump about")) == 4  # text no action names
    assert shortest_path_length(env, 3, limit=2, prefix=("right",) * 2) is None  # 3 steps left
    assert shortest_path_length(env, 3, limit=10, prefix=("right",) * 5) == 0  # the prefix's last step won


def test_a_prefix_that_ended_the_episode_without_a_win_leaves_no_path():
    class Trapdoor(Corridor):
        """"down" ends the episode, lost."""

        def step(self, action):
            if action == "down":
                return self._observation(), 0.0, True, False, self._info()
            return super().step(action)

    assert shortest_path_length(Trapdoor(), 0, limit=5, prefix=("down",)) is None
    assert shortest_path_length(Trapdoor(), 0, limit=5, prefix=("right",)) == 1
