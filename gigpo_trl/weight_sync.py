"""vLLM's weight sync of a LoRA model, with the base weights left bit-identical.

TRL 1.16 syncs a PEFT model to vLLM (`VLLMGeneration._iter_named_params`) by `merge_adapter()`, reading the merged
weights, then `unmerge_adapter()`. In floating point W + dW - dW is not W, so every sync moves the frozen base weights
by rounding (bf16 SmolLM2 on an H100: 0.23% of them after 3 syncs, docs/gpu.md); over the thousands of syncs of a run
that trains the base, and the saved adapter no longer fits the base it is published for.

`sync_lora_out_of_place` keeps TRL's iteration (its gathering under ZeRO-3, its vLLM parameter names, its colocate
and server paths) and changes only where the merged weights come from: TRL's `merge_adapter` / `unmerge_adapter` do
nothing, and where TRL yields an adapted layer's base weight, a new tensor takes its place, computed as PEFT's merge
computes it, one layer at a time. Nothing writes to the module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from peft import PeftModel
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.tuners_utils import BaseTunerLayer, check_adapters_to_merge

if TYPE_CHECKING:
    from trl.generation.vllm_generation import VLLMGeneration

NamedTensors = Iterator[tuple[str, torch.Tensor]]


def sync_lora_out_of_place(generation: VLLMGeneration) -> None:
    """Make TRL's vLLM backend sync a PEFT model without touching its base weights (see the module docstring).
    Nothing changes for a model without adapters.

    Raises ValueError for what cannot be merged exactly out of place: a PEFT layer other than LoRA's linear layer
    (LoHa, IA3, a LoRA embedding, trainable tokens, a quantized layer, ...), a LoRA variant (DoRA, ...), or FSDP,
    whose per-unit traversal the merge is not written for.
    """
    model = generation.model
    if not isinstance(model, PeftModel):
        return
    problems = unsupported_layers(model)
    if generation._dist.is_fsdp:
        problems.append("FSDP (TRL's traversal of FSDP units); DeepSpeed ZeRO-3 is supported")
    if problems:
        raise ValueError(
            "vLLM's weight sync of this PEFT model would move its base weights: TRL merges the adapter into them and "
            "unmerges it (W + dW - dW is not W in floating point), and gigpo-trl merges out of place only plain LoRA "
            f"on linear layers. Not supported: {'; '.join(problems)}. Use plain LoRA (no use_dora), or use_vllm=False")
    named_params = generation._iter_named_params
    generation._iter_named_params = lambda: merged_out_of_place(model, named_params)


def unsupported_layers(model: PeftModel) -> list[str]:
    """The adapted layers whose merge `merged_weight` does not compute: any PEFT layer but `peft.tuners.lora.Linear`,
    and LoRA layers with a variant (DoRA's `DoraLinearVariant`, ...), by module name and class."""
    return lora_layers(model, lambda module: type(module) is LoraLinear)[1]


def lora_layers(model: PeftModel, accepted: Callable[[Any], bool], refusal: str = "") -> tuple[list[str], list[str]]:
    """The PEFT-adapted layers of `model`, in two lists: the names of the plain LoRA layers of the kinds `accepted`
    takes, and the others by name and reason: a layer of another kind (its class, then `refusal`), or a LoRA layer
    with a variant (DoRA's `DoraLinearVariant`, ...)."""
    plain, problems = [], []
    for name, module in model.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        if not accepted(module):
            problems.append(f"{name} ({type(module).__module__}.{type(module).__name__}{refusal})")
        elif getattr(module, "lora_variant", None):
            variants = sorted({type(variant).__name__ for variant in module.lora_variant.values()})
            problems.append(f"{name} (LoRA variant {', '.join(variants)})")
        else:
            plain.append(name)
    return plain, problems


def merged_out_of_place(model: PeftModel, named_params: Callable[[], NamedTensors]) -> NamedTensors:
    """`named_params` (TRL's `_iter_named_params`: vLLM's name and the tensor of every parameter, gathered under
    ZeRO-3) run with the model's merge and unmerge doing nothing; each adapted layer's base weight (and bias, with
    `lora_bias`) it yields is replaced by a new merged tensor. Raises RuntimeError if one of them never came (vLLM
    would keep generating with that layer's unmerged weight)."""
    with merge_disabled(model):
        merges = None
        for name, tensor in named_params():
            if merges is None:  # TRL has gathered every parameter (ZeRO-3) before its first yield
                merges = pending_merges(model)
            merge = merges.pop(tensor.data_ptr(), None)
            yield name, tensor if merge is None else merge()
    if merges:
        raise RuntimeError(f"{len(merges)} adapted weights were not among the weights TRL synced to vLLM")


@contextmanager
def merge_disabled(model: PeftModel) -> Iterator[None]:
    """`model.merge_adapter()` and `model.unmerge_adapter()` do nothing inside the block."""
    model.merge_adapter = model.unmerge_adapter = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del model.merge_adapter, model.unmerge_adapter


def pending_merges(model: PeftModel) -> dict[int, Callable[[], torch.Tensor]]:
    """The data pointer of every base tensor `merge_adapter()` would change -> the merged tensor's computation. The
    adapters are those `merge_adapter()` merges: each layer's active ones not merged already (PEFT's own rule)."""
    merges = {}
    for layer in model.modules():
        if not isinstance(layer, LoraLinear):
            continue
        adapters = [adapter for adapter in check_adapters_to_merge(layer) if adapter in layer.lora_A]
        if not adapters:
            continue
        base = layer.get_base_layer()
        merges[base.weight.data_ptr()] = functools.partial(merged_weight, layer, adapters)
        if any(layer.lora_bias[adapter] for adapter in adapters):
            merges[base.bias.data_ptr()] = functools.partial(merged_bias, layer, adapters)
    return merges


@torch.no_grad()
def merged_weight(layer: LoraLinear, adapters: list[str]) -> torch.Tensor:
    """W + scaling * B @ A for each adapter in turn (transposed for `fan_in_fan_out`: PEFT's `get_delta_weight`),
    (out_features, in_features), in W's dtype. As `lora.Linear.merge` computes it: the sum in the wider dtype of
    the two (W bf16, the adapter float32: float32), rounded to W's dtype after each adapter."""
    weight = layer.get_base_layer().weight
    merged = weight
    for adapter in adapters:
        merged = (merged + layer.get_delta_weight(adapter)).to(weight.dtype)
    return merged


@torch.no_grad()
def merged_bias(layer: LoraLinear, adapters: list[str]) -> torch.Tensor:
    """b + scaling * (B's bias) for each adapter with `lora_bias=True` in turn, (out_features,), in b's dtype."""
    bias = layer.get_base_layer().bias
    merged = bias
    for adapter in adapters:
        if layer.lora_bias[adapter]:
            merged = (merged + layer.lora_B[adapter].bias * layer.scaling[adapter]).to(bias.dtype)
    return merged
