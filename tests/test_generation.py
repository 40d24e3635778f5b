"""The generation backends seen from the rollout: vLLM's log-probs and importance-sampling correction, and its
sleep mode, through stand-ins that follow TRL 1.16's protocols, so that they run without vLLM (tests/test_vllm.py
runs the real engine, on CPU with vLLM's CPU build; vLLM's CPU build has no sleep mode)."""

from __future__ import annotations

import random

import pytest
import torch
from trainer_helpers import settings_config, step_samples

from gigpo_trl.batch import loss_batch
from gigpo_trl.tasks import task_dataset
from gigpo_trl.trainer import GiGPOTrainer

pytestmark = pytest.mark.timeout(300)


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
    trainer = GiGPOTrainer(tiny_model_path, args=settings_config(tmp_path, env_name=env_name, max_env_steps=2, env_processes=False),
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


def test_vllm_sampling_diagnostics_leave_out_padding_rows_and_unscored_tokens(tmp_path, tiny_model_path):
    trainer = vllm_like_trainer(tmp_path, tiny_model_path)
    trainer.vllm_importance_sampling_mode = "token_truncate"
    completions, advantages = step_samples(trainer.model.config.vocab_size, 4, seed=3)
    for k, completion in enumerate(completions):  # real rows: plausible log-probs, one unscored; padding: absurd
        completion.logprobs = [-1.0] * len(completion.completion_ids) if k < 2 else [-80.0] * len(completion.completion_ids)
        if k == 0:
            completion.logprobs[0] = float("nan")
    trainer._metrics["train"].clear()

    batch = loss_batch(trainer, completions, [1.0, 1.0, 0.0, 0.0], advantages, "train")

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


def test_greedy_rows_are_not_corrected_and_log_no_sampling_metrics(tmp_path, tiny_model_path):
    trainer = vllm_like_trainer(tmp_path, tiny_model_path)
    completions, advantages = step_samples(trainer.model.config.vocab_size, 4, seed=3)
    for completion in completions:  # log-probs far from the trainer's: a correction would clamp or mask them
        completion.logprobs = [-30.0] * len(completion.completion_ids)
    trainer._metrics["eval"].clear()

    batch = loss_batch(trainer, completions, [1.0] * 4, advantages, "eval", sampled=False)

    assert torch.equal(batch["importance_sampling_ratio"], torch.ones(4, 1))  # TRL's loss multiplies by it: 1
    assert not [name for name in trainer._metrics["eval"] if name.startswith("sampling/")]
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
    trainer = GiGPOTrainer(tiny_model_path, args=settings_config(tmp_path, max_env_steps=4, env_processes=False),
                           train_dataset=task_dataset(range(4)))
    engine = SleepingVLLMEngine(trainer.model.config.vocab_size)
    trainer.use_vllm, trainer.vllm_generation, trainer._last_loaded_step = True, engine, -1
    rows = [{"seed": seed, "options": ""} for seed in (0, 0, 1, 1, 2, 2, 3, 3)]

    trainer._generate_and_score_completions(rows)  # 4 turns: answers "5 6 7" are invalid, no episode ends early

    assert engine.events == ["wake weights", "load weights", "wake kv_cache"] + ["generate"] * 4 + ["sleep 2"]
    assert engine.enable_sleep_mode and engine._llm_weights_sleeping  # asleep again, for the update
    trainer.close_environments()


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_a_lora_model_generates_at_the_precision_it_trains_at(tmp_path, tiny_model_path, prefix_cache):
    """fp32 weights under bf16 autocast (the CPU quickstart's set-up): accelerate puts the autocast on the prepared
    model's forward, which a PEFT wrapper's `generate` never calls; generation must run at the training's precision
    all the same, with the prefix cache and with TRL's `generate`."""
    from peft import LoraConfig  # noqa: PLC0415

    trainer = GiGPOTrainer(tiny_model_path, args=settings_config(tmp_path, bf16=True, use_cpu=True,
                                                                 generation_prefix_cache=prefix_cache),
                           train_dataset=task_dataset(range(8)), peft_config=LoraConfig(r=4, target_modules="all-linear"))
    dtypes = []
    layer = trainer.model.get_base_model().model.layers[0].mlp.down_proj.base_layer
    hook = layer.register_forward_hook(lambda module, inputs, output: dtypes.append(output.dtype))
    trainer.turns([[{"role": "user", "content": "Go."}]], [None])
    hook.remove()
    assert dtypes and set(dtypes) == {torch.bfloat16}
    assert next(trainer.model.parameters()).dtype == torch.float32
