"""Does it learn? GiGPO against step-wise GRPO (omega = 0), identical settings, budgets and seeds.

    python bench/learning.py                                   # the CPU setting, 3 seeds (about 50 min on 2 cores)
    python bench/learning.py --config recipes/configs/X.yaml --model MODEL   # e.g. a GPU setting
    python bench/learning.py --output outputs/learning_100 --max_steps 100   # unknown arguments go to the recipe
    python bench/learning.py --reading-probe 250 --output outputs/probe      # can the model read? (no RL)
    python bench/learning.py --parallel --detach --config C --model M --output O   # 6 runs at once, in the background
    python bench/learning.py --analyze-only --output O                       # collect them (cut-off runs too)
    python bench/learning.py --screen C1 C2 ... --model M                    # choose a setting: the base model's numbers
    python bench/learning.py --step-lambda 0.5 ...                           # a third arm: GiGPO at lambda 0.5

Each (method, seed) run is `recipes/train_gigpo.py --config CONFIG --step_advantage_weight {1, 0} --seed S`, so
both methods share every other setting; `--step-lambda L` adds a third method, GiGPO with the bootstrapped step value
(`--step_advantage_weight 1 --step_advantage_lambda L`, GIGPO_SPEC.md section 9), compared with both. Per-rollout success rate and return (training rollouts and held-out
evaluations) are read from each run's records and written to OUTPUT/learning_curves.csv, with a plot of the mean
and the spread (min-max over seeds) per method in OUTPUT/learning_curves.png and a summary in OUTPUT/summary.json
(final success and episode length per method, each method against step-wise GRPO and the lambda arm against GiGPO,
and per seed the first iteration at which training success reaches 0.5 and 0.8).

Without --model, the policy is a tiny transformer built locally (gigpo_trl.models.build_tiny_model) and given a
short supervised warm-up on the answer FORMAT only: for prompts of random states, the target is
"<action>k</action>" with k drawn uniformly among the admissible actions, so it starts as a uniformly random
policy that answers well-formed, with no knowledge of the task.

With --parallel the runs start at once, one process each (on one GPU they share it), instead of one after the other.
Every run writes its records as it goes (gigpo/iterations.jsonl, evaluations.jsonl), so a run cut off still reports:
--analyze-only redoes the comparison from whatever the runs have written. --detach starts the whole command in a new
process session (it outlives the shell), writes its output to OUTPUT/learning.log and returns at once. The summary
applies the pre-registered criterion of docs/results.md: decided when one method's final held-out success is above
the other's on every seed. Held-out figures are compared only between runs whose evaluations played the same tasks
(OUTPUT/*/gigpo/evaluations.jsonl name them): where an environment could not start a task, or the panels differ, the
held-out comparison and the decision are refused, naming the runs and the tasks, unless --allow-panel-mismatch.

--screen plays each candidate config's held-out panel greedily with the base model (no training) and one sampled
rollout, and prints what choosing a setting needs: held-out success, the optimal path length (breadth-first),
and the step groups (mean size, singleton share) that the copies of a task form.

Rooms diagnostics, in the summary and the plot (docs/results.md reads them): the share of steps that follow the
draught, the mean advantage of steps that follow it and of those that go against it, and the policy entropy
(from the runs' logs). --reading-probe asks, without RL, whether the model can learn to act on the observation.
In every setting, per rollout: the step samples played and those the update left out (`gigpo/subsampled_rows`), the
share of task groups whose copies all got the same return, and, where trajectories were logged, the share of steps
that come back to the observation of two steps before (`two_step_loop_share`: a policy without history caught in a
loop). Runs brought back from another machine without their logs take their entropy from the CSV of an analysis made
there (--entropy-from).
"""

from __future__ import annotations

import argparse
import ast
import csv
import itertools
import json
import random
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gigpo_trl.records import read_evaluations, read_iterations, read_trajectories

ROOT = Path(__file__).resolve().parent.parent
EMBEDDED = "embedded:SmolLM2-135M-Instruct"
PAPER, BASELINE = "GiGPO", "GRPO (omega=0)"
SUCCESS_TARGETS = (0.5, 0.8)  # training success (trailing mean of 5) whose first iteration is reported per seed
PANEL_FLAG = "--allow-panel-mismatch"
# Per (method, seed) run: per evaluation step, the held-out tasks played (None: not recorded).
Panels = dict[tuple[str, int], dict[int, frozenset[str] | None]]


def methods(step_lambda: float | None = None) -> dict[str, list[str]]:
    """The compared methods and the recipe arguments that make each: GiGPO (omega 1, the paper's step value),
    step-wise GRPO (omega 0) and, with `step_lambda`, GiGPO with the bootstrapped step value of GIGPO_SPEC.md
    section 9 (`--step_advantage_lambda`)."""
    result = {PAPER: ["--step_advantage_weight", "1"], BASELINE: ["--step_advantage_weight", "0"]}
    if step_lambda is not None:
        result[f"GiGPO lambda {step_lambda:g}"] = ["--step_advantage_weight", "1", "--step_advantage_lambda",
                                                 f"{step_lambda:g}"]
    return result


def run_directory(output: Path, method: str, seed: int) -> Path:
    """gigpo-seed0, grpo-seed0, gigpo-lambda0.5-seed0."""
    name = {PAPER: "gigpo", BASELINE: "grpo"}.get(method) or "gigpo-lambda" + method.rsplit(" ", 1)[1]
    return output / f"{name}-seed{seed}"


def run_log(output_dir: Path) -> Path:
    """A run's output, beside its folder: gigpo-lambda0.5-seed0.log (not with_suffix, which reads ".5-seed0" as one)."""
    return output_dir.parent / f"{output_dir.name}.log"


def lambda_of_runs(output: Path) -> float | None:
    """The lambda of the bootstrapped arm whose runs are in `output` (from their directories' names), or None."""
    found = {float(path.name.split("-")[1].removeprefix("lambda")) for path in output.glob("gigpo-lambda*-seed*")}
    if len(found) > 1:
        raise ValueError(f"{output} holds runs of several lambdas {sorted(found)}: pass --step-lambda")
    return found.pop() if found else None


def state_prompts(env_name: str, env_kwargs: dict, template_name: str, tokenizer, draw: random.Random):
    """Endless (prompt token ids, observation, admissible actions) of random states: a reset and 0-5 random moves."""
    from gigpo_trl.envs import make_env
    from gigpo_trl.prompts import build_messages, load_template

    template, env = load_template(template_name), make_env(env_name, **env_kwargs)
    while True:
        observation, info = env.reset(seed=draw.randrange(10**6))
        for _ in range(draw.randrange(6)):
            observation, _, done, _, info = env.step(draw.choice(info["admissible_actions"]))
            if done:
                break
        messages = build_messages(observation, task=info.get("task"), admissible_actions=info["admissible_actions"],
                                  template=template)
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        yield list(prompt), observation, info["admissible_actions"]


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
                   steps: int = 300, batch_size: int = 16) -> Path:
    """Build the tiny model and teach it the answer format only (uniformly random well-formed answers)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gigpo_trl.models import build_tiny_model

    if (output_dir / "config.json").is_file():
        return output_dir
    build_tiny_model(output_dir, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    model = AutoModelForCausalLM.from_pretrained(output_dir)
    draw = random.Random(seed)
    prompts = state_prompts(env_name, env_kwargs, template_name, tokenizer, draw)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for _ in range(steps):
        pairs = []
        for _ in range(batch_size):  # a state, then its label: the draw order of the documented warm-up
            prompt, _, actions = next(prompts)
            pairs.append((prompt, draw.randint(1, len(actions))))
        loss = supervised_step(model, tokenizer, pairs, optimizer)
    print(f"format warm-up: {steps} steps, final loss {loss:.3f}")
    model.save_pretrained(output_dir)
    return output_dir


def draught_move(observation: str) -> str:
    """Rooms: the action that follows the draught of "Room k. The draught blows west." ("go west")."""
    return "go " + observation.rsplit(" ", 1)[-1].rstrip(".")


def draught_action(observation: str, actions: list[str]) -> int:
    """Rooms: the number of the admissible action that follows the draught."""
    return actions.index(draught_move(observation)) + 1


def reading_probe(model_dir: str, settings: dict, learning_rate: float, steps: int, batch_size: int = 64,
                  every: int = 25) -> list[dict]:
    """Can the policy model learn to act on the observation at all, and after how many updates? Supervised
    learning from the format-warmed model with PERFECT labels (rooms: follow the draught), same optimizer family
    and learning rate as the RL runs. Greedy accuracy of the action number on 64 fixed held-out states every
    `every` steps. A method-neutral ceiling: RL from the same start gets a noisier signal than these labels."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    env_args = (settings["env_name"], settings.get("env_kwargs") or {}, settings["prompt_template"], tokenizer)

    def states(draw: random.Random):  # states with a hint to follow (not the treasure room)
        return (state for state in state_prompts(*env_args, draw) if "draught blows" in state[1])

    held_out, training = list(itertools.islice(states(random.Random(10**6)), 64)), states(random.Random(1))
    digits = [tokenizer(str(k), add_special_tokens=False)["input_ids"][-1] for k in (1, 2)]

    def accuracy() -> float:
        correct = 0
        with torch.no_grad():
            for prompt, observation, actions in held_out:
                ids = torch.tensor([prompt + tokenizer("<action>", add_special_tokens=False)["input_ids"]])
                logits = model(input_ids=ids).logits[0, -1, digits]
                correct += int(logits.argmax()) + 1 == draught_action(observation, actions)
        return correct / len(held_out)

    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    curve, loss = [{"step": 0, "accuracy": accuracy()}], float("nan")
    for step in range(1, steps + 1):
        batch = [next(training) for _ in range(batch_size)]
        loss = supervised_step(model, tokenizer, [(prompt, draught_action(obs, actions)) for prompt, obs, actions in batch],
                                optimizer)
        if step % every == 0:
            curve.append({"step": step, "loss": loss, "accuracy": accuracy()})
            print(f"reading probe: step {step}, loss {loss:.3f}, held-out accuracy {curve[-1]['accuracy']:.2f}", flush=True)
    return curve


def start_run(config: Path, model: str, method_arguments: list[str], seed: int, output_dir: Path,
              overrides: list[str]) -> subprocess.Popen:
    """One training run through the recipe, started in a process of its own (its output in OUTPUT_DIR.log)."""
    command = [sys.executable, str(ROOT / "recipes" / "train_gigpo.py"), "--config", str(config),
               "--model_name_or_path", model, *method_arguments, "--seed", str(seed),
               "--output_dir", str(output_dir), *overrides]
    with open(run_log(output_dir), "w") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def train_all(runs: dict[tuple[str, int], Path], arms: dict[str, list[str]], config: Path, model: str,
              overrides: list[str], parallel: bool) -> dict[str, float]:
    """Every (method, seed) run, one after the other or all at once; returns their wall times in seconds."""
    started, processes, seconds = {}, {}, {}

    def finish(key):
        if processes[key].wait():
            raise RuntimeError(f"{key[0]} seed {key[1]} failed: see {run_log(runs[key])}")
        seconds[f"{key[0]} seed {key[1]}"] = time.perf_counter() - started[key]
        print(f"{key[0]:16s} seed {key[1]}: {seconds[f'{key[0]} seed {key[1]}']:.0f} s", flush=True)

    for key, output_dir in runs.items():
        started[key] = time.perf_counter()
        processes[key] = start_run(config, model, arms[key[0]], key[1], output_dir, overrides)
        if not parallel:
            finish(key)
    if parallel:
        for key in runs:
            finish(key)
    return seconds


def detach(output: Path) -> None:
    """This command again, without --detach, in a new process session writing to OUTPUT/learning.log."""
    arguments = [argument for argument in sys.argv[1:] if argument != "--detach"]
    with open(output / "learning.log", "w") as log:
        process = subprocess.Popen([sys.executable, *sys.argv[:1], *arguments], stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    print(f"started in the background (pid {process.pid}); output: {output / 'learning.log'}; collect with "
          f"python bench/learning.py --analyze-only --output {output}")


def longest_prompt_tokens(args, tokenizer) -> int:
    """Tokens of a step sample at its longest: the prompt of the first training task's first state with
    `history_length` past steps that repeat that state and its longest admissible action, plus a full answer."""
    from gigpo_trl import fold_seeds, make_env
    from gigpo_trl.prompts import build_messages, load_template, template_for

    env = make_env(args.env_name, **args.env_kwargs)
    observation, info = env.reset(seed=fold_seeds(args.env_name, "train", 1, **args.env_kwargs)[0])
    env.close()
    actions = info.get("admissible_actions") or ["look"]
    template = load_template(args.prompt_template) if args.prompt_template else template_for(args.env_name)
    messages = build_messages(observation, step=args.max_env_steps - 1, task=info.get("task"),
                              history=[(observation, max(actions, key=len))] * args.history_length,
                              admissible_actions=actions, history_length=args.history_length, template=template)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return len(prompt["input_ids"]) + args.max_completion_length


def check_memory_plan(config: Path, model: str, overrides: list[str], num_runs: int) -> None:
    """Refuse to start `num_runs` runs at once that cannot fit the GPU (or, without one, the host's free memory):
    each run's weights, gradients and AdamW moments (and a reference model), one loss pass of
    max_step_samples_per_micro_batch rows (a whole micro-batch without it) at the longest step sample, and vLLM
    colocate's share (`bench/update_memory.py`; its coefficient was measured on CPU, docs/performance.md)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from trl import ModelConfig, TrlParser

    from bench.update_memory import BYTES_PER_TOKEN_LAYER_HIDDEN, pass_memory_gib, plan_fits, run_memory_gib
    from gigpo_trl import GiGPOConfig, TaskArguments
    from gigpo_trl.models import resolve_model

    _, args, _ = TrlParser((TaskArguments, GiGPOConfig, ModelConfig)).parse_args_and_config(
        args=["--config", str(config), "--output_dir", str(ROOT / "outputs" / "memory_plan"), *overrides])
    path = resolve_model(model)
    model_config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(model_config).parameters())
    micro_batch = args.per_device_train_batch_size * args.max_env_steps  # its step samples at most
    rows = min(args.max_step_samples_per_micro_batch or micro_batch, micro_batch)
    tokens = longest_prompt_tokens(args, AutoTokenizer.from_pretrained(path))
    if torch.cuda.is_available():
        kind, device, total = "cuda", torch.cuda.get_device_name(), torch.cuda.mem_get_info()[1] / 2**30
    else:
        import psutil

        kind, device, total = "cpu", "the host (no GPU)", psutil.virtual_memory().available / 2**30
    coefficient = BYTES_PER_TOKEN_LAYER_HIDDEN[kind, "bf16" if args.bf16 else "fp32"] * model_config.hidden_size
    pass_gib = pass_memory_gib(coefficient, rows, tokens, model_config.num_hidden_layers)
    vllm_share = args.vllm_gpu_memory_utilization if args.use_vllm and args.vllm_mode == "colocate" else None
    per_run = run_memory_gib(parameters, pass_gib=pass_gib, reference_model=args.beta != 0.0, total_gib=total,
                             vllm_share=vllm_share)
    plan = (f"{num_runs} runs x {per_run:.1f} GiB (weights, gradients and AdamW {parameters / 1e6:.0f}M parameters; "
            f"one loss pass of {rows} step samples x {tokens} tokens: {pass_gib:.1f} GiB"
            + (f"; vLLM colocate {vllm_share:g} of the GPU" if vllm_share else "") + f") on {device} ({total:.1f} GiB)")
    plan_fits(num_runs, per_run, total, plan)
    print(f"memory plan: {plan} = {num_runs * per_run:.1f} GiB", flush=True)


def screen(config: Path, model: str, eval_tasks: int, sampled_tasks: int, copies: int) -> dict:
    """What choosing a setting needs, from the base model (no training): its greedy held-out success and episode
    length on the first `eval_tasks` tasks of the config's eval fold, the optimal path length of those tasks
    (`shortest_path_length`), and one sampled rollout of `sampled_tasks` x `copies`: success and step groups."""
    from trl import ModelConfig, TrlParser

    from gigpo_trl import GiGPOConfig, GiGPOTrainer, TaskArguments, make_env
    from gigpo_trl.shortest_paths import shortest_path_length

    overrides = ["--output_dir", str(ROOT / "outputs" / "screen" / config.stem), "--num_eval_tasks", str(eval_tasks),
                 "--num_train_tasks", str(sampled_tasks),
                 "--per_device_eval_batch_size", str(eval_tasks), "--num_generations", str(copies),
                 "--per_device_train_batch_size", str(sampled_tasks * copies), "--steps_per_generation", "1",
                 "--gradient_accumulation_steps", "1", "--report_to", "none", "--log_trajectories", "0"]
    task_args, args, _ = TrlParser((TaskArguments, GiGPOConfig, ModelConfig)).parse_args_and_config(
        args=["--config", str(config), *overrides])
    train, panel = task_args.datasets(args.env_name, args.env_kwargs)
    trainer = GiGPOTrainer(model, args=args, train_dataset=train, eval_dataset=panel)
    held_out = trainer.evaluate()
    env = make_env(args.env_name, **args.env_kwargs)
    optimal = [shortest_path_length(env, seed, args.max_env_steps) for seed in panel["seed"]]
    env.close()
    reachable = [length for length in optimal if length is not None]
    trainer.model.train()
    rows = [train[k] for k in range(sampled_tasks) for _ in range(copies)]
    trainer._generate_and_score_completions(rows)  # one sampled rollout, no update
    sampled = {name: values[-1] for name, values in trainer._metrics["train"].items() if values}
    trainer.close_environments()
    return {
        "config": str(config), "held_out_success": held_out["eval_env/success_rate"],
        "held_out_episode_length": held_out["eval_env/episode_length_mean"],
        "optimal_path_mean": float(np.mean(reachable)) if reachable else None,
        "optimal_path_min": min(reachable, default=None), "unwinnable_within_limit": optimal.count(None),
        "sampled_success": sampled["env/success_rate"], "step_group_size_mean": sampled["gigpo/step_group_size_mean"],
        "singleton_share": sampled["gigpo/singleton_share"], "rollout_s": sampled["timing/rollout_s"],
    }


def draught_steps(trajectories: dict[str, list[dict]]) -> list[tuple[int, bool, dict]]:
    """Rooms diagnostic: the recorded training steps taken where a draught blows (not in the treasure room), as
    (rollout, whether the action follows the draught, the step record), from a run's `read_trajectories`. Empty
    outside rooms."""
    return [(int(name.split("-")[1]), step["action"] == draught_move(step["observation"]), step)
            for name, episodes in trajectories.items() if name.startswith("train-")
            for episode in episodes for step in episode["steps"] if "draught blows" in step["observation"]]


def draught_following(steps: list[tuple[int, bool, dict]]) -> dict[int, float]:
    """Per training rollout, the share of `draught_steps` whose action goes the way the draught blows (0.5 for a
    policy that ignores it, 1 for the optimal one)."""
    follows_by_rollout: dict[int, list[bool]] = {}
    for rollout, follows, _ in steps:
        follows_by_rollout.setdefault(rollout, []).append(follows)
    return {rollout: sum(follows) / len(follows) for rollout, follows in follows_by_rollout.items()}


def draught_advantages(steps: list[tuple[int, bool, dict]]) -> dict[str, float] | None:
    """The mean advantage (the one the loss used) of the valid `draught_steps` that follow the draught and of those
    that go against it. A credit signal that points the right way gives the first the higher value; the gap, in units
    of the advantages' standard deviation (GiGPO's sum of two normalized terms has the larger scale), says how
    sharply it separates them. None outside rooms."""
    by_kind: dict[str, list[float]] = {"follows": [], "against": []}
    for _, follows, step in steps:
        if step["valid"]:
            by_kind["follows" if follows else "against"].append(step["advantage"])
    if not by_kind["follows"] or not by_kind["against"]:
        return None
    means = {kind: float(np.mean(values)) for kind, values in by_kind.items()}
    spread = float(np.std(by_kind["follows"] + by_kind["against"]))
    return means | {"gap_in_std": (means["follows"] - means["against"]) / spread, "steps": sum(map(len, by_kind.values()))}


def two_step_loop_share(episodes: list[dict]) -> float:
    """The share of the logged steps, from each episode's third step on, taken where the observation is the one of
    two steps before and the observation in between differs (A, B, A: a move undone, the loop of a policy without
    history); NaN if no episode has a third step. The trajectory records hold observations, not anchors, so the
    observation stands for the state."""
    loops = [steps[t]["observation"] == steps[t - 2]["observation"] != steps[t - 1]["observation"]
             for steps in (episode["steps"] for episode in episodes) for t in range(2, len(steps))]
    return float(np.mean(loops)) if loops else float("nan")


def logged_entropy(log_path: Path) -> list[float]:
    """The policy's mean token entropy of every training update, in order, from TRL's log lines in a run's log
    (`{'loss': ..., 'entropy': ...}`, one per update with logging_steps 1)."""
    entropies = []
    for line in log_path.read_text().splitlines():
        for match in re.finditer(r"\{'loss': [^}]*\}", line):
            entropies.append(float(ast.literal_eval(match.group(0))["entropy"]))
    return entropies


def earlier_entropy(curves_csv: Path) -> dict[tuple[str, int], dict[int, float]]:
    """{(method, seed): {step: entropy}} of the training rows of an earlier analysis's learning_curves.csv."""
    entropy: dict[tuple[str, int], dict[int, float]] = {}
    with open(curves_csv, newline="") as file:
        reader = csv.DictReader(file)
        if not {"method", "seed", "mode", "step", "entropy"} <= set(reader.fieldnames or ()):
            raise ValueError(f"{curves_csv} is not a learning_curves.csv with an entropy column (its columns: "
                             f"{reader.fieldnames})")
        for row in reader:
            if row["mode"] == "train":
                entropy.setdefault((row["method"], int(row["seed"])), {})[int(row["step"])] = float(row["entropy"])
    return entropy


def run_entropy(output_dir: Path, train_steps: list[int], earlier: dict[int, float]) -> dict[int, float]:
    """{step: the policy entropy of that step's update}: from the run's log (the k-th update follows the k-th training
    rollout) or, where the log is missing (records brought back from another machine without it), from `earlier`
    (an earlier analysis's figures for this run, `earlier_entropy`); said when neither has it."""
    log = run_log(output_dir)
    if log.is_file():
        return dict(zip(train_steps, logged_entropy(log)))
    print(f"{output_dir.name}: no {log.name}: entropy {'from --entropy-from' if earlier else 'not known'}", flush=True)
    return earlier


def curves(runs: dict[tuple[str, int], Path], hint_steps: dict[tuple[str, int], list],
           trajectories: dict[tuple[str, int], dict[str, list[dict]]],
           entropy_from: dict[tuple[str, int], dict[int, float]]) -> list[dict]:
    """One row per (method, seed, rollout): step, mode, success rate, return, step-group statistics, timings, the
    step samples the rollout played and those its update left out, the invalid-answer rate, the share of task groups
    whose copies all got the same return and of the update's samples with a nonzero advantage, and, where the
    rollout's trajectories were logged, their `two_step_loop_share`; the logged loop metrics (`loops/*`) and in-group
    return std."""
    rows = []
    for (method, seed), output_dir in runs.items():
        if not (output_dir / "gigpo" / "iterations.jsonl").is_file():  # not started yet, or failed at once
            print(f"{method} seed {seed}: no records in {output_dir}", flush=True)
            continue
        following = draught_following(hint_steps[method, seed])
        loops = {name: two_step_loop_share(episodes) for name, episodes in trajectories[method, seed].items()}
        records = read_iterations(output_dir)
        entropy = run_entropy(output_dir, [record["step"] for record in records if record["mode"] == "train"],
                              entropy_from.get((method, seed), {}))
        for record in records:
            metrics = record["metrics"]
            rows.append({
                "method": method, "seed": seed, "mode": record["mode"], "step": record["step"],
                "success_rate": metrics["env/success_rate"], "return_mean": metrics["env/return_mean"],
                "episode_length": metrics["env/episode_length_mean"],
                "singleton_share": metrics["gigpo/singleton_share"],
                "step_group_size_mean": metrics["gigpo/step_group_size_mean"],
                "rollout_s": metrics["timing/rollout_s"], "advantages_s": metrics["timing/advantages_s"],
                "update_s": metrics.get("timing/update_s", float("nan")),
                "draught_following": following.get(record["rollout"], float("nan")) if record["mode"] == "train" else float("nan"),
                "entropy": entropy.get(record["step"], float("nan")) if record["mode"] == "train" else float("nan"),
                "step_samples": metrics.get("env/step_samples", float("nan")),
                "subsampled_rows": metrics.get("gigpo/subsampled_rows", float("nan")),
                "invalid_action_rate": metrics.get("env/invalid_action_rate", float("nan")),
                "equal_return_groups": metrics.get("frac_reward_zero_std", float("nan")),
                "nonzero_advantage_share": metrics.get("gigpo/nonzero_advantage_share", float("nan")),
                "two_step_loop_share": loops.get(f"{record['mode']}-{record['rollout']:05d}", float("nan")),
                # Exact, from the anchors of every episode (docs/metrics.md "Loops"); absent where the anchors are not
                # states, and in records written before they were logged.
                **{name: metrics.get(f"loops/{name}", float("nan"))
                   for name in ("revisit_share", "reversal_share", "cycle_end_share", "distinct_states_mean")},
                "group_return_std": metrics.get("env/group_return_std", float("nan")),
            })
    return rows


def mean_curve(rows: list[dict], method: str, mode: str, field: str) -> tuple[np.ndarray, np.ndarray]:
    """Steps and the per-seed values (seeds x steps) of one method's curve (last record per step and seed)."""
    by_seed: dict[int, dict[int, float]] = {}
    for row in rows:
        if row["method"] == method and row["mode"] == mode:
            by_seed.setdefault(row["seed"], {})[row["step"]] = row[field]
    steps = sorted(set.intersection(*(set(values) for values in by_seed.values())))
    return np.array(steps), np.array([[values[s] for s in steps] for values in by_seed.values()])


def plot(rows: list[dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(16, 8), layout="constrained")
    FigureCanvasAgg(figure)
    panels = [("train", "success_rate", "Training rollouts: success rate"),
              ("eval", "success_rate", "Held-out tasks (greedy): success rate"),
              ("train", "return_mean", "Training rollouts: mean return"),
              ("train", "episode_length", "Training rollouts: mean episode length"),
              ("eval", "episode_length", "Held-out tasks (greedy): mean episode length"),
              ("train", "entropy", "Policy entropy (mean per completion token)")]
    if not all(np.isnan(row["draught_following"]) for row in rows):  # rooms: what the policy learned
        panels[2] = ("train", "draught_following", "Steps that follow the draught (rooms)")
    for axes, (mode, field, title) in zip(figure.subplots(2, 3).flat, panels):
        for method in dict.fromkeys(row["method"] for row in rows):
            steps, values = mean_curve(rows, method, mode, field)
            if field == "draught_following":  # 4 sampled episodes per rollout: average 10 rollouts
                steps, values = steps[::10], np.array([np.nanmean(v.reshape(-1, 10), axis=1) for v in values[:, : len(steps) // 10 * 10]])
                steps = steps[: values.shape[1]]
            line, = axes.plot(steps, values.mean(0), marker="o" if mode == "eval" or field == "draught_following" else None,
                              markersize=4, label=method)
            axes.fill_between(steps, values.min(0), values.max(0), color=line.get_color(), alpha=0.2)
        axes.set(title=title, xlabel="iteration (optimizer updates so far)", ylabel=field.replace("_", " "))
        axes.legend(title="mean, min-max over seeds")
        axes.grid(alpha=0.3)
    figure.savefig(path, dpi=110)


def comparisons(arms: Sequence[str]) -> list[tuple[str, str]]:
    """The (method, against) pairs a comparison reports: every method against step-wise GRPO, and the bootstrapped
    arm against the paper's GiGPO."""
    return [(method, BASELINE) for method in arms if method != BASELINE] + [
        (method, PAPER) for method in arms if method not in (PAPER, BASELINE)]


def summary(rows: list[dict], seeds: list[int], arms: Sequence[str], panels: Panels | None = None,
            allow_panel_mismatch: bool = False) -> dict:
    """Final success rates and episode lengths, when each method reaches the other's final value (mean over seeds),
    and per seed the first iteration at which training success reaches each of SUCCESS_TARGETS. The held-out
    comparisons of two methods (`eval`, `decision`, `decisions`) are refused where their runs' evaluations did not play
    the same tasks (`panels`, see `panel_differences`), unless `allow_panel_mismatch`; `held_out_panels` says which."""
    panels = panels or {}
    result: dict = {"seeds": seeds, "methods": list(arms)}
    pairs = comparisons(arms)
    every_difference = panel_differences(panels, arms)
    result["held_out_panels"] = {
        "same_tasks": every_difference is None, "differences": every_difference,
        "compared_anyway": every_difference is not None and allow_panel_mismatch,
        "tasks_not_recorded": [f"{method} seed {seed}" for (method, seed), by_step in panels.items()
                               if None in by_step.values()],
    }
    for mode in ("train", "eval"):
        window = 5 if mode == "train" else 1  # training curves are noisy: compare trailing means
        result[mode] = {"trailing_window": window}
        for field, higher in (("success_rate", True), ("episode_length", False)):
            result[mode][field] = {}
            for method, against in pairs:
                differences = panel_differences(panels, (method, against)) if mode == "eval" else None
                compared = (_comparison(rows, mode, field, window, higher, method, against)
                            if allow_panel_mismatch or differences is None else {"refused": _refusal(differences)})
                result[mode][field][f"{method} against {against}"] = compared
    result["decision"] = decision(rows, panels=panels, allow_panel_mismatch=allow_panel_mismatch)
    result["decisions"] = {f"{method} against {against}": decision(rows, method, against, panels, allow_panel_mismatch)
                           for method, against in pairs}
    result["first_step_at_train_success"] = {
        method: {f"{target:g}": first_steps_at(rows, method, target) for target in SUCCESS_TARGETS} for method in arms}
    train = [r for r in rows if r["mode"] == "train"]
    for method in arms:
        mine = [r for r in train if r["method"] == method]
        if not mine:
            continue
        # Medians for timings: robust to a few iterations slowed by other work on the machine.
        result.setdefault("per_iteration_median", {})[method] = {
            name: float(np.nanmedian([r[name] for r in mine])) for name in ("rollout_s", "update_s", "advantages_s")
        }
        result.setdefault("per_iteration_mean", {})[method] = {
            name: float(np.nanmean([r[name] for r in mine]))
            for name in ("rollout_s", "update_s", "advantages_s", "singleton_share", "step_group_size_mean", "episode_length",
                         "step_samples", "subsampled_rows")
        }
        last = max(r["step"] for r in mine)
        for field in ("draught_following", "entropy", "singleton_share", "step_group_size_mean", "equal_return_groups",
                      "nonzero_advantage_share", "two_step_loop_share", "revisit_share", "reversal_share"):
            if not all(np.isnan(r[field]) for r in mine):
                result.setdefault(f"{field}_first_last_20", {})[method] = {
                    "first_20_iterations": float(np.nanmean([r[field] for r in mine if r["step"] < 20])),
                    "last_20_iterations": float(np.nanmean([r[field] for r in mine if r["step"] > last - 20])),
                }
    return result


def first_steps_at(rows: list[dict], method: str, target: float, window: int = 5) -> dict[str, int | None]:
    """Per seed of `method`: the first iteration whose training success, as a trailing mean of `window` rollouts,
    is at least `target` (None if never)."""
    by_seed: dict[int, dict[int, float]] = {}
    for row in rows:
        if row["method"] == method and row["mode"] == "train":
            by_seed.setdefault(row["seed"], {})[row["step"]] = row["success_rate"]
    result = {}
    for seed, curve in sorted(by_seed.items()):
        steps = sorted(curve)
        smoothed = _trailing_mean(np.array([curve[step] for step in steps]), window)
        reached = np.flatnonzero(smoothed >= target)
        result[str(seed)] = int(steps[reached[0]]) if reached.size else None
    return result


def decision(rows: list[dict], first: str = PAPER, second: str = BASELINE, panels: Panels | None = None,
             allow_panel_mismatch: bool = False) -> str:
    """The pre-registered criterion (docs/results.md): decided when one method's final held-out success is above the
    other's on every seed (each run's last evaluation); otherwise undecided. Refused when those last evaluations did
    not all play the same tasks (`panels`, see `panel_differences`), unless `allow_panel_mismatch`: then it says so."""
    differences = panel_differences(panels or {}, (first, second), final_only=True)
    if differences is not None and not allow_panel_mismatch:
        return f"refused: {_refusal(differences)}"
    final: dict[str, dict[int, float]] = {first: {}, second: {}}
    for row in sorted((r for r in rows if r["mode"] == "eval" and r["method"] in final), key=lambda r: r["step"]):
        final[row["method"]][row["seed"]] = row["success_rate"]
    seeds = sorted(set(final[first]) & set(final[second]))
    anyway = "" if differences is None else f" (compared with {PANEL_FLAG} although {differences})"
    if not seeds:
        return "undecided: no held-out evaluation"
    for better, worse in ((first, second), (second, first)):
        if all(final[better][seed] > final[worse][seed] for seed in seeds):
            return f"decided: {better} above {worse} on every seed ({len(seeds)}){anyway}"
    return f"undecided: neither method is above the other on every seed ({len(seeds)}){anyway}"


def held_out_panels(runs: dict[tuple[str, int], Path]) -> Panels:
    """Per run, the tasks each of its evaluations played, by training step (the latest evaluation at a step, as the
    curves keep it): from OUTPUT_DIR/gigpo/evaluations.jsonl; None for an evaluation recorded without them (records
    written before evaluations named their tasks)."""
    return {run: {record["step"]: frozenset(record["tasks"]) if "tasks" in record else None
                  for record in read_evaluations(output_dir)} for run, output_dir in runs.items()}


def panel_differences(panels: Panels, methods: Sequence[str], final_only: bool = False) -> str | None:
    """Which evaluations of these methods' runs (each run's last one with `final_only`) did not play every task that
    the others played: which run, at which step, and the tasks it lacks; None when they all played the same tasks.
    Evaluations recorded without their tasks are not compared (`held_out_panels`)."""
    played = {}
    for (method, seed), by_step in sorted(panels.items()):
        if method in methods:
            steps = [max(by_step)] if final_only and by_step else sorted(by_step)
            played |= {(method, seed, step): by_step[step] for step in steps if by_step[step] is not None}
    every_task = frozenset().union(*played.values())
    short = [f"{method} seed {seed} at step {step} played {len(tasks)} of the {len(every_task)} tasks (not: "
             f"{_some(sorted(every_task - tasks))})" for (method, seed, step), tasks in played.items() if tasks != every_task]
    return f"the held-out panels differ: {'; '.join(short)}" if short else None


def _refusal(differences: str) -> str:
    return f"{differences}; their held-out figures are not over the same tasks ({PANEL_FLAG} compares them anyway)"


def _some(names: list[str], shown: int = 5) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _comparison(rows: list[dict], mode: str, field: str, window: int, higher_is_better: bool, method: str,
                against: str) -> dict:
    """Both methods' final value of one curve (trailing mean over seeds) and the first step at which `method`'s is
    at least as good as the final value of `against`."""
    steps, base = mean_curve(rows, against, mode, field)
    _, ours = mean_curve(rows, method, mode, field)
    base_mean, ours_mean = _trailing_mean(base.mean(0), window), _trailing_mean(ours.mean(0), window)
    target = base_mean[-1]
    reached = np.flatnonzero(ours_mean >= target if higher_is_better else ours_mean <= target)
    return {
        "final": {method: float(ours_mean[-1]), against: float(target)},
        "final_per_seed": {method: ours[:, -1].tolist(), against: base[:, -1].tolist()},
        "reaches_final_of_the_other_at_step": int(steps[reached[0]]) if reached.size else None,
        "last_step": int(steps[-1]),
    }


def _trailing_mean(values: np.ndarray, window: int) -> np.ndarray:
    return np.array([values[max(0, k - window + 1) : k + 1].mean() for k in range(len(values))])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--config", type=Path, default=ROOT / "recipes" / "configs" / "learning_rooms_cpu.yaml")
    parser.add_argument("--model", default=None, help="model id or folder (default: the format-warmed tiny model)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--output", type=Path, default=ROOT / "outputs" / "learning")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--analyze-only", action="store_true", help="skip training: redo the CSV, plot and summary "
                      "from the runs already in --output")
    what.add_argument("--screen", type=Path, nargs="+", metavar="CONFIG", help="screen candidate settings with the "
                      "base model (see above); prints and writes OUTPUT/screen.json")
    what.add_argument("--reading-probe", type=int, metavar="STEPS", default=None,
                      help="rooms only, no RL: supervised learning with perfect labels from the same start, "
                      "for STEPS updates at the config's learning rate; writes OUTPUT/reading_probe.json")
    parser.add_argument("--step-lambda", type=float, default=None, metavar="LAMBDA",
                        help="a third arm: GiGPO with the bootstrapped step value at this lambda in [0, 1) "
                        "(--step_advantage_lambda; --analyze-only finds it from the runs' folders)")
    parser.add_argument("--entropy-from", type=Path, default=None, metavar="CSV",
                        help="the entropy of runs whose log is missing (records brought back without it) from an "
                        "earlier analysis's learning_curves.csv, made where the logs were")
    parser.add_argument(PANEL_FLAG, action="store_true",
                        help="compare held-out figures even of runs whose evaluations did not play the same tasks (an "
                        "environment that could not start, another panel); the summary says which (held_out_panels)")
    parser.add_argument("--parallel", action="store_true", help="start every run at once (one process each)")
    parser.add_argument("--detach", action="store_true", help="run in a new process session, output to OUTPUT/learning.log")
    parser.add_argument("--screen-tasks", type=int, nargs=3, default=[32, 4, 8], metavar=("EVAL", "SAMPLED", "COPIES"),
                        help="--screen's held-out tasks, sampled tasks and copies per sampled task")
    args, overrides = parser.parse_known_args()  # the rest goes to the recipe, e.g. --max_steps 100
    args.output.mkdir(parents=True, exist_ok=True)
    if args.detach:
        detach(args.output)
        return
    if args.screen:
        results = []
        for config in args.screen:  # each result printed and saved as it comes: a screen takes minutes per config
            results.append(screen(config, args.model or EMBEDDED, *args.screen_tasks))
            args.output.mkdir(parents=True, exist_ok=True)
            (args.output / "screen.json").write_text(json.dumps(results, indent=2))
            print(json.dumps(results[-1], indent=2), flush=True)
        return
    import yaml

    settings = yaml.safe_load(args.config.read_text())
    if args.step_lambda is not None and not 0.0 <= args.step_lambda < 1.0:
        parser.error(f"--step-lambda must be in [0, 1) (lambda 1 is the GiGPO arm), got {args.step_lambda}")
    step_lambda = args.step_lambda if args.step_lambda is not None or not args.analyze_only else lambda_of_runs(args.output)
    arms = methods(step_lambda)
    runs = {(method, seed): run_directory(args.output, method, seed) for seed in args.seeds for method in arms}
    if args.reading_probe is not None and args.reading_probe < 1:
        parser.error(f"--reading-probe takes a number of updates >= 1, got {args.reading_probe}")
    if args.reading_probe is not None and settings["env_name"] != "rooms":
        parser.error(f"--reading-probe knows the right action of the rooms environment only, not {settings['env_name']!r}")
    model = args.model
    if model is None and not args.analyze_only:
        model = str(warm_up_format(args.output / "warm-tiny-model", settings["env_name"], settings.get("env_kwargs") or {},
                                   settings["prompt_template"]))
    if args.reading_probe is not None:
        curve = reading_probe(model, settings, settings["learning_rate"], args.reading_probe)
        (args.output / "reading_probe.json").write_text(json.dumps(curve, indent=2))
        return
    if args.parallel and not args.analyze_only:
        check_memory_plan(args.config, model, overrides, len(runs))
    seconds = {} if args.analyze_only else train_all(runs, arms, args.config, model, overrides, args.parallel)
    trajectories = {run: read_trajectories(output_dir) for run, output_dir in runs.items()}  # each run's read once
    hint_steps = {run: draught_steps(episodes) for run, episodes in trajectories.items()}
    rows = curves(runs, hint_steps, trajectories, earlier_entropy(args.entropy_from) if args.entropy_from else {})
    with open(args.output / "learning_curves.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, args.output / "learning_curves.png")
    panels = held_out_panels(runs)
    result = summary(rows, args.seeds, list(arms), panels, args.allow_panel_mismatch) | {"wall_seconds": seconds}
    advantages = {f"{method} seed {seed}": draught_advantages(hint_steps[method, seed]) for method, seed in runs}
    if all(advantages.values()):
        result["advantage_by_draught"] = advantages
    (args.output / "summary.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
