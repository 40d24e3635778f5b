"""QLoRA without a GPU: a 4-bit (bitsandbytes NF4) base with a LoRA adapter trains through GiGPOTrainer with generation
by transformers, on bitsandbytes' CPU backend. With vLLM, the adapter mode is the one that can serve a 4-bit base
(tests/test_vllm.py); the merged mode is refused for it here, before anything is loaded."""

from __future__ import annotations

import math

import pytest
import torch
from optional_packages import require
from trainer_helpers import parameters, settings_config

require("bitsandbytes", "GIGPO_TRL_REQUIRE_BITSANDBYTES", "pip install -c constraints.txt -e '.[qlora]'")

from peft import LoraConfig  # noqa: E402
from transformers import BitsAndBytesConfig  # noqa: E402

from gigpo_trl.tasks import task_dataset  # noqa: E402
from gigpo_trl.trainer import GiGPOTrainer  # noqa: E402

FOUR_BIT = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
LORA = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")


def test_a_4bit_base_with_a_lora_adapter_trains_with_generation_by_transformers(tmp_path, tiny_model_path):
    import bitsandbytes as bnb

    config = settings_config(tmp_path, learning_rate=3e-2, model_init_kwargs={"quantization_config": FOUR_BIT})
    trainer = GiGPOTrainer(tiny_model_path, args=config, train_dataset=task_dataset(range(8)), peft_config=LORA)
    adapted = [module for name, module in trainer.model.named_modules() if name.endswith("base_layer")]
    assert len(adapted) == 14 and all(isinstance(module, bnb.nn.Linear4bit) for module in adapted)
    before = parameters(trainer.model)
    trainer.train()
    trainer.close_environments()
    after = parameters(trainer.model)

    logs = [entry for entry in trainer.state.log_history if "env/step_samples" in entry]
    assert len(logs) == 2 and all(math.isfinite(entry["loss"]) and math.isfinite(entry["grad_norm"]) for entry in logs)
    base = [name for name in before if "lora_" not in name]
    assert [name for name in base if not torch.equal(before[name], after[name])] == []  # the 4-bit base untouched
    assert {before[name].dtype for name in base if name.endswith("base_layer.weight")} == {torch.uint8}  # packed NF4
    assert min((after[name] - before[name]).abs().max().item() for name in before if "lora_" in name) > 0


@pytest.mark.parametrize("quantization", [FOUR_BIT, FOUR_BIT.to_dict()], ids=["config", "dict"])
def test_vllm_in_the_merged_mode_refuses_a_4bit_base_before_loading_it(tmp_path, quantization):
    # The merged mode merges the adapter into the base for every sync, which 4-bit weights cannot take.
    config = settings_config(tmp_path, use_vllm=True, model_init_kwargs={"quantization_config": quantization})
    with pytest.raises(ValueError, match="a 4-bit .bitsandbytes. base cannot take a merged adapter.*vllm_lora_sync='adapter'"):
        GiGPOTrainer("no/such-model", args=config, train_dataset=task_dataset(range(8)), peft_config=LORA)
