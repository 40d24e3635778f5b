"""OpenEnvAdapter: a real OpenEnv environment, in this process and behind a real OpenEnv server, as a text env."""

from __future__ import annotations

import functools
import socket
import threading
import time
import warnings
from typing import Any

import pytest

pytest.importorskip("openenv")

import uvicorn  # noqa: E402 (openenv's dependency)
from openenv.core import Action, GenericEnvClient, create_fastapi_app  # noqa: E402
from toy_openenv import TASK, Corridor, CorridorObservation, CorridorState, MoveAction, UnseededCorridor  # noqa: E402

from gigpo_trl.env_checker import check_env  # noqa: E402
from gigpo_trl.env_pool import EnvPool, GroupStartMismatchWarning  # noqa: E402
from gigpo_trl.environments.openenv_adapter import (  # noqa: E402
    OpenEnvAdapter,
    action_from_text,
    observation_anchor,
    render_observation,
)
from gigpo_trl.envs import make_env  # noqa: E402
from gigpo_trl.tasks import Task  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def play(env: Any, actions: list[str]) -> list[tuple[str, float, bool, bool, dict[str, Any]]]:
    return [env.step(action) for action in actions]


@pytest.fixture(scope="module")
def server_url():
    """A real OpenEnv server (openenv's FastAPI app under uvicorn) serving Corridor on a free local port."""
    app = create_fastapi_app(Corridor, MoveAction, CorridorObservation, max_concurrent_envs=4, state_cls=CorridorState)
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listening]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the OpenEnv server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{listening.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)
    listening.close()


def test_in_process_corridor_is_played_to_a_win():
    env = OpenEnvAdapter(Corridor)
    observation, info = env.reset(seed=1)

    assert observation == 'position: 2\nexit: 6\nstep_count: 0\nlegal_actions: ["left", "right"]'
    assert info == {
        "anchor": '{"exit":6,"legal_actions":["left","right"],"position":2}',
        "admissible_actions": ["left", "right"],
        "won": False,
        "task": TASK,
    }
    steps = play(env, ["right"] * 4)
    assert [reward for _, reward, _, _, _ in steps] == [0.0, 0.0, 0.0, 1.0]
    assert [step[2:4] for step in steps] == [(False, False)] * 3 + [(True, False)]
    assert [info["won"] for *_, info in steps] == [False, False, False, True]
    assert steps[-1][4]["admissible_actions"] == [] and steps[-1][0].startswith("position: 6\n")
    with pytest.raises(RuntimeError, match="episode has ended"):
        env.step("left")


def test_make_env_builds_the_adapter_by_name():
    env = make_env("openenv", env=Corridor, max_steps=3)
    assert isinstance(env, OpenEnvAdapter) and env.reset(seed=1)[1]["anchor"] == OpenEnvAdapter(Corridor).reset(seed=1)[1]["anchor"]


def test_the_seed_reaches_openenv_reset_and_the_adapter_passes_check_env():
    env = OpenEnvAdapter(Corridor)
    assert [env.reset(seed=seed)[0].splitlines()[0] for seed in range(5)] == [f"position: {p}" for p in (1, 2, 3, 4, 1)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(OpenEnvAdapter(Corridor), seed=3)


def test_default_anchor_ignores_step_counters_and_ids_but_tells_states_apart():
    env = OpenEnvAdapter(Corridor)
    _, start = env.reset(seed=1)  # cell 2
    direct = play(env, ["right"])[-1]  # cell 3 at step 1
    env.reset(seed=1)
    detour = play(env, ["right", "left", "right"])  # cells 3, 2, 3 at steps 1, 2, 3

    assert detour[-1][0] != direct[0]  # the text shows the step count ...
    assert detour[-1][4]["anchor"] == direct[4]["anchor"]  # ... the anchor does not
    assert detour[1][4]["anchor"] == start["anchor"]
    assert len({start["anchor"], direct[4]["anchor"]}) == 2
    assert observation_anchor({"position": 3, "step_count": 1, "episode_id": "a", "metadata": {"step": 1}}) == (
        observation_anchor({"position": 3, "step_count": 9, "episode_id": "b", "metadata": {"step": 9}})
    )


def test_text_that_is_no_action_is_an_invalid_step_that_leaves_the_state():
    env = OpenEnvAdapter(Corridor)
    observation, info = env.reset(seed=0)

    text, reward, terminated, truncated, invalid_info = env.step("fly")
    assert text == f"Invalid action: direction: Input should be 'left' or 'right'\n{observation}"
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert invalid_info == {**info, "invalid_action": True}
    assert env.step('{"direction": "up"')[0].startswith("Invalid action: the text is not valid JSON")

    text, *_, step_info = env.step('{"direction": "right"}')
    assert "step_count: 1" in text  # the invalid texts never reached the environment
    assert step_info["invalid_action"] is False and step_info["anchor"] != info["anchor"]


def test_action_from_text_fills_the_single_field_or_reads_json():
    class Say(Action):
        message: str

    class Guess(Action):
        number: int

    class Jump(Action):
        dx: int
        dy: int = 0

    class Shift(Action):
        dx: int
        dy: int

    assert action_from_text(' {"not": "parsed"} ', Say) == Say(message='{"not": "parsed"}')
    assert action_from_text("7", Guess) == Guess(number=7)
    assert action_from_text('{"number": 7}', Guess) == Guess(number=7)
    assert action_from_text("2", Jump) == Jump(dx=2)
    assert action_from_text('{"dx": 1, "dy": -1}', Shift) == Shift(dx=1, dy=-1)
    with pytest.raises(ValueError, match="^number: Input should be a valid integer"):
        action_from_text("seven", Guess)
    with pytest.raises(ValueError, match='JSON object with the fields {"dx": int, "dy": int}'):
        action_from_text("up", Shift)
    with pytest.raises(ValueError, match="^dy: Field required"):
        action_from_text('{"dx": 1}', Shift)
    with pytest.raises(ValueError, match="^speed: Extra inputs are not permitted"):
        action_from_text('{"dx": 1, "dy": 0, "speed": 2}', Shift)


def test_max_steps_truncates_invalid_steps_included():
    env = OpenEnvAdapter(Corridor, max_steps=2)
    env.reset(seed=0)
    assert env.step("left")[3] is False
    assert env.step("jump")[3] is True
    with pytest.raises(RuntimeError, match="episode has ended"):
        env.step("right")
    with pytest.raises(ValueError, match="max_steps must be None or an int >= 1"):
        OpenEnvAdapter(Corridor, max_steps=0)


def test_field_keys_and_text_hook_can_be_chosen():
    env = OpenEnvAdapter(
        Corridor, won_key=None, task_key="exit", observation_to_text=lambda observation: f"at {observation['position']}"
    )
    observation, info = env.reset(seed=2)
    assert observation == "at 3" and "won" not in info and info["task"] == "6"
    with pytest.raises(TypeError, match="admissible_actions_key=.*must be a list, got int"):
        OpenEnvAdapter(Corridor, admissible_actions_key="position").reset(seed=0)


def test_render_observation_prefers_a_text_field():
    assert render_observation({"prompt": "Your move.", "board": "..", "metadata": {"a": 1}}) == "Your move."
    assert render_observation({"text": " ", "board": "ab\ncd", "score": 1.5, "metadata": {}}) == (
        'text:  \nboard:\nab\ncd\nscore: 1.5'
    )


def test_action_class_comes_from_the_step_annotation_or_must_be_given():
    class Unannotated(Corridor):
        def step(self, action, timeout_s=None, **kwargs):  # noqa: ANN001
            return super().step(action)

    corridor = Unannotated()
    with pytest.raises(ValueError, match="pass action_cls="):
        OpenEnvAdapter(corridor)
    assert corridor.closed
    env = OpenEnvAdapter(Unannotated, action_cls=MoveAction)
    env.reset(seed=0)
    assert env.step("right")[4]["invalid_action"] is False
    with pytest.raises(TypeError, match="env must be an openenv Environment"):
        OpenEnvAdapter(42)


def test_close_closes_the_environment():
    corridor = Corridor()
    env = OpenEnvAdapter(corridor)
    env.close()
    env.close()
    assert corridor.closed


def test_a_server_gives_what_the_environment_gives_in_process(server_url):
    actions = ["left", "fly", "left", "left", "right", "right", "right", "right", "right", "right"]
    for seed in (0, 3):
        local = OpenEnvAdapter(Corridor)
        remote = OpenEnvAdapter(server_url, action_cls=MoveAction)
        try:
            assert remote.reset(seed=seed) == local.reset(seed=seed)
            for action in actions:
                step = remote.step(action)
                assert step == local.step(action)
                if step[2]:
                    break
            assert step[2] and step[4]["won"] and step[1] == 1.0
        finally:
            remote.close()


def test_a_client_factory_and_the_missing_action_class(server_url):
    env = OpenEnvAdapter(lambda: GenericEnvClient(base_url=server_url), action_cls=MoveAction)
    try:
        env.reset(seed=1, options={"episode_id": "episode-1"})
        assert play(env, ["right"] * 4)[-1][4]["won"]
    finally:
        env.close()
    with pytest.raises(ValueError, match="pass action_cls="):
        OpenEnvAdapter(server_url)


def test_pool_warns_when_the_copies_of_a_task_ignore_the_seed():
    with warnings.catch_warnings():
        warnings.simplefilter("error", GroupStartMismatchWarning)
        seeded = functools.partial(OpenEnvAdapter, env=Corridor)
        with EnvPool(seeded, 1, 4, processes=False, name="openenv") as pool:
            assert len({output.anchor for output in pool.reset([Task(seed=5)])}) == 1

    unseeded = functools.partial(OpenEnvAdapter, env=UnseededCorridor)
    with EnvPool(unseeded, 1, 4, processes=False, name="unseeded-openenv") as pool:
        with pytest.warns(GroupStartMismatchWarning, match="unseeded-openenv"):
            pool.reset([Task(seed=5)])
