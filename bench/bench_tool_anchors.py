"""Step groups of a TRL environment class under each anchor choice, side by side in one run.

    python bench/bench_tool_anchors.py                 # 16 games x 8 copies, 5 rollouts (a few seconds)

The environment is the recipe's `GuessTheNumber` (gigpo_trl.environments.guess_number), played through
`TRLEnvironment` and the real rollout loop by a scripted player (no model): each turn it calls `guess` with a number
drawn uniformly from the interval the hints so far leave (a random but sensible player; each copy draws its own).
The same games and the same guesses are anchored twice: "state" (the default: the game's public plain-data
attributes, here the secret, the interval and the end flags) and "tool_calls" (the calls made so far). Printed per
choice: step groups per rollout, their mean size, the share of singletons (steps whose step advantage is 0), and the
share of steps with a nonzero step advantage.
"""

from __future__ import annotations

import argparse
import json
import random
import re

import numpy as np

from gigpo_trl.advantages import compute_gigpo_advantages
from gigpo_trl.dialogue import Completion
from gigpo_trl.env_pool import EnvPool
from gigpo_trl.environments.guess_number import HIGHEST, GuessTheNumber, won
from gigpo_trl.parsing import ParsedAction
from gigpo_trl.rollout import collect_rollout
from gigpo_trl.tasks import row_tasks
from gigpo_trl.trl_environment import ToolCallDialogue, TRLEnvironment

HINT = re.compile(r"(\d+) is too (low|high)")


class ScriptedGuesses(ToolCallDialogue):
    """The recipe's prompts and tools; the reply is the scripted player's tool call (its text is the call's JSON)."""

    def read(self, completion, start, current) -> ParsedAction:
        return ParsedAction(completion.text, valid=True)


def guesser(seed: int):
    """The scripted player: a guess drawn from the interval the hints leave, from a generator of its own."""
    draw = random.Random(seed)

    def generate(prompts, tools):
        completions = []
        for prompt in prompts:
            low, high = 1, HIGHEST
            for message in prompt:
                hint = HINT.match(str(message["content"])) if message["role"] == "tool" else None
                if hint:
                    number = int(hint.group(1))
                    low, high = (max(low, number + 1), high) if hint.group(2) == "low" else (low, min(high, number - 1))
            call = {"type": "function", "function": {"name": "guess", "arguments": {"number": draw.randint(low, high)}}}
            completions.append(Completion([0], [0], json.dumps({"role": "assistant", "content": "", "tool_calls": [call]})))
        return completions

    return generate


def step_groups(anchor: str, tasks, group_size: int, turns: int, seed: int) -> dict[str, float]:
    with EnvPool(lambda: TRLEnvironment(GuessTheNumber, reward_funcs=[won], anchor=anchor, max_steps=turns),
                 len(tasks), group_size, processes=False) as pool:
        rollout = collect_rollout(pool, tasks, guesser(seed), max_env_steps=turns,
                                  dialogue=ScriptedGuesses(None, history_length=turns), show_progress=False)
    steps = rollout.steps
    stats = compute_gigpo_advantages(steps.reward, steps.group, steps.trajectory, steps.step, steps.anchor).stats
    return {"steps": stats.num_rows, "step_groups": stats.num_step_groups, "mean_size": stats.step_group_size_mean,
            "singleton_share": stats.singleton_share, "nonzero_step_advantage_share": stats.nonzero_step_advantage_share,
            "won": float(np.mean([e.won for e in rollout.episodes]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--games", type=int, default=16)
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--rollouts", type=int, default=5)
    options = parser.parse_args()

    prompt = [{"role": "user", "content": "New game."}]
    rows = [{"prompt": prompt, "game": game} for game in range(options.games) for _ in range(options.copies)]
    print(f"GuessTheNumber, {options.games} games x {options.copies} copies, at most {options.turns} turns, "
          f"{options.rollouts} rollouts (means over rollouts)")
    for anchor in ("state", "tool_calls"):
        results = [step_groups(anchor, row_tasks(rows, options.copies, salt=str(rollout)), options.copies,
                               options.turns, seed=rollout) for rollout in range(options.rollouts)]
        mean = {name: float(np.mean([r[name] for r in results])) for name in results[0]}
        print(f"  anchor {anchor:10s}: {mean['steps']:6.1f} steps, {mean['step_groups']:6.1f} step groups, mean size "
              f"{mean['mean_size']:.2f}, singletons {mean['singleton_share']:.0%}, nonzero step advantage "
              f"{mean['nonzero_step_advantage_share']:.0%} of steps, games won {mean['won']:.0%}")


if __name__ == "__main__":
    main()
