"""Every Python process started with this folder on PYTHONPATH runs vLLM on its CPU build as `scripts/vllm_cpu.py`
describes (its engine settings, its weight-layout shim and its LoRA ops): CPU dry-runs of the GPU recipes, whose runs
are processes that `research/learning.py --parallel` starts (research/settings/d2_coin_gpu_recipe/README.md). Not for
GPUs, where none of this applies.

    PYTHONPATH=scripts/vllm_cpu_site python research/learning.py --parallel --config research/configs/learning_coin_d2_gpu.yaml ...
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/, for vllm_cpu

from vllm_cpu import apply_lora_per_slot, keep_weights_for_sync, use_cpu_engine_environment  # noqa: E402

use_cpu_engine_environment()
try:
    keep_weights_for_sync()
    apply_lora_per_slot()
except ImportError:  # a Python without vLLM (a tool the command runs): nothing to change
    pass
