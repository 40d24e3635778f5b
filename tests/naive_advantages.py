"""The tests' oracle of `compute_gigpo_advantages`: the exact path (exact anchor grouping) in plain Python, one row
at a time, read straight off docs/algorithm.md. Slow and obvious on purpose: tests/test_advantages.py checks the
engine against it on random rows, and bench/bench_advantages.py times the engine against it."""

from __future__ import annotations

import math
from collections import defaultdict

from gigpo_trl.advantages import EPSILON


def naive_gigpo_advantages(
    rewards, group_ids, trajectory_ids, step_indices, anchor_keys, invalid=None, *,
    gamma=0.95, step_weight=1.0, norm="mean_std", episode_stats="steps", invalid_penalty=0.1, step_lambda=1.0,
):
    """Per-row Python version of the exact path (with the bootstrapped step value when `step_lambda` < 1);
    returns (advantages, episode, step, sizes) lists."""
    n = len(rewards)
    invalid = invalid if invalid is not None else [False] * n
    rows_of_trajectory = defaultdict(list)
    for i in range(n):
        rows_of_trajectory[trajectory_ids[i]].append(i)
    returns_to_go, episode_return = [0.0] * n, [0.0] * n
    for rows in rows_of_trajectory.values():
        rows.sort(key=lambda i: step_indices[i])
        running = 0.0
        for i in reversed(rows):
            running = rewards[i] + gamma * running
            returns_to_go[i] = running
        total = sum(rewards[i] for i in rows)
        for i in rows:
            episode_return[i] = total
    # Bootstrapped step value: V(k) = the mean G of the rows of the group in state k; Gl_t = r_t + gamma * ((1 - lambda) * V(k_{t+1})
    # + lambda * Gl_{t+1}), Gl = r on a trajectory's last row.
    returns_of_state = defaultdict(list)
    for i in range(n):
        returns_of_state[(group_ids[i], anchor_keys[i])].append(returns_to_go[i])
    state_value = {key: sum(values) / len(values) for key, values in returns_of_state.items()}
    lambda_returns = list(returns_to_go)
    if step_lambda != 1.0:
        for rows in rows_of_trajectory.values():
            for position in reversed(range(len(rows))):
                i = rows[position]
                if position == len(rows) - 1:
                    lambda_returns[i] = rewards[i]
                else:
                    following = rows[position + 1]
                    bootstrap = state_value[(group_ids[following], anchor_keys[following])]
                    lambda_returns[i] = rewards[i] + gamma * ((1 - step_lambda) * bootstrap
                                                              + step_lambda * lambda_returns[following])
    score = [episode_return[i] - invalid_penalty * invalid[i] for i in range(n)]
    value = [lambda_returns[i] - invalid_penalty * invalid[i] for i in range(n)]

    def norm_of(x, sample):
        # Equal values: their mean is that value (sum/len would add rounding noise).
        mean = sample[0] if len(set(sample)) == 1 else sum(sample) / len(sample)
        if norm == "mean":
            return x - mean
        std = math.sqrt(sum((s - mean) ** 2 for s in sample) / (len(sample) - 1))
        return (x - mean) / (std + EPSILON)

    episode_sample = defaultdict(list)
    if episode_stats == "steps":
        for i in range(n):
            episode_sample[group_ids[i]].append(score[i])
    else:
        for rows in rows_of_trajectory.values():
            episode_sample[group_ids[rows[0]]].append(sum(score[i] for i in rows) / len(rows))
    step_sample = defaultdict(list)
    for i in range(n):
        step_sample[(group_ids[i], anchor_keys[i])].append(value[i])

    advantages, episode, step, sizes = [], [], [], []
    for i in range(n):
        sample = episode_sample[group_ids[i]]
        a_e = score[i] if len(sample) == 1 else norm_of(score[i], sample)
        sample = step_sample[(group_ids[i], anchor_keys[i])]
        a_s = 0.0 if len(sample) == 1 else norm_of(value[i], sample)
        advantages.append(a_e + step_weight * a_s)
        episode.append(a_e)
        step.append(a_s)
        sizes.append(len(sample))
    return advantages, episode, step, sizes
