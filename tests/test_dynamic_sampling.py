"""Dynamic sampling (`gigpo_trl.dynamic_sampling`, `dynamic_sampling_max_rounds`): which task groups carry a signal,
the rounds that look for more, on real environment pools, and in GiGPOTrainer with the tiny model; and reward-std
filtering (`reward_std_filter_ratio`), the same way."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch
from datasets import Dataset
from scripted_policy import scripted_trainer
from toy_envs import Corridor
from trainer_helpers import cpu_config, parameters

from gigpo_trl.advantages import GiGPOAdvantages, compute_gigpo_advantages
from gigpo_trl.config import GiGPOConfig
from gigpo_trl.dialogue import DUMMY_PROMPT, Completion
from gigpo_trl.dynamic_sampling import (
    SamplingCounts,
    StdFilterCounts,
    extra_task_rows,
    filter_by_return_std,
    group_return_stds,
    groups_with_nonzero_advantages,
    groups_with_signal,
    groups_with_unequal_returns,
    sample_groups,
    std_filter_kept_count,
    top_std_groups,
)
from gigpo_trl.env_pool import EnvPool
from gigpo_trl.records import read_trajectories
from gigpo_trl.rollout import Rollout, collect_rollout, concatenate_rollouts
from gigpo_trl.tasks import Task, task_dataset
from gigpo_trl.trainer import GiGPOTrainer

pytestmark = pytest.mark.timeout(300)

MAX_STEPS = 4
# Corridor lengths, played by copies that walk right, the second one after a first step left (it stays in cell 0):
SHORT = 3  # both copies win within MAX_STEPS, the second a step later: equal returns
MIXED = 5  # the first copy wins at its last allowed step, the second is cut off: returns 1 and 0
LONG = 12  # both copies are cut off: equal returns


def advantages_of(rollout: Rollout, **settings) -> GiGPOAdvantages:
    steps = rollout.steps
    return compute_gigpo_advantages(steps.reward, steps.group, steps.trajectory, steps.step, steps.anchor,
                                    [not valid for valid in steps.valid], **settings)


# ------------------------------------------------------------------------------------------
# Which groups carry a signal.
# ------------------------------------------------------------------------------------------


GROUPS_OF_ROWS = [  # (group, trajectory, step, anchor, reward, invalid)
    # 0: nobody won
    (0, "0a", 0, "s0", 0.0, False), (0, "0a", 1, "s1", 0.0, False), (0, "0b", 0, "s0", 0.0, False),
    # 1: one copy won
    (1, "1a", 0, "s0", 1.0, False), (1, "1b", 0, "s0", 0.0, False),
    # 2: both won the same way
    (2, "2a", 0, "s0", 0.0, False), (2, "2a", 1, "s1", 1.0, False),
    (2, "2b", 0, "s0", 0.0, False), (2, "2b", 1, "s1", 1.0, False),
    # 3: both won, one a step later (it stayed in s0 once): equal returns, different returns-to-go in s0
    (3, "3a", 0, "s0", 0.0, False), (3, "3a", 1, "s1", 1.0, False),
    (3, "3b", 0, "s0", 0.0, False), (3, "3b", 1, "s0", 0.0, False), (3, "3b", 2, "s1", 1.0, False),
    # 4: both lost, one with an invalid answer
    (4, "4a", 0, "s0", 0.0, True), (4, "4b", 0, "s0", 0.0, False),
    # 5 and 6: a single scored element (the other copies failed at reset): it keeps its raw score
    (5, "5a", 0, "s0", 1.0, False),
    (6, "6a", 0, "s0", 0.0, False),
    # 7: rewards collected at different steps that add up to the same return
    (7, "7a", 0, "s0", 1.0, False), (7, "7a", 1, "s1", 0.0, False),
    (7, "7b", 0, "s0", 0.0, False), (7, "7b", 1, "s1", 1.0, False),
]


def test_by_default_a_group_carries_a_signal_exactly_when_its_trajectories_returns_differ():
    returns = {}
    for group, trajectory, _, _, reward, _ in GROUPS_OF_ROWS:
        returns[group, trajectory] = returns.get((group, trajectory), 0.0) + reward
    groups, totals = zip(*((group, total) for (group, _), total in returns.items()))

    assert groups_with_unequal_returns(groups, totals) == [1]  # DAPO's rule, whatever the advantages say
    assert groups_with_unequal_returns([3, 3, 0, 0], [0.5, 0.5 + 1e-12, 2.0, 2.0]) == [3]  # equal means exactly equal
    assert groups_with_unequal_returns([], []) == []


def test_by_advantages_a_group_carries_a_signal_exactly_when_some_step_sample_gets_a_nonzero_advantage():
    group, trajectory, step, anchor, reward, invalid = (list(column) for column in zip(*GROUPS_OF_ROWS))

    def signal(**settings) -> list[int]:
        gigpo = compute_gigpo_advantages(reward, group, trajectory, step, anchor, invalid, **settings)
        no_signal = {g for g in set(group) if not np.any(gigpo.advantages[np.array(group) == g])}
        assert set(groups_with_nonzero_advantages(group, gigpo.advantages)) == set(group) - no_signal
        return groups_with_nonzero_advantages(group, gigpo.advantages)

    assert signal() == [1, 3, 4, 5, 7]
    assert signal(step_weight=0.0) == [1, 4, 5]  # step-wise GRPO: groups 3 and 7 had only a step advantage
    assert signal(gamma=1.0) == [1, 4, 5, 7]  # undiscounted, the later win is worth as much
    assert signal(invalid_penalty=0.0) == [1, 3, 5, 7]


def test_the_rule_is_chosen_by_name_and_an_unknown_one_refused():
    rollout = play_corridors([SHORT, MIXED])  # group 0: both win, one later; group 1: one wins
    gigpo = advantages_of(rollout)
    assert groups_with_signal(rollout, gigpo) == groups_with_signal(rollout, gigpo, "returns") == [1]
    assert groups_with_signal(rollout, gigpo, "advantages") == [0, 1]
    with pytest.raises(ValueError, match=r"unknown dynamic sampling signal 'std'; expected one of \('returns', 'advantages'\)"):
        groups_with_signal(rollout, gigpo, "std")


def test_the_advantages_of_rounds_concatenated_are_those_of_one_pass_over_their_rollouts():
    rollouts = [play_corridors([SHORT, LONG]), play_corridors([LONG, SHORT])]
    merged = concatenate_rollouts(rollouts)

    assert merged.steps.group == rollouts[0].steps.group + [g + 2 for g in rollouts[1].steps.group]
    assert [e.trajectory for e in merged.episodes] == list(range(8))
    assert [(e.group, e.options) for e in merged.episodes[4:]] == [(2, {"length": LONG})] * 2 + [(3, {"length": SHORT})] * 2
    concatenated = GiGPOAdvantages.concatenate([advantages_of(rollout) for rollout in rollouts])
    one_pass = advantages_of(merged)
    for name in ("advantages", "episode_advantages", "step_advantages", "step_group_sizes"):
        np.testing.assert_allclose(getattr(concatenated, name), getattr(one_pass, name), atol=1e-12)
    assert concatenated.stats.num_step_groups == one_pass.stats.num_step_groups
    assert concatenated.stats.step_advantage_std == pytest.approx(one_pass.stats.step_advantage_std)


def test_extra_rounds_draw_reproducibly_and_repeat_no_row_before_all_were_drawn():
    draw = [extra_task_rows(10, 3, seed=0, step=5, process=1, round_=k) for k in (1, 2, 3, 4)]

    assert draw == [extra_task_rows(10, 3, seed=0, step=5, process=1, round_=k) for k in (1, 2, 3, 4)]
    assert sorted(draw[0] + draw[1] + draw[2] + draw[3][:1]) == list(range(10))  # a permutation, then it starts again
    for other in ({"seed": 1, "step": 5, "process": 1}, {"seed": 0, "step": 6, "process": 1},
                  {"seed": 0, "step": 5, "process": 0}):
        assert extra_task_rows(10, 3, **other, round_=1) != draw[0], other


def test_the_counts_of_the_processes_add_up_and_the_extra_rounds_cost_the_slowest_process_s_time():
    one = SamplingCounts(groups_rolled=6, groups_kept=2, groups_dropped=3, groups_surplus=1, groups_missing=0,
                         extra_rounds=2, extra_rollout_s=4.0)
    other = SamplingCounts(groups_rolled=2, groups_kept=2, groups_dropped=0, groups_surplus=0, groups_missing=0,
                           extra_rounds=2, extra_rollout_s=5.5)  # it sat both rounds out, generating with the first

    assert SamplingCounts.combine([one, other]).as_metrics() == {
        "dynamic_sampling/groups_rolled": 8.0, "dynamic_sampling/groups_kept": 4.0,
        "dynamic_sampling/groups_dropped": 3.0, "dynamic_sampling/groups_surplus": 1.0,
        "dynamic_sampling/groups_missing": 0.0, "dynamic_sampling/extra_rounds": 2.0,
        "dynamic_sampling/extra_rollout_s": 5.5,
    }


# ------------------------------------------------------------------------------------------
# The rounds, on real environment pools.
# ------------------------------------------------------------------------------------------


def copy_1_starts_left(prompts, tools):
    """Every copy walks right, except the second copy of a task (odd position), which first steps left."""
    return [Completion([1, 2, 3], [4], "<action>left</action>" if k % 2 and "(step 0)" in prompt[-1]["content"]
                       else "<action>right</action>") for k, prompt in enumerate(prompts)]


class Rounds:
    """Plays the corridors of each extra round in a real pool of 2 tasks x 2 copies and records every call."""

    def __init__(self, lengths_per_round: list[list[int]], live_elsewhere=lambda live: live):
        self.lengths = lengths_per_round
        self.live_elsewhere = live_elsewhere
        self.calls, self.prompt_counts = [], []

    def __call__(self, round_: int, needed: bool) -> Rollout:
        self.calls.append((round_, needed))
        return play_corridors(self.lengths[round_ - 1] if needed else [], self.live_elsewhere, self.prompt_counts)


def play_corridors(lengths, max_across_processes=lambda live: live, prompt_counts=None) -> Rollout:
    """Corridors of these lengths, 2 copies each, played by `copy_1_starts_left` (none: this process sits out)."""
    def generate(prompts, tools):
        if prompt_counts is not None:
            prompt_counts.append([DUMMY_PROMPT] * len(prompts) == prompts or len(prompts))
        return copy_1_starts_left(prompts, tools)

    with EnvPool(Corridor, num_groups=2, group_size=2, processes=False) as pool:
        return collect_rollout(pool, [Task(seed=0, options={"length": n}) for n in lengths], generate,
                               max_env_steps=MAX_STEPS, max_across_processes=max_across_processes, show_progress=False)


def sample(first_lengths, rounds: Rounds, max_rounds: int, max_across_processes=lambda n: n):
    first = play_corridors(first_lengths)
    return sample_groups(first, advantages_of(first), rounds, advantages_of, max_rounds=max_rounds,
                         max_across_processes=max_across_processes)


def test_rounds_stop_once_the_process_holds_as_many_groups_with_a_signal_as_it_had_tasks():
    rounds = Rounds([[LONG, LONG], [MIXED, MIXED], [MIXED, MIXED]])
    sampled = sample([LONG, MIXED], rounds, max_rounds=5)

    assert rounds.calls == [(1, True), (2, True)]  # round 2 found the missing group: no round 3
    counts = sampled.counts
    assert (counts.groups_rolled, counts.groups_kept, counts.groups_dropped, counts.groups_surplus,
            counts.groups_missing, counts.extra_rounds) == (6, 2, 3, 1, 0, 2)
    steps = sampled.rollout.steps
    # Kept: the mixed corridor of the first rollout (group 1) and the first of round 2 (group 4); the second mixed
    # corridor of round 2 (group 5) was surplus, the long ones (0, 2, 3) had no signal.
    assert sampled.samples == [k for k, group in enumerate(steps.group) if group in (1, 4)]
    one_pass = advantages_of(sampled.rollout)
    np.testing.assert_allclose(sampled.advantages.advantages, one_pass.advantages, atol=1e-12)
    for group in (0, 2, 3):
        assert not one_pass.advantages[np.array(steps.group) == group].any()
    assert sampled.counts.extra_rollout_s > 0


def test_the_limit_of_extra_rounds_is_honoured_and_the_shortfall_counted():
    rounds = Rounds([[LONG, LONG]] * 3)
    sampled = sample([LONG, LONG], rounds, max_rounds=2)

    assert rounds.calls == [(1, True), (2, True)]
    counts = sampled.counts
    assert (counts.groups_rolled, counts.groups_kept, counts.groups_dropped, counts.groups_missing,
            counts.extra_rounds) == (6, 0, 6, 2, 2)
    assert sampled.samples == [] and len(sampled.rollout.episodes) == 12


def test_a_process_that_holds_enough_still_generates_in_lock_step_while_another_looks_for_groups():
    """The other process lacks groups after the first rollout and after round 1 (`max_across_processes` reports its
    count), and its episodes last every turn: this process plays no task in rounds 1 and 2 but makes every turn's
    generation call, with the dummy prompt."""
    others_missing = iter([1, 1, 0])
    rounds = Rounds([], live_elsewhere=lambda live: 4)
    sampled = sample([MIXED, MIXED], rounds, max_rounds=5,
                     max_across_processes=lambda missing: max(missing, next(others_missing)))

    assert rounds.calls == [(1, False), (2, False)]
    assert rounds.prompt_counts == [True] * (2 * MAX_STEPS)  # a dummy prompt at every turn of both rounds
    counts = sampled.counts
    assert (counts.groups_rolled, counts.groups_kept, counts.groups_missing, counts.extra_rounds) == (2, 2, 0, 2)


# ------------------------------------------------------------------------------------------
# In GiGPOTrainer, with the tiny model and scripted answers (tests/scripted_policy.py).
# ------------------------------------------------------------------------------------------


def corridors(*lengths: int) -> Dataset:
    return task_dataset(range(len(lengths)), options=[{"length": n} for n in lengths])


def dynamic_config(tmp_path, **overrides) -> GiGPOConfig:
    """2 tasks x 2 copies per rollout, one micro-batch; no invalid-answer penalty, so that two copies that both lose
    the same corridor tie exactly (the scripted first copy breaks the answer format once)."""
    return cpu_config(tmp_path, **{
        "env_name": "corridor", "per_device_train_batch_size": 4, "steps_per_generation": 1,
        "gradient_accumulation_steps": 1, "max_env_steps": MAX_STEPS, "invalid_action_penalty": 0.0,
        "shuffle_dataset": False, "dynamic_sampling_max_rounds": 2, "max_steps": 1, **overrides})


def real_rows(batch) -> torch.Tensor:
    return batch["tool_mask"].sum(dim=1) > 0


@pytest.mark.parametrize(("signal", "penalty", "lengths", "first_without_signal"), [
    # DAPO's rule: the long corridor (both copies lose, the first with an off-format answer) and the short one (both
    # win, the second a step later) have equal returns, though their advantages are not 0; only mixed ones are kept.
    ("returns", 0.1, (LONG, SHORT, MIXED, MIXED, MIXED, MIXED), {0, 1}),
    # By advantages, without a penalty: the long corridor has none, the short one a step signal (gamma < 1).
    ("advantages", 0.0, (LONG, SHORT, LONG, LONG, SHORT, LONG), {0}),
])
def test_groups_without_signal_never_reach_the_update(tmp_path, tiny_model_path, signal, penalty, lengths,
                                                      first_without_signal):
    dataset = corridors(*lengths)
    args = dynamic_config(tmp_path, dynamic_sampling_signal=signal, invalid_action_penalty=penalty)
    trainer = scripted_trainer(tiny_model_path, args=args, train_dataset=dataset)
    trainer.model.train()
    first_tasks = [dataset[0], dataset[0], dataset[1], dataset[1]]  # as TRL's sampler hands them

    batch = trainer._generate_and_score_completions(first_tasks)

    rollout = trainer.last_rollout
    steps, gigpo = rollout.steps, advantages_of(rollout, invalid_penalty=penalty)
    with_signal = groups_with_signal(rollout, gigpo, signal)
    assert len(with_signal) >= 2 and not first_without_signal & set(with_signal)  # the rounds found more
    kept = with_signal[:2]  # the first two groups with a signal, in the order they were played
    if signal == "returns":
        for group in kept:
            assert len({e.episode_return for e in rollout.episodes if e.group == group}) == 2
        for group in first_without_signal:  # dropped, though their advantages are not all 0
            assert gigpo.advantages[np.array(steps.group) == group].any()
    expected = [k for k, group in enumerate(steps.group) if group in kept]
    real = real_rows(batch)
    assert real.sum().item() == len(expected)
    # The real rows are exactly the kept groups' samples, in rollout order, with their advantages.
    for row, sample in zip(torch.nonzero(real).flatten().tolist(), expected):
        length = len(steps.completion[sample].completion_ids)
        assert batch["completion_ids"][row, :length].tolist() == steps.completion[sample].completion_ids
        assert batch["advantages"][row].item() == pytest.approx(gigpo.advantages[sample], abs=1e-6)
    logged = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    assert logged["dynamic_sampling/groups_kept"] == 2 and logged["dynamic_sampling/groups_missing"] == 0
    assert logged["dynamic_sampling/groups_rolled"] == 2 * (1 + logged["dynamic_sampling/extra_rounds"])
    assert logged["gigpo/update_step_samples"] == len(expected)
    assert logged["gigpo/nonzero_advantage_share"] == np.count_nonzero(gigpo.advantages[expected]) / len(expected)

    # Without dynamic sampling the same first tasks put every sample in the update, those of the groups without
    # signal too.
    trainer.args.dynamic_sampling_max_rounds = 0
    batch = trainer._generate_and_score_completions(first_tasks)
    rollout = trainer.last_rollout
    assert real_rows(batch).sum().item() == len(rollout.steps)
    assert not first_without_signal & set(groups_with_signal(rollout, advantages_of(rollout, invalid_penalty=penalty), signal))
    trainer.close_environments()


def test_at_the_limit_the_update_trains_on_what_it_has_and_says_so(tmp_path, tiny_model_path):
    trainer = scripted_trainer(tiny_model_path, args=dynamic_config(tmp_path), train_dataset=corridors(*[LONG] * 6))
    before = parameters(trainer.model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()

    (log,) = [entry for entry in trainer.state.log_history if "env/step_samples" in entry]
    assert log["dynamic_sampling/extra_rounds"] == 2  # the limit
    assert log["dynamic_sampling/groups_rolled"] == 6 and log["dynamic_sampling/groups_dropped"] == 6
    assert log["dynamic_sampling/groups_kept"] == 0 and log["dynamic_sampling/groups_missing"] == 2
    assert log["gigpo/update_step_samples"] == 0
    assert log["dynamic_sampling/extra_rollout_s"] > 0 and log["timing/rollout_s"] > log["dynamic_sampling/extra_rollout_s"]
    assert len(trainer.last_rollout.episodes) == 12  # 3 rounds x 2 tasks x 2 copies
    messages = [str(w.message) for w in caught if "dynamic sampling" in str(w.message)]
    assert messages == ["dynamic sampling: after 2 extra round(s) (the limit, dynamic_sampling_max_rounds) the update "
                        "holds 0 task group(s) with a signal of the 2 asked, and has no step sample with a signal: it "
                        "runs on zero-weight rows; 6 of the 6 groups rolled had none (logged as dynamic_sampling/*)"]
    # It trained on zero-weight rows only: no gradient, and the first AdamW step moves nothing.
    assert log["loss"] == 0.0 and log["grad_norm"] == 0.0
    after = parameters(trainer.model)
    assert all(torch.equal(before[name], after[name]) for name in before)
    trainer.close_environments()


def episode_seeds(output_dir) -> dict[str, list[int]]:
    """The seeds of every episode of every training rollout, from the run's trajectory records."""
    return {name: [episode["seed"] for episode in episodes] for name, episodes in read_trajectories(output_dir).items()
            if name.startswith("train-")}


def test_extra_tasks_are_drawn_reproducibly_after_a_resume_too_and_leave_trl_s_sampler_alone(tmp_path, tiny_model_path):
    # No corridor can be won: every iteration plays its 2 extra rounds, whatever the answers.
    dataset = corridors(*[LONG] * 16)
    settings = {"max_steps": 2, "log_trajectories": 100, "shuffle_dataset": True}
    first = scripted_trainer(tiny_model_path, args=dynamic_config(tmp_path / "first", save_strategy="steps",
                                                                 save_steps=1, **settings), train_dataset=dataset)
    first.train()
    first.close_environments()
    resumed = scripted_trainer(tiny_model_path, args=dynamic_config(tmp_path / "resumed", **settings),
                              train_dataset=dataset)
    resumed.train(resume_from_checkpoint=str(tmp_path / "first" / "checkpoint-1"))
    resumed.close_environments()
    without = scripted_trainer(tiny_model_path, args=dynamic_config(tmp_path / "without", dynamic_sampling_max_rounds=0,
                                                                   **settings), train_dataset=dataset)
    without.train()
    without.close_environments()

    seeds, resumed_seeds, without_seeds = (episode_seeds(tmp_path / run) for run in ("first", "resumed", "without"))
    assert [len(s) for s in seeds.values()] == [12, 12]  # per iteration: 3 rounds x 2 tasks x 2 copies
    assert resumed_seeds["train-00000"] == seeds["train-00001"]  # the second iteration, every round, again
    assert seeds["train-00000"][4:] != seeds["train-00001"][4:]  # another step draws other extra tasks
    for iteration in ("train-00000", "train-00001"):  # the first round is TRL's draw, as without dynamic sampling
        assert seeds[iteration][:4] == without_seeds[iteration]
    drawn = [extra_task_rows(16, 2, seed=0, step=1, process=0, round_=k) for k in (1, 2)]
    assert seeds["train-00001"][4:] == [row for rows in drawn for row in rows for _ in range(2)]  # the seed is the row


def test_evaluation_is_never_filtered(tmp_path, tiny_model_path):
    panel = corridors(LONG, LONG)  # no signal at all: a training rollout would look further
    trainer = scripted_trainer(tiny_model_path, args=dynamic_config(tmp_path, per_device_eval_batch_size=4),
                              train_dataset=corridors(LONG, SHORT), eval_dataset=panel)
    metrics = trainer.evaluate()
    trainer.close_environments()

    assert len(trainer.last_rollout.episodes) == 4 and {e.options["length"] for e in trainer.last_rollout.episodes} == {LONG}
    assert not [name for name in metrics if "dynamic_sampling" in name]
    assert metrics["eval_gigpo/update_step_samples"] == metrics["eval_env/step_samples"]


@pytest.mark.parametrize("rounds", [-1, -3])
def test_a_negative_limit_is_refused_by_name(tmp_path, rounds):
    with pytest.raises(ValueError, match=f"dynamic_sampling_max_rounds={rounds} must be >= 0"):
        dynamic_config(tmp_path, dynamic_sampling_max_rounds=rounds)


def test_a_training_set_without_rows_by_index_is_refused_with_dynamic_sampling(tmp_path, tiny_model_path):
    streamed = corridors(SHORT, LONG).to_iterable_dataset()
    with pytest.raises(ValueError, match=r"dynamic_sampling_max_rounds draws further tasks from train_dataset by row "
                                         r"index, and this train_dataset \(IterableDataset\) has no rows by index"):
        scripted_trainer(tiny_model_path, args=dynamic_config(tmp_path), train_dataset=streamed)


# ------------------------------------------------------------------------------------------
# Reward-std filtering (RAGEN's rule): which groups, then in GiGPOTrainer.
# ------------------------------------------------------------------------------------------


def test_a_group_s_return_std_is_bessel_s_over_its_trajectories_and_ties_exactly_in_any_order():
    stds = group_return_stds([0, 0, 1, 1, 1, 2, 3, 3], [1.0, 0.0, 0.1, 0.2, 0.3, 5.0, 2.0, 2.0])

    assert stds == {0: pytest.approx(np.sqrt(0.5)), 1: pytest.approx(0.1), 2: 0.0, 3: 0.0}  # 2: a single trajectory
    # np.std of these returns in these two orders differs in the last bit; sorted first, the two groups tie exactly.
    assert np.std([0.8, 0.1, 0.7], ddof=1) != np.std([0.7, 0.8, 0.1], ddof=1)
    stds = group_return_stds([4, 4, 4, 5, 5, 5], [0.8, 0.1, 0.7, 0.7, 0.8, 0.1])
    assert stds[4] == stds[5]


@pytest.mark.parametrize(("num_groups", "ratio", "kept"), [
    (8, 0.25, 2), (8, 0.5, 4), (6, 0.25, 2), (10, 0.3, 3), (10, 0.7, 7), (4, 0.01, 1), (7, 1.0, 7), (3, 0.5, 2),
    (0, 0.5, 0),
])
def test_the_filter_keeps_the_ceiling_of_the_ratio_of_the_groups(num_groups, ratio, kept):
    assert std_filter_kept_count(num_groups, ratio) == kept
    everyone = top_std_groups([[0.0] * num_groups], ratio, seed=0, step=0)
    assert len(everyone[0]) == kept


def test_the_groups_of_the_largest_return_std_are_kept_over_all_processes():
    stds = [[0.7, 0.0, 0.5], [0.1, 0.7, 0.0]]  # two processes of three groups each

    assert top_std_groups(stds, 0.5, seed=0, step=0) == [[0, 2], [1]]  # 0.7, 0.5 | 0.7 of six: 3
    assert top_std_groups(stds, 2 / 6, seed=0, step=0) == [[0], [1]]
    assert top_std_groups(stds, 4 / 6, seed=0, step=0) == [[0, 2], [0, 1]]
    assert top_std_groups(stds, 1.0, seed=0, step=0) == [[0, 1, 2], [0, 1, 2]]
    # Over all processes, not each its own share: the first process holds both of the largest.
    assert top_std_groups([[0.9, 0.8], [0.1, 0.0]], 0.5, seed=0, step=0) == [[0, 1], []]
    # Processes may hold different numbers of groups (dynamic sampling's, short at its limit), or none.
    assert top_std_groups([[], [0.2, 0.9, 0.4], [0.5]], 0.5, seed=0, step=0) == [[], [1], [0]]
    assert top_std_groups([[], []], 0.5, seed=0, step=0) == [[], []]


def test_ties_are_broken_by_a_draw_from_the_seed_and_the_step_never_against_a_larger_std():
    equal = [[0.0] * 4, [0.0] * 4]
    draws = {step: top_std_groups(equal, 0.25, seed=3, step=step) for step in range(20)}

    for step, kept in draws.items():
        assert sum(map(len, kept)) == 2
        assert kept == top_std_groups(equal, 0.25, seed=3, step=step)  # another process, or a rerun, agrees
    assert len({str(kept) for kept in draws.values()}) > 1  # another step, another draw
    assert all(any(kept[process] for kept in draws.values()) for process in (0, 1))  # either process gets its turn
    assert any(top_std_groups(equal, 0.25, seed=seed, step=0) != draws[0] for seed in (4, 5))  # another run's seed

    rng = np.random.default_rng(0)
    for step in range(50):  # few distinct values: many ties
        stds = [rng.choice([0.0, 0.5, 0.7], size=rng.integers(0, 6)).tolist() for _ in range(3)]
        ratio = float(rng.uniform(0.05, 1.0))
        kept = top_std_groups(stds, ratio, seed=0, step=step)
        kept_stds = [stds[p][k] for p in range(3) for k in kept[p]]
        dropped = [std for p in range(3) for k, std in enumerate(stds[p]) if k not in kept[p]]
        assert len(kept_stds) == std_filter_kept_count(sum(map(len, stds)), ratio)
        assert min(kept_stds, default=np.inf) >= max(dropped, default=-np.inf)


def test_the_filter_s_counts_give_the_threshold_and_the_mean_std_of_kept_and_dropped_groups():
    stds = [[0.7, 0.0, 0.5], [0.1, 0.7, 0.0]]
    counts = StdFilterCounts.of(stds, top_std_groups(stds, 0.5, seed=0, step=0))

    assert counts.as_metrics() == pytest.approx({
        "reward_std_filter/groups_ranked": 6.0, "reward_std_filter/groups_kept": 3.0,
        "reward_std_filter/groups_dropped": 3.0, "reward_std_filter/groups_kept_zero_std": 0.0,
        "reward_std_filter/std_threshold": 0.5, "reward_std_filter/kept_std_mean": (0.7 + 0.5 + 0.7) / 3,
        "reward_std_filter/dropped_std_mean": 0.1 / 3,
    })
    everything = StdFilterCounts.of(stds, top_std_groups(stds, 1.0, seed=0, step=0))
    assert (everything.groups_dropped, everything.groups_kept_zero_std, everything.dropped_std_mean,
            everything.std_threshold) == (0, 2, 0.0, 0.0)
    assert StdFilterCounts.of([[], []], [[], []]) == StdFilterCounts(0, 0, 0, 0, 0.0, 0.0, 0.0)


def test_a_process_keeps_the_samples_of_its_groups_that_rank_among_every_process_s():
    rollout = play_corridors([MIXED, LONG])  # this process: stds 0.71 and 0
    groups = rollout.steps.group
    gathered = []

    def gather(mine):  # process 1 of 2; process 0 holds a group of std 0.8 and one of 0
        gathered.append(mine)
        return [[0.8, 0.0], mine]

    samples, counts = filter_by_return_std(rollout, range(len(groups)), 0.5, seed=0, step=0, process=1, gather=gather)

    assert gathered == [[pytest.approx(np.sqrt(0.5)), 0.0]]
    assert samples == [k for k, group in enumerate(groups) if group == 0]  # k = 2 of 4: 0.8 there, 0.71 here
    assert (counts.groups_ranked, counts.groups_kept, counts.std_threshold) == (4, 2, pytest.approx(np.sqrt(0.5)))
    # Only the groups of the samples offered are ranked (dynamic sampling's kept ones): here the long corridor alone.
    offered = [k for k, group in enumerate(groups) if group == 1]
    samples, counts = filter_by_return_std(rollout, offered, 0.5, seed=0, step=0)
    assert samples == offered and (counts.groups_ranked, counts.groups_kept) == (1, 1)


def std_filter_config(tmp_path, **overrides) -> GiGPOConfig:
    """4 tasks x 2 copies per rollout on one process, one micro-batch, no dynamic sampling."""
    return dynamic_config(tmp_path, **{"per_device_train_batch_size": 8, "dynamic_sampling_max_rounds": 0,
                                       "reward_std_filter_ratio": 0.5, **overrides})


def real_samples(trainer: GiGPOTrainer, batch) -> list[int]:
    """The step samples of the latest rollout that are the batch's real rows, in row order, checked against their
    answers and advantages."""
    steps = trainer.last_rollout.steps
    gigpo = advantages_of(trainer.last_rollout, invalid_penalty=trainer.args.invalid_action_penalty)
    by_answer = {}
    for sample, completion in enumerate(steps.completion):
        by_answer.setdefault((tuple(completion.prompt_ids), tuple(completion.completion_ids)), []).append(sample)
    found = []
    for row in torch.nonzero(real_rows(batch)).flatten().tolist():
        prompt = batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist()
        answer = batch["completion_ids"][row][batch["completion_mask"][row].bool()].tolist()
        candidates = [k for k in by_answer[tuple(prompt), tuple(answer)] if k not in found]
        found.append(candidates[0])
        assert batch["advantages"][row].item() == pytest.approx(gigpo.advantages[found[-1]], abs=1e-6)
    return found


def test_only_the_groups_of_the_largest_return_std_reach_the_update(tmp_path, tiny_model_path):
    # Stds of the four groups: long 0 (both cut off), mixed 0.71, short 0 (both win, one later), mixed 0.71.
    dataset = corridors(LONG, MIXED, SHORT, MIXED)
    trainer = scripted_trainer(tiny_model_path, args=std_filter_config(tmp_path), train_dataset=dataset)
    trainer.model.train()
    tasks = [dataset[k] for k in range(4) for _ in range(2)]

    batch = trainer._generate_and_score_completions(tasks)

    groups = trainer.last_rollout.steps.group
    expected = [k for k, group in enumerate(groups) if group in (1, 3)]
    assert real_samples(trainer, batch) == expected
    assert batch["tool_mask"].size(0) == len(expected)  # one process: no padding row
    logged = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    assert {name: value for name, value in logged.items() if name.startswith("reward_std_filter/")} == pytest.approx({
        "reward_std_filter/groups_ranked": 4.0, "reward_std_filter/groups_kept": 2.0,
        "reward_std_filter/groups_dropped": 2.0, "reward_std_filter/groups_kept_zero_std": 0.0,
        "reward_std_filter/std_threshold": np.sqrt(0.5),
        "reward_std_filter/kept_std_mean": np.sqrt(0.5), "reward_std_filter/dropped_std_mean": 0.0,
    })
    assert logged["gigpo/update_step_samples"] == len(expected) < logged["env/step_samples"] == len(groups)
    assert not [name for name in logged if name.startswith("dynamic_sampling/")]

    # Without the filter the same tasks put every sample in the update.
    trainer.args.reward_std_filter_ratio = None
    batch = trainer._generate_and_score_completions(tasks)
    assert real_samples(trainer, batch) == list(range(len(trainer.last_rollout.steps)))
    trainer.close_environments()


def test_equal_stds_are_broken_the_same_way_in_two_runs(tmp_path, tiny_model_path):
    # k = ceil(0.5 x 4) = 2: the mixed corridor (std 0.71), and one of the three others, whose stds are all 0 (both
    # copies cut off, both win, both cut off): the draw of the seed and the step decides which.
    dataset = corridors(MIXED, LONG, SHORT, LONG - 2)
    tasks = [dataset[k] for k in range(4) for _ in range(2)]
    chosen = []
    for run in ("first", "second"):
        trainer = scripted_trainer(tiny_model_path, args=std_filter_config(tmp_path / run), train_dataset=dataset)
        trainer.model.train()
        per_step = []
        for step in (0, 2):
            trainer.state.global_step = step
            batch = trainer._generate_and_score_completions(tasks)
            groups = trainer.last_rollout.steps.group
            kept = sorted({groups[sample] for sample in real_samples(trainer, batch)})
            assert real_samples(trainer, batch) == [k for k, group in enumerate(groups) if group in kept]
            assert kept == top_std_groups([[np.sqrt(0.5), 0.0, 0.0, 0.0]], 0.5, seed=0, step=step)[0]
            assert trainer._metrics["train"]["reward_std_filter/groups_kept_zero_std"][-1] == 1
            per_step.append(kept)
        trainer.close_environments()
        chosen.append(per_step)

    assert chosen[0] == chosen[1]
    assert chosen[0][0][0] == 0 and chosen[0][0] != chosen[0][1]  # another step, another draw among the tied groups


def test_with_dynamic_sampling_the_filter_ranks_the_groups_it_kept(tmp_path, tiny_model_path):
    # 2 tasks a rollout: the long corridor has no signal, so a round is played; dynamic sampling keeps the mixed
    # corridors of the first rollout and of round 1, and the filter keeps ceil(0.5 x 2) = 1 of them.
    dataset = corridors(LONG, MIXED, MIXED, MIXED, MIXED, MIXED)
    args = dynamic_config(tmp_path, dynamic_sampling_max_rounds=2, reward_std_filter_ratio=0.5)
    trainer = scripted_trainer(tiny_model_path, args=args, train_dataset=dataset)
    trainer.model.train()

    batch = trainer._generate_and_score_completions([dataset[0], dataset[0], dataset[1], dataset[1]])

    logged = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    assert (logged["dynamic_sampling/groups_rolled"], logged["dynamic_sampling/groups_kept"]) == (4, 2)
    assert (logged["reward_std_filter/groups_ranked"], logged["reward_std_filter/groups_kept"]) == (2, 1)
    groups = trainer.last_rollout.steps.group
    (kept,) = {groups[sample] for sample in real_samples(trainer, batch)}
    assert kept in (1, 2, 3) and 0 != kept
    assert logged["gigpo/update_step_samples"] == groups.count(kept)
    trainer.close_environments()


@pytest.mark.parametrize("ratio", [0, 0.0, -0.5, 1.5, float("nan"), "0.5", True])
def test_a_ratio_outside_zero_to_one_is_refused_by_name(tmp_path, ratio):
    with pytest.raises(ValueError, match=rf"reward_std_filter_ratio={re.escape(repr(ratio))} must be None \(off\) or a "
                                         r"number in \(0, 1\]"):
        std_filter_config(tmp_path, reward_std_filter_ratio=ratio)


def test_a_ratio_that_would_never_drop_a_group_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"reward_std_filter_ratio=0.8 keeps ceil\(0.8 x 4\) = 4 of the 4 task "
                                         r"group\(s\) of a rollout .* it would never drop one. Use a ratio of at most "
                                         r"3/4 or more tasks"):
        std_filter_config(tmp_path, reward_std_filter_ratio=0.8)
    with pytest.raises(ValueError, match=r"= 1 of the 1 task group\(s\) .* never drop one. Use more tasks per rollout"):
        std_filter_config(tmp_path, reward_std_filter_ratio=0.5, per_device_train_batch_size=2)
    assert std_filter_config(tmp_path, reward_std_filter_ratio=0.75).reward_std_filter_ratio == 0.75
    assert std_filter_config(tmp_path, reward_std_filter_ratio=1.0).reward_std_filter_ratio == 1.0  # keeps all, logs
    assert std_filter_config(tmp_path, reward_std_filter_ratio=None).reward_std_filter_ratio is None
