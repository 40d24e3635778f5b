"""What a learning setting needs before RL, and checks of what a model can learn without it: the format warm-up of the
tiny model (answers well-formed, actions uniformly random), the right actions of the rooms game (follow the draught;
without the hint, keep going and turn at the wall), the reading probe (supervised learning with those labels: can the
model act on its observation, or its history, at all?) and the screen of candidate settings with the base model."""

from __future__ import annotations

import itertools
import math
import random
import re
import time
from collections.abc import Sequence
from typing import Any
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

def draught_move(observation: str) -> str:
    """Rooms: the action that follows the draught of "Room k. The draught blows west." ("go west")."""
    return "go " + observation.rsplit(" ", 1)[-1].rstrip(".")


def draught_action(observation: str, actions: list[str]) -> int:
    """Rooms: the number of the admissible action that follows the draught."""
    return actions.index(draught_move(observation)) + 1


def memory_action(observation: str, actions: list[str], history: list[tuple[str, str]], num_rooms: int) -> int:
    """Rooms without the hint: the number of the admissible action of the policy that needs memory and wins every
    task: keep going the way of the last move, turn at the wall ("Room 0." -> go east)."""
    room = int(re.match(r"Room (\d+)", observation).group(1))
    move = "go east" if room == 0 else "go west" if room == num_rooms - 1 else history[-1][1]
    return actions.index(move) + 1


def state_prompts(env_name: str, env_kwargs: dict, template_name: str, tokenizer, draw: random.Random,
                  history_length: int = 0):
    """Endless (prompt token ids, observation, admissible actions, the (observation, action) pairs the prompt shows) of
    random states: a reset and 0-5 random moves.
    With `history_length` K > 0 the prompt shows none or the last K of those moves (drawn), so that one warmed model
    starts the arms with and without history alike. Tasks are drawn among the environment's own training seeds when
    it has folds (TextWorldExpress refuses other seeds), else among the seeds below 10**6."""
    from gigpo_trl.envs import make_env
    from gigpo_trl.prompts import build_messages, load_template

    template, env = load_template(template_name), make_env(env_name, **env_kwargs)
    own_seeds = getattr(env, "fold_seeds", None)
    seeds = own_seeds("train") if own_seeds else None
    while True:
        observation, info = env.reset(seed=draw.choice(seeds) if seeds else draw.randrange(10**6))
        history = []
        for _ in range(draw.randrange(6)):
            action = draw.choice(info["admissible_actions"])
            history.append((observation, action))
            observation, _, done, _, info = env.step(action)
            if done:
                break
        shown = draw.choice((0, history_length)) if history_length else 0  # no draw at K = 0: settings A, B, E as run
        messages = build_messages(observation, step=len(history) if shown else 0, task=info.get("task"),
                                  history=history, admissible_actions=info["admissible_actions"],
                                  history_length=shown, template=template)
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        yield list(prompt), observation, info["admissible_actions"], history[len(history) - shown:] if shown else []


def supervised_step(model, tokenizer, pairs: list[tuple[list[int], int]], optimizer) -> float:
    """One optimizer step of cross-entropy on the answers `<action>k</action><eos>` after the prompts; returns the loss."""
    import torch

    answers = [tokenizer(f"<action>{k}</action>", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
               for _, k in pairs]
    length = max(len(prompt) + len(answer) for (prompt, _), answer in zip(pairs, answers))
    ids = torch.full((len(pairs), length), tokenizer.pad_token_id)
    labels = torch.full((len(pairs), length), -100)
    mask = torch.zeros((len(pairs), length), dtype=torch.long)
    for row, ((prompt, _), answer) in enumerate(zip(pairs, answers)):
        sequence = prompt + answer
        ids[row, : len(sequence)] = torch.tensor(sequence)
        labels[row, len(prompt) : len(sequence)] = torch.tensor(answer)
        mask[row, : len(sequence)] = 1
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def warm_up_format(output_dir: Path, env_name: str, env_kwargs: dict, template_name: str, seed: int = 0,
                   steps: int = 300, batch_size: int = 16, history_length: int = 0) -> Path:
    """Build the tiny model and teach it the answer format only (uniformly random well-formed answers), on prompts
    with no history or the last `history_length` steps (`state_prompts`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gigpo_trl.models import build_tiny_model

    if (output_dir / "config.json").is_file():
        return output_dir
    build_tiny_model(output_dir, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    model = AutoModelForCausalLM.from_pretrained(output_dir)
    draw = random.Random(seed)
    prompts = state_prompts(env_name, env_kwargs, template_name, tokenizer, draw, history_length)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for _ in range(steps):
        pairs = []
        for _ in range(batch_size):  # a state, then its label: the draw order of the documented warm-up
            prompt, _, actions, _ = next(prompts)
            pairs.append((prompt, draw.randint(1, len(actions))))
        loss = supervised_step(model, tokenizer, pairs, optimizer)
    print(f"format warm-up: {steps} steps, final loss {loss:.3f}")
    model.save_pretrained(output_dir)
    return output_dir


def reading_probe(model_dir: str, settings: dict, learning_rate: float, steps: int, batch_size: int = 64,
                  every: int = 25, history_length: int = 0) -> list[dict]:
    """Can the policy model learn to act on the observation at all, and after how many updates? Supervised
    learning from the format-warmed model with PERFECT labels, same optimizer family and learning rate as the RL
    runs: rooms, follow the draught; rooms without the hint (`hint: false`), the policy of `memory_action` on prompts
    that show the last `history_length` steps (it must read its history). Greedy accuracy of the action number on 64
    fixed held-out states every `every` steps. A method-neutral ceiling: RL from the same start gets a noisier signal
    than these labels."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    env_kwargs = settings.get("env_kwargs") or {}
    env_args = (settings["env_name"], env_kwargs, settings["prompt_template"], tokenizer)
    if env_kwargs.get("hint", True):
        def states(draw: random.Random):  # states with a hint to follow (not the treasure room)
            return (state for state in state_prompts(*env_args, draw) if "draught blows" in state[1])

        def label(observation, actions, _):
            return draught_action(observation, actions)
    else:
        if history_length < 1:
            raise ValueError("the reading probe of rooms without the hint needs prompts with history (history_length >= 1)")

        def states(draw: random.Random):  # states whose prompt shows a past move (not the treasure room)
            return (state for state in state_prompts(*env_args, draw, history_length) if state[3] and "found" not in state[1])

        def label(observation, actions, history):
            return memory_action(observation, actions, history, env_kwargs.get("num_rooms", 9))

    held_out, training = list(itertools.islice(states(random.Random(10**6)), 64)), states(random.Random(1))
    digits = [tokenizer(str(k), add_special_tokens=False)["input_ids"][-1] for k in (1, 2)]

    def accuracy() -> float:
        correct = 0
        with torch.no_grad():
            for prompt, observation, actions, history in held_out:
                ids = torch.tensor([prompt + tokenizer("<action>", add_special_tokens=False)["input_ids"]])
                logits = model(input_ids=ids).logits[0, -1, digits]
                correct += int(logits.argmax()) + 1 == label(observation, actions, history)
        return correct / len(held_out)

    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    curve, loss = [{"step": 0, "accuracy": accuracy()}], float("nan")
    for step in range(1, steps + 1):
        batch = [next(training) for _ in range(batch_size)]
        loss = supervised_step(model, tokenizer, [(prompt, label(*state)) for prompt, *state in batch], optimizer)
        if step % every == 0:
            curve.append({"step": step, "loss": loss, "accuracy": accuracy()})
            print(f"reading probe: step {step}, loss {loss:.3f}, held-out accuracy {curve[-1]['accuracy']:.2f}", flush=True)
    return curve


def screen(config: Path, model: str, eval_tasks: int, sampled_tasks: int, copies: int,
           recipe_arguments: Sequence[str] = (), temperatures: Sequence[float] = (), update: bool = False,
           records_dir: Path | None = None, eval_samples: int = 0) -> dict:
    """What choosing a setting needs, from the base model (no training): its greedy held-out success and episode
    length on the first `eval_tasks` tasks of the config's eval fold, the optimal path length of those tasks
    (`shortest_path_length`), and one sampled rollout of `sampled_tasks` x `copies` at each of `temperatures` (the
    config's temperature if none): success, decisions (steps) per episode, prompt tokens per step, step groups and the
    share of task groups whose copies' returns differ. The trainer's records go to `records_dir` (default
    outputs/screen/CONFIG: give each candidate its own when several run at once). With `update`, the CPU seconds of
    one training iteration at the config's own batch (`iteration_cpu_seconds`). With `eval_samples` k, the held-out
    panel is played a second time at the config's temperature, k sampled copies of each task (`sampled_panel`).
    `recipe_arguments` change the config (e.g. --history_length 2)."""
    import gc

    from trl import ModelConfig, TrlParser

    from gigpo_trl import GiGPOConfig, GiGPOTrainer, TaskArguments, make_env
    from gigpo_trl.envs import INFO_ADMISSIBLE_ACTIONS
    from gigpo_trl.shortest_paths import shortest_path_length

    overrides = ["--output_dir", str(records_dir or ROOT / "outputs" / "screen" / config.stem),
                 "--num_eval_tasks", str(eval_tasks), "--num_train_tasks", str(sampled_tasks),
                 "--per_device_eval_batch_size", str(eval_tasks), "--num_generations", str(copies),
                 "--per_device_train_batch_size", str(sampled_tasks * copies), "--steps_per_generation", "1",
                 "--gradient_accumulation_steps", "1", "--report_to", "none", "--log_trajectories", "0"]
    task_args, args, _ = TrlParser((TaskArguments, GiGPOConfig, ModelConfig)).parse_args_and_config(
        args=["--config", str(config), *overrides, *recipe_arguments])
    train, panel = task_args.datasets(args.env_name, args.env_kwargs)
    trainer = GiGPOTrainer(model, args=args, train_dataset=train, eval_dataset=panel)
    started = time.process_time()
    held_out = trainer.evaluate()
    held_out_cpu = time.process_time() - started
    env = make_env(args.env_name, **args.env_kwargs)
    # Breadth-first distances need a finite list of actions: none without admissible actions, nor where one of them
    # is a slot for free text (WebShop's "search[<your query>]"); their optimal path is the walkthrough's length.
    listed = env.reset(seed=panel["seed"][0])[1].get(INFO_ADMISSIBLE_ACTIONS)
    graph = listed is not None and not any(re.search(r"<[^<>]+>", action) for action in listed)
    optimal = [shortest_path_length(env, seed, args.max_env_steps) if graph else walkthrough_length(env, seed)
               for seed in panel["seed"]]
    env.close()
    reachable = [length for length in optimal if length is not None]
    sampled_held_out, distance_env, distances = None, make_env(args.env_name, **args.env_kwargs) if graph else None, {}
    if eval_samples:
        sampled_held_out = sampled_panel(trainer, eval_samples, len(panel), distance_env, args.max_env_steps, distances)
    trainer.model.train()
    rows = [train[k] for k in range(sampled_tasks) for _ in range(copies)]
    sampled = {}
    for temperature in temperatures or [args.temperature]:
        trainer.temperature = trainer.generation_config.temperature = temperature
        trainer._generate_and_score_completions(rows)  # one sampled rollout, no update
        metrics = {name: values[-1] for name, values in trainer._metrics["train"].items() if values}
        prompt_tokens = [len(completion.prompt_ids) for completion in trainer.last_rollout.steps.completion]
        wasted = wasted_steps(distance_env, trainer.last_rollout, args.max_env_steps, distances) if graph else {}
        sampled[f"{temperature:g}"] = {
            "success": metrics["env/success_rate"], "decisions_per_episode": metrics["env/episode_length_mean"],
            "truncated_share": metrics["env/truncated_share"], "invalid_action_rate": metrics["env/invalid_action_rate"],
            "prompt_tokens_mean": float(np.mean(prompt_tokens)), "prompt_tokens_max": max(prompt_tokens),
            "step_group_size_mean": metrics["gigpo/step_group_size_mean"],
            "singleton_share": metrics["gigpo/singleton_share"], "rollout_s": metrics["timing/rollout_s"],
            "groups_with_return_spread": 1.0 - metrics["frac_reward_zero_std"],
            **wasted,
        }
    if distance_env is not None:
        distance_env.close()
    trainer.close_environments()
    del trainer
    gc.collect()
    result = {
        "config": str(config), "held_out_tasks": len(panel), "held_out_success": held_out["eval_env/success_rate"],
        "held_out_decisions_per_episode": held_out["eval_env/episode_length_mean"],
        "held_out_cpu_s": held_out_cpu,
        "optimal_path_mean": float(np.mean(reachable)) if reachable else None,
        "optimal_path_min": min(reachable, default=None), "unwinnable_within_limit": optimal.count(None),
        "sampled": sampled,
    }
    if sampled_held_out is not None:
        result["sampled_held_out"] = sampled_held_out
    if update:
        result["iteration"] = iteration_cpu_seconds(config, model, recipe_arguments)
    return result


def sampled_panel(trainer: Any, copies: int, tasks: int, env: Any, search_depth: int, distances: dict) -> dict:
    """The held-out panel of `trainer` (its `tasks` tasks) played at the trainer's temperature, `copies` sampled copies
    of each task, through the trainer's own evaluation with `eval_greedy` false and `num_generations_eval` = `copies`
    (the evaluation a training run with those settings makes, as `gigpo_trl.evaluation.evaluate_panels` plays it):
    its success, decisions, invalid answers and CPU seconds, and what its episodes' wasted turns cost
    (`wasted_turn_costs`, the distances found by replaying each episode in `env`; None for an environment that lists
    no admissible actions, whose distances are not searched: then the share of task groups whose copies both won and
    lost only)."""
    from research.credit_probe import step_distances

    args = trainer.args
    trainer.num_generations_eval, args.eval_greedy = copies, False
    args.per_device_eval_batch_size = copies * tasks
    rollouts, generate = [], trainer._generate_and_score_completions

    def kept(inputs):  # every rollout of the evaluation (one, with the whole panel in one batch)
        batch = generate(inputs)
        rollouts.append(trainer.last_rollout)
        return batch

    trainer._generate_and_score_completions = kept
    started = time.process_time()
    try:
        metrics = trainer.evaluate()
    finally:
        del trainer._generate_and_score_completions  # the class's method again
    cpu = time.process_time() - started
    figures = {"copies": copies, "temperature": float(trainer.temperature),
               "success": metrics["eval_env/success_rate"],
               "decisions_per_episode": metrics["eval_env/episode_length_mean"],
               "invalid_action_rate": metrics.get("eval_env/invalid_action_rate"), "cpu_s": cpu}
    if env is None:
        outcomes: dict[int, set[bool]] = {}
        for rollout in rollouts:
            for episode in rollout.episodes:
                outcomes.setdefault(episode.seed, set()).add(bool(episode.won))
        spread = sum(len(seen) == 2 for seen in outcomes.values()) / max(len(outcomes), 1)
        return figures | {"episodes": sum(len(r.episodes) for r in rollouts), "task_groups": len(outcomes),
                          "groups_with_return_spread": spread}
    episodes = []
    for rollout in rollouts:
        before, after = step_distances(env, rollout, search_depth, distances)
        for episode in rollout.episodes:
            rows = rollout.steps.rows_of(episode.trajectory)
            episodes.append((episode.seed, bool(episode.won), int((after[rows] >= before[rows]).sum()),
                             float(after[rows[-1]]) if rows else math.inf))
    return figures | {"episodes": len(episodes), **wasted_turn_costs(episodes)}


def walkthrough_length(env: Any, seed: int) -> int | None:
    """The length of the task's walkthrough (the environment's own solution, `env.walkthrough` after reset), or None
    where it gives none: the optimal path of an environment whose actions are free text (no breadth-first search)."""
    env.reset(seed=seed)
    walkthrough = getattr(env, "walkthrough", None)
    return len(walkthrough) if walkthrough else None


def wasted_turn_costs(episodes: Sequence[tuple[int, bool, int, float]]) -> dict[str, float]:
    """What wasted turns cost a panel of sampled episodes, each (task seed, won, wasted turns, distance to a win after
    its last step): the share of task groups whose copies both won and lost (`groups_with_return_spread`), the share
    of episodes with a wasted turn, of those the share that lost (`wasted_turn_loss_share`: how often a wasted turn
    costs the game), of the lost episodes the share that wasted a turn, and the share of lost episodes that ended
    within 2 moves of a win. Shares of nothing are NaN."""
    def share(part: int, whole: int) -> float:
        return part / whole if whole else float("nan")

    outcomes: dict[int, set[bool]] = {}
    for seed, won, _, _ in episodes:
        outcomes.setdefault(seed, set()).add(won)
    wasted = [won for _, won, count, _ in episodes if count > 0]
    lost = [(count, distance) for _, won, count, distance in episodes if not won]
    return {
        "task_groups": len(outcomes),
        "groups_with_return_spread": share(sum(len(seen) == 2 for seen in outcomes.values()), len(outcomes)),
        "wasted_turns_per_episode": share(sum(count for _, _, count, _ in episodes), len(episodes)),
        "episodes_with_wasted_turn_share": share(len(wasted), len(episodes)),
        "wasted_turn_loss_share": share(wasted.count(False), len(wasted)),
        "lost_with_wasted_turn_share": share(sum(count > 0 for count, _ in lost), len(lost)),
        "lost_within_2_moves_share": share(sum(distance <= 2 for _, distance in lost), len(lost)),
    }


def wasted_steps(env: Any, rollout: Any, search_depth: int, distances: dict) -> dict[str, float]:
    """Steps that bring no win nearer (the breadth-first distance to a win after the step is not below the one before:
    a wrong move, a bump, an idle action, text the game does not act on), per episode and per won episode, and the
    won episodes' decisions beyond their task's shortest path. `distances`: the distances found so far, by (seed,
    anchor), shared across calls on the same tasks."""
    from research.credit_probe import step_distances

    before, after = step_distances(env, rollout, search_depth, distances)
    wasted = after >= before
    won = [episode for episode in rollout.episodes if episode.won]
    won_rows = [row for episode in won for row in rollout.steps.rows_of(episode.trajectory)]
    start = {episode.trajectory: before[rollout.steps.rows_of(episode.trajectory)[0]] for episode in won}
    return {
        "wasted_steps_per_episode": float(wasted.sum()) / max(len(rollout.episodes), 1),
        "wasted_steps_per_won_episode": float(wasted[won_rows].sum()) / len(won) if won else float("nan"),
        "won_decisions_beyond_shortest": (float(np.mean([episode.length - start[episode.trajectory] for episode in won]))
                                          if won else float("nan")),
    }


def iteration_cpu_seconds(config: Path, model: str, recipe_arguments: Sequence[str] = ()) -> dict[str, float]:
    """The CPU seconds (user + system, this process: on busy cores, a one-thread run's quiet-core time) of one training
    iteration at the config's own batch, split into its rollout and its update (the micro-batches' passes and the
    optimizer step), with the step samples it trained on."""
    from trl import ModelConfig, TrlParser

    from gigpo_trl import GiGPOConfig, GiGPOTrainer, TaskArguments

    overrides = ["--output_dir", str(ROOT / "outputs" / "screen" / f"{config.stem}-iteration"), "--max_steps", "1",
                 "--eval_strategy", "no", "--save_strategy", "no", "--report_to", "none", "--log_trajectories", "0"]
    task_args, args, _ = TrlParser((TaskArguments, GiGPOConfig, ModelConfig)).parse_args_and_config(
        args=["--config", str(config), *recipe_arguments, *overrides])
    train, _ = task_args.datasets(args.env_name, args.env_kwargs)
    trainer = GiGPOTrainer(model, args=args, train_dataset=train)
    rollout_cpu, samples = [], []
    generate = trainer._generate_and_score_completions

    def timed_rollout(inputs):
        started = time.process_time()
        batch = generate(inputs)
        rollout_cpu.append(time.process_time() - started)
        samples.append(trainer._metrics["train"]["env/step_samples"][-1])  # the log at the end of train() clears them
        return batch

    trainer._generate_and_score_completions = timed_rollout
    started = time.process_time()
    trainer.train()
    total = time.process_time() - started
    trainer.close_environments()
    return {"rollout_cpu_s": sum(rollout_cpu), "update_cpu_s": total - sum(rollout_cpu), "step_samples": sum(samples)}
