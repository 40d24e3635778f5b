"""Does it learn? GiGPO against step-wise GRPO (omega = 0), identical settings, budgets and seeds.

    python bench/learning.py                                   # the CPU setting, 3 seeds (about 50 min on 2 cores)
    python bench/learning.py --config recipes/configs/X.yaml --model MODEL   # e.g. a GPU setting
    python bench/learning.py --output outputs/learning_100 --max_steps 100   # unknown arguments go to the recipe
    python bench/learning.py --reading-probe 250 --output outputs/probe      # can the model read? (no RL)
    python bench/learning.py --parallel --detach --config C --model M --output O   # 6 runs at once, in the background
    python bench/learning.py --analyze-only --output O                       # collect them (cut-off runs too)
    python bench/learning.py --screen C1 C2 ... --model M                    # choose a setting: the base model's numbers
    python bench/learning.py --screen C --arms CANDIDATES.yaml --screen-temperatures 0.6 1.0 --screen-update
    python bench/learning.py --step-lambda 0.5 ...                           # a third arm: GiGPO at lambda 0.5
    OMP_NUM_THREADS=1 python bench/learning.py --arms ARMS.yaml --jobs 2 ... # named arms, two runs at a time

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
and the step groups (mean size, singleton share) that the copies of a task form. With --arms, each arm of the file is
a candidate (its arguments added to each config); --screen-temperatures samples a rollout at each temperature (its
success, decisions and prompt tokens per step), and --screen-update measures the CPU seconds of one training
iteration (its rollout and its update) at the config's own batch.

Rooms diagnostics, in the summary and the plot (docs/results.md reads them): the share of steps that follow the
draught, the mean advantage of steps that follow it and of those that go against it, and the policy entropy
(from the runs' logs). --reading-probe asks, without RL, whether the model can learn to act on the observation (or,
on rooms without the hint, on its history).
In every setting, per rollout: the step samples played and those the update left out (`gigpo/subsampled_rows`), the
share of task groups whose copies all got the same return, and, where trajectories were logged, the share of steps
that come back to the observation of two steps before (`two_step_loop_share`: a policy without history caught in a
loop). Runs brought back from another machine without their logs take their entropy from the CSV of an analysis made
there (--entropy-from).

--arms ARMS.yaml replaces GiGPO and GRPO by named arms, each a list of recipe arguments (`read_arms`), compared with
the file's control arm; --jobs N runs N at a time, and each run's CPU time is recorded. On rooms without the hint,
the success per treasure side (from the logged episodes). With a control arm the summary holds setting F's
pre-registered reading (`trap_reading`, docs/results.md).
"""

from __future__ import annotations

import argparse
import ast
import csv
import itertools
import json
import os
import random
import re
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gigpo_trl.records import read_evaluations, read_iterations, read_trajectories

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script (python bench/learning.py): bench.update_memory, as the tests import it
    sys.path.insert(0, str(ROOT))
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


# Set by the bench for every run: an arm may not set them.
BENCH_ARGUMENTS = ("--config", "--model_name_or_path", "--seed", "--output_dir")


def read_arms(path: Path) -> tuple[dict[str, list[str]], str | None]:
    """The arms of an --arms file and its control arm (None if it names none). The file is YAML:

        arms:                                  # name: the recipe arguments that make the arm, in order
          history 0: [--history_length, "0"]
          history 2: [--history_length, "2", --temperature, "1.0"]
        control: history 0                     # optional: the arm every other is compared with

    Numbers may be written unquoted; an arm may not set the bench's own arguments (BENCH_ARGUMENTS)."""
    import yaml

    content = yaml.safe_load(path.read_text())
    if not isinstance(content, dict) or not isinstance(content.get("arms"), dict) or not content["arms"]:
        raise ValueError(f"{path}: expected a mapping with 'arms': {{name: [recipe arguments]}}, got {content!r}")
    unknown = set(content) - {"arms", "control"}
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)} (known: 'arms', 'control')")
    arms: dict[str, list[str]] = {}
    for name, arguments in content["arms"].items():
        if not isinstance(name, str) or not name.strip() or not isinstance(arguments, list):
            raise ValueError(f"{path}: arm {name!r} must be a name with a list of recipe arguments, got {arguments!r}")
        if any(isinstance(a, bool) or not isinstance(a, (str, int, float)) for a in arguments):
            raise ValueError(f"{path}: arm {name!r}: every recipe argument must be a string or a number, got {arguments!r}")
        arms[name] = [str(argument) for argument in arguments]
        reserved = [a for a in arms[name] if a.split("=", 1)[0] in BENCH_ARGUMENTS]
        if reserved:
            raise ValueError(f"{path}: arm {name!r} sets {reserved}, which the bench sets for every run")
    folders = [run_directory(Path(), name, 0) for name in arms]
    if len(set(folders)) < len(folders):
        raise ValueError(f"{path}: two arms share a run folder ({[folder.name for folder in folders]}): rename one")
    control = content.get("control")
    if control is not None and control not in arms:
        raise ValueError(f"{path}: the control {control!r} is not one of the arms {list(arms)}")
    return arms, control


def recipe_value(arguments: Sequence[str], name: str) -> str | None:
    """The value the recipe arguments give `--name` (the last one, as argparse takes it), or None."""
    value = None
    for k, argument in enumerate(arguments):
        if argument == f"--{name}" and k + 1 < len(arguments):
            value = arguments[k + 1]
        elif argument.startswith(f"--{name}="):
            value = argument.split("=", 1)[1]
    return value


def run_directory(output: Path, method: str, seed: int) -> Path:
    """gigpo-seed0, grpo-seed0, gigpo-lambda0.5-seed0; an arm of an --arms file by its name in lower case, each run of
    characters other than letters, digits and dots a dash: "history 2, T=1.0" -> history-2-t-1.0-seed0."""
    if method in (PAPER, BASELINE):
        name = {PAPER: "gigpo", BASELINE: "grpo"}[method]
    elif re.fullmatch(r"GiGPO lambda [0-9.]+", method):
        name = "gigpo-lambda" + method.rsplit(" ", 1)[1]
    else:
        name = re.sub(r"[^a-z0-9.]+", "-", method.lower()).strip("-")
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


def start_run(config: Path, model: str, method_arguments: list[str], seed: int, output_dir: Path,
              overrides: list[str]) -> subprocess.Popen:
    """One training run through the recipe, started in a process of its own (its output in OUTPUT_DIR.log, after a
    first line holding the command)."""
    command = [sys.executable, str(ROOT / "recipes" / "train_gigpo.py"), "--config", str(config),
               "--model_name_or_path", model, *method_arguments, "--seed", str(seed),
               "--output_dir", str(output_dir), *overrides]
    with open(run_log(output_dir), "w") as log:
        log.write(shlex.join(command) + "\n")
        log.flush()
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=run_environment())


def run_environment() -> dict[str, str]:
    """A run's environment: this one's, with a port of its own for torch.distributed (`MASTER_PORT`, unless set).
    Runs started at once each set up a process group of one (vLLM colocate does), and TRL picks the first free of a
    few fixed ports: two runs starting together both take 29500 and the second dies (EADDRINUSE)."""
    if "MASTER_PORT" in os.environ:
        return dict(os.environ)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]  # an ephemeral port: two runs' coincide about once in 28,000
    return {**os.environ, "MASTER_PORT": str(port)}


def train_all(runs: dict[tuple[str, int], Path], arms: dict[str, list[str]], config: Path, model: str,
              overrides: list[str], jobs: int) -> tuple[dict[str, float], dict[str, float]]:
    """Every (method, seed) run, in order, at most `jobs` at once (1: one after the other); returns their wall times and
    their processes' CPU times (user + system) in seconds: on a loaded machine the CPU time of a one-thread run is what
    it would take on a quiet core. A failed run stops the comparison once the runs already started have ended."""
    pending, running, seconds, cpu_seconds = list(runs), {}, {}, {}
    while pending or running:
        while pending and len(running) < jobs:
            key = pending.pop(0)
            running[key] = (time.perf_counter(), start_run(config, model, arms[key[0]], key[1], runs[key], overrides))
        time.sleep(0.2)
        for key, (started, process) in list(running.items()):
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if not pid:
                continue
            del running[key]
            process.returncode = os.waitstatus_to_exitcode(status)
            if process.returncode:
                for _, other in running.values():
                    other.wait()
                raise RuntimeError(f"{key[0]} seed {key[1]} failed: see {run_log(runs[key])}")
            name = f"{key[0]} seed {key[1]}"
            seconds[name], cpu_seconds[name] = time.perf_counter() - started, usage.ru_utime + usage.ru_stime
            print(f"{name}: {seconds[name]:.0f} s, CPU {cpu_seconds[name]:.0f} s", flush=True)
    return seconds, cpu_seconds


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


def check_memory_plan(config: Path, model: str, run_arguments: Sequence[Sequence[str]]) -> None:
    """Refuse to start at once runs that cannot fit the GPU (or, without one, the host's free memory), one per entry
    of `run_arguments` (its recipe arguments: its arm's and the command line's): each run's weights, gradients and
    AdamW moments (and a reference model), one loss pass of max_step_samples_per_micro_batch rows (a whole micro-batch
    without it) at the config's longest step sample, and vLLM colocate's share (`bench/update_memory.py`,
    docs/performance.md)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from trl import ModelConfig, TrlParser

    from bench.update_memory import BYTES_PER_TOKEN_LAYER_HIDDEN, pass_memory_gib, plan_fits, run_memory_gib
    from gigpo_trl import GiGPOConfig, TaskArguments
    from gigpo_trl.models import resolve_model

    path = resolve_model(model)
    model_config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    with torch.device("meta"):
        parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(model_config).parameters())
    if torch.cuda.is_available():
        kind, device, total = "cuda", torch.cuda.get_device_name(), torch.cuda.mem_get_info()[1] / 2**30
    else:
        import psutil

        kind, device, total = "cpu", "the host (no GPU)", psutil.virtual_memory().available / 2**30

    def one_run(arguments: tuple[str, ...]) -> tuple[float, str]:
        _, args, _ = TrlParser((TaskArguments, GiGPOConfig, ModelConfig)).parse_args_and_config(
            args=["--config", str(config), "--output_dir", str(ROOT / "outputs" / "memory_plan"), *arguments])
        micro_batch = args.per_device_train_batch_size * args.max_env_steps  # its step samples at most
        rows = min(args.max_step_samples_per_micro_batch or micro_batch, micro_batch)
        tokens = longest_prompt_tokens(args, tokenizer)
        coefficient = BYTES_PER_TOKEN_LAYER_HIDDEN[kind, "bf16" if args.bf16 else "fp32"] * model_config.hidden_size
        pass_gib = pass_memory_gib(coefficient, rows, tokens, model_config.num_hidden_layers)
        vllm_share = args.vllm_gpu_memory_utilization if args.use_vllm and args.vllm_mode == "colocate" else None
        gib = run_memory_gib(parameters, pass_gib=pass_gib, reference_model=args.beta != 0.0, total_gib=total,
                             vllm_share=vllm_share)
        return gib, (f"{gib:.1f} GiB (one loss pass of {rows} step samples x {tokens} tokens: {pass_gib:.1f} GiB"
                     + (f"; vLLM colocate {vllm_share:g} of the GPU" if vllm_share else "") + ")")

    estimates = {arguments: one_run(arguments) for arguments in dict.fromkeys(map(tuple, run_arguments))}
    needed = sum(estimates[tuple(arguments)][0] for arguments in run_arguments)
    plan = (f"{len(run_arguments)} runs of {parameters / 1e6:.0f}M parameters (weights, gradients and AdamW "
            f"{parameters * 16 / 2**30:.1f} GiB each), " + ", ".join(sorted({text for _, text in estimates.values()}))
            + f", on {device} ({total:.1f} GiB)")
    plan_fits(needed, total, plan)
    print(f"memory plan: {plan}: {needed:.1f} GiB", flush=True)


def screen(config: Path, model: str, eval_tasks: int, sampled_tasks: int, copies: int,
           recipe_arguments: Sequence[str] = (), temperatures: Sequence[float] = (), update: bool = False) -> dict:
    """What choosing a setting needs, from the base model (no training): its greedy held-out success and episode
    length on the first `eval_tasks` tasks of the config's eval fold, the optimal path length of those tasks
    (`shortest_path_length`), and one sampled rollout of `sampled_tasks` x `copies` at each of `temperatures` (the
    config's temperature if none): success, decisions (steps) per episode, prompt tokens per step and step groups.
    With `update`, the CPU seconds of one training iteration at the config's own batch (`iteration_cpu_seconds`).
    `recipe_arguments` change the config (e.g. --history_length 2)."""
    import gc

    from trl import ModelConfig, TrlParser

    from gigpo_trl import GiGPOConfig, GiGPOTrainer, TaskArguments, make_env
    from gigpo_trl.shortest_paths import shortest_path_length

    overrides = ["--output_dir", str(ROOT / "outputs" / "screen" / config.stem), "--num_eval_tasks", str(eval_tasks),
                 "--num_train_tasks", str(sampled_tasks),
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
    optimal = [shortest_path_length(env, seed, args.max_env_steps) for seed in panel["seed"]]
    env.close()
    reachable = [length for length in optimal if length is not None]
    trainer.model.train()
    rows = [train[k] for k in range(sampled_tasks) for _ in range(copies)]
    sampled = {}
    for temperature in temperatures or [args.temperature]:
        trainer.temperature = trainer.generation_config.temperature = temperature
        trainer._generate_and_score_completions(rows)  # one sampled rollout, no update
        metrics = {name: values[-1] for name, values in trainer._metrics["train"].items() if values}
        prompt_tokens = [len(completion.prompt_ids) for completion in trainer.last_rollout.steps.completion]
        sampled[f"{temperature:g}"] = {
            "success": metrics["env/success_rate"], "decisions_per_episode": metrics["env/episode_length_mean"],
            "truncated_share": metrics["env/truncated_share"], "invalid_action_rate": metrics["env/invalid_action_rate"],
            "prompt_tokens_mean": float(np.mean(prompt_tokens)), "prompt_tokens_max": max(prompt_tokens),
            "step_group_size_mean": metrics["gigpo/step_group_size_mean"],
            "singleton_share": metrics["gigpo/singleton_share"], "rollout_s": metrics["timing/rollout_s"],
        }
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
    if update:
        result["iteration"] = iteration_cpu_seconds(config, model, recipe_arguments)
    return result


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


def rollout_diagnostics(trajectories: dict[str, list[dict]], settings: dict) -> dict[tuple[str, int], dict[str, float]]:
    """On rooms whose treasure end the seed picks, per recorded rollout ((mode, rollout) -> columns), from a run's
    `read_trajectories` (`log_trajectories` episodes a rollout; all of them when it is at least the rollout's batch):
    the success rate of the tasks with the treasure west (even seeds) and east (odd). Empty elsewhere."""
    env_kwargs = settings.get("env_kwargs") or {}
    if settings["env_name"] != "rooms" or env_kwargs.get("treasure", "seed") != "seed":
        return {}
    result = {}
    for name, episodes in trajectories.items():
        mode, rollout = name.split("-")
        result[mode, int(rollout)] = {
            f"success_treasure_{side}": float(np.mean(won)) if won else float("nan")
            for side, parity in (("west", 0), ("east", 1))
            for won in [[bool(episode["won"]) for episode in episodes if episode["seed"] % 2 == parity]]}
    return result


DIAGNOSTIC_COLUMNS = ("success_treasure_west", "success_treasure_east")


def curves(runs: dict[tuple[str, int], Path], hint_steps: dict[tuple[str, int], list],
           trajectories: dict[tuple[str, int], dict[str, list[dict]]],
           entropy_from: dict[tuple[str, int], dict[int, float]], settings: dict) -> list[dict]:
    """One row per (method, seed, rollout): step, mode, success rate, return, step-group statistics, timings, the
    step samples the rollout played and those its update left out, the invalid-answer rate, the share of task groups
    whose copies all got the same return and of the update's samples with a nonzero advantage, and, where the
    rollout's trajectories were logged, their `two_step_loop_share`; the logged loop metrics (`loops/*`) and in-group
    return std; on rooms without the hint, the success per treasure side (`rollout_diagnostics`)."""
    rows = []
    for (method, seed), output_dir in runs.items():
        if not (output_dir / "gigpo" / "iterations.jsonl").is_file():  # not started yet, or failed at once
            print(f"{method} seed {seed}: no records in {output_dir}", flush=True)
            continue
        following = draught_following(hint_steps[method, seed])
        loops = {name: two_step_loop_share(episodes) for name, episodes in trajectories[method, seed].items()}
        diagnostics = rollout_diagnostics(trajectories[method, seed], settings)
        records = read_iterations(output_dir)
        entropy = run_entropy(output_dir, [record["step"] for record in records if record["mode"] == "train"],
                              entropy_from.get((method, seed), {}))
        for record in records:
            metrics = record["metrics"]
            missing = dict.fromkeys(DIAGNOSTIC_COLUMNS, float("nan"))
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
                **diagnostics.get((record["mode"], record["rollout"]), missing),
            })
    return rows


def mean_curve(rows: list[dict], method: str, mode: str, field: str) -> tuple[np.ndarray, np.ndarray]:
    """Steps and the per-seed values (seeds x steps) of one method's curve (last record per step and seed)."""
    by_seed: dict[int, dict[int, float]] = {}
    for row in rows:
        if row["method"] == method and row["mode"] == mode:
            by_seed.setdefault(row["seed"], {})[row["step"]] = row.get(field, float("nan"))
    steps = sorted(set.intersection(*(set(values) for values in by_seed.values())))
    return np.array(steps), np.array([[values[s] for s in steps] for values in by_seed.values()])


def plot(rows: list[dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [("train", "success_rate", "Training rollouts: success rate"),
              ("eval", "success_rate", "Held-out tasks (greedy): success rate"),
              ("train", "return_mean", "Training rollouts: mean return"),
              ("train", "episode_length", "Training rollouts: mean episode length"),
              ("eval", "episode_length", "Held-out tasks (greedy): mean episode length"),
              ("train", "entropy", "Policy entropy (mean per completion token)")]
    if not all(np.isnan(row["draught_following"]) for row in rows):  # rooms: what the policy learned
        panels[2] = ("train", "draught_following", "Steps that follow the draught (rooms)")
    if not all(np.isnan(row["revisit_share"]) for row in rows):  # the loop metrics (loops/*)
        panels += [("train", "revisit_share", "Steps into a state visited before (revisits)"),
                   ("train", "reversal_share", "Steps back to the state of two states before"),
                   ("train", "distinct_states_mean", "Distinct states per episode")]
    if not all(np.isnan(row["success_treasure_west"]) for row in rows):  # rooms without the hint: one side or both?
        panels[2] = ("train", "success_treasure_west", "Training rollouts: success, treasure west")
        panels.append(("train", "success_treasure_east", "Training rollouts: success, treasure east"))
    lines = -(-len(panels) // 3)
    figure = Figure(figsize=(16, 4 * lines), layout="constrained")
    FigureCanvasAgg(figure)
    grid = list(figure.subplots(lines, 3).flat)
    for axes in grid[len(panels):]:
        axes.set_axis_off()
    for axes, (mode, field, title) in zip(grid, panels):
        for method in dict.fromkeys(row["method"] for row in rows if row["mode"] == mode):
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


def comparisons(arms: Sequence[str], control: str | None = None) -> list[tuple[str, str]]:
    """The (method, against) pairs a comparison reports: every method against the control when there is one (an
    --arms file's); otherwise every method against step-wise GRPO, and the bootstrapped arm against the paper's GiGPO,
    where they are arms."""
    if control is not None:
        return [(method, control) for method in arms if method != control]
    return [(method, against) for against in (BASELINE, PAPER) if against in arms
            for method in arms if method not in (against, BASELINE)]


def summary(rows: list[dict], seeds: list[int], arms: Sequence[str], panels: Panels | None = None,
            allow_panel_mismatch: bool = False, control: str | None = None) -> dict:
    """Final success rates and episode lengths, when each method reaches the other's final value (mean over seeds),
    and per seed the first iteration at which training success reaches each of SUCCESS_TARGETS. The held-out
    comparisons of two methods (`eval`, `decision`, `decisions`) are refused where their runs' evaluations did not play
    the same tasks (`panels`, see `panel_differences`), unless `allow_panel_mismatch`; `held_out_panels` says which.
    Also the first and last 20 iterations of every diagnostic (entropy, loops, ...), and with a control (an --arms
    file's) the trap reading (`trap_reading`)."""
    panels = panels or {}
    result: dict = {"seeds": seeds, "methods": list(arms)} | ({"control": control} if control else {})
    pairs = comparisons(arms, control)
    every_difference = panel_differences(panels, arms)
    result["held_out_panels"] = {
        "same_tasks": every_difference is None, "differences": every_difference,
        "compared_anyway": every_difference is not None and allow_panel_mismatch,
        "tasks_not_recorded": [f"{method} seed {seed}" for (method, seed), by_step in panels.items()
                               if None in by_step.values()],
    }
    for mode in ("train", "eval"):
        if not any(r["mode"] == mode for r in rows):  # e.g. runs without held-out evaluation (eval_strategy no)
            continue
        window = 5 if mode == "train" else 1  # training curves are noisy: compare trailing means
        result[mode] = {"trailing_window": window}
        for field, higher in (("success_rate", True), ("episode_length", False)):
            result[mode][field] = {}
            for method, against in pairs:
                differences = panel_differences(panels, (method, against)) if mode == "eval" else None
                compared = (_comparison(rows, mode, field, window, higher, method, against)
                            if allow_panel_mismatch or differences is None else {"refused": _refusal(differences)})
                result[mode][field][f"{method} against {against}"] = compared
    if PAPER in arms and BASELINE in arms:
        result["decision"] = decision(rows, panels=panels, allow_panel_mismatch=allow_panel_mismatch)
    result["decisions"] = {f"{method} against {against}": decision(rows, method, against, panels, allow_panel_mismatch)
                           for method, against in pairs}
    if control is not None:
        result["trap_reading"] = trap_reading(rows, arms, control)
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
        for field in ("success_rate", "draught_following", "entropy", "singleton_share", "step_group_size_mean",
                      "equal_return_groups", "nonzero_advantage_share", "two_step_loop_share", "revisit_share",
                      "reversal_share", "cycle_end_share", "distinct_states_mean", *DIAGNOSTIC_COLUMNS):
            if not all(np.isnan(r.get(field, np.nan)) for r in mine):
                result.setdefault(f"{field}_first_last_20", {})[method] = {
                    "first_20_iterations": float(np.nanmean([r.get(field, np.nan) for r in mine if r["step"] < 20])),
                    "last_20_iterations": float(np.nanmean([r.get(field, np.nan) for r in mine if r["step"] > last - 20])),
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


# The trap-and-escape rule of setting F (docs/results.md), fixed before its full run. Windows: the first and the last
# TRAP_WINDOW training updates of each run. Side-balanced success: the mean of the success rates of the tasks whose
# treasure is west and east (rooms without the hint; the plain success rate elsewhere). No policy of the current
# observation alone beats MEMORYLESS_CEILING there (docs/results.md, setting F).
TRAP_WINDOW = 20
MEMORYLESS_CEILING = 0.5
TRAP_ENTROPY_FALL = 0.6  # the trap: the last window's entropy at most this share of the first window's ...
TRAP_SUCCESS_MARGIN = 0.05  # ... its balanced success at most the ceiling plus this ...
TRAP_LOOPS = 0.5  # ... and at least this share of its steps revisiting a state
TRAP_SEED_SHARE = 0.8  # shown when it holds on at least this share of the control's seeds (4 of 5)
ESCAPE_SUCCESS = 0.6  # an arm escapes on a seed when its last window's balanced success is at least this


def window_means(rows: list[dict], method: str, seed: int, field: str, window: int = TRAP_WINDOW) -> tuple[float, float]:
    """The mean of a training curve's `field` over one run's first and last `window` updates (NaN values left out)."""
    curve = {r["step"]: r.get(field, np.nan) for r in rows if r["method"] == method and r["seed"] == seed and r["mode"] == "train"}
    if not curve:
        return float("nan"), float("nan")
    last = max(curve)
    first_values = [v for step, v in curve.items() if step < window and not np.isnan(v)]
    last_values = [v for step, v in curve.items() if step > last - window and not np.isnan(v)]
    return (float(np.mean(first_values)) if first_values else float("nan"),
            float(np.mean(last_values)) if last_values else float("nan"))


def trap_reading(rows: list[dict], arms: Sequence[str], control: str) -> dict:
    """Setting F's pre-registered reading, from the curves: per run, the first and last windows' entropy,
    side-balanced success and revisit share (`loops/revisit_share`), and the last held-out success. The control shows the trap on a seed when its entropy falls to at most
    TRAP_ENTROPY_FALL of its start, its balanced success ends at most MEMORYLESS_CEILING + TRAP_SUCCESS_MARGIN, and
    at least TRAP_LOOPS of its steps revisit; shown when that holds on TRAP_SEED_SHARE of its seeds. Any arm escapes
    on a seed when its last window's balanced success is at least ESCAPE_SUCCESS (out of reach without memory); it
    escapes when it does on every seed."""
    sides = any(not np.isnan(r["success_treasure_west"]) for r in rows)
    per_arm: dict[str, dict[str, dict]] = {}
    for method in arms:
        for seed in sorted({r["seed"] for r in rows if r["method"] == method}):
            entropy = window_means(rows, method, seed, "entropy")
            if sides:
                west, east = (window_means(rows, method, seed, f"success_treasure_{side}") for side in ("west", "east"))
                success = ((west[0] + east[0]) / 2, (west[1] + east[1]) / 2)
            else:
                success = window_means(rows, method, seed, "success_rate")
            revisits = window_means(rows, method, seed, "revisit_share")
            held_out = [r["success_rate"] for r in sorted(rows, key=lambda r: r["step"])
                        if r["method"] == method and r["seed"] == seed and r["mode"] == "eval"]
            figures = {"entropy": entropy, "balanced_success": success, "revisit_share": revisits,
                       "held_out_last": held_out[-1] if held_out else float("nan"),
                       "escaped": bool(success[1] >= ESCAPE_SUCCESS)}
            if method == control:
                figures["trap"] = bool(entropy[1] <= TRAP_ENTROPY_FALL * entropy[0]
                                       and success[1] <= MEMORYLESS_CEILING + TRAP_SUCCESS_MARGIN
                                       and revisits[1] >= TRAP_LOOPS)
            per_arm.setdefault(method, {})[str(seed)] = figures
    result: dict = {"balanced_by_treasure_side": sides, "per_seed": per_arm}
    traps = [figures["trap"] for figures in per_arm.get(control, {}).values()]
    shown = bool(traps) and sum(traps) >= TRAP_SEED_SHARE * len(traps)
    result["control"] = f"{control}: trap {'shown' if shown else 'not shown'} on {sum(traps)} of {len(traps)} seeds"
    result["arms"] = {}
    for method, seeds in per_arm.items():
        escaped = [figures["escaped"] for figures in seeds.values()]
        verdict = "escapes" if all(escaped) else "does not escape"
        result["arms"][method] = f"{verdict}: balanced success >= {ESCAPE_SUCCESS:g} on {sum(escaped)} of {len(escaped)} seeds"
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


def cut_at_common_evaluation(rows: list[dict]) -> tuple[list[dict], int]:
    """The budget rule of the GPU settings (docs/results.md, settings D and D2): runs stopped at a fixed time are
    compared at the last held-out evaluation that every run reached. Returns the rows up to that step (training and
    evaluation) and the step. Raises ValueError when some run has no evaluation at all."""
    last: dict[tuple[str, int], int] = {}
    for row in rows:
        last.setdefault((row["method"], row["seed"]), -1)
        if row["mode"] == "eval":
            last[row["method"], row["seed"]] = max(last[row["method"], row["seed"]], row["step"])
    missing = sorted(f"{method} seed {seed}" for (method, seed), step in last.items() if step < 0)
    if missing:
        raise ValueError(f"no held-out evaluation to cut at: {', '.join(missing)} evaluated nothing")
    step = min(last.values())
    return [row for row in rows if row["step"] <= step], step


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
    arms_option = parser.add_mutually_exclusive_group()
    arms_option.add_argument("--step-lambda", type=float, default=None, metavar="LAMBDA",
                             help="a third arm: GiGPO with the bootstrapped step value at this lambda in [0, 1) "
                             "(--step_advantage_lambda; --analyze-only finds it from the runs' folders)")
    arms_option.add_argument("--arms", type=Path, default=None, metavar="ARMS.yaml",
                             help="named arms instead of GiGPO and GRPO, each a list of recipe arguments (read_arms); "
                             "copied to OUTPUT/arms.yaml, which --analyze-only reads when --arms is not given")
    parser.add_argument("--entropy-from", type=Path, default=None, metavar="CSV",
                        help="the entropy of runs whose log is missing (records brought back without it) from an "
                        "earlier analysis's learning_curves.csv, made where the logs were")
    parser.add_argument(PANEL_FLAG, action="store_true",
                        help="compare held-out figures even of runs whose evaluations did not play the same tasks (an "
                        "environment that could not start, another panel); the summary says which (held_out_panels)")
    at_once = parser.add_mutually_exclusive_group()
    at_once.add_argument("--parallel", action="store_true", help="start every run at once (one process each)")
    at_once.add_argument("--jobs", type=int, default=1, metavar="N", help="at most N runs at once, in order (default 1; "
                         "on a few CPU cores with OMP_NUM_THREADS=1, one run a core)")
    parser.add_argument("--detach", action="store_true", help="run in a new process session, output to OUTPUT/learning.log")
    parser.add_argument("--cut-at-common-evaluation", action="store_true",
                        help="compare the runs up to the last held-out evaluation every run reached (the budget rule "
                        "of runs stopped at a fixed time); the summary says the step (cut_at_step)")
    parser.add_argument("--screen-tasks", type=int, nargs=3, default=[32, 4, 8], metavar=("EVAL", "SAMPLED", "COPIES"),
                        help="--screen's held-out tasks, sampled tasks and copies per sampled task")
    parser.add_argument("--screen-temperatures", type=float, nargs="+", default=[], metavar="T",
                        help="--screen's sampled rollout at each of these temperatures (default: the config's)")
    parser.add_argument("--screen-update", action="store_true",
                        help="--screen also measures the CPU seconds of one training iteration at the config's batch")
    args, overrides = parser.parse_known_args()  # the rest goes to the recipe, e.g. --max_steps 100
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    args.output.mkdir(parents=True, exist_ok=True)
    if args.detach:
        detach(args.output)
        return
    if args.screen:
        # Without --arms each config is a candidate; with it, each (config, arm) pair, the arm's arguments added.
        candidates = read_arms(args.arms)[0] if args.arms else {"": []}
        results = []
        for config, (name, arguments) in itertools.product(args.screen, candidates.items()):
            # each result printed and saved as it comes: a screen takes minutes per candidate
            results.append({"candidate": name or config.stem, "recipe_arguments": [*arguments, *overrides]} | screen(
                config, args.model or EMBEDDED, *args.screen_tasks, [*arguments, *overrides],
                args.screen_temperatures, args.screen_update))
            (args.output / "screen.json").write_text(json.dumps(results, indent=2))
            print(json.dumps(results[-1], indent=2), flush=True)
        return
    import yaml

    settings = yaml.safe_load(args.config.read_text())
    if args.step_lambda is not None and not 0.0 <= args.step_lambda < 1.0:
        parser.error(f"--step-lambda must be in [0, 1) (lambda 1 is the GiGPO arm), got {args.step_lambda}")
    arms_file = args.arms or (args.output / "arms.yaml" if args.analyze_only and args.step_lambda is None else None)
    control = None
    if arms_file is not None and arms_file.is_file():
        try:
            arms, control = read_arms(arms_file)
        except ValueError as error:
            parser.error(str(error))
        if not args.analyze_only and arms_file.resolve() != (args.output / "arms.yaml").resolve():
            (args.output / "arms.yaml").write_text(arms_file.read_text())
    elif args.arms is not None:
        parser.error(f"--arms: no such file {args.arms}")
    else:
        step_lambda = args.step_lambda if args.step_lambda is not None or not args.analyze_only else lambda_of_runs(args.output)
        arms = methods(step_lambda)
    runs = {(method, seed): run_directory(args.output, method, seed) for seed in args.seeds for method in arms}
    if args.reading_probe is not None and args.reading_probe < 1:
        parser.error(f"--reading-probe takes a number of updates >= 1, got {args.reading_probe}")
    if args.reading_probe is not None and settings["env_name"] != "rooms":
        parser.error(f"--reading-probe knows the right action of the rooms environment only, not {settings['env_name']!r}")
    # One warmed model starts every arm: on prompts of the longest history any arm shows.
    history = max(int(recipe_value(arguments, "history_length") or settings.get("history_length", 2))
                  for arguments in ([*arm, *overrides] for arm in arms.values()))
    model = args.model
    if model is None and not args.analyze_only:
        folder = "warm-tiny-model" + (f"-history{history}" if history else "")
        model = str(warm_up_format(args.output / folder, settings["env_name"], settings.get("env_kwargs") or {},
                                   settings["prompt_template"], history_length=history))
    if args.reading_probe is not None:
        curve = reading_probe(model, settings, settings["learning_rate"], args.reading_probe, history_length=history)
        (args.output / "reading_probe.json").write_text(json.dumps(curve, indent=2))
        return
    if args.parallel and not args.analyze_only:
        check_memory_plan(args.config, model, [[*arms[method], *overrides] for method, _ in runs])
    jobs = len(runs) if args.parallel else args.jobs
    seconds, cpu_seconds = ({}, {}) if args.analyze_only else train_all(runs, arms, args.config, model, overrides, jobs)
    trajectories = {run: read_trajectories(output_dir) for run, output_dir in runs.items()}  # each run's read once
    hint_steps = {run: draught_steps(episodes) for run, episodes in trajectories.items()}
    rows = curves(runs, hint_steps, trajectories, earlier_entropy(args.entropy_from) if args.entropy_from else {},
                  settings)
    cut_at_step = None
    if args.cut_at_common_evaluation:
        rows, cut_at_step = cut_at_common_evaluation(rows)
        print(f"compared up to update {cut_at_step}: the last held-out evaluation every run reached", flush=True)
    with open(args.output / "learning_curves.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(dict.fromkeys(name for row in rows for name in row)),
                                restval=float("nan"))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, args.output / "learning_curves.png")
    panels = held_out_panels(runs)
    if cut_at_step is not None:
        panels = {run: {step: tasks for step, tasks in by_step.items() if step <= cut_at_step} for run, by_step in panels.items()}
    result = summary(rows, args.seeds, list(arms), panels, args.allow_panel_mismatch, control) | {
        "wall_seconds": seconds, "cpu_seconds": cpu_seconds} | ({"cut_at_step": cut_at_step} if cut_at_step is not None else {})
    advantages = {f"{method} seed {seed}": draught_advantages(hint_steps[method, seed]) for method, seed in runs}
    if all(advantages.values()):
        result["advantage_by_draught"] = advantages
    (args.output / "summary.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
