"""Search QA (`gigpo_trl.environments.search_qa`): the history gap of its question families, its step groups, and
what retrieval costs, in one script.

    python bench/bench_search_qa.py --ceilings       # oracle vs the best memoryless policy, per family and window K
    python bench/bench_search_qa.py --step-groups    # one task group's step groups under both anchors
    python bench/bench_search_qa.py --format-probe   # SmolLM2-135M's first answers: the format as chat turns or inline
    python bench/bench_search_qa.py                  # retrieval: per query, one rollout turn of a pool, a worker's memory

`--ceilings`: the success of `oracle_policy` and of `memoryless_policy(K)` for K = 0, 1, 2, 3 on `--tasks` tasks of
each family (collect with 2 and 3 people), the default world otherwise.

`--step-groups`: four copies of one collect task played by scripts (the oracle; the same searches in the other order;
an invalid action first; the memoryless policy with K = 0), their steps grouped as GiGPO groups them under
`anchor="retrieved"` (exact) and `anchor="observation"` (`similarity_threshold=0.9`), with each step's step advantage
(gamma 0.95, mean-std normalisation).

`--format-probe`: the first answers of the embedded SmolLM2-135M-Instruct to `--tasks` tasks (sampled at temperature
1), in the format or not, with the default template's worked example as earlier chat turns and the same example written
inline in the instruction.

The retrieval bench (no flag): BM25 per query in process over generated worlds of about 10k and 100k passages; one
rollout turn of `--envs` live episodes (one task each) searching through an `EnvPool` against the 100k corpus in
process (the index saved once and loaded memory-mapped by every worker) and against the shipped HTTP server (each
environment its own request), beside one request carrying all the queries (what batching would give); the memory of a
worker (`--memory-workers` of them, started as fresh interpreters) holding its own index, the memory-mapped index, or
an HTTP client.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

from gigpo_trl.advantages import anchor_step_groups, compute_gigpo_advantages
from gigpo_trl.dialogue import TextDialogue
from gigpo_trl.env_pool import EnvPool
from gigpo_trl.envs import EnvOutput
from gigpo_trl.environments.retrieval import BM25Retriever, HTTPRetriever, read_corpus
from gigpo_trl.environments.search_qa import (
    PROMPT_TEMPLATE, SearchQAEnv, World, WorldSettings, generate_world, memoryless_policy, oracle_policy, play,
)
from gigpo_trl.fork_server import ForkServer
from gigpo_trl.parsing import parse_action
from gigpo_trl.paths import CACHE_ENV_VAR
from gigpo_trl.tasks import Task

WINDOWS = (0, 1, 2, 3)
FAMILY_ROWS = (("lookup", {"families": ["lookup"]}), ("chain (2-3 hops)", {"families": ["chain"]}),
               ("collect, 2 people", {"families": ["collect"]}),
               ("collect, 3 people", {"families": ["collect"], "collect_size": 3}),
               ("compare", {"families": ["compare"]}))
MIB = 1 << 20


def ceilings(tasks: int) -> None:
    print(f"Success over {tasks} tasks a family (default world: 10 people, 4 companies, 8 cities, 2 distractors, "
          "top 3, 4 turns)\n")
    print("| family | oracle | " + " | ".join(f"memoryless, K = {k}" for k in WINDOWS) + " |")
    print("|---|---|" + "---|" * len(WINDOWS))
    for name, knobs in FAMILY_ROWS:
        env = SearchQAEnv(**knobs)
        won = {"oracle": 0, **{k: 0 for k in WINDOWS}}
        for seed in range(tasks):
            won["oracle"] += play(env, seed, oracle_policy)[1]
            cities = env.world.cities
            for k in WINDOWS:
                won[k] += play(env, seed, memoryless_policy(k, cities, random.Random(seed)))[1]
        print(f"| {name} | " + " | ".join(f"{100 * won[key] / tasks:.1f}%" for key in ["oracle", *WINDOWS]) + " |")


def step_groups(seed: int) -> None:
    env = SearchQAEnv(families=["collect"])
    env.reset(seed=seed)
    a_search, b_search, answer = env.walkthrough
    names = dict(zip(env.world.question.searches, "ab"))
    scripts = {"A": lambda: _script([a_search, b_search, answer]), "B": lambda: _script([b_search, a_search, answer]),
               "C": lambda: _script(["I will search for them.", a_search, b_search, answer]),
               "D": lambda: memoryless_policy(0, env.world.cities, random.Random(seed))}  # the same guess each time
    print(f"Task (seed {seed}): {env.world.question.text} (a, b); golden answers {env.world.question.golden_answers}")
    print("Copies: A the oracle; B the same searches in the other order; C an invalid action first; D memoryless, "
          "K = 0 (guesses a's birth place)")
    for anchor, threshold in (("retrieved", None), ("observation", 0.9)):
        rows = []  # copy, step, anchor, action, reward, the state in words
        for copy, policy in scripts.items():
            played, won = play(SearchQAEnv(families=["collect"], anchor=anchor), seed, policy())
            searched: list[str] = []
            for t, (key, action) in enumerate(played):
                rows.append((copy, t, key, action, float(won) if t == len(played) - 1 else 0.0,
                             _state(anchor, searched, played[t - 1][1] if t else None, names)))
                query = re.fullmatch(r"<search>(.*)</search>", action)
                searched += [names[query.group(1)]] if query else []
        copies, steps, keys, actions, rewards, states = map(list, zip(*rows))
        groups = anchor_step_groups([0] * len(rows), keys, steps, threshold)
        advantages = compute_gigpo_advantages(rewards, [0] * len(rows), copies, steps, keys,
                                              similarity_threshold=threshold).step_advantages
        print(f"\nanchor={anchor!r}" + (f", similarity_threshold={threshold}" if threshold else " (exact)"))
        print("| step group | step | the state its anchor holds | action | reward | A_S |")
        print("|---|---|---|---|---|---|")
        for k in sorted(range(len(rows)), key=lambda k: (groups[k], steps[k], copies[k])):
            shown = re.sub(r"<search>(.*)</search>", lambda m: f"search {names[m.group(1)]}", actions[k])
            print(f"| {groups[k] + 1} | {copies[k]}{steps[k]} | {states[k]} | {shown} | {rewards[k]:g} | "
                  f"{advantages[k]:+.2f} |")


def _script(actions: Sequence[str]) -> Callable[..., str]:
    """A policy that plays `actions` in turn."""
    return lambda question, history, observation: actions[len(history)]


def _state(anchor: str, searched: Sequence[str], last_action: str | None, names: dict[str, str]) -> str:
    """What a step's anchor holds, in words."""
    if anchor == "retrieved":
        return "the question, " + (f"results of {' and '.join(sorted(searched))}" if searched else "nothing retrieved")
    if last_action is None:
        return "the question"
    query = re.fullmatch(r"<search>(.*)</search>", last_action)
    return f"results of {names[query.group(1)]}" if query else "the invalid-action message"


def format_probe(tasks: int, tokens: int) -> None:
    """How often the embedded SmolLM2-135M-Instruct's first answer follows the format, with the template's worked
    example as earlier chat turns and with the same example written inline in the instruction."""
    import torch  # noqa: PLC0415 (only this mode loads a model)
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    from gigpo_trl.models import EMBEDDED_MODEL, resolve_model  # noqa: PLC0415

    torch.manual_seed(0)
    path = resolve_model(EMBEDDED_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path)
    inline = dataclasses.replace(PROMPT_TEMPLATE, examples=(),
                                 instruction=f"{PROMPT_TEMPLATE.instruction} For example: <search>Ysolde Quaine</search>")
    env = SearchQAEnv()
    print(f"First answers of {EMBEDDED_MODEL} to {tasks} tasks (sampled, temperature 1, {tokens} tokens at most)\n")
    print("| the format shown | in the format | searches | answers |")
    print("|---|---|---|---|")
    for name, template in (("a worked example as earlier chat turns (the default)", PROMPT_TEMPLATE),
                           ("the same example inline in the instruction", inline)):
        prompts = []
        for seed in range(tasks):
            observation, info = env.reset(seed=seed)
            start = EnvOutput(observation, info=info)
            messages = TextDialogue(template).prompt(start, start, [], 0)
            prompts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        inputs = tokenizer(prompts, return_tensors="pt", padding=True)
        generated = model.generate(**inputs, max_new_tokens=tokens, do_sample=True, temperature=1.0, top_p=1.0,
                                   pad_token_id=tokenizer.pad_token_id)
        answers = tokenizer.batch_decode(generated[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        parsed = [parse_action(answer, None, PROMPT_TEMPLATE.action_tags) for answer in answers]
        kinds = [p.action[1:7] for p in parsed if p.valid]
        print(f"| {name} | {len(kinds)} of {tasks} | {kinds.count('search')} | {kinds.count('answer')} |")


def world_of(passages: int, seed: int = 0) -> World:
    """A generated world of about `passages` passages (60% people, 25% companies, 15% cities)."""
    return generate_world(seed, WorldSettings(num_people=passages * 6 // 10, num_companies=passages // 4,
                                              num_cities=passages * 15 // 100))


def retrieval(envs: int, memory_workers: int, repeats: int) -> None:
    print(f"CPU: {_cpu()}; {psutil.cpu_count()} cores\n")
    print("| corpus | indexing | one query a call (median of 200) | 64 queries in one call, per query |")
    print("|---|---|---|---|")
    for size in (10_000, 100_000):
        world = world_of(size)
        started = time.perf_counter()
        retriever = BM25Retriever(world.passages)
        indexing = time.perf_counter() - started
        people = [entity for entity in world.entities if entity.kind == "person"]
        queries = [person.name for person in random.Random(size).sample(people, 200)]
        one = statistics.median(_seconds(lambda q=q: retriever([q], 3)) for q in queries)
        batch = statistics.median(_seconds(lambda: retriever(queries[:64], 3)) for _ in range(repeats)) / 64
        print(f"| {len(world.passages):,} passages | {indexing:.2f} s | {1e3 * one:.2f} ms | {1e3 * batch:.2f} ms |")

    with tempfile.TemporaryDirectory() as folder:  # the 100k world's corpus, questions about its people, the cache
        os.environ[CACHE_ENV_VAR] = str(Path(folder) / "cache")  # for this process, the server and the workers
        corpus, qa = Path(folder) / "corpus.jsonl", Path(folder) / "qa.jsonl"
        corpus.write_text("".join(json.dumps({"id": p.id, "contents": p.contents}) + "\n" for p in world.passages))
        asked = people[: max(envs, memory_workers)]
        qa.write_text("".join(json.dumps({"question": f"Where was {p.name} born?",
                                          "golden_answers": [p.facts["birth_city"]]}) + "\n" for p in asked))
        started = time.perf_counter()
        BM25Retriever.from_corpus_file(corpus)  # saved once for the machine, before any worker loads it
        print(f"\nThe {len(world.passages):,}-passage corpus indexed and saved in {time.perf_counter() - started:.1f} s")
        server = subprocess.Popen([sys.executable, "-m", "gigpo_trl.environments.retrieval", "--corpus", str(corpus),
                                   "--port", "0"], stdout=subprocess.PIPE, text=True)
        try:
            url = server.stdout.readline().split(" at ")[1].strip()
            searches = [f"<search>{person.name}</search>" for person in asked]
            arms = {"in process, the index memory-mapped": functools.partial(SearchQAEnv, qa=str(qa), corpus=str(corpus),
                                                                             max_steps=None),
                    "HTTP server, a request an environment": functools.partial(SearchQAEnv, qa=str(qa),
                                                                               retriever_url=url, max_steps=None)}
            print(f"\nOne rollout turn of {envs} live episodes searching, through an EnvPool (median of {repeats})\n")
            print("| retrieval | the turn | per episode |")
            print("|---|---|---|")
            for arm, factory in arms.items():
                with EnvPool(factory, envs, 1) as pool:
                    pool.reset([Task(seed=k) for k in range(envs)])
                    turn = statistics.median(_seconds(lambda: pool.step(dict(enumerate(searches[:envs]))))
                                             for _ in range(repeats))
                print(f"| {arm} | {1e3 * turn:.1f} ms | {1e3 * turn / envs:.2f} ms |")
            client = HTTPRetriever(url)
            batched = statistics.median(_seconds(lambda: client([p.name for p in asked[:envs]], 3))
                                        for _ in range(repeats))
            print(f"| HTTP server, one request of all {envs} queries (no pool) | {1e3 * batched:.1f} ms | "
                  f"{1e3 * batched / envs:.2f} ms |")

            arms = {"its own index in memory": functools.partial(_own_index_env, str(qa), str(corpus)), **arms}
            print(f"\nA worker's memory after one search (median of {memory_workers} workers, each a fresh "
                  "interpreter)\n")
            print("| retrieval | RSS | USS |")
            print("|---|---|---|")
            for arm, factory in arms.items():
                fork_server = ForkServer(start_method="spawn")
                try:
                    with EnvPool(factory, memory_workers, 1, fork_server=fork_server) as pool:
                        pool.reset([Task(seed=k) for k in range(memory_workers)])
                        pool.step(dict(enumerate(searches[:memory_workers])))
                        memory = [psutil.Process(worker.process.pid).memory_full_info() for worker in pool._workers]
                finally:
                    fork_server.close()
                print(f"| {arm} | {statistics.median(m.rss for m in memory) / MIB:.0f} MiB | "
                      f"{statistics.median(m.uss for m in memory) / MIB:.0f} MiB |")
            held = psutil.Process(server.pid).memory_full_info()
            print(f"| (the HTTP server itself, all workers' index) | {held.rss / MIB:.0f} MiB | {held.uss / MIB:.0f} MiB |")
        finally:
            server.terminate()
            server.wait(timeout=10)
            server.stdout.close()


def _own_index_env(qa: str, corpus: str) -> SearchQAEnv:
    """An environment whose worker reads the corpus and indexes it in its own memory."""
    return SearchQAEnv(qa=qa, retriever=BM25Retriever(read_corpus(corpus)), max_steps=None)


def _seconds(call: Callable[[], object]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def _cpu() -> str:
    lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout.splitlines()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name")), "unknown")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ceilings", action="store_true", help="oracle vs memoryless success per family and window")
    parser.add_argument("--step-groups", action="store_true", help="one task group's step groups under both anchors")
    parser.add_argument("--format-probe", action="store_true", help="how often SmolLM2-135M's first answer follows the "
                        "format, the example as chat turns or inline (loads the model: minutes on CPU)")
    parser.add_argument("--tasks", type=int, default=None,
                        help="tasks a family (--ceilings, default 300), or tasks (--format-probe, default 32)")
    parser.add_argument("--seed", type=int, default=1, help="the task (--step-groups)")
    parser.add_argument("--envs", type=int, default=64, help="live episodes of the pool's turn")
    parser.add_argument("--memory-workers", type=int, default=8, help="workers whose memory is measured, an arm")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats of a turn or a batch")
    options = parser.parse_args(argv)
    if options.ceilings:
        ceilings(options.tasks or 300)
    elif options.step_groups:
        step_groups(options.seed)
    elif options.format_probe:
        format_probe(options.tasks or 32, 40)
    else:
        retrieval(options.envs, options.memory_workers, options.repeats)


if __name__ == "__main__":
    main()
