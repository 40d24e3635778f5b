"""Rollouts that run ahead of the update (`async_staleness`): seconds per update, synchronous and with the producer, side
by side in one run, and TRL's own multi-turn trainer on the same environment class beside them.

    python bench/bench_async.py                    # every arm, each in a process of its own, one after the other
    python bench/bench_async.py --arms latency:trl latency:sync latency:1   # some arms of the table
    python bench/bench_async.py --arm quickstart:1 # one arm (its figures as a JSON line)

Two workloads, the embedded SmolLM2-135M-Instruct in both:

- **quickstart**: `recipes/configs/quickstart_cpu.yaml` (TextWorldExpress's "Simon says", 4 tasks x 4 copies, 2 steps),
  synchronous, at staleness 0 and at staleness 1, `--updates` updates each.
- **a service's latency**: `GuessTheNumber` (`environments/guess_number.py`, TRL's environment-class face), each
  episode's start and each guess answered after `--delay` seconds (a session opened with a service, a tool that calls
  it), 4 games x 4 copies, at most 4 turns, TRL's Qwen2.5
  chat template on the embedded model (as `recipes/configs/guess_number_cpu.yaml`): `GRPOTrainer(environment_factory=
  ...)` (TRL's peer: the whole conversation one sample, the same games, copies and turn limit), and `GiGPOTrainer`
  synchronous and at staleness 1.

An arm's seconds per update are the median of the gaps between its updates' ends, the first update left out (it holds
the start); updates per hour follow from them. On two shared cores the producer and the update compete for the same
cores: the figures say what the overlap buys there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from gigpo_trl.environments.guess_number import GuessTheNumber

ROOT = Path(__file__).resolve().parents[1]
DELAY = [0.5]  # seconds a guess waits (--delay)
ARMS = ("quickstart:sync", "quickstart:0", "quickstart:1", "latency:trl", "latency:sync", "latency:1")


class SlowGuess(GuessTheNumber):
    """`GuessTheNumber` whose every reset and every guess waits `DELAY[0]` seconds, as an environment that opens a
    session with a service and a tool that calls it would. The reset's wait is what every episode pays: the base model
    seldom makes a well-formed tool call, so the guesses' waits alone are hardly paid."""

    def reset(self, **kwargs: Any) -> str:
        time.sleep(DELAY[0])
        return super().reset(**kwargs)

    def guess(self, number: int) -> str:
        """Guess the number.

        Args:
            number: Your guess, a whole number.

        Returns:
            Whether the guess is right, too low or too high.
        """
        time.sleep(DELAY[0])
        return super().guess(number)


def run_arm(arm: str, updates: int, delay: float, output: Path) -> dict[str, Any]:
    """Train one arm `updates` updates; its seconds per update (median of the gaps after the first)."""
    from transformers import TrainerCallback  # noqa: PLC0415

    workload, mode = arm.split(":")
    ends: list[float] = []

    class UpdateEnds(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    if workload == "quickstart":
        trainer = _quickstart_trainer(mode, updates, output)
    else:
        DELAY[0] = delay
        trainer = _latency_trainer(mode, updates, output)
    trainer.add_callback(UpdateEnds())
    started = time.perf_counter()
    trainer.train()
    if hasattr(trainer, "close_environments"):
        trainer.close_environments()
    gaps = [later - earlier for earlier, later in zip(ends, ends[1:])]
    seconds = statistics.median(gaps) if gaps else ends[0] - started
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {"arm": arm, "updates": len(ends), "seconds_per_update": seconds, "updates_per_hour": 3600 / seconds,
            "first_update_s": ends[0] - started,
            "staleness_max": [entry.get("async/staleness_max") for entry in logs],
            "trainer_wait_s": [entry.get("async/trainer_wait_s") for entry in logs]}


def _quickstart_trainer(mode: str, updates: int, output: Path):
    from trl import ModelConfig, TrlParser  # noqa: PLC0415

    from gigpo_trl import EMBEDDED_MODEL, GiGPOConfig, GiGPOTrainer, TaskArguments  # noqa: PLC0415

    staleness = [] if mode == "sync" else ["--async_staleness", mode]
    task_args, args, model_args = TrlParser((TaskArguments, GiGPOConfig, ModelConfig)).parse_args_and_config(args=[
        "--config", str(ROOT / "recipes" / "configs" / "quickstart_cpu.yaml"), "--output_dir", str(output),
        "--max_steps", str(updates), "--num_eval_tasks", "0", *staleness])
    train, _ = task_args.datasets(args.env_name, args.env_kwargs)
    return GiGPOTrainer(model_args.model_name_or_path or EMBEDDED_MODEL, args=args, train_dataset=train)


def _latency_trainer(mode: str, updates: int, output: Path):
    import trl.chat_template_utils  # noqa: PLC0415
    from datasets import Dataset  # noqa: PLC0415
    from transformers import AutoTokenizer  # noqa: PLC0415
    from trl import GRPOConfig, GRPOTrainer  # noqa: PLC0415

    from gigpo_trl import EMBEDDED_MODEL, GiGPOConfig, GiGPOTrainer  # noqa: PLC0415
    from gigpo_trl.environments.guess_number import HIGHEST, won  # noqa: PLC0415
    from gigpo_trl.models import resolve_model  # noqa: PLC0415

    model = resolve_model(EMBEDDED_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = trl.chat_template_utils.qwen2_5_chat_template
    prompt = [{"role": "user", "content": f"I am thinking of a whole number from 1 to {HIGHEST}: guess it."}]
    rows = Dataset.from_dict({"prompt": [prompt] * 64})
    shared = dict(output_dir=str(output), per_device_train_batch_size=4, steps_per_generation=4,
                  gradient_accumulation_steps=4, num_generations=4, max_steps=updates, learning_rate=2e-5,
                  temperature=1.0, bf16=False, activation_checkpointing=False, logging_steps=1, save_strategy="no",
                  report_to=[], seed=0)
    if mode == "trl":  # the whole conversation one sample: its answers share TRL's budget of 4 x 32 tokens
        config = GRPOConfig(**shared, max_completion_length=128, max_tool_calling_iterations=3)
        return GRPOTrainer(model, args=config, train_dataset=rows, processing_class=tokenizer,
                           environment_factory=SlowGuess, reward_funcs=[won])
    staleness = {} if mode == "sync" else {"async_staleness": int(mode)}
    config = GiGPOConfig(**shared, max_completion_length=32, max_env_steps=4, history_length="conversation",
                         **staleness)
    return GiGPOTrainer(model, args=config, train_dataset=rows, processing_class=tokenizer,
                        environment_factory=SlowGuess, reward_funcs=[won])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", choices=ARMS, default=None, help="one arm, in this process (its figures as JSON)")
    parser.add_argument("--arms", choices=ARMS, nargs="+", default=list(ARMS), help="the arms of the table (all)")
    parser.add_argument("--updates", type=int, default=4, help="updates an arm trains")
    parser.add_argument("--delay", type=float, default=0.5, help="seconds a guess waits (the latency workload)")
    parser.add_argument("--output", type=Path, default=ROOT / "outputs" / "bench_async")
    options = parser.parse_args(argv)
    if options.arm:
        print(json.dumps(run_arm(options.arm, options.updates, options.delay, options.output / options.arm.replace(":", "-"))))
        return
    print(f"CPU: {_cpu()}\n")
    print("| workload | trainer | seconds per update | updates per hour | first update (with the start) | staleness |")
    print("|---|---|---|---|---|---|")
    for arm in options.arms:
        result = subprocess.run([sys.executable, __file__, "--arm", arm, "--updates", str(options.updates),
                                 "--delay", str(options.delay), "--output", str(options.output)],
                                capture_output=True, text=True, cwd=ROOT, check=True)
        figures = json.loads(result.stdout.strip().splitlines()[-1])
        workload, mode = arm.split(":")
        trainer = {"sync": "GiGPOTrainer, synchronous", "trl": "GRPOTrainer(environment_factory=...)"}.get(
            mode, f"GiGPOTrainer, async_staleness {mode}")
        print(f"| {workload} | {trainer} | {figures['seconds_per_update']:.1f} | {figures['updates_per_hour']:.0f} | "
              f"{figures['first_update_s']:.1f} s | {figures['staleness_max']} |", flush=True)


def _cpu() -> str:
    lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout.splitlines()
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name")), "unknown")
    return f"{model}; {psutil.cpu_count()} cores"


if __name__ == "__main__":
    main()
