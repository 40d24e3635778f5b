"""The environment contract: registry, make_env, gymnasium environments, check_env."""

from __future__ import annotations

import warnings

import gymnasium
import pytest
from toy_envs import Corridor, GuessTheNumber, UnseededCorridor

from gigpo_trl.env_checker import EnvCheckError, EnvCheckWarning, check_env
from gigpo_trl.env_pool import EnvPool
from gigpo_trl.envs import anchor_of, env_factory, fold_seeds, make_env, register_env, registered_envs
from gigpo_trl.fork_server import ForkServer
from gigpo_trl.tasks import Task

gymnasium.register(id="GuessTheNumber-v0", entry_point=GuessTheNumber)


def test_registered_names_callables_and_gymnasium_ids_all_make_environments():
    register_env("test-corridor", Corridor, overwrite=True)

    assert "test-corridor" in registered_envs() and {"sokoban", "textworld"} <= set(registered_envs())
    assert make_env("test-corridor").reset(seed=2)[1]["anchor"] == (5, 0)
    assert make_env(Corridor).reset(seed=0)[1]["anchor"] == (3, 0)
    assert make_env("GuessTheNumber-v0").reset(seed=0)[0] == "Guess a number from 1 to 9."


@pytest.mark.parametrize("server", ["auto", "spawn"])
def test_a_gymnasium_text_environment_works_through_the_contract_and_the_pool(server):
    """The id is registered in this process only (this module's `gymnasium.register`): a fork server started as a
    fresh interpreter, which never ran that line, still makes the environment (the factory carries its spec)."""
    check_env(make_env("GuessTheNumber-v0"))

    fork_server = ForkServer(start_method=server)
    with EnvPool(env_factory("GuessTheNumber-v0"), num_groups=1, group_size=9, fork_server=fork_server) as pool:
        pool.reset([Task(seed=3)])
        outputs = pool.step({i: str(i + 1) for i in range(9)})
    fork_server.close()

    assert [o.info.get("env_error") for o in outputs.values()] == [None] * 9
    winners = [i for i, o in outputs.items() if o.info["won"]]
    assert len(winners) == 1 and outputs[winners[0]].reward == 10.0 and outputs[winners[0]].terminated


def test_a_name_registered_in_this_process_plays_in_a_pool_whose_fork_server_is_a_fresh_interpreter():
    register_env("test-corridor-spawned", Corridor, overwrite=True)
    fork_server = ForkServer(start_method="spawn")
    with EnvPool(env_factory("test-corridor-spawned"), num_groups=1, group_size=2, fork_server=fork_server) as pool:
        outputs = pool.reset([Task(seed=1)])
    fork_server.close()

    assert [o.anchor for o in outputs] == [(4, 0), (4, 0)]


def test_registry_errors_name_the_problem():
    register_env("test-twice", Corridor, overwrite=True)
    with pytest.raises(ValueError, match="'test-twice' is already registered"):
        register_env("test-twice", Corridor)
    with pytest.raises(ValueError, match="must be a callable or a 'module:attribute' string"):
        register_env("test-bad", 42)
    with pytest.raises(ValueError, match=r"unknown environment 'no-such-env'; registered: \[.*'sokoban'"):
        make_env("no-such-env")


class CorridorWithFolds(Corridor):
    """Folds of its own: odd seeds train, even seeds dev and test."""

    def fold_seeds(self, fold):
        return {"train": [1, 3, 5], "dev": [2, 4], "test": [6]}[fold]


def test_fold_seeds_are_the_environment_s_own_folds_or_disjoint_ranges():
    assert fold_seeds(Corridor, "train", 3) == [0, 1, 2]
    assert fold_seeds(Corridor, "dev", 2) == [1_000_000, 1_000_001]
    assert fold_seeds("sokoban", "test", 2) == [2_000_000, 2_000_001]
    assert fold_seeds(CorridorWithFolds, "dev", 2) == [2, 4]
    with pytest.raises(ValueError, match="the test fold of .* has 1 tasks, fewer than the 2 asked for"):
        fold_seeds(CorridorWithFolds, "test", 2)
    with pytest.raises(ValueError, match="fold must be one of"):
        fold_seeds(Corridor, "validation", 2)


def test_an_environment_argument_named_env_reaches_the_factory():
    register_env("takes-env", lambda env: Corridor(), overwrite=True)
    assert make_env("takes-env", env="anything").reset(seed=0)[1]["anchor"] == (3, 0)


def test_anchor_defaults_to_the_observation():
    assert anchor_of("You see a door.", {}) == "You see a door."
    assert anchor_of("You see a door.", {"anchor": 7}) == 7


def test_check_env_accepts_a_conforming_environment():
    check_env(Corridor())


def test_check_env_catches_a_non_deterministic_reset():
    with pytest.raises(EnvCheckError, match=r"reset\(seed=0\) is not deterministic.*ignores its seed"):
        check_env(UnseededCorridor(), options={"length": 50})


class _Broken(Corridor):
    def __init__(self, **overrides):
        self.overrides = overrides

    def reset(self, *, seed=None, options=None):
        observation, info = super().reset(seed=seed, options=options)
        return self.overrides.get("observation", observation), {**info, **self.overrides.get("info", {})}

    def step(self, action):
        observation, reward, terminated, truncated, info = super().step(action)
        return observation, self.overrides.get("reward", reward), terminated, truncated, {**info, **self.overrides.get("info", {})}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"observation": ["cell", 0]}, "observation, block 0: a content block is"),
        ({"observation": 7}, "observation is a int; it must be a str, a PIL image, or a list of content blocks"),
        ({"info": {"anchor": ["cell", 0]}}, r"info\['anchor'\] must be hashable"),
        ({"info": {"admissible_actions": "left"}}, r"info\['admissible_actions'\] must be a list of str"),
        ({"info": {"won": "no"}}, r"info\['won'\] must be a bool"),
        ({"info": {"task": 3}}, r"info\['task'\] must be a str"),
        ({"reward": "1"}, "reward '1': the reward must be a finite number"),
        ({"reward": float("nan")}, "the reward must be a finite number"),
    ],
)
def test_check_env_names_each_violation(overrides, message):
    with pytest.raises(EnvCheckError, match=message):
        check_env(_Broken(**overrides))


class _CumulativeScore(Corridor):
    """Reports the running score as the reward: a classic plug-in mistake."""

    def reset(self, *, seed=None, options=None):
        self.score = 0
        observation, info = super().reset(seed=seed, options=options)
        return observation, {**info, "score": 0}

    def step(self, action):
        observation, reward, terminated, truncated, info = super().step(action)
        self.score += 1 if action == "right" else 0
        return observation, float(self.score), terminated, truncated, {**info, "score": self.score}


def test_check_env_warns_about_cumulative_rewards():
    with pytest.warns(EnvCheckWarning, match="rewards look cumulative"):
        check_env(_CumulativeScore(), options={"length": 10})


class _ScoreDifference(_CumulativeScore):
    """Rewards the score difference, as the contract asks; the first point's reward equals the score."""

    def step(self, action):
        before = self.score
        observation, _, terminated, truncated, info = super().step(action)
        return observation, float(self.score - before), terminated, truncated, info


def test_check_env_accepts_a_first_reward_equal_to_the_score_it_raised():
    with warnings.catch_warnings():
        warnings.simplefilter("error", EnvCheckWarning)
        check_env(_ScoreDifference(), options={"length": 10})
