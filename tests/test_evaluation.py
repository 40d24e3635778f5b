"""Held-out evaluation: success on held-out seeds, and the evaluation loss in passes of bounded size."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scripted_policy import ScriptedTrainer
from trainer_helpers import cpu_config, settings_config

from gigpo_trl.tasks import task_dataset
from gigpo_trl.trainer import GiGPOTrainer

pytestmark = pytest.mark.timeout(300)


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


def forward_batch_sizes(model) -> list[int]:
    """Records the batch size of every scoring forward pass of the (real) model: the loss's and the log-probs'
    (TRL scores with `fused_lm_head=True`), not generation's."""
    sizes: list[int] = []

    def record(module, args, kwargs):
        if kwargs.get("fused_lm_head"):
            sizes.append(kwargs["input_ids"].size(0))

    model.register_forward_pre_hook(record, with_kwargs=True)
    return sizes


def test_the_evaluation_loss_runs_in_passes_of_at_most_the_bound_and_equals_one_pass(tmp_path, tiny_model_path):
    settings = dict(env_name="sokoban", max_env_steps=3, env_processes=False, per_device_eval_batch_size=4,
                    num_generations_eval=2, max_step_samples_per_micro_batch=3)
    trainer = GiGPOTrainer(tiny_model_path, args=settings_config(tmp_path, **settings), train_dataset=task_dataset(range(4)),
                           eval_dataset=task_dataset(range(100, 102)))
    trainer.model.eval()
    inputs = trainer._prepare_inputs([{"seed": seed, "options": ""} for seed in (100, 100, 101, 101)])
    assert inputs["prompt_ids"].size(0) == 12  # 4 episodes x 3 steps: every sample kept, none drawn out
    sizes = forward_batch_sizes(trainer.model)

    with torch.no_grad():
        in_parts = trainer._loss_in_passes(trainer.model, inputs, 3, backward=False)
        assert sizes == [3, 3, 3, 3]
        whole = trainer.compute_loss(trainer.model, inputs)
    torch.testing.assert_close(in_parts, whole, rtol=1e-5, atol=1e-7)

    sizes.clear()
    metrics = trainer.evaluate()
    assert np.isfinite(metrics["eval_loss"]) and sizes and max(sizes) <= 3
    trainer.close_environments()
