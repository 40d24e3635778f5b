"""fp32 against bf16 autocast on CPU: a recipe trained both ways, side by side in one run.

    python bench/cpu_precision.py                                   # the quickstart, seeds 0 and 1 (about 30 min)
    python bench/cpu_precision.py --config CONFIG --seeds 0 1 2 --output outputs/cpu_precision.json

Each run is the recipe's own command (`recipes/train_gigpo.py --config CONFIG --seed S`) in a fresh process, with
`--bf16 false` (fp32) or `--bf16 true --use_cpu true` (transformers' bf16 autocast on CPU; the weights and the
optimizer stay fp32), one precision after the other for each seed, so that both see the same machine. For every run it
reports the training time (the Trainer's `train_runtime`, the held-out evaluations excluded), the time per iteration
and the held-out success before and after training, as the recipe prints them; then the mean per precision and the
ratio of training times. The CPU's bf16 support is printed first: bf16 autocast is fast only on CPUs with bf16
instructions (AVX-512 BF16 or AMX on x86).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "train_gigpo.py"
PRECISIONS = {"fp32": ["--bf16", "false"], "bf16": ["--bf16", "true", "--use_cpu", "true"]}
PANEL = re.compile(r"Held-out success rate \(\d+ tasks\): ([0-9.]+)% before training -> ([0-9.]+)% after")
RUNTIME = re.compile(r"'train_runtime': '([0-9.]+)'")


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


def summary(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Mean training time, time per iteration and held-out success of each precision, over its runs."""
    by_precision: dict[str, dict[str, float]] = {}
    for precision in PRECISIONS:
        mine = [run for run in runs if run["precision"] == precision]
        by_precision[precision] = {key: sum(run[key] for run in mine) / len(mine)
                                   for key in ("train_runtime_s", "seconds_per_iteration", "success_before", "success_after")}
    return by_precision


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "recipes" / "configs" / "quickstart_cpu.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--max-steps", type=int, default=None, help="override the config's max_steps (a quick check)")
    parser.add_argument("--output", type=Path, default=ROOT / "outputs" / "cpu_precision.json")
    args = parser.parse_args(argv)

    support = cpu_bf16_support()
    print(f"CPU bf16 support: {support}", flush=True)
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
    result = {"config": args.config, "cpu": support, "runs": runs, "means": means, "bf16_over_fp32_time": ratio}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
