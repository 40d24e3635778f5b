"""Search QA, the paper's third task family: generated worlds, the protocol of tagged actions, exact-match rewards,
the anchors, bring-your-own data, and the TRL class under TRL's trainer and GiGPO's."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from datasets import Dataset
from http_servers import scripted_server
from scripted_policy import scripted_tool_trainer, tool_call
from trainer_helpers import cpu_config, logged_metrics
from trl import GRPOConfig, GRPOTrainer

from gigpo_trl.advantages import anchor_step_groups
from gigpo_trl.dialogue import Completion, TextDialogue
from gigpo_trl.env_checker import EnvCheckWarning, check_env
from gigpo_trl.env_pool import EnvPool
from gigpo_trl.environments.retrieval import BM25Retriever, read_corpus, serve, tokenize
from gigpo_trl.environments.search_qa import (
    FAMILIES, PROMPT_TEMPLATE, SearchQAEnv, SearchQAToolEnv, WorldSettings, exact_match, generate_world,
    memoryless_policy, normalize_answer, oracle_policy, play,
)
from gigpo_trl.envs import env_factory, make_env
from gigpo_trl.prompts import template_for
from gigpo_trl.rollout import collect_rollout
from gigpo_trl.tasks import Task

pytestmark = pytest.mark.timeout(300)

DATA = Path(__file__).parent / "data" / "search_qa"


def searched(env: SearchQAEnv, *queries: str) -> dict:
    """The info after searching `queries` in turn."""
    for query in queries:
        info = env.step(f"<search>{query}</search>")[4]
    return info


def test_check_env_passes_under_both_anchors():
    for anchor in ("retrieved", "observation"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", EnvCheckWarning)
            check_env(make_env("search_qa", anchor=anchor), seed=3)


def test_the_same_seed_gives_the_same_world_and_question_in_another_process():
    here = generate_world(11)
    code = ("import json; from gigpo_trl.environments.search_qa import generate_world; w = generate_world(11); "
            "print(json.dumps([w.question.text, [p.contents for p in w.passages]]))")
    elsewhere = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                               env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert json.loads(elsewhere.stdout) == [here.question.text, [p.contents for p in here.passages]]
    assert generate_world(12).question.text != here.question.text


def test_a_world_holds_distractors_and_near_misses_of_the_people_a_question_names():
    world = generate_world(0, WorldSettings(families=("compare",), distractors=2))
    first, second = re.fullmatch(r"Who was born earlier, (.+) or (.+)\?", world.question.text).groups()
    names = [entity.name for entity in world.entities]
    for person in (first, second):
        given, family = person.split(" ", 1)
        assert [name for name in names if name != person and (name.startswith(f"{given} ") or name.endswith(f" {family}"))]
        assert sum(f"{person}." in p.contents for p in world.passages) >= 2  # its own passage and a near miss
    assert all(p.contents.startswith(f'"{e.name}"\n') for e, p in zip(world.entities, world.passages))


def test_the_tokenizer_keeps_every_token_of_the_generated_names():
    names = [entity.name for seed in range(20)
             for entity in generate_world(seed, WorldSettings(num_people=30, num_companies=10, num_cities=15)).entities]
    regions = [entity.facts["region"] for seed in range(20) for entity in generate_world(seed).entities
               if entity.kind == "city"]
    assert len(names) > 1000
    for name in [*names, *regions]:
        assert tokenize([name]) == [name.lower().split()], name


@pytest.mark.parametrize("family", FAMILIES)
def test_the_oracle_answers_every_task_of_a_family_with_its_walkthrough(family):
    env = make_env("search_qa", families=[family], collect_size=3 if family == "collect" else 2)
    for seed in range(40):
        steps, won = play(env, seed, oracle_policy)
        assert won, (seed, env.world.question)
        assert [action for _, action in steps] == env.walkthrough
        assert env.reset(seed=seed)[1]["task_type"] == family


@pytest.mark.parametrize(("action", "reason"), [
    ("I would look for Ada.", "neither <search> nor <answer>"),
    ("<search>Ada</search><answer>Rome</answer>", "both <search> and <answer>"),
    ("<search>Ada</search> then <search>Bo</search>", "<search> twice"),
    ("<answer>Rome", "<answer> not closed by </answer>"),
    ("<search>  </search>", "an empty query"),
    ("<think>easy</think><answer></answer>", "an empty answer"),
])
def test_an_invalid_action_takes_a_turn_says_what_was_wrong_and_returns_no_results(action, reason):
    env = make_env("search_qa")
    _, start = env.reset(seed=0)
    observation, reward, terminated, truncated, info = env.step(action)

    assert observation == f"Invalid action: {reason}. Search with <search>query</search> or answer with <answer>text</answer>."
    assert (reward, terminated, truncated, info["invalid_action"]) == (0.0, False, False, reason)
    assert info["anchor"] == start["anchor"] and info["metrics"]["searches"] == 0 and env.elapsed_steps == 1


def test_text_after_the_closing_tag_is_ignored_and_the_turn_limit_truncates():
    env = make_env("search_qa", families=["collect"], max_steps=3)
    env.reset(seed=4)
    name = env.world.question.searches[0]
    observation, _, _, _, info = env.step(f"<think>first {name}</think><search>{name}</search> and later Rome")
    assert observation.startswith(f'<information>\nDoc 1: "{name}" ') and info["invalid_action"] is None
    assert observation.count("\nDoc ") == 3 and info["metrics"]["searches"] == 1
    assert env.step("<search>Rome</search>")[2:4] == (False, False)
    assert env.step("<search>Paris</search>")[2:4] == (False, True)  # the 3rd turn of 3: truncated, no answer


def test_exact_match_normalises_case_punctuation_articles_and_spaces():
    assert normalize_answer("  The  Kelesk-Uplands, an old Reach! ") == "keleskuplands old reach"
    assert exact_match("the Kelmor uplands.", ["Kelmor Uplands"]) and not exact_match("Kelmor", ["Kelmor Uplands"])
    env = make_env("search_qa", families=["collect"])
    env.reset(seed=2)
    first, second = re.fullmatch(r"(.+) and (.+)", env.world.question.golden_answers[0]).groups()
    assert set(env.world.question.golden_answers) == {f"{first} and {second}", f"{second} and {first}"}
    _, reward, terminated, _, info = env.step(f"<answer>{second.lower()} AND {first}.</answer>")
    assert (reward, terminated, info["won"]) == (1.0, True, True)


def test_searching_a_then_b_meets_b_then_a_at_the_answer_step_under_the_retrieved_anchor():
    env, observation_env = make_env("search_qa", families=["collect"]), make_env("search_qa", families=["collect"],
                                                                                  anchor="observation")
    env.reset(seed=5)
    a, b = env.world.question.searches
    a_then_b = searched(env, a, b)["anchor"]
    env.reset(seed=5)
    b_then_a = searched(env, b, a)["anchor"]
    assert a_then_b == b_then_a and a_then_b[0] == env.world.question.text and len(a_then_b[1]) >= 4
    observation_env.reset(seed=5)
    assert searched(observation_env, a, b)["anchor"].startswith(f'<information>\nDoc 1: "{b}"')  # the latest only
    observation_env.reset(seed=5)
    assert searched(observation_env, b, a)["anchor"].startswith(f'<information>\nDoc 1: "{a}"')


def test_a_window_too_short_for_the_passages_a_question_needs_must_guess():
    won = {window: 0 for window in (0, 1)}
    env = make_env("search_qa", families=["collect"])
    for seed in range(30):
        env.reset(seed=seed)
        for window in won:
            won[window] += play(env, seed, memoryless_policy(window, env.world.cities, random.Random(seed)))[1]
    assert won[1] == 30 and won[0] < 10  # K = 1 sees both birth places; K = 0 guesses the first among 8 cities


def test_questions_of_a_qa_file_are_searched_in_a_corpus_or_given_as_options():
    env = make_env("search_qa", qa=str(DATA / "qa.jsonl"), corpus=str(DATA / "corpus.jsonl"))
    observation, info = env.reset(seed=4)  # row 4 % 3 = 1
    assert observation == "Where was Odile Stroame born?" and info["task_type"] == "sample"
    assert env.walkthrough == ["<search>Where was Odile Stroame born?</search>", "<answer>Fennbury</answer>"]
    assert searched(env, "Odile Stroame")["anchor"] == (observation, ("0", "1", "5"))
    assert "evidence_retrieved" not in env.step("<answer>fennbury</answer>")[4]["metrics"]
    assert env.world is None

    row = {"question": "Who kept bees?", "golden_answers": ["Odile Varsk"]}
    assert env.reset(seed=0, options=row)[0] == "Who kept bees?"
    assert env.step("<answer>Odile Varsk</answer>")[1] == 1.0


@pytest.mark.parametrize(("kwargs", "options", "message"), [
    ({"qa": str(DATA / "qa.jsonl")}, None, "qa needs passages to search: give corpus, retriever_url or retriever"),
    ({"corpus": "c.jsonl", "retriever_url": "http://x/retrieve"}, None, "give one source of passages, not corpus and"),
    ({}, {"question": "Who?", "golden_answers": ["Me"]}, "a QA row needs passages to search"),
    ({}, {"questions": "Who?"}, r"SearchQAEnv's task options are .*got \['questions'\]"),
    ({}, {"num_cities": 0}, "num_cities must be an int >= 1, got 0"),
    ({"families": ["riddle"]}, None, "families must be a non-empty list of"),
    ({"collect_size": 5}, None, "collect_size must be an int from 2 to 4"),
    ({"anchor": "history"}, None, r"anchor must be one of \('retrieved', 'observation'\)"),
])
def test_bad_settings_and_options_are_refused_naming_the_problem(kwargs, options, message):
    with pytest.raises(ValueError, match=message):
        make_env("search_qa", **kwargs).reset(seed=0, options=options)


def test_the_registered_template_s_answers_are_read_by_their_tags_in_the_turn_loop():
    """The rollout reads answers with the template's action tags: a block is sent written out, and the oracle, told
    through the prompts alone, wins every copy (chain questions: each hop reads the latest result only)."""
    template = template_for("search_qa")
    assert template is PROMPT_TEMPLATE and template.action_tags == ("search", "answer")

    def generate(prompts, tools):
        completions = []
        for prompt in prompts:
            text = prompt[-1]["content"]
            question = re.search(r"^Question: (.+)$", text, re.MULTILINE).group(1)
            step = text.count("] Your action: ")  # the window of 4 shows every past step
            observation = text[text.rindex("<information>"):] if step else question
            action = oracle_policy(question, [("", "")] * step, observation)
            completions.append(Completion([1], [2], f"<think>step {step}</think>{action} done."))
        return completions

    with EnvPool(env_factory("search_qa", families=["chain"]), 2, 2, processes=False) as pool:
        rollout = collect_rollout(pool, [Task(seed=0), Task(seed=1)], generate, max_env_steps=4, show_progress=False,
                                  dialogue=TextDialogue(template, history_length=4))

    assert all(episode.won for episode in rollout.episodes) and all(rollout.steps.valid)
    assert all(re.fullmatch(r"<(search|answer)>[^<]+</\1>", action) for action in rollout.steps.action)


def search_everywhere(prompts, tools):
    return [Completion([1], [2], "<search>Odile Stroame</search>") for _ in prompts]


def play_on_server(url: str):
    """Two copies of a QA file's task searching through the server at `url`, in a pool of worker processes."""
    factory = env_factory("search_qa", qa=str(DATA / "qa.jsonl"), retriever_url=url, retriever_wait=0.5)
    with EnvPool(factory, 1, 2) as pool, pytest.warns(match=f"failed and its trajectory ends here.*{url}"):
        return collect_rollout(pool, [Task(seed=0)], search_everywhere, max_env_steps=2, show_progress=False,
                               dialogue=TextDialogue(PROMPT_TEMPLATE))


def test_a_retrieval_server_that_stopped_fails_the_trajectories_and_the_rollout_goes_on():
    server = serve(BM25Retriever(read_corpus(DATA / "corpus.jsonl")), port=0)
    url = f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    server.server_close()

    rollout = play_on_server(url)
    assert all(f"the retrieval server {url} is unavailable" in episode.env_error for episode in rollout.episodes)
    assert logged_metrics(rollout)["env/env_error_share"] == 1.0


def test_a_retrieval_server_that_answers_garbage_fails_that_trajectory_only():
    good = {"result": [[{"document": {"id": "1", "contents": '"Odile Stroame"\nBorn in Fennbury.'}, "score": 2.0}]]}
    with scripted_server((200, b"Internal error, sorry"), (200, json.dumps(good).encode())) as url:
        rollout = play_on_server(url)

    failed, played = sorted(rollout.episodes, key=lambda episode: episode.env_error is None)
    assert f"the retrieval server {url} answered something that is not JSON" in failed.env_error
    assert "'Internal error, sorry'" in failed.env_error
    assert played.env_error is None and played.length == 2 and played.truncated  # it searched on, to the turn limit
    assert logged_metrics(rollout)["env/env_error_share"] == 0.5


def rows(count: int) -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": "Answer with the tools."}]] * count,
                              "seed": list(range(count))})


def tool_oracle(messages: list[dict], position: int) -> str:
    """`oracle_policy` as tool calls: the question from the first message, the observations from the tool results."""
    question = re.search(r"Question: (.+)$", messages[0]["content"]).group(1)
    seen = [question, *(message["content"] for message in messages if message["role"] == "tool")]
    action = oracle_policy(question, [(observation, "") for observation in seen[:-1]], seen[-1])
    kind, text = re.fullmatch(r"<(search|answer)>(.*)</\1>", action).groups()
    return tool_call(kind, **{"query" if kind == "search" else "answer": text})


def test_the_tool_class_trains_under_gigpo_with_step_groups_on_what_was_retrieved(tmp_path, tool_model_path):
    config = cpu_config(tmp_path, max_completion_length=8, max_env_steps=5, max_steps=1, history_length=8,
                        steps_per_generation=1, gradient_accumulation_steps=1)
    trainer = scripted_tool_trainer(tool_model_path, answer=tool_oracle, args=config, train_dataset=rows(4),
                                    environment_factory=SearchQAToolEnv)
    trainer.train()

    rollout, steps = trainer.last_rollout, trainer.last_rollout.steps
    assert all(episode.won and episode.episode_return == 1.0 for episode in rollout.episodes)
    assert all(isinstance(anchor, tuple) and isinstance(anchor[1], tuple) for anchor in steps.anchor)
    groups = anchor_step_groups(steps.group, steps.anchor, steps.step)
    assert len(set(groups)) < len(steps)  # the two copies of a task retrieve the same passages: shared step groups
    log = next(entry for entry in trainer.state.log_history if "env/success_rate" in entry)
    assert log["env/success_rate"] == 1.0
    trainer.close_environments()


def test_the_tool_class_trains_unchanged_under_trl_s_grpo_trainer(tmp_path, tool_model_path):
    config = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_steps=1,
                        max_completion_length=16, max_tool_calling_iterations=2, report_to=[], bf16=False,
                        activation_checkpointing=False, save_strategy="no")
    trainer = GRPOTrainer(tool_model_path, args=config, train_dataset=rows(4), environment_factory=SearchQAToolEnv)
    trainer.train()

    assert trainer.state.global_step == 1
    assert sorted(tool.__name__ for tool in trainer._env_tools[None]) == ["answer", "search"]


def test_the_tool_class_plays_the_text_environment_s_tasks_and_ends_after_an_answer_or_its_turns():
    tools, text = SearchQAToolEnv(), make_env("search_qa")
    assert tools.reset(prompt=[], seed=7) == f" Question: {text.reset(seed=7)[0]}"
    *searches, answer = text.walkthrough
    for action in searches:
        query = re.fullmatch(r"<search>(.*)</search>", action).group(1)
        observation, *_, info = text.step(action)
        assert tools.search(query) == observation and tools.anchor == info["anchor"]
    assert not tools.done
    tools.answer(re.fullmatch(r"<answer>(.*)</answer>", answer).group(1))
    assert tools.done and tools.won and tools.get_reward() == 1.0
    with pytest.raises(ValueError, match="The game is over"):
        tools.search("Rome")

    limited = SearchQAToolEnv(max_steps=2)
    limited.reset(seed=7)
    with pytest.raises(ValueError, match="The query is empty"):
        limited.search("  ")  # a turn taken all the same
    limited.search("Rome")
    assert limited.done and not limited.won and limited.get_reward() == 0.0
    with pytest.raises(ValueError, match="needs a `seed` column"):
        limited.reset(prompt=[])


def test_the_bench_prints_the_history_gap_and_one_task_group_s_step_groups(capsys):
    from bench.bench_search_qa import main

    main(["--ceilings", "--tasks", "5"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if "%" in line]
    assert [row[0] for row in rows] == ["| lookup", "| chain (2-3 hops)", "| collect, 2 people", "| collect, 3 people",
                                        "| compare"]
    assert all(row[1] == "100.0%" for row in rows)  # the oracle

    main(["--step-groups"])
    retrieved = capsys.readouterr().out.split("anchor='observation'")[0]
    answers = [line.split(" | ")[:2] for line in retrieved.splitlines() if "<answer>" in line]
    assert sorted(step for _, step in answers) == ["A2", "B2", "C3", "D2"] and len({g for g, _ in answers}) == 1
