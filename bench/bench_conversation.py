"""Conversation mode's costs side by side in one run: the update of a T-step conversation's step samples, and the
rollout's prefill, at T = 5, 10, 20 and 50 (docs/performance.md, "Whole conversations").

    OMP_NUM_THREADS=1 python bench/bench_conversation.py                        # T = 5 10 20 50, about 40 minutes
    OMP_NUM_THREADS=1 python bench/bench_conversation.py --steps 5 10 --layers 30   # SmolLM2-135M's full depth

Synthetic ALFWorld-shaped conversations (`--shape`: instruction, observation and answer tokens; random ids) of G
episodes (`--episodes`), on a random model of SmolLM2-135M's shape cut to `--layers` layers (random weights change no
cost; answers in the rollout are forced to their length). Per T:

1. **The update** of the T step samples of each episode, one micro-batch an episode, each arm's loss and backward
   passes (`GiGPOTrainer.compute_loss`, as `bench/packed_update.py` times them), alternating `--repeats` times:
   (a) conversation mode, packed: step t's prompt is the whole conversation so far, its answer trained with the step's
       advantage; the packed update forwards each distinct token once;
   (b) the same step samples as plain rows (each forwarded whole, padded as TRL pads them, in passes of 5 rows);
   (c) a 2-step window: step t's prompt is the instructions, the last 2 exchanges and the observation (packed, as the
       windowed default trains);
   (d) TRL's own loss path on each conversation as one sample (`GRPOTrainer(environment_factory=...)`'s way): the first
       prompt, then every answer and observation as one completion, the observations masked (`tool_mask` 0).
   Per arm: the token positions forwarded (padding included), the real tokens, and the CPU seconds (this process) per
   step sample (T x G of them in every arm).
2. **The rollout's prefill**: the G conversations generated turn by turn (answers of exactly the shape's length),
   with TRL's `generate` over left-padded prompts and with the prefix cache (`gigpo_trl.prefix_cache`), alternating:
   the prompt tokens forwarded and the generation seconds.
3. With `--first-turn TASKS COPIES`, instead: one turn of windowed prompts (shared instructions, each task's copies
   alike, as a GiGPO rollout's first turn), generated both ways: the CPU seconds and the prompt tokens forwarded.
4. With `--turn-tokens CONFIG ...`, instead: the tokens of each later turn of a conversation in each recipe config's
   environment, template and tokenizer (an episode played by its walkthrough, or its first admissible action), written
   as conversation mode writes it (the observation, and the admissible actions where they changed) and as it wrote it
   before (the first turn's whole wording again: task aside, the actions list and the answer format).
Writes OUTPUT/bench_conversation.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from packed_update import positions_forwarded, timed_update  # noqa: E402

WINDOW = 2  # the windowed arm's exchanges, the text environments' default
PLAIN_ROWS_PER_PASS = 5


def random_model(source: str, layers: int, attention: str = "sdpa"):
    """A random model of `source`'s configuration cut to `layers` layers (its `attention` implementation), and
    `source`'s tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from gigpo_trl.models import resolve_model

    path = resolve_model(source)
    config = AutoConfig.from_pretrained(path)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention), AutoTokenizer.from_pretrained(path)


def conversations(episodes: int, steps: int, shape: tuple[int, int, int], vocab: int, seed: int) -> list[dict]:
    """`episodes` conversations: shared instructions, then per step an observation and an answer (random ids)."""
    instructions, observation, answer = shape
    rng = random.Random(seed)
    tokens = lambda count: [rng.randrange(3, vocab) for _ in range(count)]  # noqa: E731
    shared = tokens(instructions)
    return [{"instructions": shared, "observations": [tokens(observation) for _ in range(steps)],
             "answers": [tokens(answer) for _ in range(steps)]} for _ in range(episodes)]


def step_prompt(conversation: dict, step: int, window: int | None) -> list[int]:
    """Step `step`'s prompt: the instructions, the exchanges before it (all, or the last `window`), its observation."""
    first = 0 if window is None else max(0, step - window)
    exchanges = [token for k in range(first, step)
                 for token in conversation["observations"][k] + conversation["answers"][k]]
    return conversation["instructions"] + exchanges + conversation["observations"][step]


def update_trainer(model, tokenizer, rows_per_micro_batch: int, micro_batches: int, max_completion_length: int,
                   rows_per_pass: int | None = None, use_cpu: bool = True):
    """A GiGPOTrainer (fp32; on the CPU unless `use_cpu` is False) whose update takes `micro_batches` micro-batches of
    `rows_per_micro_batch` rows, forwarded in passes of `rows_per_pass` rows (`max_step_samples_per_micro_batch`;
    None: a micro-batch a pass)."""
    from gigpo_trl import GiGPOConfig, GiGPOTrainer, task_dataset

    args = GiGPOConfig(output_dir=tempfile.mkdtemp(), env_name="corridor", env_processes=False, num_generations=2,
                       per_device_train_batch_size=rows_per_micro_batch, steps_per_generation=micro_batches,
                       gradient_accumulation_steps=micro_batches, use_cpu=use_cpu, bf16=False, activation_checkpointing=False,
                       report_to=[], save_strategy="no", max_completion_length=max_completion_length,
                       max_step_samples_per_micro_batch=rows_per_pass)
    tasks = rows_per_micro_batch * micro_batches // 2
    trainer = GiGPOTrainer(model, args=args, processing_class=tokenizer, train_dataset=task_dataset(range(tasks)))
    trainer.model.train()
    return trainer


def step_rows(trainer, episodes: list[dict], window: int | None, steps: list[int] | None = None) -> list[dict]:
    """One micro-batch an episode: its T step samples (prompt, answer), or those of `steps`, random advantages."""
    from gigpo_trl.batch import loss_batch
    from gigpo_trl.dialogue import Completion

    rng = random.Random(1)
    micro_batches = []
    for conversation in episodes:
        completions = [Completion(step_prompt(conversation, t, window), answer, "")
                       for t, answer in enumerate(conversation["answers"]) if steps is None or t in steps]
        micro_batches.append(loss_batch(trainer, completions, [1.0] * len(completions),
                                        [rng.gauss(0.0, 1.0) for _ in completions], "train"))
    return micro_batches


def whole_rows(trainer, episodes: list[dict]) -> list[dict]:
    """TRL's one sample per conversation: the first prompt, then every answer and observation as its completion, the
    observations masked out of the loss; one micro-batch an episode."""
    import torch

    from gigpo_trl.batch import loss_batch
    from gigpo_trl.dialogue import Completion

    rng = random.Random(1)
    micro_batches = []
    for conversation in episodes:
        completion, trained = [], []
        for t, answer in enumerate(conversation["answers"]):
            if t:
                completion += conversation["observations"][t]
                trained += [0] * len(conversation["observations"][t])
            completion += answer
            trained += [1] * len(answer)
        prompt = conversation["instructions"] + conversation["observations"][0]
        batch = loss_batch(trainer, [Completion(prompt, completion, "")], [1.0], [rng.gauss(0.0, 1.0)], "train")
        batch["tool_mask"] = batch["tool_mask"] * torch.tensor([trained])
        micro_batches.append(batch)
    return micro_batches


def sampled_steps(steps: int, rows: int) -> list[int]:
    """`rows` of `steps` steps, evenly spaced, the last one included (its prompt is the episode's longest)."""
    return sorted({steps - 1 - k * max(1, steps // rows) for k in range(min(rows, steps))})


def bench_update(model, tokenizer, episodes: list[dict], repeats: int, time_plain: bool = True) -> dict:
    """The four arms' update of the same conversations (module docstring, 1). Unless `time_plain`, the plain rows
    are timed on one pass of each episode (PLAIN_ROWS_PER_PASS rows, `sampled_steps`): TRL pads a micro-batch's rows
    to its longest, so with the episode's last step among them the pass has the shape, and the cost, of every pass of
    the whole micro-batch; their positions are counted whole in any case."""
    steps = len(episodes[0]["answers"])
    answer = len(episodes[0]["answers"][0])
    longest = sum(map(len, episodes[0]["observations"][1:])) + steps * answer
    step_trainer = update_trainer(model, tokenizer, steps, len(episodes), answer)
    # plain rows in passes of PLAIN_ROWS_PER_PASS (the same compute, a fraction of the activations: a micro-batch of
    # 20 rows of 1,700 tokens in one pass ran this machine out of memory)
    plain_trainer = update_trainer(model, tokenizer, steps, len(episodes), answer, PLAIN_ROWS_PER_PASS)
    whole_trainer = update_trainer(model, tokenizer, 1, len(episodes), longest)
    arms = {  # name: (trainer, micro-batches, packed)
        "conversation_packed": (step_trainer, step_rows(step_trainer, episodes, None), True),
        "conversation_plain_rows": (plain_trainer, step_rows(plain_trainer, episodes, None), False),
        "window_2_packed": (step_trainer, step_rows(step_trainer, episodes, WINDOW), True),
        "trl_one_sample": (whole_trainer, whole_rows(whole_trainer, episodes), False),
    }
    timed_arms = dict(arms)
    timed_rows = {name: steps * len(episodes) for name in arms}
    if not time_plain:
        sample = sampled_steps(steps, PLAIN_ROWS_PER_PASS)
        sample_trainer = update_trainer(model, tokenizer, len(sample), len(episodes), answer)
        timed_arms["conversation_plain_rows"] = (sample_trainer, step_rows(sample_trainer, episodes, None, sample), False)
        timed_rows["conversation_plain_rows"] = len(sample) * len(episodes)
    runs: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(repeats):
        for name, (trainer, micro_batches, packed) in timed_arms.items():
            runs[name].append(timed_update(trainer, micro_batches, packed)["cpu_s"])
    figures = {}
    for name, (trainer, micro_batches, packed) in arms.items():
        real = sum(int((b["prompt_mask"].sum() + b["completion_mask"].sum()).item()) for b in micro_batches)
        figures[name] = {"positions_forwarded": positions_forwarded(trainer, micro_batches, packed), "real_tokens": real,
                         "cpu_s_per_step_sample": min(runs[name]) / timed_rows[name], "cpu_s_runs": runs[name],
                         "timed_step_samples": timed_rows[name]}
    return figures


def bench_prefill(model, tokenizer, episodes: list[dict], repeats: int) -> dict:
    """The conversations generated turn by turn with TRL's `generate` and with the prefix cache (module docstring,
    2): prompt tokens forwarded and generation seconds, the best of `repeats`."""
    import torch
    from transformers import GenerationConfig

    from gigpo_trl.prefix_cache import PrefixCache

    answer = len(episodes[0]["answers"][0])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    config = GenerationConfig(do_sample=False, max_new_tokens=answer, min_new_tokens=answer, eos_token_id=None,
                              pad_token_id=pad)
    model.eval()

    def plain(prompts: list[list[int]]) -> tuple[list[list[int]], int]:
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), pad)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):], mask[row, width - len(prompt):] = torch.tensor(prompt), 1
        return model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, width:].tolist(), \
            sum(map(len, prompts))

    def play(generate) -> tuple[float, int, int]:
        """(CPU seconds, prompt tokens, tokens forwarded) of the conversations played turn by turn, each turn's
        prompt its previous prompt and answer (as generated) and the next observation."""
        prompts = [step_prompt(conversation, 0, window=0) for conversation in episodes]
        seconds = prompt_tokens = forwarded = 0
        for t in range(len(episodes[0]["answers"])):
            started = time.process_time()
            answers, read = generate(prompts)
            seconds += time.process_time() - started
            prompt_tokens, forwarded = prompt_tokens + sum(map(len, prompts)), forwarded + read
            if t + 1 < len(episodes[0]["answers"]):
                prompts = [prompt + generated + conversation["observations"][t + 1]
                           for prompt, generated, conversation in zip(prompts, answers, episodes)]
        return seconds, prompt_tokens, forwarded

    def cached(prompts: list[list[int]]) -> tuple[list[list[int]], int]:
        generated = cache.generate(model, prompts, config, pad).tolist()
        return generated, cache.take_counts().forwarded_tokens

    runs: dict[str, list[tuple[float, int, int]]] = {"generate": [], "prefix_cache": []}
    with torch.no_grad():
        for _ in range(repeats):
            runs["generate"].append(play(plain))
            cache = PrefixCache()
            runs["prefix_cache"].append(play(cached))
    model.train()
    return {name: {"cpu_s": min(run[0] for run in played), "prompt_tokens": played[0][1],
                   "prefill_tokens": played[0][2], "cpu_s_runs": [run[0] for run in played]}
            for name, played in runs.items()}


def bench_first_turn(model, tasks: int, copies: int, shape: tuple[int, int, int], repeats: int) -> dict:
    """One turn of windowed prompts (module docstring, 3): `tasks` x `copies` prompts of the shape's instructions and
    a task of `observation` tokens, each task's copies alike, answers of the shape's length; TRL's `generate` and the
    prefix cache alternately, the best CPU seconds of `repeats` and the prompt tokens forwarded."""
    import torch
    from transformers import GenerationConfig

    from gigpo_trl.prefix_cache import PrefixCache

    instructions, observation, answer = shape
    rng = random.Random(0)
    tokens = lambda count: [rng.randrange(3, model.config.vocab_size) for _ in range(count)]  # noqa: E731
    shared = tokens(instructions)
    prompts = [prompt for prompt in (shared + tokens(observation) for _ in range(tasks)) for _ in range(copies)]
    config = GenerationConfig(do_sample=False, max_new_tokens=answer, min_new_tokens=answer, eos_token_id=None,
                              pad_token_id=0)
    model.eval()
    seconds: dict[str, list[float]] = {"generate": [], "prefix_cache": []}
    with torch.no_grad():
        for _ in range(repeats):
            width = max(map(len, prompts))
            ids = torch.zeros((len(prompts), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, prompt in enumerate(prompts):
                ids[row, width - len(prompt):], mask[row, width - len(prompt):] = torch.tensor(prompt), 1
            started = time.process_time()
            plain = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, width:]
            seconds["generate"].append(time.process_time() - started)
            cache = PrefixCache()
            started = time.process_time()
            cached = cache.generate(model, prompts, config, 0)
            seconds["prefix_cache"].append(time.process_time() - started)
            if not torch.equal(plain, cached):
                raise AssertionError("the prefix cache's greedy tokens differ from generate's")
    model.train()
    return {"prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)),
            "prefill_tokens": {"generate": sum(map(len, prompts)), "prefix_cache": cache.take_counts().forwarded_tokens},
            "cpu_s": {name: min(runs) for name, runs in seconds.items()}, "cpu_s_runs": seconds}


def turn_tokens(config_path: Path, episodes: int = 4, steps: int = 5) -> dict:
    """Tokens of the later turns of conversations in a recipe config's environment (module docstring, 4): per turn,
    as `TextDialogue.turn` writes it, and with the first turn's whole wording (`build_messages` without history) as
    conversation mode wrote it before."""
    import yaml
    from transformers import AutoTokenizer

    from gigpo_trl.conversation import ChatTurns
    from gigpo_trl.dialogue import Exchange, TextDialogue
    from gigpo_trl.envs import INFO_ADMISSIBLE_ACTIONS, EnvOutput, make_env
    from gigpo_trl.models import resolve_model
    from gigpo_trl.parsing import ParsedAction
    from gigpo_trl.prompts import build_messages, load_template, template_for

    config = yaml.safe_load(config_path.read_text())
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(config["model_name_or_path"]))
    turns = ChatTurns(lambda messages, prompt: list(tokenizer.apply_chat_template(
        messages, add_generation_prompt=prompt, tokenize=True, return_dict=False)), {tokenizer.eos_token_id})
    template = load_template(config["prompt_template"]) if config.get("prompt_template") else template_for(config["env_name"])
    dialogue, env = TextDialogue(template, None), make_env(config["env_name"], **config.get("env_kwargs", {}))
    new, old = [], []
    for seed in range(episodes):
        observation, info = env.reset(seed=seed)
        state = EnvOutput(observation, info=info)
        walkthrough = list(getattr(env, "walkthrough", None) or [])
        for step in range(1, steps + 1):
            action = walkthrough[step - 1] if step <= len(walkthrough) else state.info[INFO_ADMISSIBLE_ACTIONS][0]
            observation, reward, terminated, truncated, info = env.step(action)
            result = EnvOutput(observation, reward, terminated, truncated, info)
            new.append(len(turns.turn_ids(dialogue.turn(Exchange(state, ParsedAction(action, True), result, None), step))[1]))
            whole = build_messages(observation, step=step, admissible_actions=info.get(INFO_ADMISSIBLE_ACTIONS),
                                   history_length=0, template=template)[-1:]
            old.append(len(turns.turn_ids(whole)[1]))
            if result.done:
                break
            state = result
    env.close()
    return {"config": str(config_path), "turns": len(new), "tokens_per_turn_before": sum(old) / len(old),
            "tokens_per_turn_now": sum(new) / len(new)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, nargs="+", default=[5, 10, 20, 50], help="the conversations' lengths T")
    parser.add_argument("--episodes", type=int, default=2, help="conversations G")
    parser.add_argument("--shape", type=int, nargs=3, default=[200, 60, 15],
                        metavar=("INSTRUCTIONS", "OBSERVATION", "ANSWER"), help="tokens of each part")
    parser.add_argument("--model", default="embedded:SmolLM2-135M-Instruct", help="the configuration and tokenizer")
    parser.add_argument("--layers", type=int, default=2, help="layers of the random model")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--time-plain-up-to", type=int, default=20, metavar="T",
                        help="time the plain rows' whole update up to this T; beyond it, one pass of each episode's "
                        f"rows ({PLAIN_ROWS_PER_PASS} rows padded to its longest, as every pass of it is; at T = 50 the "
                        "whole update takes hours)")
    parser.add_argument("--skip-rollout", action="store_true", help="the update only")
    parser.add_argument("--first-turn", type=int, nargs=2, metavar=("TASKS", "COPIES"), default=None,
                        help="instead: one turn of windowed prompts, TASKS x COPIES (each task's copies alike) of the "
                        "shape's instructions and an observation-sized task, generated with and without the prefix "
                        "cache (e.g. the quickstart's first turn: --first-turn 4 4 --shape 300 80 12 --layers 30)")
    parser.add_argument("--turn-tokens", type=Path, nargs="+", default=None, metavar="CONFIG",
                        help="instead: the tokens of each later turn of a conversation in these recipe configs' "
                        "environments (module docstring, 4)")
    parser.add_argument("--output", type=Path, default=ROOT / "outputs" / "bench_conversation")
    args = parser.parse_args()
    if args.turn_tokens:
        for config in args.turn_tokens:
            print(json.dumps(turn_tokens(config)), flush=True)
        return

    import torch

    torch.manual_seed(0)
    model, tokenizer = random_model(args.model, args.layers)
    if args.first_turn:
        figures = bench_first_turn(model, *args.first_turn, tuple(args.shape), args.repeats)
        print(json.dumps(figures, indent=1))
        args.output.mkdir(parents=True, exist_ok=True)
        (args.output / "bench_first_turn.json").write_text(json.dumps(figures, indent=1))
        return
    results = {"model": f"{args.model}, random, {args.layers} layers", "shape": args.shape, "episodes": args.episodes,
               "steps": {}}
    for steps in args.steps:
        episodes = conversations(args.episodes, steps, tuple(args.shape), model.config.vocab_size, seed=steps)
        row = {"update": bench_update(model, tokenizer, episodes, args.repeats, steps <= args.time_plain_up_to)}
        if not args.skip_rollout:
            row["rollout"] = bench_prefill(model, tokenizer, episodes, args.repeats)
        update = row["update"]
        packed, plain = update["conversation_packed"], update["conversation_plain_rows"]
        row["ratios"] = {
            "packed_vs_trl_cpu": packed["cpu_s_per_step_sample"] / update["trl_one_sample"]["cpu_s_per_step_sample"],
            "plain_rows_vs_packed_positions": plain["positions_forwarded"] / packed["positions_forwarded"],
        }
        row["ratios"]["plain_rows_vs_packed_cpu"] = plain["cpu_s_per_step_sample"] / packed["cpu_s_per_step_sample"]
        if "rollout" in row:
            rollout = row["rollout"]
            row["ratios"]["prefill_tokens_generate_vs_cache"] = (rollout["generate"]["prefill_tokens"]
                                                                 / rollout["prefix_cache"]["prefill_tokens"])
            row["ratios"]["generation_s_generate_vs_cache"] = rollout["generate"]["cpu_s"] / rollout["prefix_cache"]["cpu_s"]
        results["steps"][steps] = row
        print(json.dumps({"T": steps, **row}, indent=1), flush=True)
        args.output.mkdir(parents=True, exist_ok=True)
        (args.output / "bench_conversation.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
