"""Retrieval for search environments: BM25 in process (bm25s), its index built once per machine and loaded
memory-mapped, Search-R1's retrieval protocol against the shipped server on localhost, and the data files users
bring, refused line by line when they do not fit."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from http_servers import scripted_server

from gigpo_trl.environments.retrieval import (
    BM25Retriever, HTTPRetriever, Passage, RetrieverError, read_corpus, read_qa, serve,
)

pytestmark = pytest.mark.timeout(120)

DATA = Path(__file__).parent / "data" / "search_qa"
CORPUS = DATA / "corpus.jsonl"


@pytest.fixture(scope="module")
def server_url():
    """The shipped server, `python -m gigpo_trl.environments.retrieval`, over the sample corpus on a free port."""
    process = subprocess.Popen([sys.executable, "-m", "gigpo_trl.environments.retrieval", "--corpus", str(CORPUS),
                                "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("BM25 over 6 passages of "), line
        yield line.split(" at ")[1].strip()
    finally:
        process.terminate()
        process.wait(timeout=10)
        process.stdout.close()


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_name_finds_its_own_passage_first_and_ties_are_broken_by_corpus_order():
    retriever = BM25Retriever(read_corpus(CORPUS))
    (stroame,) = retriever(["Odile Stroame"], 3)
    assert [p.id for p in stroame] == ["1", "5", "0"] and stroame[0].score > stroame[1].score

    twins = BM25Retriever([Passage(str(k), '"Twin"\nThe same words.') for k in range(5)] + [Passage("5", "Other.")])
    assert [[p.id for p in found] for found in twins(["same words", "same words"], 3)] == [["0", "1", "2"]] * 2
    assert twins(["nothing matches", "the of"], 3) == [[], []]  # no shared token (or stopwords only): no passage


def test_a_corpus_file_is_indexed_once_per_machine_and_loaded_memory_mapped(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(CORPUS.read_bytes())
    first = BM25Retriever.from_corpus_file(corpus, cache=tmp_path / "cache")
    (folder,) = [path for path in (tmp_path / "cache").iterdir() if path.is_dir()]
    built = {path.name: path.stat().st_mtime_ns for path in folder.iterdir()}
    second = BM25Retriever.from_corpus_file(corpus, cache=tmp_path / "cache")

    assert {path.name: path.stat().st_mtime_ns for path in folder.iterdir()} == built  # loaded, not built again
    queries = ["Odile Stroame", "Quellport harbour", "lanterns"]
    assert first(queries, 3) == second(queries, 3) == BM25Retriever(read_corpus(corpus))(queries, 3)
    assert isinstance(second._bm25.scores["data"], np.memmap)
    corpus.write_text(CORPUS.read_text() + '{"id": "6", "contents": "\\"Extra\\"\\nOne more."}\n')
    BM25Retriever.from_corpus_file(corpus, cache=tmp_path / "cache")
    assert len([path for path in (tmp_path / "cache").iterdir() if path.is_dir()]) == 2  # keyed by the file's content


@pytest.mark.parametrize(("line", "message"), [
    ('{"id": "9", "text": "no contents"}', r"bad\.jsonl, line 2: a corpus line needs `contents`, a string"),
    ('{"id": "9", "contents": ', r"bad\.jsonl, line 2: not JSON"),
    ('["a list"]', r"bad\.jsonl, line 2: a line must be a JSON object"),
])
def test_a_corpus_line_that_does_not_fit_is_refused_naming_its_file_and_line(tmp_path, line, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "0", "contents": "\\"Fine\\"\\nA passage."}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        read_corpus(bad)


def test_a_qa_row_without_answers_is_refused_naming_its_line(tmp_path):
    assert [row.golden_answers for row in read_qa(DATA / "qa.jsonl")][2] == (
        "Quellport", "the harbour town of Quellport")
    bad = tmp_path / "qa.jsonl"
    bad.write_text('{"question": "Where?", "golden_answers": ["Here"]}\n\n{"question": "Who?", "golden_answers": []}\n')
    with pytest.raises(ValueError, match=r"qa\.jsonl, line 3: a QA row needs `golden_answers`, a non-empty list"):
        read_qa(bad)


def test_the_server_speaks_search_r1_s_protocol_with_and_without_scores(server_url):
    status, answer = post(server_url, {"queries": ["Odile Stroame", "Fennbury market"], "topk": 2,
                                       "return_scores": True})
    assert status == 200 and [len(found) for found in answer["result"]] == [2, 2]
    first = answer["result"][0][0]
    assert first["document"] == {"id": "1", "contents": read_corpus(CORPUS)[1].contents} and first["score"] > 0
    assert answer["result"][1][0]["document"]["id"] == "3"

    status, plain = post(server_url, {"queries": ["Odile Stroame"], "topk": 2})
    assert status == 200 and plain["result"] == [[item["document"] for item in answer["result"][0]]]


def test_the_client_gets_what_the_retriever_in_process_finds_one_list_per_query(server_url):
    queries = ["Odile Stroame", "Quellport", "lanterns of the harbour", "nothing here"]
    found = HTTPRetriever(server_url)(queries, 3)
    assert found == BM25Retriever(read_corpus(CORPUS))(queries, 3)
    assert [len(passages) for passages in found] == [3, 3, 3, 0]


@pytest.mark.parametrize(("body", "message"), [
    ({"queries": "Odile", "topk": 3}, "`queries` must be a list of strings"),
    ({"queries": ["Odile"], "topk": 0}, "`topk` must be an int >= 1, got 0"),
    ({"queries": ["Odile"], "return_scores": "yes"}, "`return_scores` must be true or false"),
])
def test_a_request_that_does_not_fit_is_answered_400_saying_why(server_url, body, message):
    status, answer = post(server_url, body)
    assert status == 400 and answer["error"].startswith(message)


def closed_port_url() -> tuple[str, int]:
    """The URL of the retrieval endpoint on a port that was free a moment ago and where nothing listens now."""
    server = serve(BM25Retriever(read_corpus(CORPUS)), port=0)
    port = server.server_address[1]
    server.server_close()
    return f"http://127.0.0.1:{port}/retrieve", port


def test_a_server_that_stays_down_is_waited_for_then_named(caplog):
    url, _ = closed_port_url()
    with pytest.raises(RetrieverError, match=rf"the retrieval server {url} is unavailable \(.*refused.*\), still after "
                                             r"1 s of waiting \(the wait's bound: 1 s\): is it running"):
        HTTPRetriever(url, wait=1.0)(["Odile"], 3)
    (said,) = [r.message for r in caplog.records if r.name == "gigpo_trl"]  # said once, as the wait started
    assert said.startswith(f"the retrieval server {url} is unavailable (")
    assert said.endswith("): waiting up to 1 s for it")


def test_a_server_that_comes_back_within_the_wait_is_answered_as_if_it_never_left(caplog):
    url, port = closed_port_url()
    retriever = BM25Retriever(read_corpus(CORPUS))
    restarted = []

    def restart() -> None:
        server = serve(retriever, port=port)
        restarted.append(server)
        server.serve_forever(poll_interval=0.05)

    timer = threading.Timer(1.5, restart)
    timer.start()
    try:
        assert HTTPRetriever(url, wait=30.0)(["Odile Stroame"], 2) == retriever(["Odile Stroame"], 2)
    finally:
        while timer.is_alive() and not restarted:
            time.sleep(0.05)
        restarted[0].shutdown()  # serve_forever returns, and the timer's thread with it
        timer.join()
        restarted[0].server_close()
    said = [r.message for r in caplog.records if r.name == "gigpo_trl"]
    assert len(said) == 2 and "is unavailable" in said[0] and re.fullmatch(
        rf"the retrieval server {re.escape(url)} answers again \(after \d+\.\d s\)", said[1])


def test_a_5xx_answer_is_retried_and_garbage_is_refused_naming_the_url_and_what_came_back():
    good = json.dumps({"result": [[{"id": "7", "contents": '"A"\nText.'}]]}).encode()
    with scripted_server((503, b"busy"), (200, good)) as url:
        assert HTTPRetriever(url, wait=5.0)(["A"], 1) == [[Passage("7", '"A"\nText.', 0.0)]]

    for body, what in [(b"<html>oops</html>", "something that is not JSON"),
                       (b'{"result": []}', "no list of 1 result lists"),
                       (b'{"result": [[{"document": {"id": 1}}]]}', "a document without `contents`")]:
        with scripted_server((200, body)) as url, pytest.raises(
                RetrieverError, match=rf"the retrieval server {url} answered {what}.*{re.escape(body[:8].decode())}"):
            HTTPRetriever(url)(["A"], 1)
    with scripted_server((404, b"no such page")) as url, pytest.raises(
            RetrieverError, match=rf"{url} answered HTTP 404: 'no such page'"):
        HTTPRetriever(url)(["A"], 1)


def test_a_server_that_does_not_answer_in_time_is_named_without_trying_again():
    received = []
    with scripted_server((200, b"late"), delay=1.0, received=received) as url:
        with pytest.raises(RetrieverError, match=rf"the retrieval server {url} did not answer within 0.2 s"):
            HTTPRetriever(url, timeout=0.2)(["A"], 1)
        assert received == ["/retrieve"]  # asked once: a retry would have arrived before the error


@pytest.mark.timeout(300)
def test_the_gpu_recipe_trains_on_search_r1_files_through_a_retrieval_server_on_cpu(server_url, tmp_path,
                                                                                      tiny_model_path):
    """recipes/configs/search_qa_gpu.yaml as the recipe parses it, cut to one CPU update of the tiny model on the sample
    QA file, retrieving through the shipped server; the answers are scripted (search the question, then answer)."""
    from scripted_policy import scripted
    from trl import ModelConfig, TrlParser

    from gigpo_trl import GiGPOConfig, GiGPOTrainer, TaskArguments
    from gigpo_trl.dialogue import prompt_messages

    config = Path(__file__).resolve().parents[1] / "recipes" / "configs" / "search_qa_gpu.yaml"
    env_kwargs = {"qa": str(DATA / "qa.jsonl"), "retriever_url": server_url, "anchor": "observation", "top_k": 3}
    task_args, args, _ = TrlParser((TaskArguments, GiGPOConfig, ModelConfig)).parse_args_and_config(args=[
        "--config", str(config), "--output_dir", str(tmp_path), "--env_kwargs", json.dumps(env_kwargs),
        "--num_train_tasks", "8", "--use_vllm", "false", "--bf16", "false", "--dtype", "float32", "--max_steps", "1",
        "--per_device_train_batch_size", "10", "--steps_per_generation", "1", "--gradient_accumulation_steps", "1",
        "--max_completion_length", "8", "--activation_checkpointing", "false", "--save_strategy", "no",
        "--report_to", "none", "--env_processes", "false"])

    def search_then_answer(prompt, tools, position):
        text = prompt_messages(prompt)[-1]["content"]
        if "<information>" in text:
            return "<answer>Fennbury</answer>"
        return f"<search>{re.search(r'Question: (.+)', text).group(1)}</search>"

    train, _ = task_args.datasets(args.env_name, args.env_kwargs)
    trainer = scripted(GiGPOTrainer(tiny_model_path, args=args, train_dataset=train), search_then_answer)
    trainer.train()
    trainer.close_environments()

    assert (args.num_generations, args.similarity_threshold, args.history_length) == (5, 0.9, None)  # the paper's
    log = next(entry for entry in trainer.state.log_history if "env/searches" in entry)
    assert log["env/searches"] == 1.0 and log["env/env_error_share"] == 0.0 and log["env/step_samples"] == 20
    steps = trainer.last_rollout.steps
    assert all("<information>" in steps.observation[row] for row in range(len(steps)) if steps.step[row] == 1)
