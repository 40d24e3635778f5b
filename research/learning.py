"""Does it learn? GiGPO against step-wise GRPO (omega = 0), identical settings, budgets and seeds.

    python research/learning.py                                   # the CPU setting, 3 seeds (about 50 min on 2 cores)
    python research/learning.py --config research/configs/X.yaml --model MODEL   # e.g. a GPU setting
    python research/learning.py --output outputs/learning_100 --max_steps 100   # unknown arguments go to the recipe
    python research/learning.py --reading-probe 250 --output outputs/probe      # can the model read? (no RL)
    python research/learning.py --parallel --detach --config C --model M --output O   # 6 runs at once, in the background
    python research/learning.py --analyze-only --output O                       # collect them (cut-off runs too)
    python research/learning.py --screen C1 C2 ... --model M                    # choose a setting: the base model's numbers
    python research/learning.py --screen C --arms CANDIDATES.yaml --screen-temperatures 0.6 1.0 --screen-update
    python research/learning.py --step-lambda 0.5 ...                           # a third arm: GiGPO at lambda 0.5
    python research/learning.py --shared-base-evaluation --jobs 2 ...          # the panel before training played once
    OMP_NUM_THREADS=1 python research/learning.py --arms ARMS.yaml --jobs 2 ... # named arms, two runs at a time
    python research/learning.py --resume ... (the same command)                # go on with runs stopped part-way

Each (method, seed) run is `recipes/train_gigpo.py --config CONFIG --step_advantage_weight {1, 0} --seed S`, so
both methods share every other setting; `--step-lambda L` adds a third method, GiGPO with the bootstrapped step value
(`--step_advantage_weight 1 --step_advantage_lambda L`, docs/algorithm.md), compared with both. Per-rollout success
rate and return (training rollouts and held-out evaluations) are read from each run's records and written to
OUTPUT/learning_curves.csv, with a plot of the mean and the spread (min-max over seeds) per method in
OUTPUT/learning_curves.png and a summary in OUTPUT/summary.json
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
applies the pre-registered criterion of the settings' pages (research/settings/): decided when one method's final
held-out success is above the other's on every seed. Held-out figures are compared only between runs whose evaluations played the same tasks
(OUTPUT/*/gigpo/evaluations.jsonl name them): where an environment could not start a task, or the panels differ, the
held-out comparison and the decision are refused, naming the runs and the tasks, unless --allow-panel-mismatch.

--screen plays each candidate config's held-out panel greedily with the base model (no training) and one sampled
rollout, and prints what choosing a setting needs: held-out success, the optimal path length (breadth-first),
and the step groups (mean size, singleton share) that the copies of a task form. With --arms, each arm of the file is
a candidate (its arguments added to each config); --screen-temperatures samples a rollout at each temperature (its
success, decisions and prompt tokens per step), --screen-eval-samples K plays the held-out panel again at the
config's temperature, K sampled copies of each task (the evaluation of a run with eval_greedy false and
num_generations_eval K: its success, return spread within task groups, and how often a wasted turn lost the game),
and --screen-update measures the CPU seconds of one training iteration (its rollout and its update) at the config's
own batch.

Rooms diagnostics, in the summary and the plot (settings A and B read them): the share of steps that follow the
draught, the mean advantage of steps that follow it and of those that go against it, and the policy entropy
(from the runs' logs). --reading-probe asks, without RL, whether the model can learn to act on the observation (or,
on rooms without the hint, on its history).
In every setting, per rollout: the step samples played and those the update left out (`gigpo/subsampled_rows`), the
share of task groups whose copies all got the same return, and, where trajectories were logged, the share of steps
that come back to the observation of two steps before (`two_step_loop_share`: a policy without history caught in a
loop). Runs brought back from another machine without their logs take their entropy from the CSV of an analysis made
there (--entropy-from); runs whose records are gone altogether take their rows from an earlier analysis's CSV
(--rows-from), and the summary lists them among the runs whose held-out tasks are not known.

--arms ARMS.yaml replaces GiGPO and GRPO by named arms, each a list of recipe arguments (`read_arms`), compared with
the file's control arm; --jobs N runs N at a time, and each run's CPU time is recorded. On rooms without the hint,
the success per treasure side (from the logged episodes). With a control arm the summary holds setting F's
pre-registered reading (`trap_reading`, research/settings/f_trap_cpu/README.md).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script (python research/learning.py): research.*, bench.update_memory
    sys.path.insert(0, str(ROOT))

from gigpo_trl.records import read_trajectories  # noqa: E402
from research.analysis import (  # noqa: E402
    PANEL_FLAG,
    curve_mean_rows,
    curves,
    cut_at_common_evaluation,
    draught_advantages,
    draught_steps,
    earlier_entropy,
    earlier_rows,
    held_out_panels,
    panel_resolution,
    plot,
    shortest_move_advantages,
    shortest_moves,
    step_credit_reading,
    summary,
    with_base_evaluation,
    won_decisions,
)
from research.probes import reading_probe, screen, warm_up_format  # noqa: E402
from research.runs import (  # noqa: E402
    BASE_FOLDER,
    check_memory_plan,
    detach,
    evaluate_base,
    lambda_of_runs,
    methods,
    read_arms,
    recipe_value,
    run_directory,
    train_all,
)

EMBEDDED = "embedded:SmolLM2-135M-Instruct"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--config", type=Path, default=ROOT / "research" / "configs" / "learning_rooms_cpu.yaml")
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
    parser.add_argument("--rows-from", type=Path, default=None, metavar="CSV",
                        help="with --analyze-only: the rows of runs that have no records in OUTPUT (lost with a machine) "
                        "from an earlier analysis's learning_curves.csv")
    parser.add_argument(PANEL_FLAG, action="store_true",
                        help="compare held-out figures even of runs whose evaluations did not play the same tasks (an "
                        "environment that could not start, another panel); the summary says which (held_out_panels)")
    at_once = parser.add_mutually_exclusive_group()
    at_once.add_argument("--parallel", action="store_true", help="start every run at once (one process each)")
    at_once.add_argument("--jobs", type=int, default=1, metavar="N", help="at most N runs at once, in order (default 1; "
                         "on a few CPU cores with OMP_NUM_THREADS=1, one run a core)")
    parser.add_argument("--detach", action="store_true", help="run in a new process session, output to OUTPUT/learning.log")
    parser.add_argument("--resume", action="store_true", help="go on with the runs already in --output: each from its "
                        "last checkpoint (its records continue from there), a finished one not started again, one "
                        "without a checkpoint afresh")
    parser.add_argument("--shared-base-evaluation", action="store_true",
                        help="evaluate the model once before any run (OUTPUT/base) instead of once per run: runs from "
                        "the same weights get the same greedy figure on the same panel; the analysis takes it as every "
                        "run's step 0")
    parser.add_argument("--cut-at-common-evaluation", action="store_true",
                        help="compare the runs up to the last held-out evaluation every run reached (the budget rule "
                        "of runs stopped at a fixed time); the summary says the step (cut_at_step)")
    parser.add_argument("--screen-tasks", type=int, nargs=3, default=[32, 4, 8], metavar=("EVAL", "SAMPLED", "COPIES"),
                        help="--screen's held-out tasks, sampled tasks and copies per sampled task")
    parser.add_argument("--screen-temperatures", type=float, nargs="+", default=[], metavar="T",
                        help="--screen's sampled rollout at each of these temperatures (default: the config's)")
    parser.add_argument("--screen-eval-samples", type=int, default=0, metavar="K",
                        help="--screen also plays the held-out panel at the config's temperature, K sampled copies of "
                        "each task, through the trainer's evaluation (eval_greedy false, num_generations_eval K), with "
                        "what its wasted turns cost (research.probes.sampled_panel)")
    parser.add_argument("--screen-update", action="store_true",
                        help="--screen also measures the CPU seconds of one training iteration at the config's batch")
    args, overrides = parser.parse_known_args()  # the rest goes to the recipe, e.g. --max_steps 100
    if args.screen_eval_samples < 0 or args.screen_eval_samples == 1:
        parser.error(f"--screen-eval-samples takes 0 (none) or K >= 2 copies a task, got {args.screen_eval_samples}")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.rows_from is not None and not args.analyze_only:
        parser.error("--rows-from completes an analysis of runs whose records are gone: use it with --analyze-only")
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
                args.screen_temperatures, args.screen_update,
                args.output / "records" / f"{config.stem}-{len(results)}", args.screen_eval_samples))
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
    model = args.model
    if model is None and not args.analyze_only:
        # One warmed model starts every arm: on prompts of the longest history any arm shows.
        history = max(int(recipe_value(arguments, "history_length") or settings.get("history_length", 2))
                      for arguments in ([*arm, *overrides] for arm in arms.values()))
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
    base = args.output / BASE_FOLDER
    if args.shared_base_evaluation and not args.analyze_only:
        evaluate_base(args.config, model, base, overrides)
        overrides = [*overrides, "--evaluate_before_training", "false"]
    seconds, cpu_seconds = ({}, {}) if args.analyze_only else train_all(
        runs, arms, args.config, model, overrides, jobs, args.resume)
    trajectories = {run: read_trajectories(output_dir) for run, output_dir in runs.items()}  # each run's read once
    hint_steps = {run: draught_steps(episodes) for run, episodes in trajectories.items()}
    rows = curves(runs, hint_steps, trajectories, earlier_entropy(args.entropy_from) if args.entropy_from else {},
                  settings)
    panels = held_out_panels(runs)
    if args.rows_from:
        rows, taken = earlier_rows(args.rows_from, rows, list(runs))
        for run in taken:  # the tasks of their evaluations went with their records
            panels[run] = {row["step"]: None for row in rows if (row["method"], row["seed"]) == run and row["mode"] == "eval"}
        print(f"rows from {args.rows_from}: {', '.join(f'{method} seed {seed}' for method, seed in taken) or 'no run'}",
              flush=True)
    if (base / "gigpo" / "evaluations.jsonl").is_file():  # the shared evaluation before training: every run's step 0
        base_run = {("base", 0): base}
        rows, panels = with_base_evaluation(rows, curves(base_run, {("base", 0): []}, {("base", 0): {}}, {}, settings),
                                            panels, held_out_panels(base_run)[("base", 0)])
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
    if cut_at_step is not None:
        panels = {run: {step: tasks for step, tasks in by_step.items() if step <= cut_at_step} for run, by_step in panels.items()}
    result = summary(rows, args.seeds, list(arms), panels, args.allow_panel_mismatch, control) | {
        "wall_seconds": seconds, "cpu_seconds": cpu_seconds} | ({"cut_at_step": cut_at_step} if cut_at_step is not None else {})
    advantages = {f"{method} seed {seed}": draught_advantages(hint_steps[method, seed]) for method, seed in runs}
    if all(advantages.values()):
        result["advantage_by_draught"] = advantages
    if settings["env_name"] == "compass":  # setting H's readings (research/settings/h_step_credit/README.md)
        greedy = settings.get("eval_greedy", False)
        if greedy:
            result["step_credit_reading"] = step_credit_reading(rows, settings["num_eval_tasks"])
        else:  # setting I's: a sampled panel, the reversal tolerance its resolution, and the curve's mean read too
            tolerance = panel_resolution(settings["num_eval_tasks"], settings["num_generations_eval"], greedy=False)
            result["panel_resolution"] = tolerance
            result["step_credit_reading"] = step_credit_reading(rows, settings["num_eval_tasks"], tolerance=tolerance)
            result["step_credit_reading_curve_mean"] = step_credit_reading(
                curve_mean_rows(rows), settings["num_eval_tasks"], tolerance=tolerance)
        result["advantage_by_shortest_move"] = {f"{method} seed {seed}": shortest_move_advantages(
            shortest_moves(trajectories[method, seed])) for method, seed in runs}
        result["won_decisions"] = {f"{method} seed {seed}": won_decisions(trajectories[method, seed])
                                   for method, seed in runs} | {"base": won_decisions(read_trajectories(base))}
    (args.output / "summary.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
