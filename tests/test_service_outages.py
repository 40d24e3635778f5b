"""When a service an environment needs goes down: an outage is waited out (and a step that waits is not taken for a
hang), a failure is reported once a rollout, and a run whose every trajectory fails stops with the cause and a
checkpoint it resumes from. Real servers on localhost: the shipped retrieval server and an OpenEnv server."""

from __future__ import annotations

import html
import threading
import warnings
from pathlib import Path

import pytest
import torch
from http_servers import OpenEnvServer, RetrievalServerWithOutage, scripted_server
from scripted_policy import scripted
from trainer_helpers import cpu_config, parameters

from gigpo_trl.dialogue import Completion, TextDialogue, prompt_messages
from gigpo_trl.env_failures import EnvironmentUnavailableError
from gigpo_trl.env_pool import EnvironmentFailureWarning, EnvPool
from gigpo_trl.environments.retrieval import BM25Retriever, read_corpus, serve
from gigpo_trl.environments.search_qa import PROMPT_TEMPLATE
from gigpo_trl.envs import env_factory
from gigpo_trl.records import read_iterations
from gigpo_trl.report import write_report
from gigpo_trl.rollout import collect_rollout
from gigpo_trl.services import ServiceUnavailable, ServiceWait, wait_out, waits_reported_to
from gigpo_trl.tasks import Task, task_dataset
from gigpo_trl.trainer import GiGPOTrainer

pytestmark = pytest.mark.timeout(300)

DATA = Path(__file__).parent / "data" / "search_qa"
SEARCH = "<search>Odile Stroame</search>"


class Outage(Exception):
    pass


def test_an_outage_is_tried_again_with_doubling_pauses_until_its_bound_and_said_once():
    clock, pauses, heard = [0.0], [], []

    def sleep(seconds):
        pauses.append(seconds)
        clock[0] += seconds

    def down():
        raise Outage("refused")

    with waits_reported_to(heard.append), pytest.raises(ServiceUnavailable, match=r"the server is unavailable "
                                                                                 r"\(refused\), still after 20 s"):
        wait_out(down, service="the server", retry_reason=lambda exc: str(exc) if isinstance(exc, Outage) else None,
                 wait=20.0, call_timeout=5.0, clock=lambda: clock[0], sleep=sleep)
    assert pauses == [0.5, 1.0, 2.0, 4.0, 8.0, 4.5]  # doubling, up to the bound
    assert heard == [ServiceWait("the server", "refused", 20.0, 5.0)]

    calls, heard = iter([Outage("refused"), Outage("refused"), "answer"]), []

    def flaky():
        outcome = next(calls)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    with waits_reported_to(heard.append):
        assert wait_out(flaky, service="the server", retry_reason=str, wait=20.0, clock=lambda: clock[0],
                        sleep=sleep) == "answer"
    assert [wait.seconds_left for wait in heard] == [20.0, 0]  # started, then answered again

    with pytest.raises(ValueError, match="not an outage"):  # not retried: raised at once
        wait_out(lambda: (_ for _ in ()).throw(ValueError("not an outage")), service="s", retry_reason=lambda exc: None,
                 wait=20.0, sleep=sleep)


def search_everywhere(prompts, tools):
    return [Completion([1], [2], SEARCH) for _ in prompts]


def play_searches(url: str, step_timeout: float = 30.0):
    """Two copies of a QA file's task searching twice through the server at `url`, in worker processes."""
    factory = env_factory("search_qa", qa=str(DATA / "qa.jsonl"), retriever_url=url, retriever_wait=60.0)
    with EnvPool(factory, 1, 2, step_timeout=step_timeout, warn_each_failure=False, name="search_qa") as pool:
        return collect_rollout(pool, [Task(seed=0)], search_everywhere, max_env_steps=2, show_progress=False,
                               dialogue=TextDialogue(PROMPT_TEMPLATE))


def test_a_retrieval_server_that_goes_away_mid_rollout_and_comes_back_within_the_wait_loses_no_trajectory(caplog):
    retriever = BM25Retriever(read_corpus(DATA / "corpus.jsonl"))
    server = RetrievalServerWithOutage(retriever, after=2, outage=4.0)
    try:
        # a step waits 4 s for the server, longer than the step timeout: the wait it reports is not taken for a hang
        rollout = play_searches(server.url, step_timeout=2.0)
    finally:
        server.close()
    assert server.stopped.is_set() and server.restarted.is_set() and server.requests == 4

    assert [episode.env_error for episode in rollout.episodes] == [None, None]
    found = retriever(["Odile Stroame"], 3)[0][0].contents.splitlines()[0]
    assert all(found in observation for observation, step in zip(rollout.steps.observation, rollout.steps.step) if step)
    said = [record.message for record in caplog.records if record.name == "gigpo_trl"]
    assert said[0].startswith(f"environment 'search_qa' #") and "waiting up to 60 s for it" in said[0]
    assert said[-1] == f"environment 'search_qa': 2 environment(s) waited for the retrieval server {server.url}: 2 went on"


def rows(count: int):
    return task_dataset(range(count))


def search_config(tmp_path, url: str, **overrides):
    return cpu_config(tmp_path, env_name="search_qa", max_env_steps=2, **{
        "env_kwargs": {"qa": str(DATA / "qa.jsonl"), "retriever_url": url, "retriever_wait": 0.5}, **overrides})


def search_then_answer(prompt, tools, position: int) -> str:
    """Search first; then the copy at an even position answers the first QA row's answer, the other a wrong one (the
    tasks of seeds 0, 3, 6 are won by one copy of two: a signal to train on)."""
    if "<information>" not in prompt_messages(prompt)[-1]["content"]:
        return SEARCH
    return "<answer>Odile Stroame</answer>" if position % 2 == 0 else "<answer>nobody</answer>"


def searching_trainer(model, args) -> GiGPOTrainer:
    return scripted(GiGPOTrainer(model, args=args, train_dataset=rows(8)), search_then_answer)


def test_a_server_answering_garbage_fails_every_trajectory_by_name_in_one_report_a_rollout(tmp_path, tiny_model_path):
    with scripted_server((200, b"Internal error, sorry")) as url:
        trainer = searching_trainer(tiny_model_path, search_config(tmp_path, url, stop_after_failed_rollouts=0))
        before = parameters(trainer.model)
        with pytest.warns(EnvironmentFailureWarning) as caught:
            trainer.train()
        trainer.close_environments()

    reports = [str(w.message) for w in caught if issubclass(w.category, EnvironmentFailureWarning)]
    reason = (f"environment raised RetrieverError: the retrieval server {url} answered something that is not JSON, "
              "not Search-R1's")
    assert len(reports) == 2  # one a rollout, of 8 trajectories each
    for step, report in enumerate(reports):
        assert report.startswith(f"environment 'search_qa': 8 of the 8 trajectories of the training rollout of step "
                                 f"{step} failed and ended there (the first: #0): 8 x {reason}")
    for record in read_iterations(tmp_path):
        failures = record["env_failures"]
        assert (failures["trajectories"], failures["failed"]) == (8, 8)
        (entry,) = failures["reasons"]
        assert entry["reason"].startswith(reason) and entry["trajectories"] == [f"#{i}" for i in range(8)]
    page = (write_report(tmp_path) / "index.html").read_text()
    assert f"training rollout of step 1: 8 of 8 trajectories failed: 8 x {html.escape(reason)}" in page
    # no update trained on anything: the optimizer moved no weight
    assert all(torch.equal(before[name], p) for name, p in trainer.model.named_parameters())
    assert [entry["env/env_error_share"] for entry in trainer.state.log_history if "loss" in entry] == [1.0, 1.0]


def test_a_server_that_stays_down_stops_the_run_with_a_checkpoint_that_resumes_once_it_is_back(tmp_path,
                                                                                                tiny_model_path):
    server = serve(BM25Retriever(read_corpus(DATA / "corpus.jsonl")), port=0)
    port = server.server_address[1]
    server.server_close()  # nothing listens there until the server comes back
    url = f"http://127.0.0.1:{port}/retrieve"

    trainer = searching_trainer(tiny_model_path, search_config(tmp_path, url, max_steps=4,
                                                               stop_after_failed_rollouts=2))
    before = parameters(trainer.model)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(EnvironmentUnavailableError) as stopped:
        warnings.simplefilter("always")
        trainer.train()
    checkpoint = tmp_path / "checkpoint-1"
    message = str(stopped.value)
    assert message.startswith("environment 'search_qa' failed every trajectory of 2 training rollout(s) in a row "
                              "(those of steps 0-1; stop_after_failed_rollouts=2): 16 x environment raised RetrieverError:"
                              f" the retrieval server {url} is unavailable (")
    assert f"resume_from_checkpoint={str(checkpoint)!r}" in message and (checkpoint / "trainer_state.json").is_file()
    assert len([w for w in caught if issubclass(w.category, EnvironmentFailureWarning)]) == 2
    assert all(torch.equal(before[name], p) for name, p in trainer.model.named_parameters())

    server = serve(BM25Retriever(read_corpus(DATA / "corpus.jsonl")), port=port)  # the server is back
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        resumed = searching_trainer(tiny_model_path, search_config(tmp_path, url, max_steps=3))
        resumed.train(resume_from_checkpoint=str(checkpoint))
        resumed.close_environments()
    finally:
        server.shutdown()
        server.server_close()
    logs = [entry for entry in resumed.state.log_history if "loss" in entry]  # the checkpoint's, then the run's
    assert [(entry["step"], entry["env/env_error_share"]) for entry in logs] == [(1, 1.0), (2, 0.0), (3, 0.0)]
    assert max(entry["env/success_rate"] for entry in logs) > 0
    assert not all(torch.equal(before[name], p) for name, p in resumed.model.named_parameters())


def test_an_openenv_server_that_goes_away_mid_rollout_fails_those_trajectories_and_its_return_is_waited_for():
    pytest.importorskip("openenv")
    from toy_openenv import Corridor, CorridorObservation, CorridorState, MoveAction

    server = OpenEnvServer(Corridor, MoveAction, CorridorObservation, CorridorState)
    factory = env_factory("openenv", env=server.url, action_cls=MoveAction, service_wait=30.0)
    turns = []

    def walk_right(prompts, tools):
        turns.append(len(prompts))
        if len(turns) == 2 and server is not None:  # the server goes away after the first step of the first rollout
            server.stop()
            threading.Timer(2.0, server.start).start()  # and comes back 2 s later
        return [Completion([1], [2], "<action>right</action>") for _ in prompts]

    try:
        with EnvPool(factory, 1, 2, warn_each_failure=False, name="openenv") as pool:
            first = collect_rollout(pool, [Task(seed=1)], walk_right, max_env_steps=8, show_progress=False)
            second = collect_rollout(pool, [Task(seed=1)], walk_right, max_env_steps=8, show_progress=False)
    finally:
        server.stop()
    for episode in first.episodes:
        assert episode.length == 2 and episode.env_error.startswith(
            f"environment raised ConnectionError: the OpenEnv server {server.url}")
        assert "the episode's state was in its session and is lost" in episode.env_error or \
            "lost the episode's session" in episode.env_error
    assert all(episode.won and episode.env_error is None for episode in second.episodes)  # its resets waited


def test_anchors_that_do_not_fit_similarity_threshold_are_refused_when_the_trainer_is_built(tmp_path, tiny_model_path):
    """The GPU search recipe's similarity_threshold with search_qa's default anchor (a tuple): refused by the first
    environment's reset at construction, with the message a rollout's advantages would give, before any generation."""
    args = cpu_config(tmp_path, env_name="search_qa", similarity_threshold=0.9)
    with pytest.raises(ValueError, match=r"similarity_threshold needs text anchors, but an anchor key is a tuple"):
        GiGPOTrainer(tiny_model_path, args=args, train_dataset=rows(8))
    observation = cpu_config(tmp_path, env_name="search_qa", similarity_threshold=0.9, env_kwargs={"anchor": "observation"})
    GiGPOTrainer(tiny_model_path, args=observation, train_dataset=rows(8)).close_environments()  # text anchors: built
