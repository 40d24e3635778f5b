"""TRL's environment classes (`GRPOTrainer(environment_factory=...)`) trained by GiGPOTrainer, unchanged: one
assistant turn a step, on real TRL machinery (its chat template helpers and response parser) with the tiny model
given TRL's Qwen2.5 tool-calling template; and the same classes under TRL's own GRPOTrainer."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from datasets import Dataset
from scripted_policy import counter_answer, scripted_tool_trainer, tool_call
from toy_tool_envs import GuessTheNumber, IncrementEnv, guess_reward
from trainer_helpers import cpu_config
from trl import GRPOConfig, GRPOTrainer

from gigpo_trl.dynamic_sampling import extra_task_rows
from gigpo_trl.recipe import train_and_report
from gigpo_trl.records import read_evaluations, read_iterations, read_trajectories
from gigpo_trl.trainer import GiGPOTrainer
from gigpo_trl.trl_environment import TRLEnvironment, attribute_anchor

pytestmark = pytest.mark.timeout(300)


def rows(count: int, **columns) -> Dataset:
    """Rows in TRL's shape: a conversational prompt and other columns."""
    prompts = [[{"role": "user", "content": f"Task {k}."}] for k in range(count)]
    return Dataset.from_dict({"prompt": prompts, **{name: [value] * count for name, value in columns.items()}})


def tool_config(tmp_path, **overrides):
    return cpu_config(tmp_path, **{"max_completion_length": 8, "max_env_steps": 8, "max_steps": 1, **overrides})


def replay(factory, episode, actions, **kwargs) -> list:
    """The anchors of an episode's states, played again in a fresh environment from its seed and row."""
    environment = TRLEnvironment(factory, **kwargs)
    anchors = [environment.reset(seed=episode.seed, options=episode.options)[1]["anchor"]]
    for action in actions:
        anchors.append(environment.step(action)[4]["anchor"])
    return anchors


@pytest.mark.slow
def test_a_counter_trains_one_turn_a_step_with_rewards_that_sum_to_get_reward(tmp_path, tool_model_path):
    trainer = scripted_tool_trainer(tool_model_path, args=tool_config(tmp_path), train_dataset=rows(4),
                                  environment_factory=IncrementEnv)
    trainer.train()

    rollout, steps = trainer.last_rollout, trainer.last_rollout.steps
    assert len(rollout.episodes) == 8 and all(e.done and not e.truncated for e in rollout.episodes)  # 4 tasks x 2
    for episode in rollout.episodes:
        row_indices = steps.rows_of(episode.trajectory)
        actions = [json.loads(steps.action[r]) for r in row_indices]
        assert all(a.get("tool_calls") for a in actions[:-1]) and not actions[-1].get("tool_calls")  # TRL's end
        environment = TRLEnvironment(IncrementEnv)
        environment.reset(seed=episode.seed, options=episode.options)
        for r in row_indices:
            environment.step(steps.action[r])
        # get_reward's change per step, summing to its final value (TRL's reward for the whole conversation)
        assert sum(steps.reward[r] for r in row_indices) == episode.episode_return == environment.environment.get_reward() == 1.0
        assert [steps.reward[r] for r in row_indices].count(1.0) == 1
    first_prompt = trainer.processing_class.decode(steps.completion[0].prompt_ids)
    assert '"name": "increment"' in first_prompt and "Task 0. Bring the counter to" in first_prompt
    assert steps.valid == [True] * len(steps)
    assert all(entry["env/step_samples"] == len(steps) for entry in trainer.state.log_history if "env/step_samples" in entry)
    trainer.close_environments()


def test_step_groups_are_the_states_the_copies_share_when_replayed(tmp_path, tool_model_path):
    trainer = scripted_tool_trainer(tool_model_path, args=tool_config(tmp_path), train_dataset=rows(4),
                                  environment_factory=IncrementEnv)
    trainer.train()

    steps = trainer.last_rollout.steps
    for episode in trainer.last_rollout.episodes:
        row_indices = steps.rows_of(episode.trajectory)
        replayed = replay(IncrementEnv, episode, [steps.action[r] for r in row_indices])
        assert [steps.anchor[r] for r in row_indices] == replayed[:-1]
    # The trajectory viewer's step-group sizes: how many steps of the task group were taken in the same state.
    (episodes,) = read_trajectories(tmp_path).values()
    counts = Counter(zip(steps.group, steps.anchor))
    sizes = [step["step_group_size"] for episode in episodes for step in episode["steps"]]
    assert sizes == [counts[steps.group[r], steps.anchor[r]] for e in episodes for r in steps.rows_of(e["trajectory"])]
    assert max(sizes) > 1  # the copies of a task pass through the same counters: step groups, not singletons
    trainer.close_environments()


def guess_answer(messages: list[dict], position: int) -> str:
    """Search for the number with the game's hints; the first guess is 2 at even positions of the batch, 7 at odd
    ones (at the first turn every environment is live, so positions are the copies)."""
    low, high, guesses = 1, 8, 0
    for message, reply in zip(messages, messages[1:]):
        if message["role"] == "assistant" and reply["role"] == "tool":
            guess, guesses = message["tool_calls"][0]["function"]["arguments"]["number"], guesses + 1
            low, high = (guess + 1, high) if reply["content"] == "Too low." else (low, guess - 1)
    first = 2 if position % 2 == 0 else 7
    return tool_call("guess", number=first if guesses == 0 else (low + high) // 2)


def test_a_guessing_game_with_done_and_reward_funcs_scores_the_last_step(tmp_path, tool_model_path):
    trainer = scripted_tool_trainer(tool_model_path, answer=guess_answer, args=tool_config(tmp_path, history_length=8),
                                    train_dataset=rows(4), environment_factory=GuessTheNumber, reward_funcs=guess_reward)
    trainer.train()

    steps = trainer.last_rollout.steps
    for episode in trainer.last_rollout.episodes:
        rewards = [steps.reward[r] for r in steps.rows_of(episode.trajectory)]
        assert episode.won and not episode.truncated  # the game's done flag ended it, its won flag says so
        assert rewards == [0.0] * (len(rewards) - 1) + [1.0]  # reward_funcs(environments=...) at the end
    log = next(entry for entry in trainer.state.log_history if "env/success_rate" in entry)
    assert log["env/success_rate"] == 1.0
    trainer.close_environments()


@pytest.mark.slow
def test_a_class_without_won_logs_no_success_rate_anywhere_while_its_returns_are_logged(tmp_path, tool_model_path,
                                                                                         capsys):
    # IncrementEnv has get_reward and no `won`: whether an episode was won is unknown, which is not a success rate of 0.
    trainer = scripted_tool_trainer(tool_model_path, args=tool_config(tmp_path, per_device_eval_batch_size=2),
                                  train_dataset=rows(4), eval_dataset=rows(1), environment_factory=IncrementEnv)
    outcome = train_and_report(trainer)

    assert all(episode.won is None for episode in trainer.last_rollout.episodes)
    logged = [entry for entry in trainer.state.log_history if "env/return_mean" in entry]
    assert logged and all(entry["env/return_mean"] == 1.0 for entry in logged)  # every counter reaches its target
    assert not [name for entry in trainer.state.log_history for name in entry if "success_rate" in name]
    for evaluation in (outcome.before, outcome.after):
        assert evaluation["eval_env/return_mean"] == 1.0 and not [name for name in evaluation if "success_rate" in name]
    records = [*read_iterations(tmp_path), *read_evaluations(tmp_path)]
    assert len(records) == 5 and not [name for record in records for name in record["metrics"] if "success_rate" in name]
    assert {episode["won"] for episodes in read_trajectories(tmp_path).values() for episode in episodes} == {None}
    assert not (outcome.report / "panel.png").exists()  # no held-out success to plot, rather than a line at 0
    assert "success not reported" in (outcome.report / "index.html").read_text()
    assert ("Held-out success rate: success not reported by the environment (no `won`); mean return 1 before training "
            "-> 1 after") in capsys.readouterr().out


@pytest.mark.slow
def test_dynamic_sampling_plays_further_dataset_rows_with_fresh_seeds_each_round(tmp_path, tool_model_path):
    """Undiscounted (gamma 1), every copy of every counter reaches its target and every step value ties: no task group
    has a signal, and the iteration plays its 2 extra rounds. Their rows come from the training set (4 rows: every
    round draws all of them again), and every task gets a fresh seed, as TRL's environments draw at every reset."""
    def sampled_tasks() -> tuple[list, list, dict]:
        trainer = scripted_tool_trainer(tool_model_path, args=tool_config(tmp_path, gamma=1.0, dynamic_sampling_max_rounds=2),
                                      train_dataset=rows(4), environment_factory=IncrementEnv)
        trainer.train()
        trainer.close_environments()
        groups = trainer.last_rollout.episodes[::2]  # the first copy of each task
        (log,) = [entry for entry in trainer.state.log_history if "env/step_samples" in entry]
        return [episode.seed for episode in groups], [episode.options["prompt"] for episode in groups], log

    seeds, prompts, log = sampled_tasks()

    assert (log["dynamic_sampling/extra_rounds"], log["dynamic_sampling/groups_rolled"],
            log["dynamic_sampling/groups_kept"], log["dynamic_sampling/groups_missing"]) == (2, 12, 0, 4)
    dataset_prompts = rows(4)["prompt"]
    for round_ in (1, 2):
        drawn = extra_task_rows(4, 4, seed=0, step=0, process=0, round_=round_)
        assert prompts[4 * round_ : 4 * round_ + 4] == [dataset_prompts[row] for row in drawn]
    assert len(set(seeds)) == 12  # the same 4 rows in every round, a fresh seed for each task
    assert sampled_tasks()[:2] == (seeds, prompts)  # and the same draw again in a run with the same seed


def increment(step: int) -> str:
    return json.dumps({"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "increment", "arguments": {"step": step}}}]})


class ReachedAsAProperty(IncrementEnv):
    @property
    def won(self) -> bool:
        """Success computed from the state, as a class with get_reward only can give it (a property: no tool)."""
        return self.counter == self.target


class UnknownUntilOver(IncrementEnv):
    won = None  # None: unknown


class SaysYes(IncrementEnv):
    won = "yes"


def test_success_is_the_instance_s_won_a_bool_or_none_while_unknown():
    environment = TRLEnvironment(ReachedAsAProperty)
    _, info = environment.reset(seed=1, options={})
    assert info["won"] is False and [tool["function"]["name"] for tool in info["tools"]] == ["increment"]
    assert environment.step(increment(environment.environment.target))[4]["won"] is True

    for unknown in (IncrementEnv, UnknownUntilOver):
        assert "won" not in TRLEnvironment(unknown).reset(seed=0, options={})[1]
    with pytest.raises(ValueError, match=r"SaysYes.won must be a bool \(or None while unknown\), got 'yes'"):
        TRLEnvironment(SaysYes).reset(seed=0, options={})


def test_an_exception_in_a_tool_becomes_its_error_result_as_in_trl():
    environment = TRLEnvironment(GuessTheNumber, reward_funcs=[guess_reward])
    environment.reset(seed=3, options={"prompt": [{"role": "user", "content": "Play."}]})
    secret = environment.environment.secret
    reply = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "guess", "arguments": {"number": secret}}},
        {"type": "function", "function": {"name": "guess", "arguments": {"number": secret}}},
        {"type": "function", "function": {"name": "shout", "arguments": {}}},
    ]}
    observation, reward, terminated, truncated, info = environment.step(json.dumps(reply))

    assert [m["content"] for m in info["tool_messages"]] == [
        "Correct!", "{'error': 'Game over.'}", "{'error': 'Tool shout not found.'}"]
    assert terminated and not truncated and reward == 1.0 and info["won"]


def test_the_state_anchor_merges_paths_to_one_state_and_the_tool_call_anchor_keeps_them_apart():
    def play(anchor, steps):
        environment = TRLEnvironment(IncrementEnv, anchor=anchor)
        environment.reset(seed=0, options={})
        for step in steps:
            reply = {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "increment", "arguments": {"step": step}}}]}
            info = environment.step(json.dumps(reply))[4]
        return info["anchor"], environment.environment

    (one_and_one, environment), (two, _) = play("state", [1, 1]), play("state", [2])
    assert one_and_one == two == attribute_anchor(environment)
    assert play("tool_calls", [1, 1])[0] != play("tool_calls", [2])[0]


def test_the_class_s_own_anchor_property_is_used_and_is_no_tool():
    environment = TRLEnvironment(GuessTheNumber)
    _, info = environment.reset(seed=5, options={})
    assert info["anchor"] == (environment.environment.secret, False)
    assert [tool["function"]["name"] for tool in info["tools"]] == ["guess"]


def test_rows_are_routed_to_a_dict_of_environments_by_their_environment_column(tmp_path, tool_model_path):
    def answer(messages, position):
        guessing = "secret number" in messages[0]["content"]
        return guess_answer(messages, position) if guessing else counter_answer(messages, position)

    dataset = rows(4).add_column("environment", ["counter", "guess"] * 2)
    trainer = scripted_tool_trainer(tool_model_path, answer=answer, args=tool_config(tmp_path, history_length=8),
                                    train_dataset=dataset,
                                    environment_factory={"counter": IncrementEnv, "guess": GuessTheNumber})
    trainer.train()

    episodes = trainer.last_rollout.episodes
    assert sorted({e.task_type for e in episodes}) == ["counter", "guess"]
    steps = trainer.last_rollout.steps
    for episode in episodes:
        first = trainer.processing_class.decode(steps.completion[steps.rows_of(episode.trajectory)[0]].prompt_ids)
        assert ('"name": "guess"' in first) == (episode.task_type == "guess")
    trainer.close_environments()


def test_max_tool_calling_iterations_sets_the_turns_of_an_episode(tmp_path):
    assert tool_config(tmp_path, max_env_steps=50, max_tool_calling_iterations=2).max_env_steps == 3
    with pytest.raises(ValueError, match="max_tool_calling_iterations=2 means 3 turns an episode, but max_env_steps=8"):
        tool_config(tmp_path, max_tool_calling_iterations=2)


class NoTools:
    def reset(self, **kwargs):
        return "Nothing to do."


class Undocumented(IncrementEnv):
    def decrement(self, step: int) -> str:
        self.counter -= step
        return str(self.counter)


class NeedsTarget(IncrementEnv):
    def reset(self, target, **kwargs):
        return super().reset()


class StrictReset(IncrementEnv):
    def reset(self):
        return super().reset()


@pytest.mark.parametrize(
    ("factory", "dataset", "message"),
    [
        (NoTools, rows(4), "NoTools has no tools: its public methods"),
        (Undocumented, rows(4), "the tool Undocumented.decrement cannot be described to the model"),
        (NeedsTarget, rows(4), r"NeedsTarget.reset needs \['target'\], which the dataset has no column for"),
        (StrictReset, rows(4), r"StrictReset.reset\(\*\*row\) receives every column of a row, as in TRL, but does not accept \['prompt'\]"),
        ({"counter": IncrementEnv}, rows(4), r"a dict environment_factory routes each row by its 'environment' column"),
    ],
)
def test_environments_that_do_not_fit_are_refused_at_construction(tmp_path, tool_model_path, factory, dataset, message):
    with pytest.raises(ValueError, match=message):
        GiGPOTrainer(tool_model_path, args=tool_config(tmp_path), train_dataset=dataset, environment_factory=factory)


def test_a_chat_template_that_cannot_call_tools_is_refused_naming_the_ones_that_can(tmp_path, tiny_model_path):
    with pytest.raises(ValueError, match="chat template cannot render tool calls.*qwen2_5"):
        GiGPOTrainer(tiny_model_path, args=tool_config(tmp_path), train_dataset=rows(4), environment_factory=IncrementEnv)


@pytest.mark.parametrize(("factory", "reward_funcs"), [(IncrementEnv, None), (GuessTheNumber, guess_reward)])
def test_the_same_classes_train_unchanged_under_trl_s_grpo_trainer(tmp_path, tool_model_path, factory, reward_funcs):
    config = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_steps=1,
                        max_completion_length=16, max_tool_calling_iterations=2, report_to=[], bf16=False,
                        activation_checkpointing=False, save_strategy="no")
    trainer = GRPOTrainer(tool_model_path, reward_funcs=reward_funcs, args=config, train_dataset=rows(4),
                          environment_factory=factory)
    trainer.train()

    assert trainer.state.global_step == 1
    assert [tool.__name__ for tool in trainer._env_tools[None]] == (["increment"] if factory is IncrementEnv else ["guess"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_processes_train_a_trl_environment_class(tmp_path, tool_model_path):
    from test_distributed import launch

    logs, _ = launch(2, tool_model_path, tmp_path, "tool_counter")

    assert len(logs) == 2
    for log in logs:  # every episode reaches its target (reward 1 once) and ends on a reply without a tool call
        assert log["env/truncated_share"] == 0.0 and log["env/return_mean"] == 1.0 and log["env/step_samples"] >= 16
        assert "env/success_rate" not in log  # IncrementEnv has no `won`: unknown on every process, not 0
