"""Step credit without the representation problem: GiGPO against step-wise GRPO with a tabular policy.

    python research/credit_tabular.py                 # all variants, the settings of research/configs/learning_rooms_cpu.yaml
    python research/credit_tabular.py --variants adam --seeds 50
    python research/credit_tabular.py --lambdas 0.5   # a third method: GiGPO with the bootstrapped step value at 0.5

The language-model comparison (research/learning.py) mixes two questions: does GiGPO's advantage give a better
learning signal, and can the policy represent "act on what the observation says"? This diagnostic removes the
second. The policy is a softmax table with one row of logits per observation text, so it can follow any
observation from the first update. Everything else is the project's: the environment and its settings come from the
recipe config (env, tasks per rollout, copies, max steps, gamma, norm, episode statistics), and the advantages are
`compute_gigpo_advantages` with omega = 1 (GiGPO) or 0 (step-wise GRPO), and with `--lambdas` GiGPO with the
bootstrapped step value of docs/algorithm.md (`step_lambda`). The update follows the policy gradient of
the mean over step rows of A * log pi(a | observation), one step per rollout, the same for both methods.

GiGPO's advantage A_E + A_S has a larger scale than A_E alone (1.4-3.9x the standard deviation in rooms), so at one
learning rate plain gradient steps are also larger for GiGPO. The variants separate that from the direction of the
credit: "sgd" (raw advantages), "sgd-unit-std" (advantages divided by their standard deviation over the rollout:
equal step sizes, only the direction differs) and "adam" (per-parameter normalized steps, as the trainer's AdamW).

Reported per variant, learning rate and method, over seeds: the training (sampled) success rate of the last 5
iterations, the first iteration at which the seed-mean training success (trailing mean of 5) reaches 0.5 and 0.9,
the first at which GiGPO's reaches the baseline's final value, and the mean episode length of the last 5. Per seed
(`per_seed`): the first iteration whose trailing mean of 5 reaches each success target (`--targets`; never: counted
as the number of iterations) and the final success (mean of the last 10), summarized by mean, std, median and
min-max, and paired with GiGPO at lambda 1 and with step-wise GRPO on the same seeds (the same task draws at the
first iteration): the mean difference with a 95% bootstrap interval over seeds, and on how many seeds each is ahead.
Greedy success is not reported: a table solves both task kinds greedily as soon as every row tilts the right way,
after a handful of updates with either method. One comparison (a variant, a learning rate, 20 seeds x 2 methods)
takes 10-60 s on one core.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np

from gigpo_trl.advantages import compute_gigpo_advantages
from gigpo_trl.envs import INFO_ADMISSIBLE_ACTIONS, INFO_ANCHOR, INFO_WON, make_env

ROOT = Path(__file__).resolve().parent.parent
PAPER, BASELINE = "GiGPO", "GRPO (omega=0)"


def methods(lambdas: tuple[float, ...] = ()) -> dict[str, tuple[float, float]]:
    """The compared methods as (omega, lambda): GiGPO, step-wise GRPO, and GiGPO at each bootstrapped lambda."""
    return {PAPER: (1.0, 1.0), BASELINE: (0.0, 1.0), **{f"GiGPO lambda {lam:g}": (1.0, lam) for lam in lambdas}}


VARIANTS = {  # name: (optimizer, divide the advantages by their std, learning rates)
    "sgd": ("sgd", False, (0.3, 1.0, 3.0)),
    "sgd-unit-std": ("sgd", True, (0.3, 1.0, 3.0)),
    "adam": ("adam", False, (0.01, 0.03, 0.1)),
}
ADAM_BETAS, ADAM_EPSILON = (0.9, 0.999), 1e-8  # torch.optim.AdamW's defaults (TRL trains without weight decay)


class TabularPolicy:
    """pi(a | observation) = softmax(logits[observation]); unseen observations start uniform (logits 0).

    `optimizer` is "sgd" (logits += lr * gradient) or "adam" (Adam with bias correction; like torch, every row of
    the table takes a step each update, a zero gradient for rows absent from the batch).
    """

    def __init__(self, num_actions: int, optimizer: str = "sgd", learning_rate: float = 1.0):
        if optimizer not in ("sgd", "adam"):
            raise ValueError(f"optimizer must be 'sgd' or 'adam', got {optimizer!r}")
        self.num_actions, self.optimizer, self.learning_rate = num_actions, optimizer, learning_rate
        self.logits: dict[str, np.ndarray] = {}
        self._moments: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._updates = 0

    def probabilities(self, observation: str) -> np.ndarray:
        logits = self.logits.setdefault(observation, np.zeros(self.num_actions))
        exp = np.exp(logits - logits.max())
        return exp / exp.sum()

    def gradient(self, observations: list[str], actions: list[int], advantages: np.ndarray) -> dict[str, np.ndarray]:
        """d/dlogits of mean_t A_t * log pi(a_t | o_t), with d log pi(a | o) / dlogits[o] = onehot(a) - pi(. | o)."""
        gradients = {observation: np.zeros(self.num_actions) for observation in observations}
        for observation, action, advantage in zip(observations, actions, advantages):
            gradients[observation] -= advantage * self.probabilities(observation) / len(actions)
            gradients[observation][action] += advantage / len(actions)
        return gradients

    def update(self, observations: list[str], actions: list[int], advantages: np.ndarray) -> None:
        """One ascent step on mean_t A_t * log pi(a_t | o_t)."""
        gradients = self.gradient(observations, actions, advantages)
        if self.optimizer == "sgd":
            for observation, gradient in gradients.items():
                self.logits[observation] += self.learning_rate * gradient
            return
        self._updates += 1
        (beta1, beta2), t = ADAM_BETAS, self._updates
        for observation in self.logits:
            gradient = gradients.get(observation, np.zeros(self.num_actions))
            first, second = self._moments.get(observation, (np.zeros(self.num_actions), np.zeros(self.num_actions)))
            first, second = beta1 * first + (1 - beta1) * gradient, beta2 * second + (1 - beta2) * gradient**2
            self._moments[observation] = (first, second)
            step = (first / (1 - beta1**t)) / (np.sqrt(second / (1 - beta2**t)) + ADAM_EPSILON)
            self.logits[observation] += self.learning_rate * step


def play(env, policy: TabularPolicy, seed: int, max_steps: int, draw: random.Random) -> list[dict]:
    """One episode of sampled actions; returns its step rows."""
    observation, info = env.reset(seed=seed)
    rows = []
    for step in range(max_steps):
        actions = info[INFO_ADMISSIBLE_ACTIONS]
        probabilities = policy.probabilities(observation)
        action = draw.choices(range(len(actions)), weights=probabilities)[0]
        anchor = info[INFO_ANCHOR]
        next_observation, reward, terminated, truncated, info = env.step(actions[action])
        rows.append({"observation": observation, "action": action, "anchor": anchor, "reward": reward, "step": step,
                     "won": bool(info[INFO_WON])})
        observation = next_observation
        if terminated or truncated:
            break
    return rows


def train(settings: dict, omega: float, variant: str, learning_rate: float, seed: int,
          iterations: int, step_lambda: float = 1.0) -> tuple[list[float], list[float], float]:
    """One run: the training success rate and mean episode length of every iteration, and the mean over iterations
    of the advantages' std."""
    optimizer, unit_std, _ = VARIANTS[variant]
    env = make_env(settings["env_name"], **(settings.get("env_kwargs") or {}))
    _, info = env.reset(seed=0)
    policy = TabularPolicy(len(info[INFO_ADMISSIBLE_ACTIONS]), optimizer, learning_rate)
    copies = settings["num_generations"]
    tasks_per_rollout = settings["per_device_train_batch_size"] // copies
    draw = random.Random(seed)
    success, length, advantage_std = [], [], []
    for _ in range(iterations):
        rows, won = [], []
        for group in range(tasks_per_rollout):
            task_seed = draw.randrange(10**6)
            for copy in range(copies):
                episode = play(env, policy, task_seed, settings["max_env_steps"], draw)
                won.append(episode[-1]["won"])
                rows += [row | {"group": group, "trajectory": (group, copy)} for row in episode]
        result = compute_gigpo_advantages(
            rewards=[r["reward"] for r in rows], group_ids=[r["group"] for r in rows],
            trajectory_ids=[r["trajectory"] for r in rows], step_indices=[r["step"] for r in rows],
            anchor_keys=[r["anchor"] for r in rows], gamma=settings["gamma"], step_weight=omega,
            norm=settings["advantage_norm"], episode_stats=settings["episode_stats"], step_lambda=step_lambda,
        )
        advantages = result.advantages / (result.advantages.std() + 1e-6) if unit_std else result.advantages
        policy.update([r["observation"] for r in rows], [r["action"] for r in rows], advantages)
        success.append(float(np.mean(won)))
        length.append(len(rows) / len(won))
        advantage_std.append(float(result.advantages.std()))
    return success, length, float(np.mean(advantage_std))


def trailing_mean(values: np.ndarray, window: int = 5) -> np.ndarray:
    return np.array([values[max(0, k - window + 1) : k + 1].mean() for k in range(len(values))])


def compare(settings: dict, variant: str, learning_rate: float, seeds: int, iterations: int,
            lambdas: tuple[float, ...] = (), targets: tuple[float, ...] = (0.5, 0.9)) -> dict:
    """Every method over the same seeds (the same task draws at iteration 0); summary over seeds."""
    arms = methods(lambdas)
    results = {method: [train(settings, omega, variant, learning_rate, seed, iterations, step_lambda)
                        for seed in range(seeds)] for method, (omega, step_lambda) in arms.items()}
    curves = {method: [success for success, _, _ in runs] for method, runs in results.items()}
    mean = {method: trailing_mean(np.mean(runs, axis=0)) for method, runs in curves.items()}
    reached = np.flatnonzero(mean[PAPER] >= mean[BASELINE][-1])
    summary = {"env_kwargs": settings.get("env_kwargs"), "max_env_steps": settings["max_env_steps"], "variant": variant,
               "learning_rate": learning_rate, "seeds": seeds, "iterations": iterations}
    for method, runs in curves.items():
        final = np.array([np.mean(run[-5:]) for run in runs])
        summary[method] = {
            "train_success_last5_mean": float(final.mean()),
            "train_success_last5_min_max": [float(final.min()), float(final.max())],
            "train_success_at_iterations_10_25_50": [float(mean[method][k]) for k in (9, 24, 49) if k < iterations],
            "episode_length_last5_mean": float(np.mean([np.mean(length[-5:]) for _, length, _ in results[method]])),
            "advantage_std_mean": float(np.mean([std for _, _, std in results[method]])),
            # When the baseline saturates early, "reaches the baseline's final value" says little: also compare
            # how many iterations each method needs to reach fixed success levels.
            "first_iteration_mean_success_at_least": {
                level: next((k for k, value in enumerate(mean[method]) if value >= level), None) for level in (0.5, 0.9)
            },
        }
    summary["gigpo_reaches_baseline_final_at_iteration"] = int(reached[0]) if reached.size else None
    summary["baseline_last_iteration"] = iterations - 1
    summary["per_seed"] = per_seed_summary(curves, iterations, targets)
    return summary


def per_seed_summary(curves: dict[str, list[list[float]]], iterations: int, targets: tuple[float, ...]) -> dict:
    """Per method, from each seed's own curve: the first iteration whose trailing mean of 5 reaches each target
    (`iterations` when it never does, and how often that happened) and the final success (mean of the last 10); each
    summarized over seeds and paired, seed by seed, with GiGPO at lambda 1 and with step-wise GRPO."""
    figures = {method: {"final_success": np.array([np.mean(run[-10:]) for run in runs]),
                        **{f"iterations_to_{target:g}": np.array([first_at(trailing_mean(np.array(run)), target, iterations)
                                                                  for run in runs]) for target in targets}}
               for method, runs in curves.items()}
    summary: dict = {}
    for method, measures in figures.items():
        summary[method] = {}
        for name, values in measures.items():
            summary[method][name] = spread(values)
            if name.startswith("iterations_to_"):
                summary[method][name]["never_reached"] = int((values >= iterations).sum())
            for against in (PAPER, BASELINE):
                if against != method:
                    summary[method][name][f"minus {against}"] = paired_difference(values - figures[against][name],
                                                                                   higher_is_better=name == "final_success")
    return summary


def first_at(curve: np.ndarray, target: float, never: int) -> int:
    """The first index at which `curve` is at least `target`; `never` if none."""
    reached = np.flatnonzero(curve >= target)
    return int(reached[0]) if reached.size else never


def spread(values: np.ndarray) -> dict[str, float]:
    """Mean, standard deviation (ddof 1), median and min-max of per-seed values."""
    return {"mean": float(values.mean()), "std": float(values.std(ddof=1)) if values.size > 1 else 0.0,
            "median": float(np.median(values)), "min": float(values.min()), "max": float(values.max())}


def paired_difference(differences: np.ndarray, higher_is_better: bool, draws: int = 10_000) -> dict:
    """The mean of per-seed differences, its 95% bootstrap interval over seeds (percentiles of `draws` resamples,
    a fixed generator), and on how many seeds the difference is favourable, unfavourable or zero."""
    rng = np.random.default_rng(0)
    means = differences[rng.integers(0, differences.size, (draws, differences.size))].mean(axis=1)
    favourable = differences > 0 if higher_is_better else differences < 0
    return {"mean": float(differences.mean()), "ci95": [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))],
            "seeds_ahead": int(favourable.sum()), "seeds_behind": int((differences != 0).sum() - favourable.sum()),
            "seeds_equal": int((differences == 0).sum())}


def table(summary: dict) -> str:
    """One comparison's per-seed figures in markdown: per method the final success and the iterations to each target
    (mean +- std, median, min-max, seeds that never reached it), and the paired difference from GiGPO at lambda 1."""
    per_seed = summary["per_seed"]
    names = list(next(iter(per_seed.values())))
    lines = [f"**{summary['variant']}, lr {summary['learning_rate']:g}**, {summary['seeds']} seeds x "
             f"{summary['iterations']} iterations ({summary['env_kwargs']}, {summary['max_env_steps']} steps)", "",
             "| method | " + " | ".join(name.replace("_", " ") for name in names) + " |", "|---" * (len(names) + 1) + "|"]

    def cell(figures: dict, name: str) -> str:
        text = (f"{figures['mean']:.3g} +- {figures['std']:.2g} (median {figures['median']:.3g}, "
                f"{figures['min']:.3g} to {figures['max']:.3g})")
        if figures.get("never_reached"):
            text += f", never {figures['never_reached']}"
        paired = figures.get(f"minus {PAPER}")
        if paired:
            text += (f"; vs GiGPO {paired['mean']:+.3g} [{paired['ci95'][0]:+.3g}, {paired['ci95'][1]:+.3g}], ahead on "
                     f"{paired['seeds_ahead']}, behind on {paired['seeds_behind']}")
        return text

    for method, figures in per_seed.items():
        lines.append(f"| {method} | " + " | ".join(cell(figures[name], name) for name in names) + " |")
    return "\n".join(lines)


def json_object(text: str) -> dict:
    """argparse type: a JSON object (the environment's keyword arguments)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object of keyword arguments, got {text!r}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "research" / "configs" / "learning_rooms_cpu.yaml")
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--env-kwargs", type=json_object, default=None, help='JSON, replaces the config\'s env_kwargs, '
                        'e.g. \'{"num_rooms": 21}\'')
    parser.add_argument("--max-env-steps", type=int, default=None, help="replaces the config's max_env_steps")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--learning-rates", type=float, nargs="+", default=None,
                        help="replaces each variant's three learning rates")
    parser.add_argument("--lambdas", type=float, nargs="*", default=[],
                        help="add GiGPO with the bootstrapped step value at each lambda in [0, 1)")
    parser.add_argument("--targets", type=float, nargs="+", default=[0.5, 0.9],
                        help="training success levels whose first iteration is reported per seed")
    parser.add_argument("--output", type=Path, default=None, help="also write the summaries to this JSON file")
    parser.add_argument("--report-only", type=Path, metavar="JSON", help="print the tables of an --output file again")
    args = parser.parse_args()
    if args.report_only:
        for summary in json.loads(args.report_only.read_text()):
            print(table(summary) + "\n")
        return
    if any(not 0.0 <= lam < 1.0 for lam in args.lambdas):
        parser.error(f"every --lambdas value must be in [0, 1) (lambda 1 is the GiGPO arm), got {args.lambdas}")
    import yaml

    settings = yaml.safe_load(args.config.read_text())
    if args.env_kwargs is not None:
        settings["env_kwargs"] = args.env_kwargs
    if args.max_env_steps is not None:
        settings["max_env_steps"] = args.max_env_steps
    summaries = []
    for variant in args.variants:
        for learning_rate in args.learning_rates or VARIANTS[variant][2]:
            summaries.append(compare(settings, variant, learning_rate, args.seeds, args.iterations,
                                     tuple(args.lambdas), tuple(args.targets)))
            print(table(summaries[-1]) + "\n", flush=True)
            if args.output:  # after each comparison: a cut-off run keeps what it did
                args.output.write_text(json.dumps(summaries, indent=2))


if __name__ == "__main__":
    main()
