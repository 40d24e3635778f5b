"""The runs of a learning comparison: which arms (methods) there are and the recipe arguments that make each, where
each (arm, seed) run writes, and starting them: one after the other, `--jobs N` at a time, or all at once on one GPU
(`--parallel`) after a memory plan says they fit; `--detach` puts the whole command in the background."""

from __future__ import annotations

import multiprocessing
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PAPER, BASELINE = "GiGPO", "GRPO (omega=0)"


def methods(step_lambda: float | None = None) -> dict[str, list[str]]:
    """The compared methods and the recipe arguments that make each: GiGPO (omega 1, the paper's step value),
    step-wise GRPO (omega 0) and, with `step_lambda`, GiGPO with the bootstrapped step value of
    docs/algorithm.md (`--step_advantage_lambda`)."""
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


def start_run(config: Path, model: str, method_arguments: list[str], seed: int, output_dir: Path,
              overrides: list[str], resume_from: Path | None = None) -> subprocess.Popen:
    """One training run through the recipe, started in a process of its own (its output in OUTPUT_DIR.log, after a
    first line holding the command). Resumed from a checkpoint (`resume_from`), the run's log goes on after a line
    RESUME_MARK + the checkpoint's name, so the earlier part's output stays (`logged_entropy` reads both)."""
    command = [sys.executable, str(ROOT / "recipes" / "train_gigpo.py"), "--config", str(config),
               "--model_name_or_path", model, *method_arguments, "--seed", str(seed),
               "--output_dir", str(output_dir), *overrides,
               *(["--resume_from_checkpoint", str(resume_from)] if resume_from else [])]
    with open(run_log(output_dir), "a" if resume_from else "w") as log:
        if resume_from:
            log.write(f"{RESUME_MARK}{resume_from.name}\n")
        log.write(shlex.join(command) + "\n")
        log.flush()
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=run_environment())


RESUME_MARK = "# resumed from "  # a run log's line where a resumed part begins, then the checkpoint's name


def resume_point(output_dir: Path) -> tuple[Path | None, bool]:
    """Where `--resume` takes a run up: (its last complete checkpoint or None, whether that checkpoint ends the run: its
    global step has reached its max steps, as the checkpoint's trainer_state.json says). A checkpoint is complete once
    its trainer_state.json is written (transformers writes it last): a run killed while saving one leaves a folder
    without it, which is renamed incomplete-checkpoint-N (kept, out of transformers' way) and the one before it, kept
    until the new one is complete, taken instead. A run with no complete checkpoint starts afresh; a finished one is
    not started again."""
    import json

    checkpoints = sorted(output_dir.glob("checkpoint-*"), key=lambda path: int(path.name.split("-")[1]))
    while checkpoints and not (checkpoints[-1] / "trainer_state.json").is_file():
        incomplete = checkpoints.pop()
        incomplete.rename(incomplete.with_name(f"incomplete-{incomplete.name}"))
    if not checkpoints:
        return None, False
    state = json.loads((checkpoints[-1] / "trainer_state.json").read_text())
    return checkpoints[-1], state["global_step"] >= state["max_steps"]


BASE_FOLDER = "base"  # OUTPUT/base: the shared evaluation before training (`evaluate_base`)


def evaluate_base(config: Path, model: str, output_dir: Path, overrides: Sequence[str] = ()) -> Path:
    """The held-out evaluation every run of a comparison would make before training, made once: runs that start from
    the same weights get the same figure from a greedy evaluation of the same panel, so their recipes skip it
    (`--evaluate_before_training false`) and the analysis takes this one as each run's step 0
    (`research.analysis.with_base_evaluation`). The trainer writes it to OUTPUT_DIR/gigpo (its iteration and evaluation
    records, at step 0); an evaluation already there is kept.

    It runs in a process of its own, which ends before the runs start: under vLLM colocate the trainer sets up a
    process group (TRL exports MASTER_PORT, 29500 at first) and an engine that holds memory, and in this process both
    would outlive the evaluation, the port passed on to every run (the second one to start died of EADDRINUSE in
    setting G's GPU dry-run) and the engine's memory held while they train."""
    from gigpo_trl.records import read_evaluations

    if read_evaluations(output_dir):
        return output_dir
    process = multiprocessing.get_context("spawn").Process(
        target=_evaluate_before_training, args=(config, model, output_dir, tuple(overrides)))
    process.start()
    process.join()
    if process.exitcode:
        raise RuntimeError(f"the shared evaluation before training failed (exit code {process.exitcode}); "
                           f"its output is above")
    return output_dir


def _evaluate_before_training(config: Path, model: str, output_dir: Path, overrides: tuple[str, ...]) -> None:
    """`evaluate_base`'s evaluation, in the process it starts."""
    from trl import ModelConfig, TrlParser

    from gigpo_trl import GiGPOConfig, GiGPOTrainer, TaskArguments

    os.environ.update(run_environment())
    task_args, args, _ = TrlParser((TaskArguments, GiGPOConfig, ModelConfig)).parse_args_and_config(
        args=["--config", str(config), *overrides, "--output_dir", str(output_dir), "--report_to", "none"])
    train, panel = task_args.datasets(args.env_name, args.env_kwargs)
    if panel is None:
        raise ValueError(f"{config} has no held-out panel (num_eval_tasks 0): there is no evaluation to share")
    trainer = GiGPOTrainer(model, args=args, train_dataset=train, eval_dataset=panel)
    trainer.evaluate()
    trainer.close_environments()


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
              overrides: list[str], jobs: int, resume: bool = False) -> tuple[dict[str, float], dict[str, float]]:
    """Every (method, seed) run, in order, at most `jobs` at once (1: one after the other); returns their wall times and
    their processes' CPU times (user + system) in seconds: on a loaded machine the CPU time of a one-thread run is what
    it would take on a quiet core. A failed run stops the comparison once the runs already started have ended. With
    `resume`, each run goes on from its last checkpoint (`resume_point`), a finished one is skipped, and the times are
    this part's."""
    pending, running, seconds, cpu_seconds = list(runs), {}, {}, {}
    while pending or running:
        while pending and len(running) < jobs:
            key = pending.pop(0)
            checkpoint, finished = resume_point(runs[key]) if resume else (None, False)
            if finished:
                print(f"{key[0]} seed {key[1]}: finished at {checkpoint.name}, not started again", flush=True)
                continue
            running[key] = (time.perf_counter(), checkpoint,
                            start_run(config, model, arms[key[0]], key[1], runs[key], overrides, checkpoint))
        time.sleep(0.2)
        for key, (started, checkpoint, process) in list(running.items()):
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if not pid:
                continue
            del running[key]
            process.returncode = os.waitstatus_to_exitcode(status)
            if process.returncode:
                for _, _, other in running.values():
                    other.wait()
                raise RuntimeError(f"{key[0]} seed {key[1]} failed: see {run_log(runs[key])}")
            name = f"{key[0]} seed {key[1]}"
            seconds[name], cpu_seconds[name] = time.perf_counter() - started, usage.ru_utime + usage.ru_stime
            part = f" (from {checkpoint.name})" if checkpoint else ""
            print(f"{name}{part}: {seconds[name]:.0f} s, CPU {cpu_seconds[name]:.0f} s", flush=True)
    return seconds, cpu_seconds


def detach(output: Path) -> None:
    """This command again, without --detach, in a new process session writing to OUTPUT/learning.log."""
    arguments = [argument for argument in sys.argv[1:] if argument != "--detach"]
    with open(output / "learning.log", "w") as log:
        process = subprocess.Popen([sys.executable, *sys.argv[:1], *arguments], stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    print(f"started in the background (pid {process.pid}); output: {output / 'learning.log'}; collect with "
          f"python research/learning.py --analyze-only --output {output}")


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
