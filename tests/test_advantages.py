"""compute_gigpo_advantages against its specification, docs/algorithm.md."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from naive_advantages import naive_gigpo_advantages

from gigpo_trl.advantages import (
    EPSILON,
    StepGroupStats,
    anchor_step_groups,
    compute_gigpo_advantages,
    discounted_returns,
    greedy_similarity_clusters,
)

# The worked example of docs/algorithm.md: one group, trajectories A (wins) and B (fails).
WORKED = dict(
    rewards=[0, 0, 10, 0, 0, 0],
    group_ids=[0] * 6,
    trajectory_ids=["A", "A", "A", "B", "B", "B"],
    step_indices=[0, 1, 2, 0, 1, 2],
    anchor_keys=["s0", "s1", "s2", "s0", "s1", "s3"],
)
OPTIONS = st.fixed_dictionaries(
    {
        "norm": st.sampled_from(["mean_std", "mean"]),
        "episode_stats": st.sampled_from(["steps", "trajectories"]),
        "gamma": st.sampled_from([0.0, 0.5, 0.95, 1.0]),
        "step_weight": st.sampled_from([0.0, 0.5, 1.0, 2.0]),
        "invalid_penalty": st.sampled_from([0.0, 0.1, 1.0]),
    }
)
LAMBDA_OPTIONS = OPTIONS.flatmap(
    lambda options: st.sampled_from([0.0, 0.3, 0.9, 1.0]).map(lambda lam: {**options, "step_lambda": lam}))
# The bootstrapped step value's worked example (docs/algorithm.md): one group, three trajectories; A wins, B and C
# lose, C loops in s5.
WORKED_LAMBDA = dict(
    rewards=[0, 0, 1, 0, 0, 0, 0, 0, 0],
    group_ids=[0] * 9,
    trajectory_ids=list("AAABBBCCC"),
    step_indices=[0, 1, 2] * 3,
    anchor_keys=["s0", "s1", "s2", "s0", "s1", "s3", "s0", "s5", "s5"],
)


def columns(rows: list[dict]) -> dict:
    return {
        "rewards": [r["reward"] for r in rows],
        "group_ids": [r["group"] for r in rows],
        "trajectory_ids": [r["trajectory"] for r in rows],
        "step_indices": [r["step"] for r in rows],
        "anchor_keys": [r["anchor"] for r in rows],
        "invalid": [r["invalid"] for r in rows],
    }


@st.composite
def step_rows(draw, text_anchors: bool = False) -> list[dict]:
    """A batch of valid step rows: groups of trajectories over a handful of shared states."""
    rewards = st.one_of(st.sampled_from([0.0, 1.0, 10.0, -1.0]), st.floats(-10, 10, allow_nan=False))
    states = [f"You are in room {k}. A door leads north." for k in range(4)] if text_anchors else list(range(4))
    rows = []
    for g in range(draw(st.integers(1, 3))):
        for j in range(draw(st.integers(1, 4))):
            for t in range(draw(st.integers(1, 6))):
                rows.append(
                    {
                        "reward": draw(rewards),
                        "group": f"task-{g}",
                        "trajectory": (g, j),
                        "step": t,
                        "anchor": draw(st.sampled_from(states)),
                        "invalid": draw(st.booleans()),
                    }
                )
    return rows


def step_values(rows: list[dict], gamma: float, invalid_penalty: float) -> list[float]:
    """v_t = G_t - p * invalid_t, computed one trajectory at a time."""
    values = [0.0] * len(rows)
    for trajectory in {r["trajectory"] for r in rows}:
        running = 0.0
        for i in sorted((i for i, r in enumerate(rows) if r["trajectory"] == trajectory), key=lambda i: -rows[i]["step"]):
            running = rows[i]["reward"] + gamma * running
            values[i] = running - invalid_penalty * rows[i]["invalid"]
    return values


# --------------------------------------------------------------------------------------------
# The worked example and hand-computed cases.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("episode_stats", "table"),
    [
        ("steps", [1.620, 1.620, 0.913, -1.620, -1.620, -0.913]),
        ("trajectories", [1.414, 1.414, 0.707, -1.414, -1.414, -0.707]),
    ],
)
def test_worked_example_matches_the_spec_table(episode_stats, table):
    out = compute_gigpo_advantages(**WORKED, episode_stats=episode_stats)

    np.testing.assert_array_equal(np.round(out.advantages, 3), table)
    # The exact values behind the rounded table: S_E = {10,10,10,0,0,0} (steps) or {10, 0}
    # (trajectories); the s0 and s1 step groups hold G = 0.95^2*10 or 0.95*10 against 0.
    episode_std = math.sqrt(30.0) if episode_stats == "steps" else math.sqrt(50.0)
    a_e = 5.0 / (episode_std + EPSILON)
    a_s = [(g / 2) / (math.sqrt(2 * (g / 2) ** 2) + EPSILON) for g in (0.95**2 * 10, 0.95 * 10)]
    np.testing.assert_allclose(out.episode_advantages, [a_e] * 3 + [-a_e] * 3, rtol=1e-12)
    np.testing.assert_allclose(out.step_advantages, [a_s[0], a_s[1], 0, -a_s[0], -a_s[1], 0], rtol=1e-12)
    np.testing.assert_array_equal(out.step_group_sizes, [2, 2, 1, 2, 2, 1])
    assert out.step_advantages[2] == 0.0 and out.step_advantages[5] == 0.0


def test_worked_example_mean_mode_only_centers():
    out = compute_gigpo_advantages(**WORKED, norm="mean")

    np.testing.assert_allclose(out.episode_advantages, [5, 5, 5, -5, -5, -5], rtol=1e-12)
    np.testing.assert_allclose(out.step_advantages, [9.025 / 2, 9.5 / 2, 0, -9.025 / 2, -9.5 / 2, 0], rtol=1e-12)


def test_discounted_returns_follow_the_recursion():
    # Two trajectories laid out one after the other: [1, 2, 3] and [4].
    returns = discounted_returns(np.array([1.0, 2.0, 3.0, 4.0]), np.array([2, 1, 0, 0]), gamma=0.5)

    np.testing.assert_allclose(returns, [1 + 0.5 * (2 + 0.5 * 3), 2 + 0.5 * 3, 3, 4], rtol=1e-15)


def test_gamma_discounts_the_step_value_only():
    # Trajectory A reaches the reward one step later than B from the same start state.
    out = compute_gigpo_advantages(
        rewards=[0, 0, 1, 0, 1], group_ids=[0] * 5, trajectory_ids=list("AAABB"), step_indices=[0, 1, 2, 0, 1],
        anchor_keys=["s", "x", "y", "s", "z"], gamma=0.5, norm="mean",
    )
    # Both win (R = 1): no episode advantage. In state s, A's return is 0.25 and B's 0.5.
    np.testing.assert_array_equal(out.episode_advantages, np.zeros(5))
    np.testing.assert_allclose(out.step_advantages, [-0.125, 0, 0, 0.125, 0], rtol=1e-15)


def test_invalid_penalty_hits_its_own_row_and_does_not_flow_back():
    out = compute_gigpo_advantages(
        rewards=[0, 1, 0, 1], group_ids=[0] * 4, trajectory_ids=list("AABB"), step_indices=[0, 1, 0, 1],
        anchor_keys=["s0", "s1", "s0", "s1"], invalid=[False, True, False, False],
        gamma=1.0, norm="mean", invalid_penalty=0.1,
    )
    # Scores s: A0 = 1, A1 = 0.9, B0 = B1 = 1 (mean 0.975). Values v: s0 -> {1, 1}, s1 -> {0.9, 1}.
    np.testing.assert_allclose(out.episode_advantages, [0.025, -0.075, 0.025, 0.025], rtol=1e-12)
    np.testing.assert_allclose(out.step_advantages, [0.0, -0.05, 0.0, 0.05], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("norm", ["mean_std", "mean"])
def test_a_group_with_one_score_keeps_raw_scores(norm):
    single_step = compute_gigpo_advantages([3.0], ["g"], ["t"], [0], ["s"], norm=norm)
    one_trajectory = compute_gigpo_advantages(
        [0.0, 2.0], ["g", "g"], ["t", "t"], [0, 1], ["a", "b"], [True, False],
        norm=norm, episode_stats="trajectories", invalid_penalty=0.5,
    )

    assert single_step.episode_advantages.tolist() == [3.0]
    assert one_trajectory.episode_advantages.tolist() == [1.5, 2.0]  # s_t = R - p * invalid_t


def test_step_group_stats_describe_the_pass():
    out = compute_gigpo_advantages(**WORKED)
    stats = out.stats

    assert (stats.num_rows, stats.num_step_groups, stats.step_group_size_max) == (6, 4, 2)
    assert stats.singleton_share == 0.5  # s2 and s3 alone, s0 and s1 shared
    assert stats.step_group_size_mean == 1.5
    assert stats.nonzero_step_advantage_share == pytest.approx(4 / 6)
    assert stats.episode_advantage_std == pytest.approx(np.std(out.episode_advantages))
    assert stats.step_advantage_mean == pytest.approx(np.mean(out.step_advantages))
    metrics = stats.as_metrics()
    assert metrics["gigpo/singleton_share"] == 0.5 and all(isinstance(v, float) for v in metrics.values())


@settings(max_examples=60, deadline=None)
@given(rows=step_rows(), options=OPTIONS)
def test_the_stats_of_processes_combine_into_the_stats_of_the_whole_rollout(rows, options):
    # Each task group on one "process" (groups never cross processes), some processes without rows.
    groups = sorted({r["group"] for r in rows})
    parts = [[r for r in rows if r["group"] == g] for g in groups] + [[]]
    whole = compute_gigpo_advantages(**columns(rows), **options).stats
    combined = StepGroupStats.combine([compute_gigpo_advantages(**columns(part), **options).stats for part in parts])

    assert (combined.num_rows, combined.num_step_groups, combined.step_group_size_max) == (
        whole.num_rows, whole.num_step_groups, whole.step_group_size_max)
    for name in ("singleton_share", "step_group_size_mean", "nonzero_step_advantage_share", "episode_advantage_mean",
                 "episode_advantage_std", "step_advantage_mean", "step_advantage_std"):
        assert getattr(combined, name) == pytest.approx(getattr(whole, name), rel=1e-9, abs=1e-9), name


def test_the_combined_stats_of_no_rows_are_empty():
    empty = compute_gigpo_advantages([], [], [], [], []).stats
    assert StepGroupStats.combine([empty, empty]) == empty == StepGroupStats.combine([])


def test_tuple_keys_are_single_keys():
    as_tuples = compute_gigpo_advantages(
        **{**WORKED, "anchor_keys": [("room", 0), ("room", 1), ("room", 2), ("room", 0), ("room", 1), ("room", 3)]}
    )
    np.testing.assert_array_equal(as_tuples.advantages, compute_gigpo_advantages(**WORKED).advantages)


def test_empty_input_gives_empty_arrays():
    out = compute_gigpo_advantages([], [], [], [], [])

    for array in (out.advantages, out.episode_advantages, out.step_advantages, out.step_group_sizes):
        assert array.shape == (0,)
    assert out.step_group_sizes.dtype == np.int64 and out.stats.num_rows == 0


# --------------------------------------------------------------------------------------------
# Similarity grouping.
# --------------------------------------------------------------------------------------------


def test_greedy_clusters_compare_with_seeds_only():
    # "aaaaaaaaab" is 0.9-similar to the seed "aaaaaaaaaa"; "aaaaaaaabb" is 0.9-similar to the
    # former but only 0.8 to the seed, so greedy makes it a new cluster.
    labels = greedy_similarity_clusters(["aaaaaaaaaa", "aaaaaaaaab", "aaaaaaaabb"], threshold=0.9)

    assert labels.tolist() == [0, 0, 1]


def test_similar_anchors_share_a_step_group_within_a_task_group_only():
    kitchen = "-= Kitchen =- You are in the kitchen. There is a fridge and an oven. You carry {} coins."
    anchors = [kitchen.format(1), kitchen.format(2), "-= Garden =- Birds sing.", kitchen.format(1)]
    codes = anchor_step_groups(["g", "g", "g", "h"], anchors, [0, 1, 2, 0], similarity_threshold=0.95)

    assert codes[0] == codes[1]  # one character differs: similarity > 0.98
    assert len({codes[0], codes[2], codes[3]}) == 3  # a different room; another task group


def test_similarity_visits_anchors_in_first_step_order():
    # Visiting order is (first step, text), not row order: "aaaaaaaabb" (first seen at step 0) is
    # the seed, "aaaaaaaaab" (0.9-similar) joins it, "aaaaaaaaaa" (0.8-similar) starts a cluster.
    codes = anchor_step_groups([0, 0, 0], ["aaaaaaaaaa", "aaaaaaaaab", "aaaaaaaabb"], [2, 1, 0], similarity_threshold=0.9)

    assert codes[2] == codes[1] and codes[0] != codes[2]


# --------------------------------------------------------------------------------------------
# Bootstrapped step values (docs/algorithm.md).
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("step_lambda", "table"),
    [
        (1.0, [0.6017, 0.475, 0, -0.3008, -0.475, 0, -0.3008, 0, 0]),
        (0.0, [0.1504, 0.475, 0, 0.1504, -0.475, 0, -0.3008, 0, 0]),
        (0.5, [0.3760, 0.475, 0, -0.0752, -0.475, 0, -0.3008, 0, 0]),
    ],
)
def test_bootstrapped_worked_example_matches_the_spec_table(step_lambda, table):
    out = compute_gigpo_advantages(**WORKED_LAMBDA, norm="mean", step_lambda=step_lambda)

    np.testing.assert_array_equal(np.round(out.step_advantages, 4), table)
    # The exact values, by the recursion: V(s1) = 0.95 / 2, V(s2) = 1, V(s3) = V(s5) = 0; B and C never earn a reward.
    lam, v_s1, v_s2 = step_lambda, 0.95 / 2, 1.0
    a1 = 0.95 * ((1 - lam) * v_s2 + lam * 1.0)
    s0 = np.array([0.95 * ((1 - lam) * v_s1 + lam * a1), 0.95 * (1 - lam) * v_s1, 0.0])  # A0, B0, C0
    np.testing.assert_allclose(out.step_advantages[[0, 3, 6]], s0 - s0.mean(), rtol=1e-12)
    # A_E does not depend on lambda.
    np.testing.assert_array_equal(out.episode_advantages,
                                  compute_gigpo_advantages(**WORKED_LAMBDA, norm="mean").episode_advantages)


def test_a_revisited_state_bootstraps_from_the_value_of_all_its_visits():
    # A: s0 -> s1 -> s0 -> s2 and wins at its 4th step; B: s0 -> s3 and loses. gamma 0.5.
    # G: A 0.125, 0.25, 0.5, 1; B 0, 0. V(s0) = (0.125 + 0.5 + 0) / 3, V(s1) = 0.25, V(s2) = 1, V(s3) = 0.
    out = compute_gigpo_advantages(
        rewards=[0, 0, 0, 1, 0, 0], group_ids=[0] * 6, trajectory_ids=list("AAAABB"), step_indices=[0, 1, 2, 3, 0, 1],
        anchor_keys=["s0", "s1", "s0", "s2", "s0", "s3"], gamma=0.5, norm="mean", step_lambda=0.5)

    v_s0, v_s1, v_s2, v_s3 = 0.625 / 3, 0.25, 1.0, 0.0
    a3 = 1.0
    a2 = 0.5 * (0.5 * v_s2 + 0.5 * a3)
    a1 = 0.5 * (0.5 * v_s0 + 0.5 * a2)  # A's move out of s1 leads back into s0: valued over all three visits
    a0 = 0.5 * (0.5 * v_s1 + 0.5 * a1)
    b0 = 0.5 * (0.5 * v_s3 + 0.5 * 0.0)
    s0 = np.array([a0, a2, b0])
    np.testing.assert_allclose(out.step_advantages[[0, 2, 4]], s0 - s0.mean(), rtol=1e-12)
    assert out.step_advantages[1] == out.step_advantages[3] == out.step_advantages[5] == 0.0  # singletons


def test_the_lambda_return_at_lambda_1_is_the_return_to_go_exactly():
    rng = np.random.default_rng(0)
    rewards, steps_to_go = rng.normal(size=40), np.concatenate([np.arange(9, -1, -1)] * 4)
    next_values = rng.normal(size=40) * 1e3

    np.testing.assert_array_equal(discounted_returns(rewards, steps_to_go, 0.9, 1.0, next_values),
                                  discounted_returns(rewards, steps_to_go, 0.9))
    with pytest.raises(ValueError, match="next_values are needed"):
        discounted_returns(rewards, steps_to_go, 0.9, 0.5)


@settings(max_examples=150, deadline=None)
@given(rows=step_rows(), options=OPTIONS, seed=st.integers(0, 2**32 - 1))
def test_lambda_1_gives_the_papers_advantages_exactly_on_shuffled_rows(rows, options, seed):
    permutation = np.random.default_rng(seed).permutation(len(rows))

    paper = compute_gigpo_advantages(**columns(rows), **options)
    with_lambda = compute_gigpo_advantages(**columns([rows[i] for i in permutation]), **options, step_lambda=1.0)

    for name in ("advantages", "episode_advantages", "step_advantages", "step_group_sizes"):
        np.testing.assert_array_equal(getattr(paper, name)[permutation], getattr(with_lambda, name), err_msg=name)
    assert paper.stats == with_lambda.stats


@settings(max_examples=60, deadline=None)
@given(rows=step_rows(text_anchors=True), step_lambda=st.sampled_from([0.0, 0.5]))
def test_with_similarity_grouping_a_state_is_its_cluster(rows, step_lambda):
    # Anchors differ in a trailing detail; at 0.9 the rooms' texts cluster into one state per room.
    for row in rows:
        row["anchor"] += f" Turn {row['step']}."
    data = columns(rows)
    clusters = anchor_step_groups(data["group_ids"], data["anchor_keys"], data["step_indices"], similarity_threshold=0.9)

    similar = compute_gigpo_advantages(**data, similarity_threshold=0.9, step_lambda=step_lambda)
    exact_on_clusters = compute_gigpo_advantages(**(data | {"anchor_keys": clusters.tolist()}), step_lambda=step_lambda)

    np.testing.assert_array_equal(similar.advantages, exact_on_clusters.advantages)


# --------------------------------------------------------------------------------------------
# Properties over random batches.
# --------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(rows=step_rows(), options=LAMBDA_OPTIONS, seed=st.integers(0, 2**32 - 1))
def test_result_does_not_depend_on_row_order(rows, options, seed):  # with the bootstrapped step value too
    permutation = np.random.default_rng(seed).permutation(len(rows))
    shuffled = [rows[i] for i in permutation]

    out = compute_gigpo_advantages(**columns(rows), **options)
    out_shuffled = compute_gigpo_advantages(**columns(shuffled), **options)

    for name in ("advantages", "episode_advantages", "step_advantages", "step_group_sizes"):
        np.testing.assert_array_equal(getattr(out, name)[permutation], getattr(out_shuffled, name), err_msg=name)
    assert out.stats == out_shuffled.stats


@settings(max_examples=60, deadline=None)
@given(rows=step_rows(text_anchors=True), seed=st.integers(0, 2**32 - 1))
def test_similarity_grouping_does_not_depend_on_row_order(rows, seed):
    permutation = np.random.default_rng(seed).permutation(len(rows))
    out = compute_gigpo_advantages(**columns(rows), similarity_threshold=0.9)
    out_shuffled = compute_gigpo_advantages(**columns([rows[i] for i in permutation]), similarity_threshold=0.9)

    np.testing.assert_array_equal(out.advantages[permutation], out_shuffled.advantages)


@settings(max_examples=150, deadline=None)
@given(rows=step_rows(), options=LAMBDA_OPTIONS)
def test_matches_the_per_row_python_reference(rows, options):  # the bootstrapped step value included
    out = compute_gigpo_advantages(**columns(rows), **options)
    naive = naive_gigpo_advantages(**columns(rows), **options)

    # Two summation orders of the same formula: equal up to float rounding.
    np.testing.assert_allclose(out.advantages, naive[0], rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(out.episode_advantages, naive[1], rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(out.step_advantages, naive[2], rtol=1e-9, atol=1e-9)
    np.testing.assert_array_equal(out.step_group_sizes, naive[3])
    # Lambda changes the step value only.
    paper = compute_gigpo_advantages(**columns(rows), **(options | {"step_lambda": 1.0}))
    np.testing.assert_array_equal(out.episode_advantages, paper.episode_advantages)


@settings(max_examples=100, deadline=None)
@given(rows=step_rows(), options=OPTIONS, other_anchors=st.lists(st.integers(0, 9), min_size=200, max_size=200))
def test_zero_step_weight_gives_the_episode_part_only(rows, options, other_anchors):
    options = {**options, "step_weight": 0.0}
    out = compute_gigpo_advantages(**columns(rows), **options)
    reanchored = columns(rows) | {"anchor_keys": other_anchors[: len(rows)]}

    np.testing.assert_array_equal(out.advantages, out.episode_advantages)
    np.testing.assert_array_equal(compute_gigpo_advantages(**reanchored, **options).advantages, out.advantages)


@settings(max_examples=100, deadline=None)
@given(rows=step_rows(), options=OPTIONS)
def test_singleton_and_constant_step_groups_get_zero(rows, options):
    out = compute_gigpo_advantages(**columns(rows), **options)
    values = step_values(rows, options["gamma"], options["invalid_penalty"])

    assert np.isfinite(out.advantages).all()
    assert (out.step_advantages[out.step_group_sizes == 1] == 0.0).all()
    for i, row in enumerate(rows):
        members = [k for k, r in enumerate(rows) if (r["group"], r["anchor"]) == (row["group"], row["anchor"])]
        if len({values[k] for k in members}) == 1:
            assert out.step_advantages[i] == 0.0


@settings(max_examples=100, deadline=None)
@given(rows=step_rows(), options=OPTIONS)
def test_step_advantages_of_a_step_group_average_to_zero(rows, options):
    out = compute_gigpo_advantages(**columns(rows), **options)
    groups = anchor_step_groups(columns(rows)["group_ids"], columns(rows)["anchor_keys"], columns(rows)["step_indices"])

    for code in np.unique(groups):
        members = out.step_advantages[groups == code]
        assert abs(members.mean()) <= 1e-9 * max(1.0, np.abs(members).max())


@settings(max_examples=100, deadline=None)
@given(rows=step_rows(), options=OPTIONS)
def test_rows_depend_only_on_their_own_group(rows, options):
    out = compute_gigpo_advantages(**columns(rows), **options)
    for group in {r["group"] for r in rows}:
        mine = [i for i, r in enumerate(rows) if r["group"] == group]
        alone = compute_gigpo_advantages(**columns([rows[i] for i in mine]), **options)

        np.testing.assert_array_equal(out.advantages[mine], alone.advantages)
        np.testing.assert_array_equal(out.step_group_sizes[mine], alone.step_group_sizes)


# --------------------------------------------------------------------------------------------
# Bad input: a ValueError that names the problem.
# --------------------------------------------------------------------------------------------


def with_changes(**changes) -> dict:
    return {**WORKED, **changes}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (with_changes(rewards=[0, 0, 10, 0, 0]), "length mismatch: rewards has 5"),
        (with_changes(invalid=[False] * 5), "invalid has 5"),
        (with_changes(step_indices=[0, 1, 1, 0, 1, 2]), r"trajectory 'A' has duplicate step indices \[1\]"),
        (with_changes(step_indices=[0, 1, 3, 0, 1, 2]), r"trajectory 'A' has a gap .* \[2\] missing"),
        (with_changes(step_indices=[1, 2, 3, 0, 1, 2]), r"trajectory 'A' has a gap .* \[0\] missing"),
        (with_changes(rewards=[0, 0, float("nan"), 0, 0, 0]), r"rewards must be finite, but rewards\[2\] is nan"),
        (with_changes(rewards=[0, 0, 0, 0, float("inf"), 0]), r"rewards\[4\] is inf"),
        (with_changes(rewards=["0", "a", 0, 0, 0, 0]), "rewards must be numbers"),
        (with_changes(step_indices=[0.0, 1.0, 2.0, 0.0, 1.0, 2.0]), "step_indices must be integers"),
        (with_changes(step_indices=[0, 1, 2, -1, 0, 1]), "step_indices must be >= 0"),
        (with_changes(group_ids=[0, 0, 0, 1, 1, 2]), r"trajectory 'B' has rows in two groups \(1 and 2\)"),
        (with_changes(anchor_keys=["s0", ["s1"], "s2", "s0", "s1", "s3"]), r"anchor_keys must hold hashable keys, but anchor_keys\[1\] is a list"),
        (with_changes(anchor_keys=["s0", None, "s2", "s0", "s1", "s3"]), r"anchor_keys\[1\] is None: a missing key"),
        (with_changes(trajectory_ids=["A", "A", float("nan"), "B", "B", "B"]), r"trajectory_ids\[2\] is nan"),
        (with_changes(invalid=[0, 1, 2, 0, 0, 0]), "invalid must be None or one bool"),
        (with_changes(norm="std"), "unknown norm 'std'"),
        (with_changes(episode_stats="episodes"), "unknown episode_stats 'episodes'"),
        (with_changes(gamma=1.5), r"gamma must be in \[0, 1\]"),
        (with_changes(invalid_penalty=-0.1), "invalid_penalty must be a finite number >= 0"),
        (with_changes(step_weight=float("nan")), "step_weight must be a finite number"),
        (with_changes(similarity_threshold=0.0), r"similarity_threshold must be None or in \(0, 1\]"),
        (with_changes(anchor_keys=[0, 1, 2, 0, 1, 3], similarity_threshold=0.9), "similarity_threshold needs text anchors"),
        (with_changes(rewards=5), "rewards must be a sequence"),
        (with_changes(step_lambda=1.5), r"step_lambda must be a number in \[0, 1\], got 1.5"),
        (with_changes(step_lambda=-0.1), r"step_lambda must be a number in \[0, 1\], got -0.1"),
        (with_changes(step_lambda=float("nan")), r"step_lambda must be a number in \[0, 1\], got nan"),
        (with_changes(step_lambda="0.5"), r"step_lambda must be a number in \[0, 1\], got '0.5'"),
    ],
)
def test_bad_input_raises_a_value_error_naming_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        compute_gigpo_advantages(**kwargs)
