"""GiGPOTrainer on CPU with a tiny local model and real environments."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from peft import LoraConfig
from scripted_policy import scripted_trainer
from trainer_helpers import cpu_config, parameters, settings_config

from gigpo_trl.advantages import compute_gigpo_advantages
from gigpo_trl.tasks import task_dataset
from gigpo_trl.trainer import GiGPOTrainer

pytestmark = pytest.mark.timeout(300)

LOGGED_METRICS = [
    "env/success_rate", "env/return_mean", "env/episode_length_mean", "env/truncated_share", "env/invalid_action_rate",
    "gigpo/singleton_share", "gigpo/step_group_size_mean", "gigpo/step_group_size_max",
    "gigpo/nonzero_step_advantage_share", "gigpo/episode_advantage_mean", "gigpo/episode_advantage_std",
    "gigpo/step_advantage_mean", "gigpo/step_advantage_std", "timing/rollout_s", "timing/generation_s",
    "timing/advantages_s", "generation/tokens_per_s",
]


@pytest.mark.parametrize(
    ("trainer_class", "env_name"),
    [
        (GiGPOTrainer, "sokoban"),  # the tiny model's own answers: the step penalty already varies the returns
        (scripted_trainer, "textworld"),  # admissible commands drawn at random: some copies find the treasure
    ],
)
@pytest.mark.slow
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


@pytest.mark.parametrize("step_lambda", [1.0, 0.0])
def test_scripted_rollout_gives_the_hand_computed_step_rows_and_advantages(tmp_path, tiny_model_path, step_lambda):
    config = cpu_config(tmp_path, env_name="corridor", per_device_train_batch_size=2, steps_per_generation=1,
                        gradient_accumulation_steps=1, max_env_steps=6, step_advantage_lambda=step_lambda)
    trainer = scripted_trainer(tiny_model_path, args=config, train_dataset=task_dataset([1]))  # corridor of 4 cells
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
    assert steps.trajectory == expected["trajectory_ids"]
    assert steps.step == expected["step_indices"]
    assert steps.anchor == expected["anchor_keys"]
    assert steps.reward == expected["rewards"]
    assert [not valid for valid in steps.valid] == expected["invalid"]
    assert steps.action == ["right", "left", "right", "right", "right", "right", "right"]
    assert [(e.length, e.won, e.truncated) for e in trainer.last_rollout.episodes] == [(3, True, False), (4, True, False)]

    by_hand = compute_gigpo_advantages(group_ids=[0] * 7, **expected, step_lambda=step_lambda)
    assert batch["advantages"].shape == (7,)  # one process, steps_per_generation 1: no padding rows
    np.testing.assert_array_equal(batch["advantages"].numpy(), by_hand.advantages.astype(np.float32))
    assert (by_hand.step_advantages != 0).any()  # the check is not vacuous
    other_lambda = compute_gigpo_advantages(group_ids=[0] * 7, **expected, step_lambda=1.0 - step_lambda)
    assert not np.array_equal(by_hand.advantages, other_lambda.advantages)  # nor is the setting
    decoded = trainer.processing_class.batch_decode(batch["completion_ids"][2], skip_special_tokens=True)
    assert "".join(decoded) == "I go right"
    assert torch.equal(batch["tool_mask"].sum(1) > 0, torch.ones(7, dtype=torch.bool))
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


def test_an_fp32_lm_head_under_lora_on_tied_embeddings_is_refused_by_name(tmp_path, tiny_model_path):
    """The tiny model ties its LM head to its embeddings, as SmolLM2 does: TRL's cast would fail deep in its
    constructor on the PEFT wrapper, so the trainer refuses it first; untied or without PEFT it is TRL's."""
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    with pytest.raises(ValueError, match="cast_lm_head_to_fp32=True cannot run with a PEFT adapter.*tied"):
        GiGPOTrainer(tiny_model_path, args=cpu_config(tmp_path, cast_lm_head_to_fp32=True),
                     train_dataset=task_dataset(range(8)), peft_config=lora)


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


def test_a_non_finite_reward_ends_its_trajectory_as_an_environment_failure(tmp_path, tiny_model_path):
    from toy_envs import Corridor

    from gigpo_trl.envs import register_env

    class NaNOnSecondStep(Corridor):
        def step(self, action):
            observation, reward, terminated, truncated, info = super().step(action)
            self.steps = getattr(self, "steps", 0) + 1
            return observation, float("nan") if self.steps == 2 else reward, terminated, truncated, info

    register_env("nan_on_second_step", NaNOnSecondStep, overwrite=True)
    trainer = GiGPOTrainer(tiny_model_path, args=settings_config(tmp_path, env_name="nan_on_second_step", max_env_steps=4,
                                                        env_processes=False, max_steps=1, logging_steps=1),
                           train_dataset=task_dataset([3, 3, 3, 3]))  # 6-cell corridors: no episode ends in 1 step
    trainer.train()  # before: ValueError from the advantage pass ("rewards ... NaN")

    log = next(entry for entry in trainer.state.log_history if "env/env_error_share" in entry)
    assert log["env/env_error_share"] == 1.0 and log["env/truncated_share"] == 1.0
    assert all(np.isfinite(log[key]) for key in ("gigpo/episode_advantage_std", "gigpo/step_advantage_std", "loss"))
    trainer.close_environments()


def test_a_pushed_model_card_cites_gigpo_and_not_grpos_paper(tmp_path, tiny_model_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import OfflineModeIsEnabled

    trainer = GiGPOTrainer(tiny_model_path, args=settings_config(tmp_path, max_steps=1),
                           train_dataset=task_dataset(range(4)))
    # TRL's push_to_hub saves the model, writes the card into output_dir (create_model_card), then uploads the folder.
    # The Hub is not reachable from the tests: offline mode makes the upload the one step that fails, and the repository
    # id stands for the one init_hf_repo would have created there.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    trainer.hub_model_id = "someone/gigpo-sokoban"
    with pytest.raises(OfflineModeIsEnabled):
        trainer.push_to_hub()

    card = huggingface_hub.ModelCard.load(tmp_path / "README.md")
    assert {"trl", "gigpo"} <= set(card.data.tags) and "grpo" not in card.data.tags
    assert ("trained with GiGPO, a method introduced in [Group-in-Group Policy Optimization for LLM Agent Training]"
            "(https://huggingface.co/papers/2505.10978)") in card.text
    assert "Cite GiGPO as:" in card.text and "@article{feng2025group," in card.text
    assert "author       = {Lang Feng and Zhenghai Xue and Tingcong Liu and Bo An}" in card.text
    assert "DeepSeekMath" not in card.text and "2402.03300" not in card.text
    trainer.close_environments()
