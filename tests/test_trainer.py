"""GiGPOTrainer on CPU with a tiny local model and real environments."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from peft import LoraConfig
from scripted_policy import ScriptedTrainer
from toy_envs import Corridor

from gigpo_trl.advantages import compute_gigpo_advantages
from gigpo_trl.config import GiGPOConfig
from gigpo_trl.envs import register_env
from gigpo_trl.trainer import GiGPOTrainer, task_dataset, tasks_from_rows

pytestmark = pytest.mark.timeout(300)

register_env("corridor", Corridor, overwrite=True)

LOGGED_METRICS = [
    "env/success_rate", "env/return_mean", "env/episode_length_mean", "env/truncated_share", "env/invalid_action_rate",
    "gigpo/singleton_share", "gigpo/step_group_size_mean", "gigpo/step_group_size_max",
    "gigpo/nonzero_step_advantage_share", "gigpo/episode_advantage_mean", "gigpo/episode_advantage_std",
    "gigpo/step_advantage_mean", "gigpo/step_advantage_std", "timing/rollout_s", "timing/generation_s",
    "timing/advantages_s", "generation/tokens_per_s",
]


def cpu_config(tmp_path, **overrides) -> GiGPOConfig:
    settings = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, steps_per_generation=2,
        gradient_accumulation_steps=2, max_steps=2, max_completion_length=12, max_env_steps=4, logging_steps=1,
        report_to=[], gradient_checkpointing=False, learning_rate=1e-3, save_strategy="no", seed=0,
    )
    return GiGPOConfig(**{**settings, **overrides})


def parameters(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("trainer_class", "env_name"),
    [
        (GiGPOTrainer, "sokoban"),  # the tiny model's own answers: the step penalty already varies the returns
        (ScriptedTrainer, "textworld"),  # admissible commands drawn at random: some copies find the treasure
    ],
)
def test_a_short_run_changes_the_weights_and_logs_the_metrics(tmp_path, tiny_model_path, trainer_class, env_name):
    config = cpu_config(tmp_path, env_name=env_name, max_steps=3)
    trainer = trainer_class(tiny_model_path, args=config, train_dataset=task_dataset(range(4)))
    before = parameters(trainer.model)

    trainer.train()

    after = parameters(trainer.model)
    assert all(not torch.equal(before[name], after[name]) for name in before)
    logs = [entry for entry in trainer.state.log_history if "env/success_rate" in entry]
    assert len(logs) == 3
    for name in LOGGED_METRICS:
        assert all(np.isfinite(entry[name]) for entry in logs), name
    assert all(entry["env/step_samples"] >= 4 for entry in logs)  # 2 tasks x 2 copies, at least one step each
    assert "timing/update_s" in logs[-1]
    trainer.close_environments()


def test_scripted_rollout_gives_the_hand_computed_step_rows_and_advantages(tmp_path, tiny_model_path):
    config = cpu_config(tmp_path, env_name="corridor", per_device_train_batch_size=2, steps_per_generation=1,
                        gradient_accumulation_steps=1, max_env_steps=6)
    trainer = ScriptedTrainer(tiny_model_path, args=config, train_dataset=task_dataset([1]))  # corridor of 4 cells
    trainer.model.train()  # as during Trainer.train(): the training path
    rows = [trainer.train_dataset[0]] * 2

    batch = trainer._generate_and_score_completions(rows)

    # Copy 0 walks right (its 2nd answer breaks the format); copy 1 first bumps left in cell 0.
    # Rollout order: turn by turn, copy 0 before copy 1.
    expected = {
        "trajectory_ids": [0, 1, 0, 1, 0, 1, 1],
        "step_indices": [0, 0, 1, 1, 2, 2, 3],
        "anchor_keys": [(4, 0), (4, 0), (4, 1), (4, 0), (4, 2), (4, 1), (4, 2)],
        "rewards": [0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0],
        "invalid": [False, False, True, False, False, False, False],
    }
    steps = trainer.last_rollout.steps
    assert [s.trajectory for s in steps] == expected["trajectory_ids"]
    assert [s.step for s in steps] == expected["step_indices"]
    assert [s.anchor for s in steps] == expected["anchor_keys"]
    assert [s.reward for s in steps] == expected["rewards"]
    assert [not s.valid for s in steps] == expected["invalid"]
    assert [s.action for s in steps] == ["right", "left", "right", "right", "right", "right", "right"]
    assert [(e.length, e.won, e.truncated) for e in trainer.last_rollout.episodes] == [(3, True, False), (4, True, False)]

    by_hand = compute_gigpo_advantages(group_ids=[0] * 7, **expected)
    assert batch["advantages"].shape == (7,)  # one process, steps_per_generation 1: no padding rows
    np.testing.assert_array_equal(batch["advantages"].numpy(), by_hand.advantages.astype(np.float32))
    assert (by_hand.step_advantages != 0).any()  # the check is not vacuous
    decoded = trainer.processing_class.batch_decode(batch["completion_ids"][2], skip_special_tokens=True)
    assert "".join(decoded) == "I go right"
    assert torch.equal(batch["tool_mask"].sum(1) > 0, torch.ones(7, dtype=torch.bool))
    trainer.close_environments()


def test_padding_rows_carry_no_loss_and_no_advantage(tmp_path, tiny_model_path):
    # 7 step samples split into 4 micro-batches: one zero-weight padding row makes 8.
    config = cpu_config(tmp_path, env_name="corridor", per_device_train_batch_size=1, steps_per_generation=4,
                        gradient_accumulation_steps=4, max_env_steps=6)
    trainer = ScriptedTrainer(tiny_model_path, args=config, train_dataset=task_dataset([1, 2]))
    trainer.model.train()  # as during Trainer.train(): the training path

    batch = trainer._generate_and_score_completions([trainer.train_dataset[0]] * 2)

    assert batch["advantages"].shape == (8,)
    assert batch["tool_mask"][7].sum() == 0 and batch["advantages"][7] == 0
    assert torch.equal(batch["completion_ids"][7], batch["completion_ids"][0])  # a duplicate of a real row
    assert batch["num_items_in_batch"] == (batch["completion_mask"] * batch["tool_mask"]).sum()
    trainer.close_environments()


def test_memory_bound_caps_the_rows_of_every_forward_pass_with_long_episodes(tmp_path, tiny_model_path):
    class RecordingTrainer(GiGPOTrainer):
        rows_per_forward: list[int] = []

        def _compute_loss(self, model, inputs):
            self.rows_per_forward.append(inputs["prompt_ids"].shape[0])
            return super()._compute_loss(model, inputs)

    config = cpu_config(tmp_path, env_name="corridor", per_device_train_batch_size=2, max_env_steps=20, max_steps=1,
                        max_step_samples_per_micro_batch=3)
    dataset = task_dataset([0, 1], options=[{"length": 40}] * 2)  # episodes never end: 4 x 20 = 80 samples
    trainer = RecordingTrainer(tiny_model_path, args=config, train_dataset=dataset)

    with pytest.warns(UserWarning, match="74 step samples were left out"):
        trainer.train()

    assert RecordingTrainer.rows_per_forward == [3, 3]  # bound 3 rows, 2 micro-batches: 6 of 80 samples
    log = next(e for e in trainer.state.log_history if "gigpo/subsampled_rows" in e)
    assert log["gigpo/subsampled_rows"] == 74 and log["env/step_samples"] == 80
    trainer.close_environments()


def test_lora_trains_the_adapter_only_with_the_disabled_adapter_as_reference(tmp_path, tiny_model_path):
    config = cpu_config(tmp_path, beta=0.01)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GiGPOTrainer(tiny_model_path, args=config, train_dataset=task_dataset(range(8)), peft_config=lora)
    before = parameters(trainer.model)

    trainer.train()

    after = parameters(trainer.model)
    adapter = [name for name in before if "lora_" in name]
    assert adapter and all(not torch.equal(before[n], after[n]) for n in adapter)
    assert all(torch.equal(before[n], after[n]) for n in before if n not in adapter)
    assert all("kl" in entry for entry in trainer.state.log_history if "env/success_rate" in entry)
    trainer.close_environments()


def test_resume_from_a_checkpoint_continues_training(tmp_path, tiny_model_path):
    first = GiGPOTrainer(tiny_model_path, args=cpu_config(tmp_path, save_strategy="steps", save_steps=2),
                         train_dataset=task_dataset(range(12)))
    first.train()
    first.close_environments()
    assert (tmp_path / "checkpoint-2").is_dir()

    resumed = GiGPOTrainer(tiny_model_path, args=cpu_config(tmp_path, max_steps=3), train_dataset=task_dataset(range(12)))
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))

    assert resumed.state.global_step == 3
    steps_logged = [entry["step"] for entry in resumed.state.log_history if "env/success_rate" in entry]
    assert steps_logged[-1] == 3 and 1 in steps_logged  # history restored from the checkpoint, then step 3
    resumed.close_environments()


def test_evaluation_on_held_out_seeds_reports_the_success_rate(tmp_path, tiny_model_path):
    config = cpu_config(tmp_path, env_name="corridor", eval_greedy=True, per_device_eval_batch_size=2)
    held_out = task_dataset([100, 101], options=[{"length": 4}, {"length": 6}])
    trainer = ScriptedTrainer(tiny_model_path, args=config, train_dataset=task_dataset(range(4)), eval_dataset=held_out)

    metrics = trainer.evaluate()

    # The scripted walk needs 3-4 steps for 4 cells and 5-6 for 6 cells: with max_env_steps=4 the
    # copies of the first task win, those of the second are cut off.
    assert metrics["eval_env/success_rate"] == pytest.approx(0.5)
    assert metrics["eval_env/truncated_share"] == pytest.approx(0.5)
    trainer.close_environments()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"gamma": 1.5}, r"gamma=1.5 must be in \[0, 1\]"),
        ({"advantage_norm": "std"}, r"advantage_norm='std' is not one of"),
        ({"episode_stats": "episodes"}, "episode_stats='episodes' is not one of"),
        ({"loss_type": "grpo"}, "loss_type='grpo' normalizes per row or per micro-batch"),
        ({"max_env_steps": 0}, "max_env_steps=0 must be >= 1"),
        ({"similarity_threshold": 1.5}, "similarity_threshold=1.5"),
        ({"env_kwargs": "{not json"}, "env_kwargs must be a dict or a JSON object string"),
    ],
)
def test_config_rejects_invalid_combinations_naming_the_fields(tmp_path, overrides, message):
    settings = {"num_generations": 4, "per_device_train_batch_size": 4, **overrides}
    with pytest.raises(ValueError, match=message):
        cpu_config(tmp_path, **settings)


def test_cpu_config_defaults_to_fp32_and_keeps_an_explicit_choice(tmp_path):
    assert cpu_config(tmp_path).bf16 is False
    assert GiGPOConfig(output_dir=str(tmp_path), report_to=[], env_kwargs='{"num_boxes": 2}').env_kwargs == {"num_boxes": 2}


def test_a_dataset_without_seeds_or_with_too_few_tasks_is_rejected(tmp_path, tiny_model_path):
    from datasets import Dataset

    with pytest.raises(ValueError, match="train_dataset needs a 'seed' column"):
        GiGPOTrainer(tiny_model_path, args=cpu_config(tmp_path), train_dataset=Dataset.from_dict({"prompt": ["hi"] * 4}))
    with pytest.raises(ValueError, match="train_dataset has 3 tasks, but one rollout needs .* = 4 distinct tasks"):
        GiGPOTrainer(tiny_model_path, args=cpu_config(tmp_path), train_dataset=task_dataset(range(3)))


def test_tasks_from_rows_detects_split_groups():
    rows = [{"seed": 1, "options": ""}, {"seed": 1, "options": ""}, {"seed": 2, "options": '{"length": 5}'}, {"seed": 3}]
    assert [t.seed for t in tasks_from_rows(rows[:2], 2)] == [1]
    with pytest.raises(RuntimeError, match="should be 2 copies of one task"):
        tasks_from_rows(rows, 2)


def test_completion_logs_hold_each_step_prompt_answer_reward_and_advantage(tmp_path, tiny_model_path):
    config = cpu_config(tmp_path, env_name="corridor", per_device_train_batch_size=2, steps_per_generation=1,
                        gradient_accumulation_steps=1, max_env_steps=6, log_completions=True)
    trainer = ScriptedTrainer(tiny_model_path, args=config, train_dataset=task_dataset([1]))
    trainer.model.train()

    batch = trainer._generate_and_score_completions([trainer.train_dataset[0]] * 2)

    assert len(trainer._logs["prompt"]) == len(trainer._logs["completion"]) == 7
    assert "Reach the last cell." in trainer._logs["prompt"][0][-1]["content"]  # the real prompt, task included
    assert trainer._logs["completion"][2] == "I go right"
    assert list(trainer._logs["rewards"]["environment_reward"]) == [0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    np.testing.assert_allclose(trainer._logs["advantages"], batch["advantages"].numpy(), rtol=1e-6)
    trainer.close_environments()
