"""The loss around TRL's (`gigpo_trl.loss`, `GiGPOTrainer.compute_loss`): a micro-batch run in row chunks under the
memory bound gives the loss and gradient of one pass, and the entropy bonus is `entropy_coef` times the token-mean
entropy of the rollout's real tokens, whatever the micro-batch split and the lock-step padding rows. Checked against
direct computations on the same tokens."""

from __future__ import annotations

import pytest
import torch
from trainer_helpers import cpu_config, settings_config, step_samples

from gigpo_trl.batch import loss_batch
from gigpo_trl.loss import entropy_bonus, next_entropy_coef, rollout_token_normalizer, row_chunks
from gigpo_trl.tasks import task_dataset
from gigpo_trl.trainer import GiGPOTrainer

pytestmark = pytest.mark.timeout(300)


def test_row_chunks_slice_every_row_tensor_and_share_the_rollout_token_count():
    inputs = {"prompt_ids": torch.arange(10).view(5, 2), "advantages": torch.arange(5.0),
              "num_items_in_batch": torch.tensor(17)}
    chunks = row_chunks(inputs, 2)
    assert [chunk["prompt_ids"].shape[0] for chunk in chunks] == [2, 2, 1]
    assert torch.equal(torch.cat([chunk["advantages"] for chunk in chunks]), inputs["advantages"])
    assert all(chunk["num_items_in_batch"] is inputs["num_items_in_batch"] for chunk in chunks)
    assert row_chunks(inputs, None) == [inputs] and row_chunks(inputs, 5) == [inputs]


def test_rollout_token_normalizer_and_bonus_give_the_token_mean_over_an_optimizer_step():
    # 2 processes x 2 micro-batches (steps_per_generation = gradient_accumulation_steps = 2), 10 real tokens in all:
    # the DDP mean of the processes' summed micro-batch bonuses is the mean entropy of the 10 tokens.
    entropies = [torch.tensor([[1.0, 2.0, 0.0]]), torch.tensor([[3.0, 0.0, 0.0]]),  # process 0's micro-batches
                 torch.tensor([[4.0, 5.0, 6.0]]), torch.tensor([[7.0, 8.0, 9.0]])]  # process 1's
    masks = [torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([[1.0, 0.0, 0.0]]), torch.ones(1, 3), torch.ones(1, 3)]
    normalizer = rollout_token_normalizer(torch.tensor(9.0), num_processes=2, accumulation_steps=2,
                                          steps_per_generation=2)
    per_process = [sum(entropy_bonus(h, m, normalizer, 0.5) for h, m in zip(entropies[k:k + 2], masks[k:k + 2]))
                   for k in (0, 2)]
    real = torch.cat([h[m.bool()] for h, m in zip(entropies, masks)])
    assert real.numel() == 9
    assert sum(per_process) / 2 == pytest.approx(0.5 * real.mean().item())
    assert rollout_token_normalizer(torch.tensor(9.0), num_processes=2, accumulation_steps=None,
                                    steps_per_generation=2) == pytest.approx(4.5)  # evaluation


def test_adaptive_entropy_coef_rises_below_the_target_and_falls_above_within_its_bounds():
    bounds = dict(target=0.2, delta=0.005, minimum=0.0, maximum=0.012)
    assert next_entropy_coef(0.01, 0.1, **bounds) == pytest.approx(0.012)  # raised, capped at the maximum
    assert next_entropy_coef(0.01, 0.2, **bounds) == pytest.approx(0.012)  # at the target: raised
    assert next_entropy_coef(0.004, 0.5, **bounds) == 0.0  # lowered, floored at the minimum


def batch_with_padding(trainer: GiGPOTrainer, advantages_zero: bool = False) -> dict:
    """6 step samples of different lengths (advantages of both signs, or all 0) and 2 zero-weight padding rows, as
    the lock-step keeps them."""
    completions, advantages = step_samples(trainer.model.config.vocab_size, 6, seed=3)
    completions += completions[:2]
    weights = [1.0] * 6 + [0.0] * 2
    advantages = [0.0 if advantages_zero else a * w for a, w in zip(advantages + [0.0, 0.0], weights)]
    return loss_batch(trainer, completions, weights, advantages, "train")


def loss_and_gradient(trainer: GiGPOTrainer, micro_batches: list[dict]) -> tuple[float, torch.Tensor]:
    """The summed loss and gradient of micro-batches run as the Trainer runs them: `compute_loss`, then the
    accelerator's backward pass."""
    trainer.model.train()
    trainer.model.zero_grad()
    total = 0.0
    for micro_batch in micro_batches:
        loss = trainer.compute_loss(trainer.model, micro_batch)
        trainer.accelerator.backward(loss)
        total += loss.item()
    return total, torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])


@pytest.mark.parametrize("entropy_coef", [0.0, 0.05])
def test_a_micro_batch_in_chunks_of_the_bound_gives_the_loss_and_gradient_of_one_pass(tmp_path, tiny_model_path,
                                                                                      entropy_coef):
    trainer = GiGPOTrainer(tiny_model_path, args=settings_config(tmp_path, entropy_coef=entropy_coef),
                           train_dataset=task_dataset(range(4)))
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    batch = batch_with_padding(trainer)
    whole_loss, whole = loss_and_gradient(trainer, [batch])
    assert whole.abs().sum() > 0

    passes = []
    original = trainer._compute_loss
    trainer._compute_loss = lambda model, inputs: passes.append(inputs["prompt_ids"].shape[0]) or original(model, inputs)
    trainer.args.max_step_samples_per_micro_batch = 3
    chunked_loss, chunked = loss_and_gradient(trainer, [batch])

    assert passes == [3, 3, 2]  # 8 rows in passes of at most the bound
    assert chunked_loss == pytest.approx(whole_loss, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-8)


def direct_entropy_gradient(trainer: GiGPOTrainer, batch: dict, coef: float) -> torch.Tensor:
    """The gradient of `-coef * mean entropy` over the batch's real completion tokens, from the model's logits at the
    sampling temperature, without TRL's forward pass."""
    trainer.model.zero_grad()
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    completion_length = batch["completion_ids"].size(1)
    logits = trainer.model(input_ids=input_ids, attention_mask=attention_mask).logits
    logits = logits[:, -completion_length - 1 : -1] / trainer.temperature  # the logits that predict each answer token
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)  # (B, C)
    mask = (batch["completion_mask"] * batch["tool_mask"]).float()
    (-coef * (entropy * mask).sum() / mask.sum()).backward()
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])


def test_entropy_bonus_gradient_is_that_of_the_token_mean_entropy_of_the_real_tokens_over_uneven_micro_batches(
        tmp_path, tiny_model_path):
    # Two micro-batches of 4 rows: the first holds 4 real rows, the second 2 real rows and the 2 padding rows, so their
    # token counts differ. A bonus averaged per micro-batch (TRL's) would weigh the second micro-batch's few tokens as
    # much as the first's many; the exact one weighs every real token alike. Advantages are 0: the policy term has no
    # gradient, and what remains is the bonus's.
    coef = 0.05
    trainer = GiGPOTrainer(tiny_model_path, args=cpu_config(tmp_path, entropy_coef=coef, temperature=0.7),
                           train_dataset=task_dataset(range(4)))
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps  # 2, one per micro-batch
    batch = batch_with_padding(trainer, advantages_zero=True)
    micro_batches = row_chunks(batch, 4)
    assert [m["tool_mask"].any(dim=1).sum().item() for m in micro_batches] == [4, 2]

    _, gradient = loss_and_gradient(trainer, micro_batches)
    expected = direct_entropy_gradient(trainer, batch, coef)

    assert expected.abs().max() > 0
    torch.testing.assert_close(gradient, expected, rtol=1e-4, atol=1e-7)
    assert trainer._metrics["train"]["entropy_coef"][-1] == coef


def current_logps(trainer: GiGPOTrainer, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1), batch["completion_ids"].size(1))
    return logps


def real_rows_only(batch: dict, count: int = 6) -> dict:
    return {key: value[:count] if isinstance(value, torch.Tensor) and value.dim() else value for key, value in batch.items()}


@pytest.mark.parametrize("knob", [dict(epsilon_high=0.28), dict(beta=0.05), dict(top_entropy_quantile=0.5),
                                  dict(entropy_coef=0.05), dict(use_adaptive_entropy=True, entropy_coef=0.05)])
def test_trls_loss_knobs_give_the_same_loss_gradient_and_metrics_with_the_padding_rows_as_without(tmp_path, tiny_model_path,
                                                                                                 knob):
    trainer = GiGPOTrainer(tiny_model_path, args=settings_config(tmp_path, num_iterations=2, **knob),
                           train_dataset=task_dataset(range(4)))
    trainer.current_gradient_accumulation_steps = trainer.args.steps_per_generation
    batch = batch_with_padding(trainer)
    # Old log-probs away from the current ones (as after an update): ratios move, and clipping happens.
    generator = torch.Generator().manual_seed(0)
    batch["old_per_token_logps"] = current_logps(trainer, batch) + torch.randn(batch["completion_ids"].shape,
                                                                              generator=generator) * 0.3

    def run(micro_batch):
        trainer._metrics["train"].clear()
        trainer._last_world_entropy, trainer.entropy_coef = 0.0, trainer.args.entropy_coef  # adaptive: it applies
        loss, gradient = loss_and_gradient(trainer, [micro_batch])
        return loss, gradient, {key: values[-1] for key, values in trainer._metrics["train"].items() if values}

    padded_loss, padded_gradient, padded_metrics = run(batch)
    loss, gradient, metrics = run(real_rows_only(batch))
    assert padded_loss == pytest.approx(loss, rel=1e-5)
    torch.testing.assert_close(padded_gradient, gradient, rtol=1e-5, atol=1e-8)
    assert padded_metrics.keys() == metrics.keys()
    for key in metrics:
        assert padded_metrics[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize(("epsilon_high", "clipped"), [(None, True), (0.28, False)])
def test_epsilon_high_sets_the_upper_clip_of_positive_advantages(tmp_path, tiny_model_path, epsilon_high, clipped):
    # Every token's ratio to the old policy is 1.25: above 1 + epsilon (0.2), below 1 + 0.28.
    trainer = GiGPOTrainer(tiny_model_path, args=settings_config(tmp_path, num_iterations=2, epsilon_high=epsilon_high),
                           train_dataset=task_dataset(range(4)))
    trainer.current_gradient_accumulation_steps = trainer.args.steps_per_generation
    batch = batch_with_padding(trainer)
    batch["advantages"] = batch["advantages"].abs() * batch["tool_mask"][:, 0]  # positive on the real rows
    batch["old_per_token_logps"] = current_logps(trainer, batch) - torch.log(torch.tensor(1.25))
    trainer._metrics["train"].clear()
    _, gradient = loss_and_gradient(trainer, [batch])
    assert trainer._metrics["train"]["clip_ratio/high_mean"][-1] == (1.0 if clipped else 0.0)
    assert (gradient.abs().max() == 0) == clipped  # a clipped ratio passes no gradient


def test_the_kl_term_is_the_k3_estimate_over_the_real_tokens_only(tmp_path, tiny_model_path):
    trainer = GiGPOTrainer(tiny_model_path, args=settings_config(tmp_path, beta=0.05), train_dataset=task_dataset(range(4)))
    trainer.current_gradient_accumulation_steps = trainer.args.steps_per_generation
    batch = batch_with_padding(trainer)
    logps = current_logps(trainer, batch)
    offset = torch.where(batch["tool_mask"].bool(), 0.1, 3.0)  # padding rows: far from the reference, if they counted
    batch["ref_per_token_logps"] = logps + offset
    trainer._metrics["train"].clear()
    loss_and_gradient(trainer, [batch])
    expected = torch.exp(torch.tensor(0.1)) - 0.1 - 1  # k3: exp(ref - logp) - (ref - logp) - 1
    assert trainer._metrics["train"]["kl"][-1] == pytest.approx(expected.item(), rel=1e-4)


def test_an_evaluation_before_any_training_step_computes_the_bonus(tmp_path, tiny_model_path):
    # The Trainer sets its accumulation state in its training loop only; the recipes evaluate before it (eval_on_start).
    config = settings_config(tmp_path, entropy_coef=0.01, max_env_steps=3, env_processes=False,
                             per_device_eval_batch_size=4, num_generations_eval=2)
    trainer = GiGPOTrainer(tiny_model_path, args=config, train_dataset=task_dataset(range(4)),
                           eval_dataset=task_dataset(range(100, 102)))
    assert not hasattr(trainer, "current_gradient_accumulation_steps")
    metrics = trainer.evaluate()
    assert torch.isfinite(torch.tensor(metrics["eval_loss"]))
    trainer.close_environments()
