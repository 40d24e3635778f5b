"""fp32 against bf16 autocast on CPU: a recipe trained both ways, side by side in one run.

    python bench/cpu_precision.py                                   # the quickstart, seeds 0 and 1 (about 30 min)
    python bench/cpu_precision.py --config CONFIG --seeds 0 1 2 --output outputs/cpu_precision.json
    python bench/cpu_precision.py --kernels                         # the model's passes alone (about 2.5 min)

Each run is the recipe's own command (`recipes/train_gigpo.py --config CONFIG --seed S`) in a fresh process, with
`--bf16 false` (fp32) or `--bf16 true --use_cpu true` (transformers' bf16 autocast on CPU; the weights and the
optimizer stay fp32), one precision after the other for each seed, so that both see the same machine. For every run it
reports the training time (the Trainer's `train_runtime`, the held-out evaluations excluded), the time per iteration
and the held-out success before and after training, as the recipe prints them; then the mean per precision and the
ratio of training times. The CPU's bf16 support is printed first: bf16 autocast is fast only on CPUs with bf16
instructions (AVX-512 BF16 or AMX on x86).

`--kernels` answers the same question in minutes on a new machine, without training: the embedded SmolLM2's
forward+backward pass over 8 x 256 tokens and a greedy generation of 12 tokens after 16 prompts of 200 tokens, in
fp32 and under bf16 autocast, alternated, `--repeats` times each after one warm-up of each.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "train_gigpo.py"
PRECISIONS = {"fp32": ["--bf16", "false"], "bf16": ["--bf16", "true", "--use_cpu", "true"]}
PANEL = re.compile(r"Held-out success rate \(\d+ tasks\): ([0-9.]+)% before training -> ([0-9.]+)% after")
RUNTIME = re.compile(r"'train_runtime': '([0-9.]+)'")
DEFAULT_MODEL = "embedded:SmolLM2-135M-Instruct"  # the model --kernels times


def cpu_bf16_support() -> dict[str, bool | str]:
    import torch

    return {"avx512_bf16": torch.cpu._is_avx512_bf16_supported(), "amx": torch.cpu._is_amx_tile_supported(),
            "capability": torch.backends.cpu.get_cpu_capability()}


def run_recipe(config: str, seed: int, precision: str, output_dir: Path, max_steps: int | None) -> dict:
    """One recipe run; its outcome as the recipe printed it."""
    command = [sys.executable, str(RECIPE), "--config", config, "--seed", str(seed), "--output_dir", str(output_dir),
               *PRECISIONS[precision], *(["--max_steps", str(max_steps)] if max_steps else [])]
    started = time.perf_counter()
    finished = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - started
    output = finished.stdout + finished.stderr
    panel, runtime = PANEL.search(output), RUNTIME.search(output)
    if finished.returncode != 0 or panel is None or runtime is None:
        raise RuntimeError(f"{' '.join(command)} failed (exit code {finished.returncode}):\n{output[-3000:]}")
    steps = max_steps or _config_max_steps(config)
    return {"precision": precision, "seed": seed, "seconds": seconds, "train_runtime_s": float(runtime.group(1)),
            "seconds_per_iteration": float(runtime.group(1)) / steps,
            "success_before": float(panel.group(1)) / 100, "success_after": float(panel.group(2)) / 100}


def _config_max_steps(config: str) -> int:
    import yaml

    return int(yaml.safe_load(Path(config).read_text())["max_steps"])


def time_kernels(repeats: int, model_name: str = DEFAULT_MODEL) -> dict[str, dict[str, list[float]]]:
    """Seconds of each pass of the model in each precision, the precisions alternated: {pass: {precision:
    [seconds, ...]}}."""
    import torch
    from transformers import AutoModelForCausalLM

    from gigpo_trl.models import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model(model_name), dtype=torch.float32)
    tokens = torch.randint(0, model.config.vocab_size, (16, 256), generator=torch.Generator().manual_seed(0))

    def forward_backward() -> None:  # 8 x 256 tokens
        model(tokens[:8], labels=tokens[:8]).loss.backward()
        model.zero_grad()

    def generate() -> None:  # 16 prompts of 200 tokens, 12 new tokens each
        with torch.no_grad():
            model.generate(tokens[:, :200], max_new_tokens=12, do_sample=False, pad_token_id=0)

    def timed(run: Callable[[], None], precision: str) -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            started = time.perf_counter()
            run()
            return time.perf_counter() - started

    seconds: dict[str, dict[str, list[float]]] = {}
    for name, run in (("forward_backward_8x256", forward_backward), ("generate_16x200_plus_12", generate)):
        seconds[name] = {precision: [] for precision in PRECISIONS}
        for precision in PRECISIONS:  # one warm-up of each, not kept
            timed(run, precision)
        for _ in range(repeats):
            for precision in PRECISIONS:
                seconds[name][precision].append(timed(run, precision))
            print(f"{name}: " + ", ".join(f"{p} {seconds[name][p][-1]:.2f} s" for p in PRECISIONS), flush=True)
    return seconds


def summary(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Mean training time, time per iteration and held-out success of each precision, over its runs."""
    by_precision: dict[str, dict[str, float]] = {}
    for precision in PRECISIONS:
        mine = [run for run in runs if run["precision"] == precision]
        by_precision[precision] = {key: sum(run[key] for run in mine) / len(mine)
                                   for key in ("train_runtime_s", "seconds_per_iteration", "success_before", "success_after")}
    return by_precision


def compare_kernels(repeats: int, model_name: str) -> dict:
    seconds = time_kernels(repeats, model_name)
    ratios = {name: statistics.median(by["bf16"]) / statistics.median(by["fp32"]) for name, by in seconds.items()}
    for name, ratio in ratios.items():
        print(f"{name}: bf16 / fp32 median time {ratio:.2f}x")
    return {"kernel_seconds": seconds, "bf16_over_fp32_median_time": ratios}


def compare_training(args: argparse.Namespace) -> dict:
    runs = []
    for seed in args.seeds:
        for precision in PRECISIONS:
            run = run_recipe(args.config, seed, precision, args.output.parent / f"cpu_precision_{precision}_seed{seed}",
                             args.max_steps)
            runs.append(run)
            print(f"seed {seed} {precision}: training {run['train_runtime_s']:.0f} s ({run['seconds_per_iteration']:.1f} s "
                  f"an iteration), held-out success {run['success_before']:.0%} -> {run['success_after']:.0%}", flush=True)
    means = summary(runs)
    for precision, mean in means.items():
        print(f"{precision}: training {mean['train_runtime_s']:.0f} s on average, held-out success "
              f"{mean['success_before']:.0%} -> {mean['success_after']:.0%}")
    ratio = means["bf16"]["train_runtime_s"] / means["fp32"]["train_runtime_s"]
    print(f"bf16 / fp32 training time: {ratio:.2f}x")
    return {"config": args.config, "runs": runs, "means": means, "bf16_over_fp32_time": ratio}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "recipes" / "configs" / "quickstart_cpu.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--max-steps", type=int, default=None, help="override the config's max_steps (a quick check)")
    parser.add_argument("--output", type=Path, default=ROOT / "outputs" / "cpu_precision.json")
    parser.add_argument("--kernels", action="store_true", help="time the model's passes alone instead of training")
    parser.add_argument("--repeats", type=int, default=3, help="with --kernels: timed repetitions of each pass")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="with --kernels: the model whose passes are timed")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")

    support = cpu_bf16_support()
    print(f"CPU bf16 support: {support}", flush=True)
    result = {"cpu": support, **(compare_kernels(args.repeats, args.model) if args.kernels else compare_training(args))}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
