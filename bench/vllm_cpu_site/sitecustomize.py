"""Every Python process started with this folder on PYTHONPATH runs vLLM on its CPU build as `bench/vllm_cpu.py`
describes (its engine settings, its weight-layout shim and its LoRA ops): CPU dry-runs of the GPU recipes, whose runs are processes
that `bench/learning.py --parallel` starts (docs/results.md, setting D2). Not for GPUs, where none of this applies.

    PYTHONPATH=bench/vllm_cpu_site python bench/learning.py --parallel --config recipes/configs/learning_coin_d2_gpu.yaml ...
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/, for vllm_cpu

from vllm_cpu import apply_lora_per_slot, keep_weights_for_sync, use_cpu_engine_environment  # noqa: E402

use_cpu_engine_environment()
try:
    keep_weights_for_sync()
    apply_lora_per_slot()
except ImportError:  # a Python without vLLM (a tool the command runs): nothing to change
    pass
