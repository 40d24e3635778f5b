"""Rollouts that run ahead of the update (`async_staleness`): staleness 0 is the synchronous run exactly; at staleness 1
the behaviour log-probs are the previous weights' and the loss is decoupled PPO's; whole groups, never dropped, within
their bound, under random environment delays; a producer that raises stops the run; what cannot work is refused."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from scripted_policy import scripted_trainer
from toy_envs import Corridor
from transformers import TrainerCallback
from trainer_helpers import cpu_config, parameters

from gigpo_trl.async_rollouts import ProducerFailed, policy_snapshot
from gigpo_trl.batch import behaviour_weighted_advantages, importance_sampling_ratio
from gigpo_trl.config import GiGPOConfig
from gigpo_trl.envs import register_env
from gigpo_trl.records import read_iterations
from gigpo_trl.tasks import task_dataset
from gigpo_trl.trainer import GiGPOTrainer

pytestmark = pytest.mark.timeout(600)


class SlowCorridor(Corridor):
    """The corridor, each step taking a random 0-20 ms (a service's latency): episodes end at different times."""

    def step(self, action):
        time.sleep(random.random() * 0.02)
        return super().step(action)


class UnhashableAnchorLater(Corridor):
    """A corridor whose anchors are lists (unhashable) from seed 100 on: the pool that plays them raises."""

    def _info(self):
        info = super()._info()
        if self.length > 10:
            info["anchor"] = list(info["anchor"])
        return info


register_env("slow_corridor", SlowCorridor, overwrite=True)


def train(tmp_path, model, staleness, **overrides):
    config = cpu_config(tmp_path, env_name="corridor", max_steps=3, async_staleness=staleness, **overrides)
    trainer = scripted_trainer(model, args=config, train_dataset=task_dataset(range(16)))
    trainer.train()
    trainer.close_environments()
    return trainer


def test_staleness_0_is_the_synchronous_run_exactly(tmp_path, tiny_model_path):
    captured = {}

    def capture(trainer):  # every consumed rollout's step samples and advantages, as the loss gets them
        spine = trainer._generate_and_score_completions

        def kept(inputs):
            batch = spine(inputs)
            if trainer.model.training:
                steps = trainer.last_rollout.steps
                captured.setdefault(trainer.args.async_staleness, []).append(
                    ([(c.prompt_ids, c.completion_ids) for c in steps.completion], steps.reward,
                     batch["advantages"].clone()))
            return batch

        trainer._generate_and_score_completions = kept
        return trainer

    runs = {}
    for staleness in (None, 0):
        config = cpu_config(tmp_path / str(staleness), env_name="corridor", max_steps=3, async_staleness=staleness)
        trainer = capture(scripted_trainer(tiny_model_path, args=config, train_dataset=task_dataset(range(16))))
        trainer.train()
        trainer.close_environments()
        runs[staleness] = trainer
    synchronous, produced = captured[None], captured[0]
    assert len(synchronous) == len(produced) == 3
    for (tokens, rewards, advantages), (tokens_0, rewards_0, advantages_0) in zip(synchronous, produced):
        assert tokens == tokens_0 and rewards == rewards_0 and torch.equal(advantages, advantages_0)
    logs = [[{k: v for k, v in entry.items() if not k.startswith(("timing", "async")) and "per_s" not in k
              and k != "step_time"} for entry in runs[key].state.log_history if "loss" in entry] for key in (None, 0)]
    assert logs[0] == logs[1]  # the same losses, entropies, clip ratios, ...
    assert all(torch.equal(p, runs[0].model.get_parameter(name)) for name, p in runs[None].model.named_parameters())
    assert all(entry["async/staleness_max"] == 0 for entry in runs[0].state.log_history if "loss" in entry)


def test_at_staleness_1_the_behaviour_log_probs_are_the_previous_weights_and_the_loss_is_decoupled_ppo(
        tmp_path, tiny_model_path):
    config = cpu_config(tmp_path, env_name="corridor", max_steps=2, async_staleness=1, learning_rate=1e-2,
                        vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=3.0)
    trainer = scripted_trainer(tiny_model_path, args=config, train_dataset=task_dataset(range(16)))
    before = parameters(trainer.model)
    seen = {}
    spine = trainer._generate_and_score_completions

    def kept(inputs):
        batch = spine(inputs)
        seen.setdefault("batches", []).append((trainer.last_rollout, batch, parameters(trainer.model)))
        return batch

    trainer._generate_and_score_completions = kept
    trainer.train()
    trainer.close_environments()
    (first, _, _), (second, batch, weights_at_second) = seen["batches"]
    # rollout 1 was played with the weights before any update (version 0): its behaviour log-probs are theirs
    model = trainer.accelerator.unwrap_model(trainer.model)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(before[name])
        behaviour = trainer._with_behaviour_logps(second, model).steps.completion
        for name, parameter in model.named_parameters():
            parameter.copy_(weights_at_second[name])
    assert all(c.logprobs is not None for c in second.steps.completion)
    for recorded, recomputed in zip(second.steps.completion, behaviour):
        assert recorded.logprobs == pytest.approx(recomputed.logprobs, abs=1e-5)
    assert all(c.logprobs is None for c in first.steps.completion)  # rollout 0: fresh, no correction needed

    # the batch: advantages A * proximal / behaviour per token (TRL's token_truncate, clipped at 3), the proximal being
    # the weights at the update: TRL's loss on it is decoupled PPO's
    mask = batch["completion_mask"] * batch["tool_mask"]
    rows = [second.steps.completion[k] for k in range(len(second.steps.completion))]
    assert batch["advantages"].dim() == 2
    proximal = batch["old_per_token_logps"]
    real = batch["tool_mask"][:, 0].bool()
    behaviour_logps = torch.zeros_like(proximal)
    for row, completion in enumerate(rows[: int(real.sum())]):
        behaviour_logps[row, :len(completion.logprobs)] = torch.tensor(completion.logprobs)
    ratio = torch.exp((proximal - behaviour_logps) * mask).clamp(max=3.0)
    plain_advantages = batch["advantages"][:, 0] / ratio[:, 0]
    expected = plain_advantages.unsqueeze(1) * ratio
    assert torch.allclose(batch["advantages"][real], expected[real], atol=1e-5)


# TRL 1.16 cannot cast a tied LM head to fp32 under PEFT (it looks for the embeddings on the PEFT wrapper's child)
@pytest.mark.parametrize("lora, fp32_head", [(False, True), (True, False)])
def test_the_producer_s_snapshot_reads_its_own_weights_and_keeps_its_cache_when_the_trainer_s_change(
        tmp_path, tiny_model_path, lora, fp32_head):
    """TRL patches the model's forward (the fused LM head, the fp32 LM head cast) with closures over the model itself;
    a plain deep copy would generate with the trainer's live weights, and with activation checkpointing on, without a
    key-value cache."""
    from peft import LoraConfig

    config = cpu_config(tmp_path, env_name="corridor", activation_checkpointing=True,
                        cast_lm_head_to_fp32=fp32_head)
    trainer = GiGPOTrainer(tiny_model_path, args=config, train_dataset=task_dataset(range(4)),
                           peft_config=LoraConfig(r=4, target_modules="all-linear") if lora else None)
    model = trainer.accelerator.unwrap_model(trainer.model)
    model.train()
    model.gradient_checkpointing_enable()  # as while the trainer updates
    snapshot = policy_snapshot(model)
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10]])

    def read(module):
        with torch.no_grad():
            output = module(input_ids=input_ids, use_cache=True)
            logps = trainer._get_per_token_logps_and_entropies(module, input_ids, torch.ones_like(input_ids), 3)[0]
        return output, logps

    before, before_logps = read(snapshot)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter))
    after, after_logps = read(snapshot)

    assert torch.equal(before.logits, after.logits) and torch.equal(before_logps, after_logps)
    assert after.past_key_values is not None and after.past_key_values.get_seq_length() == input_ids.size(1)
    assert not torch.equal(read(model)[1], after_logps)  # the trainer's own forward reads its new weights
    assert not snapshot.training and not any(p.requires_grad for p in snapshot.parameters())
    trainer.close_environments()


def test_the_decoupled_ppo_loss_is_the_hand_written_one():
    """TRL's clipped loss on advantages weighted by `behaviour_weighted_advantages` is, token by token, the decoupled
    PPO loss written out: -(prox/behav) min(r A, clip(r) A), r = current/prox."""
    torch.manual_seed(0)
    current, proximal, behaviour = (torch.randn(4, 6) * 0.3 for _ in range(3))
    mask = torch.ones(4, 6)
    mask[2, 4:] = 0
    advantages, stale = torch.tensor([1.0, -0.5, 2.0, -1.5]), torch.tensor([True, True, True, False])
    weighted, _ = behaviour_weighted_advantages(advantages, proximal, behaviour, mask, stale, "token_truncate", None,
                                                2.0)
    ratio, eps = torch.exp(current - proximal), 0.2
    trl = -torch.min(ratio * weighted, ratio.clamp(1 - eps, 1 + eps) * weighted)  # TRL's per-token "dapo" loss
    behaviour_weight = torch.exp((proximal - behaviour) * mask).clamp(max=2.0)
    behaviour_weight[3] = 1.0  # a fresh row: sampled by the proximal policy
    by_hand = -behaviour_weight * torch.min(ratio * advantages[:, None], ratio.clamp(1 - eps, 1 + eps) * advantages[:, None])
    assert torch.allclose(trl * mask, by_hand * mask, atol=1e-6)
    masked = importance_sampling_ratio(proximal, behaviour, mask, "sequence_mask", 0.5, 2.0)
    assert masked.shape == (4, 1) and set(masked[masked != 0].tolist()) <= set(
        torch.exp(((proximal - behaviour) * mask).sum(1)).tolist())


class SlowUpdatesAt(TrainerCallback):
    """Updates that take 2 s more at the given steps: a slow update, during which the producer runs as far ahead as its
    bound admits (without it, the tiny model's updates are as fast as its rollouts, and how far the producer gets ahead
    depends on the machine's load)."""

    def __init__(self, steps: set[int]) -> None:
        self.steps = steps

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in self.steps:
            time.sleep(2.0)


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_50_updates_under_random_delays_consume_every_group_whole_within_its_bound(tmp_path, tiny_model_path,
                                                                                  staleness):
    """Issue 89's liveness check: 50 updates (about a minute each case on two cores) are what it takes for random step
    delays to reorder episodes many times over and for the producer to sit at its bound again and again."""
    config = cpu_config(tmp_path, env_name="slow_corridor", max_steps=50, async_staleness=staleness,
                        per_device_train_batch_size=2, gradient_accumulation_steps=1, steps_per_generation=1,
                        max_env_steps=3, logging_steps=1, log_trajectories=2)
    trainer = scripted_trainer(tiny_model_path, args=config, train_dataset=task_dataset(range(400)))
    trainer.add_callback(SlowUpdatesAt({10, 30}))  # the producer fills its bound while these updates take 2 s
    watchdog = threading.Timer(540, lambda: trainer.close_producer())  # a hang would end the test, not CI
    watchdog.start()
    try:
        trainer.train()
    finally:
        watchdog.cancel()
        trainer.close_environments()
    records = [record for record in read_iterations(tmp_path) if record["mode"] == "train"]
    assert len(records) == 50 and [record["rollout"] for record in records] == list(range(50))
    for record in records:
        metrics = record["metrics"]
        assert metrics["async/staleness_max"] <= staleness
        assert record["episodes"] == 2  # the whole group: both copies of its task
    assert max(record["metrics"]["async/staleness_max"] for record in records) == staleness  # it did run ahead
    # every task of the dataloader's order was trained on, once, in order: none dropped for its age
    played = [episode["seed"] for name, episodes in sorted(trainer_trajectories(tmp_path).items())
              if name.startswith("train") for episode in episodes[:1]]
    assert played == [row["seed"] for row in list(trainer.get_train_dataloader())[:50] for row in row[:1]]


def trainer_trajectories(output_dir):
    from gigpo_trl.records import read_trajectories

    return read_trajectories(output_dir)


def test_a_producer_that_raises_stops_the_run_with_its_traceback(tmp_path, tiny_model_path):
    register_env("unhashable_anchor_later", UnhashableAnchorLater, overwrite=True)
    config = cpu_config(tmp_path, env_name="unhashable_anchor_later", max_steps=3, async_staleness=1,
                        shuffle_dataset=False)
    lengths = [{"length": 3}] * 4 + [{"length": 12}] * 8  # the producer's second rollout meets the long corridors
    trainer = scripted_trainer(tiny_model_path, args=config,
                               train_dataset=task_dataset(range(12), options=lengths))
    with pytest.raises(ProducerFailed, match=r"(?s)the rollout producer raised while it played rollout 1; its "
                                             r"traceback:.*TypeError: environment 'unhashable_anchor_later': "
                                             r"info\['anchor'\] must be hashable"):
        trainer.train()
    assert trainer._producer is None  # stopped with the run
    trainer.close_environments()


@pytest.mark.parametrize("overrides, message", [
    ({"use_vllm": True}, "use_vllm=True generates with vLLM"),
    ({"dynamic_sampling_max_rounds": 2}, "dynamic_sampling_max_rounds=2"),
    ({"generation_prefix_cache": False}, "needs generation_prefix_cache=True"),
    ({"loss_type": "vespo"}, "loss_type='vespo'"),
    ({"async_staleness": -1}, "async_staleness=-1 must be None"),
])
def test_what_the_producer_cannot_honour_is_refused_by_name(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        cpu_config(tmp_path, **{"async_staleness": 1, **overrides})


def test_a_config_takes_the_option_from_the_command_line(tmp_path):
    from trl import TrlParser

    (args,) = TrlParser((GiGPOConfig,)).parse_args_and_config(
        args=["--output_dir", str(tmp_path), "--async_staleness", "2", "--report_to", "none"])
    assert args.async_staleness == 2


def test_lora_conversation_mode_and_a_resumed_run_train_with_rollouts_ahead(tmp_path, tiny_model_path):
    from peft import LoraConfig

    # LoRA: the producer's snapshot gets the adapter alone after each update; the base stays as it was
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    config = cpu_config(tmp_path / "lora", env_name="corridor", max_steps=3, async_staleness=1)
    trainer = scripted_trainer(tiny_model_path, args=config, train_dataset=task_dataset(range(16)), peft_config=lora)
    before = parameters(trainer.model)
    trainer.train()
    trainer.close_environments()
    after = parameters(trainer.model)
    adapter = [name for name in before if "lora_" in name]
    assert adapter and not all(torch.equal(before[n], after[n]) for n in adapter)
    assert all(torch.equal(before[n], after[n]) for n in before if n not in adapter)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["async/staleness_max"] for entry in logs] == [0.0, 1.0, 1.0]

    # conversation mode: the producer's turns continue each conversation token for token, with its own tokenizer
    config = cpu_config(tmp_path / "conversation", env_name="corridor", max_steps=2, async_staleness=1,
                        history_length="conversation")
    trainer = scripted_trainer(tiny_model_path, args=config, train_dataset=task_dataset(range(16)))
    trainer.train()
    trainer.close_environments()
    rollout = trainer.last_rollout
    episode = max(rollout.episodes, key=lambda e: e.length)
    first, second = rollout.steps.rows_of(episode.trajectory)[:2]
    earlier = rollout.steps.completion[first]
    assert rollout.steps.completion[second].prompt_ids[:len(earlier.prompt_ids) + len(earlier.completion_ids)] == \
        earlier.prompt_ids + earlier.completion_ids

    # a resumed run starts its producer at the checkpoint's rollout: the rollouts not yet trained are played again
    config = cpu_config(tmp_path / "resumed", env_name="corridor", max_steps=2, async_staleness=1,
                        save_strategy="steps", save_steps=1)
    first_run = scripted_trainer(tiny_model_path, args=config, train_dataset=task_dataset(range(16)))
    first_run.train()
    first_run.close_environments()
    config = cpu_config(tmp_path / "resumed", env_name="corridor", max_steps=3, async_staleness=1)
    resumed = scripted_trainer(tiny_model_path, args=config, train_dataset=task_dataset(range(16)))
    resumed.train(resume_from_checkpoint=str(tmp_path / "resumed" / "checkpoint-1"))
    resumed.close_environments()
    uninterrupted = scripted_trainer(tiny_model_path, args=cpu_config(tmp_path / "whole", env_name="corridor",
                                                                      max_steps=3), train_dataset=task_dataset(range(16)))
    uninterrupted.train()
    uninterrupted.close_environments()
    assert [episode.seed for episode in resumed.last_rollout.episodes] == \
        [episode.seed for episode in uninterrupted.last_rollout.episodes]  # rollout 2: the same tasks
    assert resumed.state.global_step == 3
