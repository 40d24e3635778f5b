"""Does it learn? GiGPO against step-wise GRPO (omega = 0), identical settings, budgets and seeds.

    python bench/learning.py                                   # the CPU setting, 3 seeds (about 20 min on 2 cores)
    python bench/learning.py --config recipes/configs/X.yaml --model MODEL   # e.g. a GPU setting

Each (method, seed) run is `recipes/train_gigpo.py --config CONFIG --step_advantage_weight {1, 0} --seed S`, so
both methods share every other setting. Per-rollout success rate and return (training rollouts and held-out
evaluations) are read from each run's records and written to OUTPUT/learning_curves.csv, with a plot of the mean
and the spread (min-max over seeds) per method in OUTPUT/learning_curves.png and a summary in OUTPUT/summary.json.

Without --model, the policy is a tiny transformer built locally (gigpo_trl.models.build_tiny_model) and given a
short supervised warm-up on the answer FORMAT only: for prompts of random states, the target is
"<action>k</action>" with k drawn uniformly among the admissible actions, so it starts as a uniformly random
policy that answers well-formed, with no knowledge of the task.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from gigpo_trl.records import read_iterations, read_trajectories

ROOT = Path(__file__).resolve().parent.parent
METHODS = {"GiGPO": 1.0, "GRPO (omega=0)": 0.0}


def warm_up_format(output_dir: Path, env_name: str, env_kwargs: dict, template_name: str, seed: int = 0,
                   steps: int = 300, batch_size: int = 16) -> Path:
    """Build the tiny model and teach it the answer format only (uniformly random well-formed answers)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gigpo_trl.envs import make_env
    from gigpo_trl.models import build_tiny_model
    from gigpo_trl.prompts import build_messages, load_template

    if (output_dir / "config.json").is_file():
        return output_dir
    build_tiny_model(output_dir, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    model = AutoModelForCausalLM.from_pretrained(output_dir)
    template, env, draw = load_template(template_name), make_env(env_name, **env_kwargs), random.Random(seed)
    torch.manual_seed(seed)

    def example() -> tuple[list[int], list[int]]:
        observation, info = env.reset(seed=draw.randrange(10**6))
        for _ in range(draw.randrange(6)):  # a few random moves: prompts of various states
            observation, _, done, _, info = env.step(draw.choice(info["admissible_actions"]))
            if done:
                break
        messages = build_messages(observation, task=info.get("task"), admissible_actions=info["admissible_actions"],
                                  template=template)
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        answer = tokenizer(f"<action>{draw.randint(1, len(info['admissible_actions']))}</action>",
                           add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return list(prompt), answer

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for _ in range(steps):
        pairs = [example() for _ in range(batch_size)]
        length = max(len(p) + len(a) for p, a in pairs)
        ids = torch.full((batch_size, length), tokenizer.pad_token_id)
        labels = torch.full((batch_size, length), -100)
        mask = torch.zeros((batch_size, length), dtype=torch.long)
        for row, (prompt, answer) in enumerate(pairs):
            sequence = prompt + answer
            ids[row, : len(sequence)] = torch.tensor(sequence)
            labels[row, len(prompt) : len(sequence)] = torch.tensor(answer)
            mask[row, : len(sequence)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print(f"format warm-up: {steps} steps, final loss {loss.item():.3f}")
    model.save_pretrained(output_dir)
    return output_dir


def run(config: Path, model: str, omega: float, seed: int, output_dir: Path, overrides: list[str]) -> float:
    """One training run through the recipe; returns its wall time in seconds."""
    command = [sys.executable, str(ROOT / "recipes" / "train_gigpo.py"), "--config", str(config),
               "--model_name_or_path", model, "--step_advantage_weight", str(omega), "--seed", str(seed),
               "--output_dir", str(output_dir), *overrides]
    started = time.perf_counter()
    with open(output_dir.with_suffix(".log"), "w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - started


def draught_following(output_dir: Path) -> dict[int, float]:
    """Rooms diagnostic: per training rollout, the share of sampled steps whose action goes the way the draught
    blows (0.5 for a policy that ignores it, 1 for the optimal one), from the recorded sample episodes."""
    shares = {}
    for name, episodes in read_trajectories(output_dir).items():
        mode, rollout = name.split("-")
        steps = [step for episode in episodes for step in episode["steps"] if "draught blows" in step["observation"]]
        if mode == "train" and steps:
            follows = [step["action"] == "go " + step["observation"].rsplit(" ", 1)[-1].rstrip(".") for step in steps]
            shares[int(rollout)] = sum(follows) / len(follows)
    return shares


def curves(runs: dict[tuple[str, int], Path]) -> list[dict]:
    """One row per (method, seed, rollout): step, mode, success rate, return, step-group statistics, timings."""
    rows = []
    for (method, seed), output_dir in runs.items():
        following = draught_following(output_dir)
        for record in read_iterations(output_dir):
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

    figure = Figure(figsize=(13, 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    panels = [("train", "success_rate", "Training rollouts: success rate"),
              ("eval", "success_rate", "Held-out tasks (greedy): success rate"),
              ("train", "return_mean", "Training rollouts: mean return")]
    if not all(np.isnan(row["draught_following"]) for row in rows):  # rooms: what the policy learned
        panels[2] = ("train", "draught_following", "Steps that follow the draught (rooms)")
    for axes, (mode, field, title) in zip(figure.subplots(1, 3), panels):
        for method in METHODS:
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


def summary(rows: list[dict], seeds: list[int]) -> dict:
    """Final success rates and when GiGPO reaches the baseline's final success (mean over seeds)."""
    result = {"seeds": seeds}
    baseline, gigpo = list(METHODS)[1], list(METHODS)[0]
    for mode in ("train", "eval"):
        steps, base = mean_curve(rows, baseline, mode, "success_rate")
        _, ours = mean_curve(rows, gigpo, mode, "success_rate")
        window = 5 if mode == "train" else 1  # training curves are noisy: compare trailing means
        base_mean, ours_mean = _trailing_mean(base.mean(0), window), _trailing_mean(ours.mean(0), window)
        target = base_mean[-1]
        reached = np.flatnonzero(ours_mean >= target)
        result[mode] = {
            "final_success": {gigpo: float(ours_mean[-1]), baseline: float(target)},
            "final_success_per_seed": {gigpo: ours[:, -1].tolist(), baseline: base[:, -1].tolist()},
            "gigpo_reaches_baseline_final_at_step": int(steps[reached[0]]) if reached.size else None,
            "baseline_steps": int(steps[-1]),
            "trailing_window": window,
        }
    train = [r for r in rows if r["mode"] == "train"]
    for method in METHODS:
        mine = [r for r in train if r["method"] == method]
        result.setdefault("per_iteration", {})[method] = {
            name: float(np.nanmean([r[name] for r in mine]))
            for name in ("rollout_s", "update_s", "advantages_s", "singleton_share", "step_group_size_mean", "episode_length")
        }
        by_window = [r["draught_following"] for r in sorted(mine, key=lambda r: (r["seed"], r["step"]))]
        result.setdefault("draught_following_first_last_20", {})[method] = {
            "first_20_iterations": float(np.nanmean([r["draught_following"] for r in mine if r["step"] < 20])),
            "last_20_iterations": float(np.nanmean([r["draught_following"] for r in mine if r["step"] >= max(r2["step"] for r2 in mine) - 19])),
        } if not np.all(np.isnan(by_window)) else None
    return result


def _trailing_mean(values: np.ndarray, window: int) -> np.ndarray:
    return np.array([values[max(0, k - window + 1) : k + 1].mean() for k in range(len(values))])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "recipes" / "configs" / "learning_rooms_cpu.yaml")
    parser.add_argument("--model", default=None, help="model id or folder (default: the format-warmed tiny model)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--output", type=Path, default=ROOT / "outputs" / "learning")
    parser.add_argument("--analyze-only", action="store_true", help="skip training: redo the CSV, plot and summary "
                        "from the runs already in --output")
    parser.add_argument("overrides", nargs="*", help="extra recipe arguments, e.g. --max_steps 20")
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    import yaml

    settings = yaml.safe_load(args.config.read_text())
    runs = {(method, seed): args.output / f"{'gigpo' if omega else 'grpo'}-seed{seed}"
            for seed in args.seeds for method, omega in METHODS.items()}
    seconds = {}
    if not args.analyze_only:
        model = args.model or str(warm_up_format(args.output / "warm-tiny-model", settings["env_name"],
                                                 settings.get("env_kwargs") or {}, settings["prompt_template"]))
        for (method, seed), output_dir in runs.items():
            seconds[f"{method} seed {seed}"] = run(args.config, model, METHODS[method], seed, output_dir, args.overrides)
            print(f"{method:16s} seed {seed}: {seconds[f'{method} seed {seed}']:.0f} s", flush=True)
    rows = curves(runs)
    with open(args.output / "learning_curves.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, args.output / "learning_curves.png")
    result = summary(rows, args.seeds) | {"wall_seconds": seconds}
    (args.output / "summary.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
