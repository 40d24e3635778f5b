"""EnvPool: N identically-seeded copies per task, parallel steps, faults isolated per environment."""

from __future__ import annotations

import functools
import re
import warnings

import pytest
from toy_envs import Corridor, FailingReset, FailsToStart, FragileCorridor, UnseededCorridor

from gigpo_trl.env_pool import INFO_ENV_ERROR, EnvironmentFailureWarning, EnvPool, GroupStartMismatchWarning
from gigpo_trl.tasks import Task

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def fragile_pool():
    with EnvPool(FragileCorridor, num_groups=2, group_size=2, step_timeout=2.0, name="fragile") as pool:
        pool.reset([Task(seed=0), Task(seed=1)])
        yield pool


def test_copies_of_a_task_start_in_the_same_state_and_tasks_differ():
    with EnvPool(Corridor, num_groups=2, group_size=3) as pool:
        outputs = pool.reset([Task(seed=1), Task(seed=None, options={"length": 6})])

    assert [o.anchor for o in outputs] == [(4, 0)] * 3 + [(6, 0)] * 3
    assert [pool.group_of(i) for i in range(6)] == [0, 0, 0, 1, 1, 1]


def test_steps_only_the_environments_asked_for():
    with EnvPool(Corridor, num_groups=1, group_size=3) as pool:
        pool.reset([Task(seed=0)])  # length 3
        first = pool.step({0: "right", 2: "left"})
        second = pool.step({0: "right"})

    assert sorted(first) == [0, 2] and first[0].anchor == (3, 1) and first[2].anchor == (3, 0)
    assert second[0].terminated and second[0].reward == 1.0 and second[0].info["won"]


@pytest.mark.parametrize(
    ("action", "reason"),
    [
        ("exit", "worker process died (exit code 3)"),
        ("segfault", "worker process died (killed by SIGSEGV)"),
        ("raise", "environment raised RuntimeError: the interpreter broke"),
        ("unpicklable", "environment raised"),
        ("hang", "no answer within 2 s (hung)"),
        ("nan", "environment raised ValueError: step returned a non-finite reward (nan)"),
        ("inf", "environment raised ValueError: step returned a non-finite reward (inf)"),
    ],
)
def test_a_failing_environment_ends_only_its_own_trajectory(fragile_pool, action, reason):
    # The step returns although environment 0 failed: a pool that waited forever would fail on pytestmark's timeout.
    with pytest.warns(EnvironmentFailureWarning, match=f"environment 'fragile' #0 failed.*: {re.escape(reason)}"):
        outputs = fragile_pool.step({0: action, 1: "right", 2: "right", 3: "left"})

    failed = outputs[0]
    assert failed.truncated and not failed.terminated and failed.reward == 0.0
    assert failed.info[INFO_ENV_ERROR].startswith(reason) and "environment restarted" in failed.info[INFO_ENV_ERROR]
    assert failed.observation == "You are in cell 0 of a corridor of 3 cells."  # the last one seen
    assert [outputs[i].anchor for i in (1, 2, 3)] == [(3, 1), (4, 1), (4, 0)]
    assert not any(INFO_ENV_ERROR in outputs[i].info for i in (1, 2, 3))
    # The restarted environment plays again after the next reset.
    assert fragile_pool.num_restarts == 1
    fragile_pool.reset([Task(seed=0), Task(seed=1)])
    assert fragile_pool.step({0: "right"})[0].anchor == (3, 1)


def test_a_failing_reset_comes_back_truncated():
    with EnvPool(FailingReset, num_groups=1, group_size=2) as pool:
        outputs = pool.reset([Task(seed=0)])

    assert all(o.truncated and "environment raised OSError: game file missing" in o.info[INFO_ENV_ERROR] for o in outputs)


@pytest.mark.parametrize("processes", [True, False])
def test_a_reset_that_fails_at_first_is_tried_again_on_a_fresh_environment_and_the_copy_plays(tmp_path, processes):
    env_fn = functools.partial(FailsToStart, tmp_path, {5: 2})  # seed 5 fails its first two starts
    with EnvPool(env_fn, num_groups=2, group_size=2, processes=processes, name="flaky") as pool:
        with pytest.warns(EnvironmentFailureWarning) as caught:
            outputs = pool.reset([Task(seed=5), Task(seed=6)])
        stepped = pool.step({0: "right", 1: "right"})

    assert not any(INFO_ENV_ERROR in output.info for output in outputs)
    assert [output.anchor for output in outputs] == [(4, 0)] * 2 + [(5, 0)] * 2  # every copy at its task's start
    assert [stepped[i].anchor for i in (0, 1)] == [(4, 1)] * 2
    assert [str(warning.message) for warning in caught] == [
        f"environment 'flaky' #0 failed and its reset is tried again (attempt {attempt + 1} of 3): environment raised "
        f"OSError: the engine of seed 5 did not start (attempt {attempt})"
        + ("; environment restarted" if processes else "") for attempt in (1, 2)]
    assert pool.num_restarts == 2 and (tmp_path / "seed-5").read_text() == "..." + "."  # 3 starts of copy 0, 1 of copy 1


def test_a_copy_that_fails_every_reset_attempt_comes_back_truncated_with_the_reason(tmp_path):
    with EnvPool(functools.partial(FailsToStart, tmp_path, {5: -1}), num_groups=2, group_size=2,
                 reset_attempts=2) as pool, pytest.warns(EnvironmentFailureWarning):
        outputs = pool.reset([Task(seed=6), Task(seed=5)])

    assert [output.anchor for output in outputs[:2]] == [(5, 0)] * 2 and INFO_ENV_ERROR not in outputs[0].info
    for failed in outputs[2:]:
        assert failed.truncated and failed.info[INFO_ENV_ERROR].startswith(
            "environment raised OSError: the engine of seed 5 did not start (attempt ")
        assert failed.info[INFO_ENV_ERROR].endswith("; environment restarted (the reset failed all 2 attempts)")
    assert len((tmp_path / "seed-5").read_text()) == 4  # 2 copies x 2 attempts: bounded


def test_copies_that_start_differently_give_a_loud_warning_naming_the_environment():
    with EnvPool(UnseededCorridor, num_groups=1, group_size=8, name="unseeded-corridor") as pool:
        with pytest.warns(GroupStartMismatchWarning, match="'unseeded-corridor'.*task 0 \\(seed 5.*different states"):
            pool.reset([Task(seed=5, options={"length": 30})])


def test_seeded_copies_give_no_warning():
    with EnvPool(Corridor, num_groups=2, group_size=4) as pool, warnings.catch_warnings():
        warnings.simplefilter("error")
        pool.reset([Task(seed=0), Task(seed=1)])


@pytest.mark.parametrize(("action", "error"), [("raise", "RuntimeError"), ("nan", "non-finite reward (nan)")])
def test_in_process_pool_catches_exceptions_and_non_finite_rewards(action, error):
    with EnvPool(FragileCorridor, num_groups=1, group_size=2, processes=False) as pool:
        pool.reset([Task(seed=0)])
        outputs = pool.step({0: action, 1: "right"})

    assert outputs[0].truncated and outputs[0].reward == 0.0 and error in outputs[0].info[INFO_ENV_ERROR]
    assert outputs[1].anchor == (3, 1)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: EnvPool(Corridor, num_groups=0, group_size=2), "num_groups and group_size must be >= 1"),
        (lambda: EnvPool(Corridor, num_groups=1, group_size=2, step_timeout=0), "timeouts must be > 0"),
        (lambda: EnvPool(Corridor, num_groups=1, group_size=2, reset_attempts=0), "reset_attempts must be >= 1, got 0"),
    ],
)
def test_bad_pool_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_bad_requests_name_the_problem():
    with EnvPool(Corridor, num_groups=2, group_size=2, processes=False) as pool:
        with pytest.raises(ValueError, match="one task per group: got 1 tasks for 2 groups"):
            pool.reset([Task(seed=0)])
        with pytest.raises(ValueError, match=r"unknown environment ids \[7\]"):
            pool.step({7: "left"})


HAZARD_ACTIONS = ["take\x00passkey", "\\x", "go south\ntake passkey", "go " * 2500, "gehe nach Süden ☃", ""]


@pytest.mark.timeout(180)
def test_hazard_actions_neither_crash_nor_hang_a_pool_of_textworld_games(tmp_path):
    from gigpo_trl.envs import env_factory

    make = env_factory("textworld", cache_dir=str(tmp_path))
    with EnvPool(make, num_groups=1, group_size=len(HAZARD_ACTIONS), step_timeout=20, name="textworld") as pool:
        start = pool.reset([Task(seed=0)])
        outputs = pool.step(dict(enumerate(HAZARD_ACTIONS)))
        follow_up = pool.step({i: "look" for i in range(pool.num_envs)})

    assert pool.num_restarts == 0
    assert not any(INFO_ENV_ERROR in o.info or o.truncated for o in [*outputs.values(), *follow_up.values()])
    # Only the first line of the newline action ran: the game did not take the passkey behind our back.
    assert outputs[2].reward == 0.0 and outputs[2].anchor != start[2].anchor  # went south only
    assert outputs[5].anchor == start[5].anchor  # the empty command changes nothing


def test_an_unhashable_anchor_is_named_as_the_environment_s_bug():
    class ListAnchors(Corridor):
        def _info(self):
            return {**super()._info(), "anchor": [self.length, self.position]}

    with EnvPool(ListAnchors, num_groups=1, group_size=2, processes=False, name="lists") as pool:
        with pytest.raises(TypeError, match=r"environment 'lists': info\['anchor'\] must be hashable .* got a list: \[3, 0\]"):
            pool.reset([Task(seed=0)])
