"""vLLM's weight sync of a LoRA model (gigpo_trl/weight_sync.py) through TRL 1.16's own parameter iteration
(`VLLMGeneration._iter_named_params`: its PEFT renaming and gathering), without a vLLM engine: the backend object is
made without `__init__`, which would start one. tests/test_vllm.py runs the same sync into vLLM's real engine."""

from __future__ import annotations

import copy

import pytest
import torch
from accelerate import Accelerator
from peft import IA3Config, LoraConfig, get_peft_model
from trainer_helpers import engineless_vllm_backend
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel
from trl.generation.vllm_generation import VLLMGeneration

from gigpo_trl.weight_sync import sync_lora_out_of_place

SYNCS = 3


def backend(model) -> VLLMGeneration:
    return engineless_vllm_backend(model, Accelerator(cpu=True))


def trained(model, seed: int = 0):
    """Give every LoRA B matrix (and bias) random values, as training would: a fresh adapter's B is 0 (no merge)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return model


def bf16_lora(tiny_model_path):
    """The tiny Qwen2 model in bf16 with LoRA on every linear layer (the adapter in float32, PEFT's default)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16)
    return trained(get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")))


def gpt2_lora_with_two_adapters():
    """GPT-2's Conv1D layers (weights stored in x out: `fan_in_fan_out`), LoRA with `lora_bias`, two active adapters."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    model = model.to(torch.bfloat16)
    config = dict(target_modules=["c_attn", "c_proj"], fan_in_fan_out=True, lora_bias=True)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, **config))
    model.add_adapter("second", LoraConfig(r=2, lora_alpha=16, use_rslora=True, **config))
    model.base_model.set_adapter(["default", "second"])
    return trained(model)


def synced(generation: VLLMGeneration) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in generation._iter_named_params()}


def vllm_name(name: str) -> str:
    return name.removeprefix("base_model.model.").replace(".base_layer", "")


def base_parameters(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" not in name}


@pytest.mark.parametrize("make", ["qwen2_all_linear", "gpt2_fan_in_fan_out_bias_two_adapters"])
def test_syncs_send_trls_first_merged_weights_every_time_and_leave_the_base_bit_identical(make, tiny_model_path):
    model = bf16_lora(tiny_model_path) if make == "qwen2_all_linear" else gpt2_lora_with_two_adapters()
    trl_model = copy.deepcopy(model)
    before = base_parameters(model)

    # TRL's own sync (merge_adapter, read, unmerge_adapter): its first sync is PEFT's merge of the untouched base ...
    trl_generation = backend(trl_model)
    expected = synced(trl_generation)
    for _ in range(SYNCS - 1):
        synced(trl_generation)
    # ... and the syncs move the base weights by rounding (W + dW - dW)
    assert [name for name, value in base_parameters(trl_model).items() if not torch.equal(value, before[name])]

    generation = backend(model)
    sync_lora_out_of_place(generation)
    for _ in range(SYNCS):
        weights = synced(generation)
        assert list(weights) == list(expected)  # TRL's vLLM names, in TRL's order
        assert [name for name in weights if not torch.equal(weights[name], expected[name])] == []
    after = base_parameters(model)
    assert [name for name in before if not torch.equal(after[name], before[name])] == []  # bit-identical
    assert not any(module.merged for module in model.modules() if hasattr(module, "merged_adapters"))
    # the merge reached the synced weights: those of every adapted layer differ from its base (its bias too, with
    # lora_bias: the GPT-2 case)
    base = {vllm_name(name): value for name, value in before.items()}
    merged = ".base_layer." if make.startswith("gpt2") else ".base_layer.weight"
    adapted = {vllm_name(name) for name in before if merged in name}
    assert adapted and {name for name in weights if not torch.equal(weights[name], base[name])} == adapted


@pytest.mark.parametrize(("config", "named"), [
    (LoraConfig(r=4, target_modules="all-linear", use_dora=True), "LoRA variant DoraLinearVariant"),
    (LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]), "peft.tuners.lora.layer.Embedding"),
    (IA3Config(target_modules=["down_proj", "q_proj"], feedforward_modules=["down_proj"]),
     "peft.tuners.ia3.layer.Linear"),
], ids=["dora", "lora_embedding", "ia3"])
def test_what_cannot_be_merged_out_of_place_is_refused_by_name(config, named, tiny_model_path):
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path), config)
    with pytest.raises(ValueError, match=named):
        sync_lora_out_of_place(backend(model))


def test_fsdp_is_refused_and_a_model_without_adapters_keeps_trls_sync(tiny_model_path):
    generation = backend(bf16_lora(tiny_model_path))
    generation._dist.fsdp_version = 2  # what accelerate's FSDP plugin sets
    with pytest.raises(ValueError, match="FSDP"):
        sync_lora_out_of_place(generation)

    plain = backend(AutoModelForCausalLM.from_pretrained(tiny_model_path))
    iterate = plain._iter_named_params
    sync_lora_out_of_place(plain)
    assert plain._iter_named_params == iterate
