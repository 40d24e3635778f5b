"""From step samples to TRL's batch (`gigpo_trl.batch`): which samples become rows, the zero-weight padding rows that
keep processes in lock-step, and TRL's loss and its metrics left exact by them."""

from __future__ import annotations

import pytest
import torch
from scripted_policy import scripted_trainer
from trainer_helpers import cpu_config, settings_config, step_samples
from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

from gigpo_trl.batch import loss_batch
from gigpo_trl.config import SUPPORTED_LOSS_TYPES
from gigpo_trl.tasks import task_dataset
from gigpo_trl.trainer import GiGPOTrainer

pytestmark = pytest.mark.timeout(300)


def update_gradient(trainer: GiGPOTrainer, completions, weights, advantages, shuffle_seed: int) -> torch.Tensor:
    """The summed gradient of one update: the rows shuffled and split into steps_per_generation micro-batches,
    exactly as GRPOTrainer._prepare_inputs does, each micro-batch's loss back-propagated."""
    trainer.model.train()
    trainer.model.zero_grad()
    batch = loss_batch(trainer, completions, weights, [a * w for a, w in zip(advantages, weights)], "train")
    torch.manual_seed(shuffle_seed)
    for micro_batch in split_tensor_dict(shuffle_sequence_dict(batch), trainer.args.steps_per_generation):
        trainer.compute_loss(trainer.model, micro_batch).backward()
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("loss_type", SUPPORTED_LOSS_TYPES)
def test_padding_rows_leave_the_update_gradient_unchanged_for_every_allowed_loss(tmp_path, tiny_model_path, loss_type,
                                                                                 packed):
    # Packed, the padding rows share the trie of the real rows they copy, and a pass's packed rows differ in shape
    # from the reference's: equal within the packed path's fp32 rounding (tests/test_packing.py's tolerance).
    trainer = GiGPOTrainer(tiny_model_path, args=settings_config(tmp_path, loss_type=loss_type, packed_update=packed),
                           train_dataset=task_dataset(range(4)))
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    completions, advantages = step_samples(trainer.model.config.vocab_size, 2, seed=1)
    reference = update_gradient(trainer, completions, [1.0, 1.0], advantages, shuffle_seed=0)
    assert reference.abs().sum() > 0

    # 2 real rows padded to 8 the way _rows_for_update pads (copies of real rows, loss weight 0), under
    # shuffles that put the real rows in one micro-batch or in both.
    padding = [completions[k % 2] for k in range(6)]
    for shuffle_seed in range(6):
        padded = update_gradient(trainer, completions + padding, [1.0, 1.0] + [0.0] * 6, advantages + [9.0] * 6,
                                 shuffle_seed)
        if packed:
            torch.testing.assert_close(padded, reference, rtol=0, atol=1e-4 * reference.abs().max().item())
        else:
            torch.testing.assert_close(padded, reference, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", SUPPORTED_LOSS_TYPES)
def test_loss_metrics_of_a_micro_batch_leave_its_padding_rows_out(tmp_path, tiny_model_path, loss_type, level):
    trainer = GiGPOTrainer(tiny_model_path, args=settings_config(tmp_path, loss_type=loss_type, importance_sampling_level=level,
                                                        epsilon=0.05), train_dataset=task_dataset(range(4)))
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    trainer.model.train()
    completions, advantages = step_samples(trainer.model.config.vocab_size, 3, seed=4)
    advantages = [1.5, -1.0, -0.5]
    rows = completions + [completions[0], completions[1]]  # 3 real rows, 2 padding rows as _rows_for_update makes them
    weights = [1.0, 1.0, 1.0, 0.0, 0.0]
    batch = loss_batch(trainer, rows, weights, [a * w for a, w in zip(advantages + [0.0, 0.0], weights)], "train")
    # Old log-probs away from the current ones, so that ratios move and clipping happens.
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        current, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1), batch["completion_ids"].size(1))
    batch["old_per_token_logps"] = current + torch.randn(current.shape, generator=generator) * 0.3

    def logged_metrics(micro_batch) -> dict[str, float]:
        trainer._metrics["train"].clear()
        trainer.compute_loss(trainer.model, micro_batch)
        return {key: values[-1] for key, values in trainer._metrics["train"].items() if values}

    real_only = {key: value[:3] if isinstance(value, torch.Tensor) and value.dim() else value for key, value in batch.items()}
    with_padding, without = logged_metrics(batch), logged_metrics(real_only)
    assert with_padding.keys() == without.keys() and "entropy" in with_padding
    for key in without:
        assert with_padding[key] == pytest.approx(without[key], rel=1e-5, abs=1e-7), key
    if loss_type == "dapo":
        assert 0.0 < without["clip_ratio/region_mean"] < 1.0  # the check is not vacuous

    padding_only = {key: value[3:] if isinstance(value, torch.Tensor) and value.dim() else value for key, value in batch.items()}
    assert logged_metrics(padding_only) == {}
    trainer.close_environments()


def test_padding_rows_carry_no_loss_and_no_advantage(tmp_path, tiny_model_path):
    # 7 step samples split into 4 micro-batches: one zero-weight padding row makes 8.
    config = cpu_config(tmp_path, env_name="corridor", per_device_train_batch_size=1, steps_per_generation=4,
                        gradient_accumulation_steps=4, max_env_steps=6)
    trainer = scripted_trainer(tiny_model_path, args=config, train_dataset=task_dataset([1, 2]))
    trainer.model.train()  # as during Trainer.train(): the training path

    batch = trainer._generate_and_score_completions([trainer.train_dataset[0]] * 2)

    assert batch["advantages"].shape == (8,)
    assert batch["tool_mask"][7].sum() == 0 and batch["advantages"][7] == 0
    assert torch.equal(batch["completion_ids"][7], batch["completion_ids"][0])  # a duplicate of a real row
    assert batch["num_items_in_batch"] == (batch["completion_mask"] * batch["tool_mask"]).sum()
    trainer.close_environments()


def test_memory_bound_caps_the_rows_of_every_forward_pass_and_every_sample_trains(tmp_path, tiny_model_path):
    class RecordingTrainer(GiGPOTrainer):
        rows_per_forward: list[int] = []

        def _compute_loss(self, model, inputs):
            self.rows_per_forward.append(inputs["prompt_ids"].shape[0])
            return super()._compute_loss(model, inputs)

    config = cpu_config(tmp_path, env_name="corridor", per_device_train_batch_size=2, max_env_steps=20, max_steps=1,
                        max_step_samples_per_micro_batch=3)
    dataset = task_dataset([0, 1], options=[{"length": 40}] * 2)  # episodes never end: 4 x 20 = 80 samples
    trainer = RecordingTrainer(tiny_model_path, args=config, train_dataset=dataset)

    trainer.train()

    # 2 micro-batches of 40 rows, each in passes of at most 3 rows: 14 passes of 3 and one of 1 per micro-batch.
    assert RecordingTrainer.rows_per_forward == ([3] * 13 + [1]) * 2
    log = next(e for e in trainer.state.log_history if "env/step_samples" in e)
    assert log["env/step_samples"] == 80 and log["gigpo/update_step_samples"] == 80
    trainer.close_environments()


def test_pad_to_multiple_of_pads_the_batch_like_trl(tmp_path, tiny_model_path):
    trainer = GiGPOTrainer(tiny_model_path, args=settings_config(tmp_path, pad_to_multiple_of=16), train_dataset=task_dataset(range(4)))
    completions, advantages = step_samples(trainer.model.config.vocab_size, 4, seed=2)
    batch = loss_batch(trainer, completions, [1.0] * 4, advantages, "train")
    assert batch["prompt_ids"].shape[1] == 16 and batch["completion_ids"].shape[1] == 16
    assert batch["prompt_mask"].sum() == sum(len(c.prompt_ids) for c in completions)
    assert batch["completion_mask"].sum() == sum(len(c.completion_ids) for c in completions)
