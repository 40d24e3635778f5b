"""research/credit_tabular.py: the tabular policy gradient (SGD and Adam steps on the policy-gradient objective) and the
per-seed comparison of its methods."""

from __future__ import annotations

import numpy as np
import pytest

from research.credit_tabular import TabularPolicy

def mean_weighted_log_probability(policy: TabularPolicy, observations, actions, advantages) -> float:
    return float(np.mean([a * np.log(policy.probabilities(o)[k]) for o, k, a in zip(observations, actions, advantages)]))


OBSERVATIONS, ACTIONS, ADVANTAGES = ["a", "b", "a", "a"], [0, 2, 1, 0], np.array([0.7, -1.2, 0.3, -0.4])


def random_policy(optimizer: str, learning_rate: float) -> TabularPolicy:
    policy = TabularPolicy(3, optimizer, learning_rate)
    rng = np.random.default_rng(0)
    policy.logits = {"a": rng.normal(size=3), "b": rng.normal(size=3), "unseen in the batch": rng.normal(size=3)}
    return policy


def test_tabular_sgd_update_is_a_gradient_step_on_the_policy_gradient_objective():
    policy = random_policy("sgd", learning_rate=0.5)
    observations, actions, advantages = OBSERVATIONS, ACTIONS, ADVANTAGES

    numeric = {}
    for observation in policy.logits:
        numeric[observation] = np.zeros(3)
        for k in range(3):
            for sign in (1, -1):
                policy.logits[observation][k] += sign * 1e-6
                numeric[observation][k] += sign * mean_weighted_log_probability(policy, observations, actions, advantages) / 2e-6
                policy.logits[observation][k] -= sign * 1e-6
    before = {o: logits.copy() for o, logits in policy.logits.items()}
    policy.update(observations, actions, advantages)

    for observation in before:
        np.testing.assert_allclose(policy.logits[observation] - before[observation], 0.5 * numeric[observation], atol=1e-7)


def test_tabular_adam_first_step_moves_every_gradient_entry_by_the_learning_rate():
    policy = random_policy("adam", learning_rate=0.01)
    gradient = policy.gradient(OBSERVATIONS, ACTIONS, ADVANTAGES)
    before = {o: logits.copy() for o, logits in policy.logits.items()}
    policy.update(OBSERVATIONS, ACTIONS, ADVANTAGES)

    for observation in ("a", "b"):  # bias-corrected Adam's first step is lr * g / |g|
        np.testing.assert_allclose(policy.logits[observation] - before[observation], 0.01 * np.sign(gradient[observation]), rtol=1e-6)
    np.testing.assert_array_equal(policy.logits["unseen in the batch"], before["unseen in the batch"])


def test_tabular_policy_rejects_an_unknown_optimizer():
    with pytest.raises(ValueError, match="optimizer must be 'sgd' or 'adam', got 'rmsprop'"):
        TabularPolicy(2, "rmsprop")


def test_the_tabular_comparison_pairs_every_method_with_gigpo_seed_by_seed():
    from research.credit_tabular import compare, paired_difference, per_seed_summary, table

    curves = {"GiGPO": [[0.0, 0.6, 0.6, 0.6, 0.6, 0.6]] * 2, "GRPO (omega=0)": [[0.0] * 6] * 2,
              "GiGPO lambda 0.5": [[1.0] * 6, [0.0, 0.6, 0.6, 0.6, 0.6, 0.6]]}
    summary = per_seed_summary(curves, 6, (0.5,))
    # Trailing means of 5 of GiGPO's curve: 0, 0.3, 0.4, 0.45, 0.48, 0.6: 0.5 first at iteration 5.
    assert summary["GiGPO"]["iterations_to_0.5"]["mean"] == 5.0
    never = {key: value for key, value in summary["GRPO (omega=0)"]["iterations_to_0.5"].items() if key != "minus GiGPO"}
    assert never == {"mean": 6.0, "std": 0.0, "median": 6.0, "min": 6.0, "max": 6.0, "never_reached": 2}
    paired = summary["GiGPO lambda 0.5"]["iterations_to_0.5"]["minus GiGPO"]
    assert paired["mean"] == -2.5 and paired["seeds_ahead"] == 1 and paired["seeds_equal"] == 1  # 0 - 5 and 5 - 5
    assert paired_difference(np.array([0.1, 0.1]), higher_is_better=True)["ci95"] == [pytest.approx(0.1)] * 2

    settings = {"env_name": "rooms", "env_kwargs": {"num_rooms": 9, "treasure": "west", "idle_actions": 2},
                "num_generations": 4, "per_device_train_batch_size": 8, "max_env_steps": 12, "gamma": 0.95,
                "advantage_norm": "mean_std", "episode_stats": "steps"}
    result = compare(settings, "adam", 0.03, seeds=2, iterations=4, lambdas=(0.5,))
    assert set(result["per_seed"]) == {"GiGPO", "GRPO (omega=0)", "GiGPO lambda 0.5"}
    assert "| GiGPO lambda 0.5 | " in table(result)
