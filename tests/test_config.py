"""GiGPOConfig and the trainer's arguments: settings GiGPO cannot honour or replaces are refused at construction,
with a message that names them; the batch arithmetic is explained in tasks and copies."""

from __future__ import annotations

from pathlib import Path

import pytest
from trainer_helpers import cpu_config, settings_config

import gigpo_trl.config as config_module
from gigpo_trl.config import SUPPORTED_LOSS_TYPES, GiGPOConfig
from gigpo_trl.tasks import task_dataset
from gigpo_trl.trainer import GiGPOTrainer

TRL_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"gamma": 1.5}, r"gamma=1.5 must be in \[0, 1\]"),
        ({"advantage_norm": "std"}, r"advantage_norm='std' is not one of"),
        ({"episode_stats": "episodes"}, "episode_stats='episodes' is not one of"),
        ({"loss_type": "grpo"}, "loss_type='grpo' normalizes per row or per micro-batch"),
        ({"max_env_steps": 0}, "max_env_steps=0 must be >= 1"),
        ({"env_reset_attempts": 0}, "env_reset_attempts=0 must be >= 1"),
        ({"similarity_threshold": 1.5}, "similarity_threshold=1.5"),
        ({"step_advantage_lambda": 1.2}, r"step_advantage_lambda=1.2 must be a number in \[0, 1\]"),
        ({"step_advantage_lambda": float("nan")}, r"step_advantage_lambda=nan must be a number in \[0, 1\]"),
        ({"step_advantage_lambda": "0.5"}, r"step_advantage_lambda='0.5' must be a number in \[0, 1\]"),
        ({"dynamic_sampling_signal": "std"}, r"dynamic_sampling_signal='std' is not one of \('returns', 'advantages'\)"),
        ({"env_kwargs": "{not json"}, "env_kwargs must be a dict or a JSON object string"),
        ({"vllm_lora_sync": "lora"}, r"vllm_lora_sync='lora' is not one of \('merged', 'adapter'\)"),
        ({"vllm_lora_sync": "adapter"}, "use_vllm=False generates without vLLM"),
        ({"vllm_lora_sync": "adapter", "use_vllm": True, "vllm_mode": "server"},
         "vllm_lora_sync='adapter' runs with vllm_mode='colocate' only, got vllm_mode='server'"),
        ({"vllm_engine_kwargs": "{not json"}, "vllm_engine_kwargs must be a dict or a JSON object string"),
        ({"vllm_engine_kwargs": '["enforce_eager"]'}, "vllm_engine_kwargs must be a dict of vLLM engine arguments"),
        ({"vllm_engine_kwargs": {"enforce_eager": True}}, r"this run has none \(use_vllm=False"),
        ({"vllm_engine_kwargs": {"enforce_eager": True}, "use_vllm": True, "vllm_mode": "server"},
         r"vllm_mode='server'\): a server takes its engine arguments on its own command line"),
        ({"vllm_engine_kwargs": {"gpu_memory_utilization": 0.5, "max_loras": 2, "enforce_eager": True}, "use_vllm": True,
          "vllm_mode": "colocate"},
         r"already sets: gpu_memory_utilization \(set by vllm_gpu_memory_utilization\), max_loras \(set by vllm_lora_sync\)$"),
    ],
)
def test_config_rejects_invalid_combinations_naming_the_fields(tmp_path, overrides, message):
    settings = {"num_generations": 4, "per_device_train_batch_size": 4, **overrides}
    with pytest.raises(ValueError, match=message):
        cpu_config(tmp_path, **settings)


@pytest.mark.skipif(not config_module._cpu_only(), reason="the CPU default applies to machines without an accelerator")
@pytest.mark.parametrize("bf16_instructions", [True, False], ids=["bf16 CPU", "other CPU"])
def test_an_unset_bf16_follows_the_cpus_bf16_instructions_and_an_explicit_choice_is_kept(
        tmp_path, monkeypatch, bf16_instructions):
    monkeypatch.setattr(config_module, "_cpu_has_bf16_instructions", lambda: bf16_instructions)
    unset = GiGPOConfig(output_dir=str(tmp_path), report_to=[])
    assert unset.bf16 is bf16_instructions and unset.use_cpu is bf16_instructions  # transformers wants use_cpu
    assert GiGPOConfig(output_dir=str(tmp_path), report_to=[], bf16=False).bf16 is False
    assert cpu_config(tmp_path).bf16 is False


@pytest.mark.skipif(not config_module._cpu_only(), reason="the CPU default applies to machines without an accelerator")
def test_under_a_deepspeed_launch_an_unset_bf16_follows_the_launch_not_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    monkeypatch.setattr(config_module, "_cpu_has_bf16_instructions", lambda: True)
    assert GiGPOConfig(output_dir=str(tmp_path), report_to=[]).bf16 is False  # not the CPU's auto choice, bf16

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # the recipes' DeepSpeed configs
    monkeypatch.setattr(config_module, "_cpu_has_bf16_instructions", lambda: False)
    with pytest.warns(UserWarning, match="about 10x slower than fp32 here; accelerate launch --mixed_precision no"):
        launched = GiGPOConfig(output_dir=str(tmp_path), report_to=[])
    assert launched.bf16 is True and launched.use_cpu is True


@pytest.mark.parametrize(("launch", "bf16", "message"), [
    ({"ACCELERATE_USE_CPU": "true"}, None, "ACCELERATE_USE_CPU=true in the environment turns DeepSpeed off"),
    ({"ACCELERATE_MIXED_PRECISION": "bf16"}, False,
     "bf16=False, but the DeepSpeed launch trains with mixed_precision=bf16 .* launch with --mixed_precision no"),
    ({"ACCELERATE_MIXED_PRECISION": "no"}, True,
     "bf16=True, but the DeepSpeed launch trains with mixed_precision=no .* launch with --mixed_precision bf16"),
])
def test_a_deepspeed_launch_the_config_contradicts_is_refused_with_what_to_change(
        tmp_path, monkeypatch, launch, bf16, message):
    # What `accelerate launch --config_file recipes/accelerate/deepspeed_zero3.yaml` puts in each process's environment
    for name, value in {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_MIXED_PRECISION": "bf16", **launch}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        GiGPOConfig(output_dir=str(tmp_path), report_to=[], bf16=bf16)


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="reads the CPU's flags from /proc/cpuinfo")
def test_the_bf16_probe_agrees_with_the_cpus_flags():
    flags = set(Path("/proc/cpuinfo").read_text().split())
    assert config_module._cpu_has_bf16_instructions() == bool({"avx512_bf16", "amx_tile"} & flags)


def test_env_kwargs_take_a_json_object_string(tmp_path):
    assert cpu_config(tmp_path, env_kwargs='{"num_boxes": 2}').env_kwargs == {"num_boxes": 2}


@pytest.mark.parametrize("loss_type", sorted(set(TRL_LOSS_TYPES) - set(SUPPORTED_LOSS_TYPES)))
def test_the_other_loss_types_are_refused_with_the_reason(tmp_path, loss_type):
    with pytest.raises(ValueError, match=f"loss_type='{loss_type}' normalizes per row or per micro-batch"):
        settings_config(tmp_path, loss_type=loss_type)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(scale_rewards="batch"), "scale_rewards='batch' has no effect in GiGPO (advantages are normalized by advantage_norm"),
        (dict(scale_rewards=False), "scale_rewards='none' has no effect in GiGPO"),
        (dict(reward_weights=[1.0, 0.5]), "reward_weights=[1.0, 0.5] has no effect in GiGPO (rewards come from the environment"),
        (dict(multi_objective_aggregation="normalize_then_sum"), "multi_objective_aggregation='normalize_then_sum' has no effect"),
        (dict(top_entropy_quantile=0.2, max_step_samples_per_micro_batch=8),
         "top_entropy_quantile=0.2 selects the tokens above an entropy quantile of each micro-batch, and "
         "max_step_samples_per_micro_batch=8 may split a micro-batch into chunks"),
    ],
)
def test_settings_gigpo_replaces_or_cannot_honour_are_refused(tmp_path, overrides, message):
    with pytest.raises(ValueError, match="invalid GiGPOConfig: ") as error:
        settings_config(tmp_path, **overrides)
    assert message in str(error.value)


def test_the_entropy_bonus_and_the_entropy_quantile_alone_are_accepted(tmp_path):
    settings_config(tmp_path, entropy_coef=0.001)
    settings_config(tmp_path, use_adaptive_entropy=True, entropy_coef=0.0)
    settings_config(tmp_path, top_entropy_quantile=0.2)


def test_the_defaults_of_the_replaced_fields_are_accepted(tmp_path):
    settings_config(tmp_path, scale_rewards=True, reward_weights=None, multi_objective_aggregation="sum_then_normalize")


def test_batch_arithmetic_is_explained_in_tasks_and_copies(tmp_path):
    with pytest.raises(ValueError) as error:
        settings_config(tmp_path, per_device_train_batch_size=2, steps_per_generation=2, num_generations=8)
    message = str(error.value)
    assert "generation_batch_size" not in message
    assert ("per_device_train_batch_size x steps_per_generation = 2 x 2 = 4 trajectories per rollout, which must be "
            "whole groups of num_generations = 8 copies of a task") in message
    assert "per_device_train_batch_size=4 with steps_per_generation=2 (1 task(s) x 8 copies per process)" in message
    settings_config(tmp_path, per_device_train_batch_size=4, steps_per_generation=2, num_generations=8)  # the suggestion works


def test_batch_arithmetic_with_the_default_steps_per_generation(tmp_path):
    with pytest.raises(ValueError, match="= 3 x 2 = 6 trajectories per rollout") as error:
        settings_config(tmp_path, per_device_train_batch_size=3, steps_per_generation=None, gradient_accumulation_steps=2,
               num_generations=4)
    assert "per_device_train_batch_size=4 with steps_per_generation=2" in str(error.value)


def test_reward_funcs_are_refused_with_the_reason(tmp_path, tiny_model_path):
    with pytest.raises(ValueError, match="GiGPOTrainer takes its rewards from the environment"):
        GiGPOTrainer(tiny_model_path, args=settings_config(tmp_path), train_dataset=task_dataset(range(4)),
                     reward_funcs=[lambda completions, **kwargs: [0.0] * len(completions)])


def test_a_dataset_without_seeds_or_with_too_few_tasks_is_rejected(tmp_path, tiny_model_path):
    from datasets import Dataset

    with pytest.raises(ValueError, match="train_dataset needs a 'seed' column"):
        GiGPOTrainer(tiny_model_path, args=cpu_config(tmp_path), train_dataset=Dataset.from_dict({"prompt": ["hi"] * 4}))
    with pytest.raises(ValueError, match="train_dataset has 3 tasks, but one rollout needs .* = 4 distinct tasks"):
        GiGPOTrainer(tiny_model_path, args=cpu_config(tmp_path), train_dataset=task_dataset(range(3)))


def test_the_papers_five_copies_get_an_eval_batch_of_whole_groups_unless_one_is_set_that_splits_them(tmp_path):
    paper = GiGPOConfig(str(tmp_path), num_generations=5, per_device_train_batch_size=10, bf16=False)
    assert paper.per_device_eval_batch_size == 10  # the smallest multiple of 5 from TRL's default of 8
    assert GiGPOConfig(str(tmp_path), num_generations=4, bf16=False).per_device_eval_batch_size == 8
    assert GiGPOConfig(str(tmp_path), num_generations=5, per_device_train_batch_size=10, num_generations_eval=3,
                       bf16=False).per_device_eval_batch_size == 9
    with pytest.raises(ValueError, match=r"per_device_eval_batch_size=8 must be a multiple of the eval group size"):
        GiGPOConfig(str(tmp_path), num_generations=5, per_device_train_batch_size=10, per_device_eval_batch_size=8,
                    bf16=False)
