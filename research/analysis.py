"""The analysis of a learning comparison, from the records its runs wrote: one row of curves per (arm, seed, rollout)
with the rooms and loop diagnostics, the plot, the summary, the pre-registered decision rules (`decision`, setting F's
`trap_reading`), the budget rule of runs stopped at a fixed time (`cut_at_common_evaluation`) and the check that
held-out figures compare the same tasks (`held_out_panels`, `panel_differences`)."""

from __future__ import annotations

import ast
import csv
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gigpo_trl.records import read_evaluations, read_iterations
from research.probes import draught_move
from research.runs import BASELINE, PAPER, RESUME_MARK, run_log


SUCCESS_TARGETS = (0.5, 0.8)  # training success (trailing mean of 5) whose first iteration is reported per seed
PANEL_FLAG = "--allow-panel-mismatch"
# Per (method, seed) run: per evaluation step, the held-out tasks played (None: not recorded).
Panels = dict[tuple[str, int], dict[int, frozenset[str] | None]]


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


COMPASS_DIRECTIONS = ("north", "south", "east", "west")


def shortest_moves(trajectories: dict[str, list[dict]]) -> list[tuple[tuple, bool, dict]]:
    """Compass diagnostic (setting H): every recorded training step as (its state: the rollout, the task's seed and the
    observation; whether its action is a shortest-path move, one of the directions the observation names; the step
    record). Every other answer (a move away, a bump, an idle action, an answer naming no move) wastes the turn. Empty
    outside compass."""
    return [((int(name.split("-")[1]), episode["seed"], step["observation"]),
             step["action"] in {f"go {d}" for d in COMPASS_DIRECTIONS if d in step["observation"].rstrip(".").split()},
             step)
            for name, episodes in trajectories.items() if name.startswith("train-")
            for episode in episodes for step in episode["steps"]
            if step["observation"].startswith(("The exit is ", "Go "))]


def shortest_move_advantages(steps: list[tuple[tuple, bool, dict]]) -> dict[str, float] | None:
    """Setting H's mechanism reading: in each state where the copies of a task took both a shortest-path move and a
    wasted turn (`shortest_moves`), the mean advantage of each kind; the difference (shortest minus wasted) averaged
    over those states, for the advantage the loss used and for its episode and step terms apart, and in units of the
    standard deviation of every recorded step's advantage. None where no state holds both kinds."""
    by_state: dict[tuple, dict[bool, list[dict]]] = {}
    for state, shortest, step in steps:
        by_state.setdefault(state, {True: [], False: []})[shortest].append(step)
    compared = [kinds for kinds in by_state.values() if kinds[True] and kinds[False]]
    if not compared:
        return None
    gaps = {field: float(np.mean([np.mean([s[field] for s in kinds[True]]) - np.mean([s[field] for s in kinds[False]])
                                  for kinds in compared]))
            for field in ("advantage", "episode_advantage", "step_advantage")}
    spread = float(np.std([step["advantage"] for _, _, step in steps]))
    return {"gap": gaps["advantage"], "gap_in_std": gaps["advantage"] / spread if spread else float("nan"),
            "episode_term_gap": gaps["episode_advantage"], "step_term_gap": gaps["step_advantage"],
            "states": len(compared), "steps": sum(len(kinds[True]) + len(kinds[False]) for kinds in compared),
            "shortest_share": float(np.mean([shortest for _, shortest, _ in steps]))}


def won_decisions(trajectories: dict[str, list[dict]]) -> dict[str, float]:
    """Per recorded evaluation (`eval-00000`, ...), the mean decisions of its won episodes (NaN if none won)."""
    return {name: float(np.mean(lengths)) if lengths else float("nan")
            for name, episodes in trajectories.items() if name.startswith("eval-")
            for lengths in [[episode["length"] for episode in episodes if episode["won"]]]}


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
    (`{'loss': ..., 'entropy': ...}`, one per update with logging_steps 1). Where a resumed part begins (a line
    RESUME_MARK + "checkpoint-N"), the updates after the N the checkpoint holds are dropped: the part plays them
    again."""
    entropies = []
    for line in log_path.read_text().splitlines():
        if line.startswith(RESUME_MARK):
            del entropies[int(line.removeprefix(RESUME_MARK).split("-")[-1]):]
        for match in re.finditer(r"\{'loss': [^}]*\}", line):
            entropies.append(float(ast.literal_eval(match.group(0))["entropy"]))
    return entropies


def read_curves(curves_csv: Path, column: str | None = None) -> list[dict]:
    """The rows of an earlier analysis's learning_curves.csv typed as `curves` makes them (method and mode strings, seed
    and step integers, every other column a float); refused unless it has those four columns and `column`."""
    with open(curves_csv, newline="") as file:
        reader = csv.DictReader(file)
        required = {"method", "seed", "mode", "step"} | ({column} if column else set())
        if not required <= set(reader.fieldnames or ()):
            raise ValueError(f"{curves_csv} is not a learning_curves.csv{f' with an {column} column' if column else ''} "
                             f"(its columns: {reader.fieldnames})")
        return [{name: value if name in ("method", "mode") else int(value) if name in ("seed", "step") else float(value)
                 for name, value in row.items()} for row in reader]


def earlier_entropy(curves_csv: Path) -> dict[tuple[str, int], dict[int, float]]:
    """{(method, seed): {step: entropy}} of the training rows of an earlier analysis's learning_curves.csv."""
    entropy: dict[tuple[str, int], dict[int, float]] = {}
    for row in read_curves(curves_csv, "entropy"):
        if row["mode"] == "train":
            entropy.setdefault((row["method"], row["seed"]), {})[row["step"]] = row["entropy"]
    return entropy


def earlier_rows(curves_csv: Path, rows: list[dict], runs: Sequence[tuple[str, int]]) -> tuple[list[dict], list[tuple[str, int]]]:
    """`rows` with, for each of `runs` that has none (its records are gone: another machine, a deleted folder), its
    rows of an earlier analysis's learning_curves.csv; and the runs so taken. Their held-out tasks are not known."""
    lost = set(runs) - {(row["method"], row["seed"]) for row in rows}
    earlier = [row for row in read_curves(curves_csv) if (row["method"], row["seed"]) in lost]
    taken = sorted({(row["method"], row["seed"]) for row in earlier})
    return rows + earlier, taken


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
# The loop metrics (loops/*) a row holds; reversal_share is in records of before 2026-11-27 only.
LOOP_COLUMNS = ("revisit_share", "stay_share", "turn_back_share", "reversal_share", "cycle_end_share",
                "distinct_states_mean")


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
                # states, and in records written before they were logged (reversal_share: in those written before
                # stay_share and turn_back_share replaced it).
                **{name: metrics.get(f"loops/{name}", float("nan")) for name in LOOP_COLUMNS},
                "group_return_std": metrics.get("env/group_return_std", float("nan")),
                **diagnostics.get((record["mode"], record["rollout"]), missing),
            })
    return pooled_evaluations(rows, {run: read_evaluations(output_dir) for run, output_dir in runs.items()
                                     if (output_dir / "gigpo" / "iterations.jsonl").is_file()})


POOLED_COLUMNS = {"success_rate": "env/success_rate", "return_mean": "env/return_mean",
                  "episode_length": "env/episode_length_mean"}


def pooled_evaluations(rows: list[dict], evaluations: dict[tuple[str, int], list[dict]]) -> list[dict]:
    """The rows with each held-out evaluation as one row: an evaluation played in several batches (a panel larger
    than `per_device_eval_batch_size`) writes an iteration record per batch. Its success rate, return and episode
    length are the whole panel's (the run's evaluation record, every episode of every batch); the other columns the
    mean over its batches."""
    pooled, batches = [], {}
    for row in rows:
        if row["mode"] != "eval":
            pooled.append(row)
            continue
        key = (row["method"], row["seed"], row["step"])
        if key not in batches:
            batches[key] = []
            pooled.append(key)  # the evaluation's place among the rows
        batches[key].append(row)
    panels = {(method, seed, record["step"]): record["metrics"]
              for (method, seed), records in evaluations.items() for record in records}
    for k, item in enumerate(pooled):
        if isinstance(item, tuple):
            parts = batches[item]
            row = {name: value if not isinstance(value, float) else float(np.mean([part[name] for part in parts]))
                   for name, value in parts[0].items()}
            row.update({column: panels[item][name] for column, name in POOLED_COLUMNS.items() if item in panels})
            pooled[k] = row
    return pooled


def mean_curve(rows: list[dict], method: str, mode: str, field: str) -> tuple[np.ndarray, np.ndarray]:
    """Steps and the per-seed values (seeds x steps, seeds in increasing order) of one method's curve (last record per
    step and seed)."""
    by_seed: dict[int, dict[int, float]] = {}
    for row in rows:
        if row["method"] == method and row["mode"] == mode:
            by_seed.setdefault(row["seed"], {})[row["step"]] = row.get(field, float("nan"))
    steps = sorted(set.intersection(*(set(values) for values in by_seed.values())))
    return np.array(steps), np.array([[by_seed[seed][s] for s in steps] for seed in sorted(by_seed)])


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
        panels.append(("train", "revisit_share", "Steps into a state visited before (revisits)"))
        if all(np.isnan(row["turn_back_share"]) for row in rows):  # records of before 2026-11-27
            panels.append(("train", "reversal_share", "Steps back to the state of two states before"))
        else:
            panels += [("train", "stay_share", "Steps that stay in their state"),
                       ("train", "turn_back_share", "Steps straight back to the state they came from")]
        panels.append(("train", "distinct_states_mean", "Distinct states per episode"))
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
    if any(r["mode"] == "eval" for r in rows):
        result["learning_reading"] = learning_reading(rows, arms)
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
                      "equal_return_groups", "nonzero_advantage_share", "two_step_loop_share", *LOOP_COLUMNS,
                      *DIAGNOSTIC_COLUMNS):
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


# The trap-and-escape rule of setting F (research/settings/f_trap_cpu/README.md), fixed before its full run. Windows:
# the first and the last TRAP_WINDOW training updates of each run. Side-balanced success: the mean of the success
# rates of the tasks whose treasure is west and east (rooms without the hint; the plain success rate elsewhere). No
# policy of the current observation alone beats MEMORYLESS_CEILING there (setting F's page).
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
    """The pre-registered criterion (the settings' pages, e.g. research/settings/d_coin_gpu/README.md): decided when
    one method's final held-out success is above the other's on every seed (each run's last evaluation); otherwise
    undecided. Refused when those last evaluations did not all play the same tasks (`panels`, see `panel_differences`), unless `allow_panel_mismatch`: then it says so."""
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


def with_base_evaluation(rows: list[dict], base_rows: list[dict], panels: Panels,
                         base_panel: dict[int, frozenset[str] | None]) -> tuple[list[dict], Panels]:
    """Each run's curves and panels with the shared evaluation before training (`research.runs.evaluate_base`) as its
    evaluation at step 0, where the run made none there itself."""
    base = [row for row in base_rows if row["mode"] == "eval" and row["step"] == 0]
    runs = sorted({(row["method"], row["seed"]) for row in rows})
    merged, panels = list(rows), {run: dict(by_step) for run, by_step in panels.items()}
    for method, seed in runs:
        if not any(r["mode"] == "eval" and r["step"] == 0 and (r["method"], r["seed"]) == (method, seed) for r in rows):
            merged += [row | {"method": method, "seed": seed} for row in base]
            if 0 in base_panel:
                panels.setdefault((method, seed), {})[0] = base_panel[0]
    return merged, panels


LEARNS_FACTOR = 2.0  # setting G: an arm learns on a seed when its final held-out success is at least twice ...
LEARNS_MARGIN = 0.20  # ... and at least 20 points above its success before training


def learning_reading(rows: list[dict], arms: Sequence[str]) -> dict:
    """Setting G's pre-registered rule (research/settings/g_simonsays/README.md): an arm learns when, on every seed, its
    final held-out success (the run's last evaluation) is at least LEARNS_FACTOR times its held-out success before
    training (its evaluation at step 0) and at least LEARNS_MARGIN above it. Per arm: per seed the two figures and
    whether the seed meets the rule, and the verdict."""
    result = {}
    for method in arms:
        evaluations: dict[int, dict[int, float]] = {}
        for row in rows:
            if row["method"] == method and row["mode"] == "eval":
                evaluations.setdefault(row["seed"], {})[row["step"]] = row["success_rate"]
        seeds = {}
        for seed, by_step in sorted(evaluations.items()):
            if 0 not in by_step or max(by_step) == 0:
                seeds[seed] = {"before": by_step.get(0), "final": None, "learns": None}
                continue
            before, final = by_step[0], by_step[max(by_step)]
            seeds[seed] = {"before": before, "final": final, "final_step": max(by_step),
                           # rounded: success rates are fractions of the panel (0.1 + 0.2 > 0.3 in floating point)
                           "learns": round(final - LEARNS_FACTOR * before, 9) >= 0
                           and round(final - before, 9) >= LEARNS_MARGIN}
        if not seeds or any(seed["learns"] is None for seed in seeds.values()):
            verdict = "not readable: a run lacks its evaluation before training or after it"
        elif all(seed["learns"] for seed in seeds.values()):
            verdict = f"learns on every seed ({len(seeds)})"
        else:
            short = [str(seed) for seed, figures in seeds.items() if not figures["learns"]]
            verdict = f"does not learn: the rule fails on seed(s) {', '.join(short)} of {len(seeds)}"
        result[method] = {"seeds": seeds, "verdict": verdict}
    return result


def panel_resolution(panel_tasks: int, copies: int = 1, greedy: bool = True) -> float:
    """The reversal tolerance of `step_credit_reading`: for a greedy panel, one of its `panel_tasks` tasks (setting
    H's); for a sampled one (`copies` episodes of each task), the standard error of its success rate where every task
    is won half the time, its largest: 0.5 / sqrt(panel_tasks x copies) (setting I's,
    research/settings/i_wasted_turns/README.md)."""
    return 1.0 / panel_tasks if greedy else 0.5 / float(np.sqrt(panel_tasks * copies))


def curve_mean_rows(rows: list[dict]) -> list[dict]:
    """One evaluation row per run whose success rate is the mean of the run's held-out evaluations after training
    began (step > 0): how soon it learns, as a row `step_credit_reading` reads as each run's final figure."""
    by_run: dict[tuple[str, int], list[float]] = {}
    for row in rows:
        if row["mode"] == "eval" and row["step"] > 0:
            by_run.setdefault((row["method"], row["seed"]), []).append(row["success_rate"])
    return [{"method": method, "seed": seed, "mode": "eval", "step": 1, "success_rate": float(np.mean(values))}
            for (method, seed), values in by_run.items()]


def step_credit_reading(rows: list[dict], panel_tasks: int, first: str = PAPER, second: str = BASELINE,
                        tolerance: float | None = None) -> dict:
    """Setting H's pre-registered rule (research/settings/h_step_credit/README.md): `first` beats `second` when its
    final held-out success (each run's last evaluation) is above on every seed, or when the mean difference over seeds
    exceeds twice its standard error (sample standard deviation over the square root of the seeds) with no seed
    reversed by more than `tolerance` (None: one task of the `panel_tasks`-task panel, H's; setting I's sampled panel
    takes `panel_resolution`). Both directions are read; per seed the figures."""
    final: dict[str, dict[int, float]] = {first: {}, second: {}}
    for row in sorted((r for r in rows if r["mode"] == "eval" and r["method"] in final and r["step"] > 0),
                      key=lambda r: r["step"]):
        final[row["method"]][row["seed"]] = row["success_rate"]
    seeds = sorted(set(final[first]) & set(final[second]))
    if len(seeds) < 2:
        return {"seeds": seeds, "verdict": "not readable: fewer than 2 seeds with both arms' final evaluation"}
    differences = np.array([final[first][seed] - final[second][seed] for seed in seeds])
    mean, standard_error = float(differences.mean()), float(differences.std(ddof=1) / np.sqrt(len(seeds)))
    verdict, allowed = "neither beats the other", 1.0 / panel_tasks if tolerance is None else tolerance
    for better, worse, sign in ((first, second, 1.0), (second, first, -1.0)):
        gains = sign * differences
        if (gains > 0).all():
            verdict = f"{better} beats {worse}: above on every seed ({len(seeds)})"
        elif sign * mean > 2 * standard_error and gains.min() >= -allowed - 1e-9:
            verdict = (f"{better} beats {worse}: mean difference {sign * mean:+.3f} above twice its standard error "
                       f"({standard_error:.3f}), no seed reversed by more than "
                       + ("one panel task" if tolerance is None else f"the panel's resolution ({tolerance:.3f})"))
    return {"seeds": seeds, "final": {method: [final[method][seed] for seed in seeds] for method in final},
            "difference_mean": mean, "difference_standard_error": standard_error, "verdict": verdict}


def cut_at_common_evaluation(rows: list[dict]) -> tuple[list[dict], int]:
    """The budget rule of the GPU settings (research/settings/d2_coin_gpu_recipe/README.md): runs stopped at a fixed time are
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
