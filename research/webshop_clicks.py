"""Setting K's reading of WebShop's results pages (research/settings/k_webshop/README.md): the clicks on products,
whether each could win, and whether GiGPO's step advantage ranks the winning clicks of a results page above the losing
ones (the paper's case study).

A run's sample episodes (`OUTPUT_DIR/gigpo/trajectories/*.json`, written for every episode when `log_trajectories` is
at least the rollout's episodes) hold each step's observation, action and step advantage. A results-page step is one
whose observation is a results page and whose action clicks a product the page shows; the click *can win* when buying that product
(with the goal's options where it offers them) scores WebShop's reward of exactly 1.0 for the episode's goal (its task
seed, on the run's shop). A results-page step group is the steps of one task group taken on the same page (the same
observation text: the instruction, the search and the page number, so the same products in the same order); it is
*mixed* when it holds a click that can win and one that cannot.

    python research/webshop_clicks.py OUTPUT_DIR [--env-kwargs JSON] [--mode train|eval]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import re
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gigpo_trl.environments.webshop import WebShopEnv, purchase_reward  # noqa: E402
from gigpo_trl.records import read_trajectories  # noqa: E402

RESULTS_PAGE = re.compile(r"\[SEP\] Page \d+ \(Total results: \d+\)")
PRODUCT_CLICK = re.compile(r"click\[(b0[0-9a-z]{8})\]")


@functools.cache
def _shop(env_kwargs: str) -> WebShopEnv:
    return WebShopEnv(**json.loads(env_kwargs))


def can_win(env_kwargs: Mapping[str, Any], seed: int, asin: str) -> bool:
    """Whether buying product `asin` can score 1.0 for the goal of task `seed` on the shop of `env_kwargs` (the best of
    its option choices)."""
    shop = _shop(json.dumps(dict(env_kwargs), sort_keys=True))
    catalogue = shop.catalogue
    goal, product = catalogue.goal_of(seed), catalogue.products[asin.upper()]
    choices = [dict(zip(product.options, values)) for values in itertools.product(*product.options.values())] or [{}]
    return any(purchase_reward(product, catalogue.prices[product.asin], chosen, goal).reward == 1.0 for chosen in choices)


def results_page_clicks(episodes: Sequence[dict[str, Any]], env_kwargs: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every product click on a results page of a rollout's episodes: its task group, page, whether it can win, its step
    advantage and the episode's outcome."""
    clicks = []
    for episode in episodes:
        for step in episode["steps"]:
            clicked = PRODUCT_CLICK.fullmatch(step["action"])  # a product the page shows (not one it does not: a no-op)
            if clicked and RESULTS_PAGE.search(step["observation"]) and clicked.group(1).upper() in step["observation"]:
                clicks.append({"group": episode["group"], "page": step["observation"], "seed": episode["seed"],
                               "wins": can_win(env_kwargs, episode["seed"], clicked.group(1)),
                               "step_advantage": step["step_advantage"], "won": bool(episode["won"])})
    return clicks


def click_figures(clicks: Sequence[dict[str, Any]]) -> dict[str, float | int | None]:
    """What the clicks say: how many, the share that can win, the mixed results-page step groups (a click that can win
    and one that cannot), and of those the share where a click that can win holds the group's highest step advantage
    (alone or tied with other winning clicks only), and the share where every winning click is above every losing
    one."""
    groups = defaultdict(list)
    for click in clicks:
        groups[(click["group"], click["page"])].append(click)
    mixed = [members for members in groups.values() if len({click["wins"] for click in members}) == 2]
    top = ranked = 0
    for members in mixed:
        best = max(click["step_advantage"] for click in members)
        top += all(click["wins"] for click in members if click["step_advantage"] == best)
        ranked += min(c["step_advantage"] for c in members if c["wins"]) > max(c["step_advantage"] for c in members
                                                                              if not c["wins"])
    return {"clicks": len(clicks), "winning_click_share": sum(c["wins"] for c in clicks) / len(clicks) if clicks else None,
            "results_page_groups": len(groups), "mixed_groups": len(mixed),
            "winning_click_on_top_share": top / len(mixed) if mixed else None,
            "winning_clicks_above_losing_share": ranked / len(mixed) if mixed else None}


def run_figures(output_dir: str | Path, env_kwargs: Mapping[str, Any], mode: str = "train",
                rollouts: slice = slice(None)) -> dict[str, float | int | None]:
    """`click_figures` of a run's recorded rollouts of `mode` (those of `rollouts`, in order)."""
    recorded = sorted((name, episodes) for name, episodes in read_trajectories(output_dir).items()
                      if name.startswith(f"{mode}-"))
    return click_figures([click for _, episodes in recorded[rollouts]
                          for click in results_page_clicks(episodes, env_kwargs)])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--env-kwargs", default="{}", help="the run's env_kwargs (JSON)")
    parser.add_argument("--mode", default="train", choices=("train", "eval"))
    args = parser.parse_args(argv)
    print(json.dumps(run_figures(args.output_dir, json.loads(args.env_kwargs), args.mode), indent=2))


if __name__ == "__main__":
    main()
