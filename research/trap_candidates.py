"""Setting F's screen of candidate games for the format-warmed tiny model (research/settings/f_trap_cpu/README.md),
without RL:

    python research/trap_candidates.py research/configs/learning_trap_cpu.yaml research/configs/screens/trap_coin6_from3.yaml \
        --model outputs/warm-trap-model

Per config: the prompt length in the tiny model's tokens without history and with the last 2 steps, and the CPU time
of one forward and backward pass over 16 such prompts (one thread, as the runs use; the update's cost grows with it);
then, on the config's first 16 training tasks x 8 copies within its step limit, their optimal path (breadth-first),
and the success rate and the loop metrics (`gigpo_trl.loops` on the anchors, as training logs them) of a uniformly
random policy (what the format warm-up starts from), of one that always answers the same number (3, or the last
listed action: what a policy that collapsed without reading does) and, on rooms without the hint, of the policy that
remembers its last move (`memory_action`, its first move west).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script (python research/trap_candidates.py): research.probes
    sys.path.insert(0, str(ROOT))

from gigpo_trl.envs import anchor_of, make_env  # noqa: E402
from gigpo_trl.loops import LoopCounts, episode_loops  # noqa: E402
from gigpo_trl.shortest_paths import shortest_path_length  # noqa: E402
from research.probes import memory_action, state_prompts, supervised_step  # noqa: E402


def prompt_cost(settings: dict, tokenizer, model, history_length: int = 2, batch: int = 16) -> dict:
    """Prompt tokens (mean, max) and CPU seconds of a forward and backward pass over `batch` prompts, per history."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    prompts = state_prompts(settings["env_name"], settings.get("env_kwargs") or {}, settings["prompt_template"],
                            tokenizer, random.Random(0), history_length)
    shown = {0: [], history_length: []}
    while min(len(prompts_of) for prompts_of in shown.values()) < 4 * batch:
        prompt, _, _, history = next(prompts)
        if len(history) in shown and len(shown[len(history)]) < 4 * batch:
            shown[len(history)].append((prompt, 1))
    result = {}
    for history, pairs in shown.items():
        started = time.process_time()
        for k in range(4):
            supervised_step(model, tokenizer, pairs[k * batch:(k + 1) * batch], optimizer)
        lengths = [len(prompt) for prompt, _ in pairs]
        result[f"history {history}"] = {"prompt_tokens_mean": statistics.mean(lengths), "prompt_tokens_max": max(lengths),
                                        "cpu_s_per_pass_of_16": (time.process_time() - started) / 4}
    return result


def scripted_policies(settings: dict, tasks: int = 16, copies: int = 8) -> dict:
    """The first tasks' optimal path, and the success rate and loops of the scripted policies on them."""
    from gigpo_trl import TaskArguments

    names = ("num_train_tasks", "min_optimal_steps", "max_optimal_steps")
    task_args = TaskArguments(**{name: settings[name] for name in names if name in settings} | {"num_train_tasks": tasks})
    seeds = task_args.seeds(settings["env_name"], "train", tasks, settings.get("env_kwargs") or {})
    env_kwargs = settings.get("env_kwargs") or {}
    env, draw = make_env(settings["env_name"], **env_kwargs), random.Random(0)
    optimal = [shortest_path_length(env, seed, settings["max_env_steps"]) for seed in seeds]
    result: dict = {"optimal_path_mean": statistics.mean(optimal), "optimal_path_min": min(optimal)}
    policies = ["uniformly random", "always the number 3"]
    if settings["env_name"] == "rooms" and env_kwargs.get("hint") is False:
        policies.append("keeps its last move, turns at the wall")
    for policy in policies:
        wins, episodes = 0, []
        for seed in seeds:
            for _ in range(copies):
                observation, info = env.reset(seed=seed)
                states, terminated, history = [anchor_of(observation, info)], False, [("", "go west")]
                for _ in range(settings["max_env_steps"]):
                    actions = info["admissible_actions"]
                    if policy == "uniformly random":
                        action = draw.choice(actions)
                    elif policy == "always the number 3":
                        action = actions[min(2, len(actions) - 1)]
                    else:
                        action = actions[memory_action(observation, actions, history, env_kwargs["num_rooms"]) - 1]
                    history.append((observation, action))
                    observation, _, terminated, _, info = env.step(action)
                    states.append(anchor_of(observation, info))
                    if terminated:
                        break
                wins += bool(info.get("won"))
                episodes.append(episode_loops(states, terminated=terminated))
        result[policy] = {"success": wins / len(episodes), **LoopCounts.of(episodes).as_metrics()}
    env.close()
    return result


def main() -> None:
    import torch
    import yaml
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", type=Path, nargs="+")
    parser.add_argument("--model", required=True, help="the format-warmed tiny model (research/learning.py builds it)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer, model = AutoTokenizer.from_pretrained(args.model), AutoModelForCausalLM.from_pretrained(args.model)
    for config in args.configs:
        settings = yaml.safe_load(config.read_text())
        result = {"config": str(config), **prompt_cost(settings, tokenizer, model), **scripted_policies(settings)}
        print(json.dumps(result, indent=2), flush=True)


if __name__ == "__main__":
    main()
