"""GiGPOTrainer under the GRPOConfig settings a TRL user can reach: exact losses under the lock-step padding
rows, and settings it cannot honour refused at construction with a message that names them."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import torch
from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

from gigpo_trl.config import SUPPORTED_LOSS_TYPES, GiGPOConfig
from gigpo_trl.rollout import Completion
from gigpo_trl.trainer import GiGPOTrainer, task_dataset

pytestmark = pytest.mark.timeout(300)
TRL_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")


def config(tmp_path, **overrides) -> GiGPOConfig:
    settings = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, steps_per_generation=2,
                    gradient_accumulation_steps=2, max_completion_length=8, report_to=[], gradient_checkpointing=False,
                    save_strategy="no", seed=0, env_name="sokoban")
    return GiGPOConfig(**{**settings, **overrides})


def step_samples(vocab_size: int, count: int, seed: int) -> tuple[list[Completion], list[float]]:
    """Step samples of different prompt and answer lengths, with advantages of both signs."""
    rng = random.Random(seed)
    completions = [
        Completion([rng.randrange(3, vocab_size) for _ in range(rng.randint(3, 9))],
                   [rng.randrange(3, vocab_size) for _ in range(rng.randint(1, 8))], "")
        for _ in range(count)
    ]
    return completions, [rng.uniform(-2, 2) for _ in range(count)]


def update_gradient(trainer: GiGPOTrainer, completions, weights, advantages, shuffle_seed: int) -> torch.Tensor:
    """The summed gradient of one update: the rows shuffled and split into steps_per_generation micro-batches,
    exactly as GRPOTrainer._prepare_inputs does, each micro-batch's loss back-propagated."""
    trainer.model.train()
    trainer.model.zero_grad()
    batch = trainer._tensorize(completions, weights, [a * w for a, w in zip(advantages, weights)], "train")
    torch.manual_seed(shuffle_seed)
    for micro_batch in split_tensor_dict(shuffle_sequence_dict(batch), trainer.args.steps_per_generation):
        trainer.compute_loss(trainer.model, micro_batch).backward()
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])


@pytest.mark.parametrize("loss_type", SUPPORTED_LOSS_TYPES)
def test_padding_rows_leave_the_update_gradient_unchanged_for_every_allowed_loss(tmp_path, tiny_model_path, loss_type):
    trainer = GiGPOTrainer(tiny_model_path, args=config(tmp_path, loss_type=loss_type),
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
        torch.testing.assert_close(padded, reference, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("loss_type", sorted(set(TRL_LOSS_TYPES) - set(SUPPORTED_LOSS_TYPES)))
def test_the_other_loss_types_are_refused_with_the_reason(tmp_path, loss_type):
    with pytest.raises(ValueError, match=f"loss_type='{loss_type}' normalizes per row or per micro-batch"):
        config(tmp_path, loss_type=loss_type)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(scale_rewards="batch"), "scale_rewards='batch' has no effect in GiGPO (advantages are normalized by advantage_norm"),
        (dict(scale_rewards=False), "scale_rewards='none' has no effect in GiGPO"),
        (dict(reward_weights=[1.0, 0.5]), "reward_weights=[1.0, 0.5] has no effect in GiGPO (rewards come from the environment"),
        (dict(multi_objective_aggregation="normalize_then_sum"), "multi_objective_aggregation='normalize_then_sum' has no effect"),
        (dict(entropy_coef=0.01), "entropy_coef=0.01 / use_adaptive_entropy=False: TRL's entropy bonus is a per-micro-batch mean"),
        (dict(use_adaptive_entropy=True), "use_adaptive_entropy=True: TRL's entropy bonus"),
        (dict(max_tool_calling_iterations=3), "max_tool_calling_iterations=3 has no effect in GiGPO (GiGPO's turns are environment steps"),
    ],
)
def test_settings_gigpo_replaces_or_cannot_honour_are_refused(tmp_path, overrides, message):
    with pytest.raises(ValueError, match="invalid GiGPOConfig: ") as error:
        config(tmp_path, **overrides)
    assert message in str(error.value)


def test_the_defaults_of_the_replaced_fields_are_accepted(tmp_path):
    config(tmp_path, scale_rewards=True, reward_weights=None, multi_objective_aggregation="sum_then_normalize")


def test_batch_arithmetic_is_explained_in_tasks_and_copies(tmp_path):
    with pytest.raises(ValueError) as error:
        config(tmp_path, per_device_train_batch_size=2, steps_per_generation=2, num_generations=8)
    message = str(error.value)
    assert "generation_batch_size" not in message
    assert ("per_device_train_batch_size x steps_per_generation = 2 x 2 = 4 trajectories per rollout, which must be "
            "whole groups of num_generations = 8 copies of a task") in message
    assert "per_device_train_batch_size=4 with steps_per_generation=2 (1 task(s) x 8 copies per process)" in message
    config(tmp_path, per_device_train_batch_size=4, steps_per_generation=2, num_generations=8)  # the suggestion works


def test_batch_arithmetic_with_the_default_steps_per_generation(tmp_path):
    with pytest.raises(ValueError, match="= 3 x 2 = 6 trajectories per rollout") as error:
        config(tmp_path, per_device_train_batch_size=3, steps_per_generation=None, gradient_accumulation_steps=2,
               num_generations=4)
    assert "per_device_train_batch_size=4 with steps_per_generation=2" in str(error.value)


def test_reward_funcs_are_refused_with_the_reason(tmp_path, tiny_model_path):
    with pytest.raises(ValueError, match="GiGPOTrainer takes its rewards from the environment"):
        GiGPOTrainer(tiny_model_path, args=config(tmp_path), train_dataset=task_dataset(range(4)),
                     reward_funcs=[lambda completions, **kwargs: [0.0] * len(completions)])


class VLLMLikeGeneration:
    """Stands in for TRL's vLLM backend in `_generate_single_turn`: answers of a few token ids with their sampling
    log-probs, where vLLM reports the log-prob of some tokens as None (NaN in vLLM)."""

    def __init__(self, vocab_size: int):
        self.vocab_size, self.calls = vocab_size, 0

    def __call__(self, prompt_ids, images, multimodal_fields, num_generations):
        self.calls += 1
        rng = random.Random(self.calls)
        completion_ids = [[rng.randrange(3, self.vocab_size) for _ in range(4)] for _ in prompt_ids]
        logprobs = [[None if k == 1 else -rng.uniform(0.1, 3.0) for k in range(4)] for _ in prompt_ids]
        return completion_ids, logprobs


def vllm_like_trainer(tmp_path, tiny_model_path, env_name="sokoban") -> GiGPOTrainer:
    trainer = GiGPOTrainer(tiny_model_path, args=config(tmp_path, env_name=env_name, max_env_steps=2, env_processes=False),
                           train_dataset=task_dataset(range(4)))
    # What use_vllm=True sets up, without a vLLM engine: the backend, and its importance-sampling correction.
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    trainer._generate_single_turn = VLLMLikeGeneration(trainer.model.config.vocab_size)
    return trainer


def test_vllm_log_probs_reported_as_none_become_nan_and_get_no_correction(tmp_path, tiny_model_path):
    trainer = vllm_like_trainer(tmp_path, tiny_model_path)
    rows = [{"seed": seed, "options": ""} for seed in (0, 0, 1, 1, 2, 2, 3, 3)]

    batch = trainer._generate_and_score_completions(rows)

    sampling = batch["sampling_per_token_logps"]
    assert torch.isnan(sampling[:, 1]).all() and torch.isfinite(sampling[:, [0, 2, 3]]).all()
    ratio = batch["importance_sampling_ratio"]
    assert torch.isfinite(ratio).all() and ratio.shape == (sampling.shape[0], 1)  # sequence_mask: one per row
    trainer.close_environments()


def test_under_vllm_a_process_whose_environments_all_failed_still_builds_its_batch(tmp_path, tiny_model_path):
    from toy_envs import FailingReset

    from gigpo_trl.envs import register_env

    register_env("failing_reset", FailingReset, overwrite=True)
    trainer = vllm_like_trainer(tmp_path, tiny_model_path, env_name="failing_reset")
    rows = [{"seed": seed, "options": ""} for seed in (0, 0, 1, 1, 2, 2, 3, 3)]

    batch = trainer._generate_and_score_completions(rows)  # before: RuntimeError (no sampling log-probs)

    assert batch["tool_mask"].sum() == 0  # only stand-in rows, with zero loss weight
    assert torch.isfinite(batch["importance_sampling_ratio"]).all()
    trainer.close_environments()


def test_pad_to_multiple_of_pads_the_batch_like_trl(tmp_path, tiny_model_path):
    trainer = GiGPOTrainer(tiny_model_path, args=config(tmp_path, pad_to_multiple_of=16), train_dataset=task_dataset(range(4)))
    completions, advantages = step_samples(trainer.model.config.vocab_size, 4, seed=2)
    batch = trainer._tensorize(completions, [1.0] * 4, advantages, "train")
    assert batch["prompt_ids"].shape[1] == 16 and batch["completion_ids"].shape[1] == 16
    assert batch["prompt_mask"].sum() == sum(len(c.prompt_ids) for c in completions)
    assert batch["completion_mask"].sum() == sum(len(c.completion_ids) for c in completions)


def test_the_readme_says_what_gigpo_does_with_every_grpo_config_field():
    import dataclasses
    import fnmatch
    import re
    from pathlib import Path

    from transformers import TrainingArguments
    from trl import GRPOConfig

    readme = Path(__file__).resolve().parent.parent / "README.md"
    section = readme.read_text().split("### TRL's `GRPOConfig` fields under GiGPO", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([a-z0-9_*]+)`", section))
    own = {f.name for f in dataclasses.fields(GRPOConfig)} - {f.name for f in dataclasses.fields(TrainingArguments)}
    missing = [name for name in sorted(own) if not any(fnmatch.fnmatchcase(name, pattern) for pattern in named)]
    assert missing == []


def test_a_non_finite_reward_ends_its_trajectory_as_an_environment_failure(tmp_path, tiny_model_path):
    from toy_envs import Corridor

    from gigpo_trl.envs import register_env

    class NaNOnSecondStep(Corridor):
        def step(self, action):
            observation, reward, terminated, truncated, info = super().step(action)
            self.steps = getattr(self, "steps", 0) + 1
            return observation, float("nan") if self.steps == 2 else reward, terminated, truncated, info

    register_env("nan_on_second_step", NaNOnSecondStep, overwrite=True)
    trainer = GiGPOTrainer(tiny_model_path, args=config(tmp_path, env_name="nan_on_second_step", max_env_steps=4,
                                                        env_processes=False, max_steps=1, logging_steps=1),
                           train_dataset=task_dataset([3, 3, 3, 3]))  # 6-cell corridors: no episode ends in 1 step
    trainer.train()  # before: ValueError from the advantage pass ("rewards ... NaN")

    log = next(entry for entry in trainer.state.log_history if "env/env_error_share" in entry)
    assert log["env/env_error_share"] == 1.0 and log["env/truncated_share"] == 1.0
    assert all(np.isfinite(log[key]) for key in ("gigpo/episode_advantage_std", "gigpo/step_advantage_std", "loss"))
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
    trainer = GiGPOTrainer(tiny_model_path, args=config(tmp_path, **settings), train_dataset=task_dataset(range(4)),
                           eval_dataset=task_dataset(range(100, 102)))
    trainer.model.eval()
    inputs = trainer._prepare_inputs([{"seed": seed, "options": ""} for seed in (100, 100, 101, 101)])
    assert inputs["prompt_ids"].size(0) == 12  # 4 episodes x 3 steps: every sample kept, none drawn out
    sizes = forward_batch_sizes(trainer.model)

    with torch.no_grad():
        in_parts = trainer._loss_in_parts(trainer.model, inputs)
        assert sizes == [3, 3, 3, 3]
        whole = trainer.compute_loss(trainer.model, inputs)
    torch.testing.assert_close(in_parts, whole, rtol=1e-5, atol=1e-7)

    sizes.clear()
    metrics = trainer.evaluate()
    assert np.isfinite(metrics["eval_loss"]) and sizes and max(sizes) <= 3
    trainer.close_environments()


def test_vllm_sampling_diagnostics_leave_out_padding_rows_and_unscored_tokens(tmp_path, tiny_model_path):
    trainer = vllm_like_trainer(tmp_path, tiny_model_path)
    trainer.vllm_importance_sampling_mode = "token_truncate"
    completions, advantages = step_samples(trainer.model.config.vocab_size, 4, seed=3)
    for k, completion in enumerate(completions):  # real rows: plausible log-probs, one unscored; padding: absurd
        completion.logprobs = [-1.0] * len(completion.completion_ids) if k < 2 else [-80.0] * len(completion.completion_ids)
        if k == 0:
            completion.logprobs[0] = float("nan")
    trainer._metrics["train"].clear()

    batch = trainer._tensorize(completions, [1.0, 1.0, 0.0, 0.0], advantages, "train")

    real = batch["completion_mask"][:2].bool().clone()
    real[0, 0] = False
    expected = (batch["old_per_token_logps"][:2] + 1.0).abs()[real]
    logged = trainer._metrics["train"]
    assert logged["sampling/sampling_logp_difference/mean"] == [pytest.approx(expected.mean().item(), rel=1e-6)]
    assert logged["sampling/sampling_logp_difference/max"] == [pytest.approx(expected.max().item(), rel=1e-6)]
    ratios = batch["importance_sampling_ratio"][:2][batch["completion_mask"][:2].bool()]
    assert logged["sampling/importance_sampling_ratio/mean"] == [pytest.approx(ratios.mean().item(), rel=1e-6)]
    assert logged["sampling/importance_sampling_ratio/max"] == [pytest.approx(ratios.max().item(), rel=1e-6)]
    trainer.close_environments()


def test_the_standard_grpo_metrics_are_logged_in_gigpo_terms(tmp_path, tiny_model_path):
    trainer = GiGPOTrainer(tiny_model_path, args=config(tmp_path, max_env_steps=3, env_processes=False, max_steps=1,
                                                        logging_steps=1), train_dataset=task_dataset(range(4)))
    trainer.train()
    log = next(entry for entry in trainer.state.log_history if "env/step_samples" in entry)
    rollout = trainer.last_rollout

    rewards = np.array([s.reward for s in rollout.steps])
    lengths = [len(s.completion.completion_ids) for s in rollout.steps]
    assert log["reward"] == pytest.approx(rewards.mean()) and log["reward_std"] == pytest.approx(rewards.std(ddof=1))
    assert (log["completions/min_length"], log["completions/max_length"]) == (min(lengths), max(lengths))
    ends = {*trainer.eos_token_ids, trainer.processing_class.pad_token_id}
    cut = [len(s.completion.completion_ids) == 8 and s.completion.completion_ids[-1] not in ends for s in rollout.steps]
    assert log["completions/clipped_ratio"] == pytest.approx(np.mean(cut))  # max_completion_length 8
    groups: dict[int, list[float]] = {}
    for episode in rollout.episodes:
        groups.setdefault(episode.group, []).append(episode.episode_return)
    assert log["frac_reward_zero_std"] == pytest.approx(np.mean([np.std(g) == 0 for g in groups.values()]))
    returns = [r for g in groups.values() for r in g]
    assert log["env/return_std"] == pytest.approx(np.std(returns, ddof=1))
    trainer.close_environments()


def test_update_time_is_the_update_s_own_even_with_evaluations_between_updates(tmp_path, tiny_model_path):
    from toy_envs import Corridor
    from transformers import TrainerCallback

    from gigpo_trl.envs import register_env

    class SlowWhenAsked(Corridor):
        def reset(self, *, seed=None, options=None):
            self.delay = (options or {}).get("delay", 0.0)
            return super().reset(seed=seed, options=options)

        def step(self, action):
            time.sleep(self.delay)
            return super().step(action)

    class SlowOptimizerStep(TrainerCallback):
        """Makes every update last at least 0.6 s (it runs between a step's backward and the evaluation)."""

        def on_step_end(self, args, state, control, **kwargs):
            time.sleep(0.6)

    register_env("slow_when_asked", SlowWhenAsked, overwrite=True)
    settings = dict(env_name="slow_when_asked", max_env_steps=4, env_processes=False, max_steps=3, logging_steps=1,
                    eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=2, num_generations_eval=2)
    trainer = GiGPOTrainer(tiny_model_path, args=config(tmp_path, **settings), callbacks=[SlowOptimizerStep()],
                           train_dataset=task_dataset(range(4), options=[{"length": 3}] * 4),
                           eval_dataset=task_dataset([9], options=[{"length": 9, "delay": 0.4}]))
    trainer.train()  # every evaluation plays 4 slow steps: at least 1.6 s

    updates = [entry["timing/update_s"] for entry in trainer.state.log_history if "timing/update_s" in entry]
    # Before: the evaluation's rollout reset the clock, so the update before it went unmeasured (about 0.0 s).
    assert len(updates) == 2 and all(0.6 <= seconds < 1.6 for seconds in updates), updates
    trainer.close_environments()


class SleepingVLLMEngine:
    """Stands in for TRL's `VLLMGeneration` in colocate mode with sleep mode, whose engine cannot run on a CPU: it
    follows TRL 1.16's wake/sleep protocol (generate re-syncs sleeping weights, wakes the KV cache, sleeps at level 2
    after every call; sync_weights wakes the weights) and records what the engine was asked to do."""

    mode = "colocate"

    def __init__(self, vocab_size: int):
        self.enable_sleep_mode, self._llm_weights_sleeping = True, True  # TRL puts the engine to sleep at start
        self.vocab_size, self.events = vocab_size, []
        self.llm = self

    def wake_up(self, tags):
        self.events.append(f"wake {tags[0]}")

    def sleep(self, level):
        self.events.append(f"sleep {level}")

    def sync_weights(self):
        if self.enable_sleep_mode:
            self.wake_up(tags=["weights"])
            self._llm_weights_sleeping = False
        self.events.append("load weights")

    def generate(self, prompts, images, num_generations, profiler):
        if self.enable_sleep_mode and self._llm_weights_sleeping:
            self.sync_weights()
        if self.enable_sleep_mode:
            self.wake_up(tags=["kv_cache"])
        self.events.append("generate")
        completion_ids = [[5, 6, 7] for _ in prompts]
        if self.enable_sleep_mode:
            self.sleep(level=2)
            self._llm_weights_sleeping = True
        return prompts, completion_ids, [[[-1.0]] * 3 for _ in prompts], None


def test_vllm_sleep_mode_wakes_the_engine_once_per_rollout_not_once_per_turn(tmp_path, tiny_model_path):
    trainer = GiGPOTrainer(tiny_model_path, args=config(tmp_path, max_env_steps=4, env_processes=False),
                           train_dataset=task_dataset(range(4)))
    engine = SleepingVLLMEngine(trainer.model.config.vocab_size)
    trainer.use_vllm, trainer.vllm_generation, trainer._last_loaded_step = True, engine, -1
    rows = [{"seed": seed, "options": ""} for seed in (0, 0, 1, 1, 2, 2, 3, 3)]

    trainer._generate_and_score_completions(rows)  # 4 turns: answers "5 6 7" are invalid, no episode ends early

    assert engine.events == ["wake weights", "load weights", "wake kv_cache"] + ["generate"] * 4 + ["sleep 2"]
    assert engine.enable_sleep_mode and engine._llm_weights_sleeping  # asleep again, for the update
    trainer.close_environments()


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", SUPPORTED_LOSS_TYPES)
def test_loss_metrics_of_a_micro_batch_leave_its_padding_rows_out(tmp_path, tiny_model_path, loss_type, level):
    trainer = GiGPOTrainer(tiny_model_path, args=config(tmp_path, loss_type=loss_type, importance_sampling_level=level,
                                                        epsilon=0.05), train_dataset=task_dataset(range(4)))
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    trainer.model.train()
    completions, advantages = step_samples(trainer.model.config.vocab_size, 3, seed=4)
    advantages = [1.5, -1.0, -0.5]
    rows = completions + [completions[0], completions[1]]  # 3 real rows, 2 padding rows as _rows_for_update makes them
    weights = [1.0, 1.0, 1.0, 0.0, 0.0]
    batch = trainer._tensorize(rows, weights, [a * w for a, w in zip(advantages + [0.0, 0.0], weights)], "train")
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


def test_the_singleton_warning_is_about_training_rollouts_not_single_copy_evaluations(tmp_path, tiny_model_path):
    import warnings

    from toy_envs import Corridor

    class CountingCorridor(Corridor):
        """The anchor is the step count: copies share their first state, then every step group is a singleton."""

        def reset(self, *, seed=None, options=None):
            self.moves = 0
            return super().reset(seed=seed, options=options)

        def step(self, action):
            self.moves += 1
            return super().step(action)

        def _info(self):
            return {**super()._info(), "anchor": ("start",) if self.moves == 0 else (id(self), self.moves)}

    settings = dict(max_env_steps=30, env_processes=False, max_steps=1, per_device_eval_batch_size=2,
                    num_generations_eval=1)
    long_corridors = [{"length": 99}] * 4
    evaluating = GiGPOTrainer(tiny_model_path, args=config(tmp_path / "eval", **settings), env=CountingCorridor,
                              train_dataset=task_dataset(range(4)), eval_dataset=task_dataset(range(2), long_corridors[:2]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        evaluating.evaluate()  # one copy per task: every step group is a singleton, by design
    assert not [w for w in caught if "singletons" in str(w.message)]
    evaluating.close_environments()

    training = GiGPOTrainer(tiny_model_path, args=config(tmp_path / "train", **settings), env=CountingCorridor,
                            train_dataset=task_dataset(range(4), long_corridors))
    with pytest.warns(UserWarning, match="of step groups are singletons"):
        training.train()
    training.close_environments()
