"""Loop diagnostics (`gigpo_trl.loops`): revisits, stays, turn-backs, endings in a cycle and distinct states, from
the anchors, for scripted policies that oscillate, explore, walk into a wall, or loop only after a while; on their
own, through a real rollout of a real environment, and through the trainer (metrics, evaluation panel, records,
report). The warnings that read them are tested in tests/test_health.py."""

from __future__ import annotations

import random
import re

import pytest
import torch
from scripted_policy import scripted_tool_trainer, scripted_trainer
from toy_envs import Corridor
from toy_tool_envs import IncrementEnv
from trainer_helpers import cpu_config, logged_metrics

from gigpo_trl.dialogue import Completion
from gigpo_trl.env_checker import EnvCheckError, check_env
from gigpo_trl.env_pool import EnvPool
from gigpo_trl.environments.rooms import RoomsEnv
from gigpo_trl.loops import EpisodeLoops, LoopCounts, episode_loops
from gigpo_trl.metrics import PanelEpisode, panel_metrics, trailing_ratio
from gigpo_trl.records import read_evaluations, read_iterations, read_trajectories, read_updates
from gigpo_trl.report import write_report
from gigpo_trl.rollout import collect_rollout
from gigpo_trl.tasks import Task, task_dataset

pytestmark = pytest.mark.timeout(300)

# ------------------------------------------------------------------------------------------
# The pure functions.
# ------------------------------------------------------------------------------------------


def test_an_oscillating_walk_revisits_every_step_but_the_first_turns_back_every_time_and_ends_in_a_cycle():
    loops = episode_loops(["a", "b", "a", "b", "a", "b", "a"], terminated=False)

    assert loops == EpisodeLoops(next_state=(1, 0, 1, 0, 1, 0), revisit=(False, True, True, True, True, True),
                                 stay=(False,) * 6, turn_back=(None, True, True, True, True, True), ends_in_cycle=True,
                                 distinct_states=2)
    assert LoopCounts.of([loops]).as_metrics() == {
        "loops/revisit_share": 5 / 6, "loops/stay_share": 0.0, "loops/turn_back_share": 1.0,
        "loops/cycle_end_share": 1.0, "loops/distinct_states_mean": 2.0}


def test_a_walk_into_a_wall_stays_at_every_bump_and_never_turns_back():
    """One way along a corridor of 3 rooms, then into its wall for the rest of the episode (setting F's collapse):
    the bumps stay, and none of them is a turn-back."""
    loops = episode_loops([0, 1, 2, 2, 2, 2], terminated=False)

    assert loops.stay == (False, False, True, True, True) and loops.turn_back == (None, False, False, False, False)
    assert loops.revisit == (False, False, True, True, True) and loops.ends_in_cycle
    assert LoopCounts.of([loops]).as_metrics() == {
        "loops/revisit_share": 3 / 5, "loops/stay_share": 3 / 5, "loops/turn_back_share": 0.0,
        "loops/cycle_end_share": 1.0, "loops/distinct_states_mean": 3.0}


def test_an_exploring_walk_never_revisits_and_does_not_end_in_a_cycle():
    loops = episode_loops([0, 1, 2, 3, 4], terminated=False)

    assert loops.revisit == (False,) * 4 and loops.stay == (False,) * 4 and loops.turn_back == (None, False, False, False)
    assert LoopCounts.of([loops]).as_metrics() == {
        "loops/revisit_share": 0.0, "loops/stay_share": 0.0, "loops/turn_back_share": 0.0,
        "loops/cycle_end_share": 0.0, "loops/distinct_states_mean": 5.0}


def test_a_walk_that_loops_only_after_a_while_counts_the_loop_from_where_it_starts():
    loops = episode_loops([0, 1, 2, 3, 2, 3, 2], terminated=False)

    assert loops.next_state == (1, 2, 3, 2, 3, 2)
    assert loops.revisit == (False, False, False, True, True, True)
    assert loops.turn_back == (None, False, False, True, True, True) and loops.stay == (False,) * 6
    assert (loops.ends_in_cycle, loops.distinct_states) == (True, 4)


def test_staying_in_place_is_a_revisit_and_a_stay_never_a_turn_back_and_going_back_further_is_no_turn_back():
    held = episode_loops(["x", "x", "x"], terminated=False)
    assert held.revisit == (True, True) and held.stay == (True, True)
    assert held.turn_back == (None, False)  # s_2 == s_0, but the state never changed: no turn-back
    around = episode_loops(["a", "b", "c", "a"], terminated=False)  # a 3-cycle: back to the start, not to s_1
    assert around.revisit == (False, False, True) and around.turn_back == (None, False, False) and around.ends_in_cycle
    assert around.stay == (False, False, False)
    after_a_stay = episode_loops(["a", "b", "b", "a"], terminated=False)  # back to s_1's predecessor only after a stay
    assert after_a_stay.stay == (False, True, False) and after_a_stay.turn_back == (None, False, False)


def test_a_terminating_last_step_is_not_counted_and_a_won_episode_does_not_end_in_a_cycle():
    won = episode_loops([0, 1, 0, 1], terminated=True)  # a win reached from a state visited before
    assert won.revisit == (False, True, None) and won.turn_back == (None, True, None) and won.stay == (False, False, None)
    assert won.ends_in_cycle is False and won.distinct_states == 2
    # A tool environment's final answer, without a tool call, leaves the state as it was: that is no loop.
    answered = episode_loops(["start", "counter 1", "counter 1"], terminated=True)
    assert LoopCounts.of([answered]).as_metrics()["loops/revisit_share"] == 0.0 and answered.ends_in_cycle is False


def test_the_state_after_a_failed_step_is_unknown_and_left_out():
    failed = episode_loops([0, 1, 0, "whatever the pool returned"], terminated=False, failed=True)
    assert failed == EpisodeLoops(next_state=(1, 0, None), revisit=(False, True, None), stay=(False, False, None),
                                  turn_back=(None, True, None), ends_in_cycle=None, distinct_states=None)
    at_reset = episode_loops(["whatever the pool returned"], terminated=False, failed=True)
    assert LoopCounts.of([failed, at_reset]).as_metrics() == {
        "loops/revisit_share": 0.5, "loops/stay_share": 0.0, "loops/turn_back_share": 1.0}


def test_counts_pool_the_episodes_add_up_over_processes_and_leave_out_what_has_nothing_to_count():
    episodes = [episode_loops(walk, terminated=False) for walk in (["a", "b", "a"], [0, 1, 2, 3], ["s", "s"])]
    whole = LoopCounts.of(episodes)
    assert whole == LoopCounts.combine([LoopCounts.of(episodes[:1]), LoopCounts.of(episodes[1:])])
    assert whole.as_metrics() == {"loops/revisit_share": 2 / 6, "loops/stay_share": 1 / 6,
                                  "loops/turn_back_share": 1 / 3, "loops/cycle_end_share": 2 / 3,
                                  "loops/distinct_states_mean": 7 / 3}
    one_step_win = LoopCounts.of([episode_loops([0, 1], terminated=True)])
    assert one_step_win.as_metrics() == {"loops/cycle_end_share": 0.0, "loops/distinct_states_mean": 2.0}


def test_the_gradient_norm_spike_ratio_is_over_the_median_of_those_before():
    assert trailing_ratio(6.0, [1.0, 2.0, 100.0]) == 3.0
    assert trailing_ratio(1.0, []) is None and trailing_ratio(1.0, [0.0]) is None


# ------------------------------------------------------------------------------------------
# Through a real rollout: the corridor of tests/toy_envs.py, answers from a scripted policy.
# ------------------------------------------------------------------------------------------


def oscillate(step: int, cell: int) -> str:
    return "right" if cell == 0 else "left"


def explore(step: int, cell: int) -> str:
    return "right"


def loop_after_three_steps(step: int, cell: int) -> str:
    return "right" if step < 3 or cell == 2 else "left"


def corridor_policy(rule):
    """A generator answering each corridor prompt with `rule(step, current cell)`."""

    def generate(prompts, tools):
        answers = []
        for prompt in prompts:
            text = prompt[-1]["content"]
            step = int(re.search(r"\(step (\d+)\)", text).group(1))
            cell = int(re.findall(r"You are in cell (\d+)", text)[-1])
            answers.append(Completion([1, 2, 3], [4], f"<action>{rule(step, cell)}</action>"))
        return answers

    return generate


def played(rule, length: int = 6, max_env_steps: int = 6):
    """Two copies of a corridor of `length` cells played by `rule`: the rollout and its logged metrics."""
    with EnvPool(Corridor, num_groups=1, group_size=2, processes=False) as pool:
        rollout = collect_rollout(pool, [Task(seed=0, options={"length": length})], corridor_policy(rule),
                                  max_env_steps=max_env_steps, show_progress=False)
    return rollout, logged_metrics(rollout)


def test_a_rollout_of_an_oscillating_policy_logs_its_loops():
    rollout, metrics = played(oscillate)

    assert [e.final_anchor for e in rollout.episodes] == [(6, 0), (6, 0)]  # s_6: cut off back in cell 0
    assert metrics["loops/revisit_share"] == 5 / 6 and metrics["loops/turn_back_share"] == 1.0
    assert metrics["loops/stay_share"] == 0.0
    assert metrics["loops/cycle_end_share"] == 1.0 and metrics["loops/distinct_states_mean"] == 2.0


def test_a_rollout_of_an_exploring_policy_logs_no_revisit():
    rollout, metrics = played(explore)

    assert all(e.won and not e.truncated for e in rollout.episodes) and rollout.episodes[0].final_anchor == (6, 5)
    assert metrics["loops/revisit_share"] == 0.0 and metrics["loops/turn_back_share"] == 0.0
    assert metrics["loops/stay_share"] == 0.0
    assert metrics["loops/cycle_end_share"] == 0.0 and metrics["loops/distinct_states_mean"] == 6.0


def test_a_rollout_of_a_policy_that_loops_after_a_while():
    _, metrics = played(loop_after_three_steps)  # cells 0 1 2 3 2 3 2

    assert metrics["loops/revisit_share"] == 3 / 6 and metrics["loops/turn_back_share"] == 3 / 5
    assert metrics["loops/cycle_end_share"] == 1.0 and metrics["loops/distinct_states_mean"] == 4.0


def test_the_in_group_return_std_is_the_mean_over_task_groups_of_each_group_s_spread():
    def first_copy_explores(prompts, tools):
        return [Completion([1], [4], "<action>right</action>" if position % 2 == 0 else "<action>left</action>")
                for position, _ in enumerate(prompts)]

    with EnvPool(Corridor, num_groups=2, group_size=2, processes=False) as pool:
        rollout = collect_rollout(pool, [Task(seed=0, options={"length": 3}), Task(seed=1, options={"length": 9})],
                                  first_copy_explores, max_env_steps=3, show_progress=False)

    assert [e.episode_return for e in rollout.episodes] == [1.0, 0.0, 0.0, 0.0]  # a win in the short corridor only
    assert logged_metrics(rollout)["env/group_return_std"] == pytest.approx((0.5**0.5 + 0.0) / 2)
    # One copy per task (evaluation's default): no group has a spread, and none is logged rather than 0.
    with EnvPool(Corridor, num_groups=2, group_size=1, processes=False) as pool:
        single = collect_rollout(pool, [Task(seed=0, options={"length": 3}), Task(seed=1, options={"length": 9})],
                                 first_copy_explores, max_env_steps=3, show_progress=False)
    assert [e.episode_return for e in single.episodes] == [1.0, 0.0]
    assert "env/group_return_std" not in logged_metrics(single)


@pytest.mark.parametrize(("idle_actions", "revisits", "stays", "turn_backs"),
                         [(0, (0.6, 0.67), (0.0, 0.05), (0.43, 0.5)), (2, (0.72, 0.79), (0.48, 0.55), (0.1, 0.14))])
def test_a_uniformly_random_walk_on_the_rooms_revisits_often_stays_where_it_can_and_turns_back_half_the_time(
        idle_actions, revisits, stays, turn_backs):
    """128 episodes of 12 steps on 9 rooms (docs/metrics.md quotes these): with the two moves, 0.63 of the steps
    revisit, 0.03 stay (at the walls), 0.46 turn back; with two idle actions too, 0.76 revisit, 0.51 stay and 0.12 turn
    back. Shares as high as a collapsed policy's: the entropy tells such a walk from a collapse (gigpo_trl.health)."""
    rng = random.Random(0)
    actions = ["go west", "go east", "wait", "look around"][: 2 + idle_actions]

    def uniform(prompts, tools):
        return [Completion([1], [4], f"<action>{rng.choice(actions)}</action>") for _ in prompts]

    with EnvPool(lambda: RoomsEnv(num_rooms=9, idle_actions=idle_actions), num_groups=32, group_size=4,
                 processes=False) as pool:
        rollout = collect_rollout(pool, [Task(seed) for seed in range(32)], uniform, max_env_steps=12,
                                  show_progress=False)
    metrics = LoopCounts.of(figures for figures in rollout.loops()).as_metrics()

    assert revisits[0] < metrics["loops/revisit_share"] < revisits[1]
    assert stays[0] < metrics["loops/stay_share"] < stays[1]
    assert turn_backs[0] < metrics["loops/turn_back_share"] < turn_backs[1]


class HistoryCorridor(Corridor):
    """A corridor whose anchor is the history of its actions, and says so."""

    def reset(self, *, seed=None, options=None):
        self.moves = []
        observation, info = super().reset(seed=seed, options=options)
        return observation, {**info, "anchor_kind": "history"}

    def step(self, action):
        self.moves.append(action)
        return super().step(action)

    def _info(self):
        return {**super()._info(), "anchor": tuple(getattr(self, "moves", ()))}


class TypoCorridor(Corridor):
    def reset(self, *, seed=None, options=None):
        observation, info = super().reset(seed=seed, options=options)
        return observation, {**info, "anchor_kind": "states"}


def test_anchors_that_are_histories_leave_the_loop_metrics_out_rather_than_at_zero():
    with EnvPool(HistoryCorridor, num_groups=1, group_size=2, processes=False) as pool:
        rollout = collect_rollout(pool, [Task(seed=0, options={"length": 6})], corridor_policy(oscillate),
                                  max_env_steps=6, show_progress=False)

    assert rollout.loops() == [None, None]
    assert not [name for name in logged_metrics(rollout) if name.startswith("loops/")]
    panel = panel_metrics([PanelEpisode.of(e, 2, loops) for e, loops in zip(rollout.episodes, rollout.loops())])
    assert panel and not [name for name in panel if name.startswith("loops/")]


def test_an_anchor_kind_that_is_neither_state_nor_history_is_refused_by_name():
    with pytest.raises(EnvCheckError, match=r"info\['anchor_kind'\] must be one of \('state', 'history'\), got 'states'"):
        check_env(TypoCorridor())
    check_env(HistoryCorridor())
    with EnvPool(TypoCorridor, num_groups=1, group_size=1, processes=False) as pool, \
            pytest.raises(ValueError, match="anchor_kind.*'states'"):
        pool.reset([Task(seed=0)])


# ------------------------------------------------------------------------------------------
# Through the trainer: the tiny model generates, a scripted rule answers.
# ------------------------------------------------------------------------------------------


def oscillating_answer(prompt_text: str, position: int) -> str:
    """Corridor answers that walk back and forth between cells 0 and 1."""
    cell = int(re.findall(r"You are in cell (\d+)", prompt_text)[-1])
    return f"<action>{oscillate(0, cell)}</action>"


@pytest.fixture
def one_thread():
    """As fast for the tiny model, and many times faster when other processes share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_training_and_evaluation_log_record_and_report_the_loops_of_an_oscillating_policy(tmp_path, tiny_model_path,
                                                                                         one_thread):
    config = cpu_config(tmp_path, env_name="corridor", max_env_steps=5, max_steps=2, steps_per_generation=1,
                        gradient_accumulation_steps=1, env_processes=False, per_device_eval_batch_size=2,
                        disable_tqdm=True)
    corridors = [{"length": 6}] * 4
    trainer = scripted_trainer(tiny_model_path, corridor=oscillating_answer, args=config, train_dataset=task_dataset(range(4), corridors),
                                 eval_dataset=task_dataset([7, 8], corridors[:2]))
    trainer.train()
    evaluation = trainer.evaluate()
    trainer.close_environments()

    # Cells 0 1 0 1 0 1 in 5 steps, cut off: 4 of 5 steps revisit, each after the first turns back, none stays, all
    # end in a cycle.
    expected = {"loops/revisit_share": 0.8, "loops/stay_share": 0.0, "loops/turn_back_share": 1.0,
                "loops/cycle_end_share": 1.0, "loops/distinct_states_mean": 2.0}
    logged = [entry for entry in trainer.state.log_history if "env/step_samples" in entry]
    assert len(logged) == 2 and all(entry[name] == pytest.approx(value) for entry in logged
                                    for name, value in expected.items())
    assert {name: evaluation[f"eval_{name}"] for name in expected} == pytest.approx(expected)
    assert {name: read_evaluations(tmp_path)[-1]["metrics"][name] for name in expected} == pytest.approx(expected)
    assert all(record["metrics"][name] == pytest.approx(value) for record in read_iterations(tmp_path)
               for name, value in expected.items())
    # The viewer's records: the state after each step, marked where it goes back.
    episode = read_trajectories(tmp_path)["train-00000"][0]
    assert [(s["next_state"], s["revisit"], s["stay"], s["turn_back"]) for s in episode["steps"]] == [
        (1, False, False, None), (0, True, False, True), (1, True, False, True), (0, True, False, True),
        (1, True, False, True)]
    assert (episode["ends_in_cycle"], episode["distinct_states"]) == (True, 2)
    page = (write_report(tmp_path) / "index.html").read_text()
    assert "<td>#0 turn back</td>" in page and "2 distinct states" in page and "not won, truncated, ends in a cycle" in page
    assert '<img src="loops.png"' in page and '<img src="health.png"' in page
    assert "<td><code>loops/revisit_share</code></td><td>0.8</td><td>0.8</td></tr>" in page  # training, evaluation
    assert all(entry["env/group_return_std"] == 0.0 for entry in logged)  # the copies play alike: no signal


def test_every_logged_training_step_is_recorded_with_its_entropy_gradient_norm_and_spike_ratio(tmp_path,
                                                                                              tiny_model_path,
                                                                                              one_thread):
    # The scripted corridor walk of tests/scripted_policy.py: copies of a task differ, so gradients are not 0.
    config = cpu_config(tmp_path, env_name="corridor", max_steps=3, env_processes=False, disable_tqdm=True)
    trainer = scripted_trainer(tiny_model_path, args=config, train_dataset=task_dataset(range(4)))
    trainer.train()
    trainer.close_environments()

    steps, updates = [entry for entry in trainer.state.log_history if "loss" in entry], read_updates(tmp_path)
    assert [record["step"] for record in updates] == [1, 2, 3]
    for entry, record in zip(steps, updates):
        assert {name: record["metrics"][name] for name in ("entropy", "grad_norm")} == {
            name: entry[name] for name in ("entropy", "grad_norm")}
    assert "grad_norm/spike" not in steps[0] and "grad_norm/spike" not in updates[0]["metrics"]  # nothing before it
    before = sorted([steps[0]["grad_norm"], steps[1]["grad_norm"]])
    assert updates[2]["metrics"]["grad_norm/spike"] == steps[2]["grad_norm/spike"] == pytest.approx(
        steps[2]["grad_norm"] / ((before[0] + before[1]) / 2))


def test_a_tool_environment_anchored_on_its_calls_says_the_loop_metrics_do_not_apply(tmp_path, tool_model_path,
                                                                                      one_thread):
    from datasets import Dataset

    prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Task {k}."}] for k in range(4)]})
    by_anchor = {}
    for anchor in ("tool_calls", "state"):
        config = cpu_config(tmp_path / anchor, max_completion_length=8, max_env_steps=8, max_steps=1,
                            tool_anchor=anchor, env_processes=False, disable_tqdm=True)
        trainer = scripted_tool_trainer(tool_model_path, args=config, train_dataset=prompts,
                                      environment_factory=IncrementEnv)
        trainer.train()
        trainer.close_environments()
        by_anchor[anchor] = next(entry for entry in trainer.state.log_history if "env/step_samples" in entry)

    assert not [name for name in by_anchor["tool_calls"] if name.startswith("loops/")]
    assert not [name for record in read_iterations(tmp_path / "tool_calls") for name in record["metrics"]
                if name.startswith("loops/")]
    steps = [s for episodes in read_trajectories(tmp_path / "tool_calls").values() for e in episodes for s in e["steps"]]
    assert steps and {s["next_state"] for s in steps} == {None}
    # Under the state anchor the counter's states are states: it counts up and never comes back (the final answer,
    # which leaves the counter as it is, ends the episode and is no loop).
    assert by_anchor["state"]["loops/revisit_share"] == 0.0 and by_anchor["state"]["loops/cycle_end_share"] == 0.0
