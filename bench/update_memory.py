"""The update's memory per step sample, measured on this machine's CPU, and the estimate that sizes GPU runs with it.

    python bench/update_memory.py --model embedded:SmolLM2-135M-Instruct --samples 1 2 4 8 --prompt-tokens 300
    python bench/update_memory.py ... --bf16              # under bf16 autocast (what `bf16: true` trains in)

One pass of GiGPO's loss (`GiGPOTrainer.compute_loss`: TRL's forward pass with its fused head, then the backward pass)
over n step samples of `--prompt-tokens` + `--answer-tokens` tokens, each size in a fresh process: what the pass adds
to the process's peak resident memory (Linux VmHWM, reset just before the pass, after a first pass has allocated the
gradients). The update's peak is one pass's, since `max_step_samples_per_micro_batch` bounds the rows of a pass and
the passes of a micro-batch free their activations before the next. A straight line through the sizes gives the
memory per step sample, and per token and layer (`bytes_per_token_layer`), the coefficient of `pass_memory_gib`.

`pass_memory_gib` and `run_memory_gib` with `BYTES_PER_TOKEN_LAYER_HIDDEN` are what `research/learning.py --parallel`
checks a plan with (it refuses one whose runs cannot fit); docs/performance.md ("Update memory per step sample") has
the figures and their check against the H100 measurement (one pass of 64 SmolLM2 samples peaked at about 23 GiB).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30
# Bytes a loss pass holds per token, decoder layer and hidden unit (hidden_size), for the backward pass. Measured with
# SmolLM2-135M (hidden 576, 30 layers; docs/figures/update_memory_cpu.json, docs/performance.md) on this project's CPU: fp32
# 133, bf16 autocast 95. On the H100 (bf16, 2026-11-25) one pass of 64 Setting D samples (355 tokens at most) peaked at
# about 23 GiB in its process, 21 GiB of it activations: 57, which is what a CUDA device gets in bf16 (the CPU's 95
# overestimates it 1.7x; CPU autocast keeps more fp32 intermediates, and CUDA's attention saves no score matrix).
BYTES_PER_TOKEN_LAYER_HIDDEN = {("cpu", "fp32"): 133.0, ("cpu", "bf16"): 95.2, ("cuda", "bf16"): 57.4,
                                ("cuda", "fp32"): 133.0}  # no CUDA fp32 figure: the CPU's, an upper bound


def pass_memory_gib(bytes_per_token_layer: float, samples: int, tokens_per_sample: int, num_layers: int) -> float:
    """The activations one loss pass holds for its backward pass: `samples x tokens x layers x coefficient` bytes.

    Args:
        bytes_per_token_layer: measured by this script for the model and precision (`measure`), or
            `BYTES_PER_TOKEN_LAYER_HIDDEN[device, precision] x hidden_size` for a model of another width.
        samples: the rows of the pass (`max_step_samples_per_micro_batch`, or a whole micro-batch without it).
        tokens_per_sample: prompt + answer tokens of a step sample (the longest expected).
        num_layers: the model's decoder layers (`config.num_hidden_layers`).
    """
    return bytes_per_token_layer * samples * tokens_per_sample * num_layers / GIB


def run_memory_gib(parameters: int, *, pass_gib: float, reference_model: bool, total_gib: float,
                   vllm_share: float | None) -> float:
    """One training run's peak GPU memory: fp32 weights, gradients and AdamW's two moments (16 bytes a parameter), a
    fp32 reference model (`beta` > 0 without LoRA: 4 more), one loss pass's activations, and vLLM colocate's share of
    the GPU (`vllm_gpu_memory_utilization` x the GPU's memory) when it generates."""
    weights = parameters * (16 + (4 if reference_model else 0)) / GIB
    return weights + pass_gib + (vllm_share or 0.0) * total_gib


def plan_fits(needed_gib: float, total_gib: float, plan: str) -> None:
    """Raise SystemExit naming the plan when runs that need `needed_gib` in all would take more than 95% of
    `total_gib`."""
    if needed_gib > 0.95 * total_gib:
        raise SystemExit(f"--parallel: the plan does not fit: {plan}: {needed_gib:.1f} GiB. Start fewer runs at once "
                         "(--seeds), lower max_step_samples_per_micro_batch (it changes only the memory), or lower "
                         "vllm_gpu_memory_utilization")


def peak_rss_reset() -> int:
    """Reset the process's peak resident memory to its current one (Linux); returns the current one in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_bytes("VmRSS")


def _status_bytes(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def one_pass(model: str, samples: int, prompt_tokens: int, answer_tokens: int, bf16: bool) -> dict:
    """In this process: the peak memory one loss pass over `samples` step samples adds (after a warm-up pass)."""
    import torch

    from gigpo_trl import GiGPOConfig, GiGPOTrainer, task_dataset
    from gigpo_trl.batch import loss_batch
    from gigpo_trl.dialogue import Completion

    torch.manual_seed(0)
    config = GiGPOConfig(output_dir=str(ROOT / "outputs" / "update_memory"), env_name="rooms", env_processes=False,
                         num_generations=2, per_device_train_batch_size=samples * 2 if samples % 2 else samples,
                         steps_per_generation=1, gradient_accumulation_steps=1, bf16=bf16, use_cpu=True,
                         gradient_checkpointing=False, report_to=[], save_strategy="no", max_completion_length=answer_tokens)
    trainer = GiGPOTrainer(model, args=config, train_dataset=task_dataset(range(4)))
    trainer.current_gradient_accumulation_steps = 1
    vocab = trainer.model.config.vocab_size
    completions = [Completion(torch.randint(3, vocab, (prompt_tokens,)).tolist(),
                              torch.randint(3, vocab, (answer_tokens - 1,)).tolist() + [trainer.eos_token_ids[0]], "")
                   for _ in range(samples)]
    batch = loss_batch(trainer, completions, [1.0] * samples, [1.0 if k % 2 else -1.0 for k in range(samples)], "train")
    trainer.model.train()

    def forward_backward():
        with trainer.compute_loss_context_manager():
            loss = trainer.compute_loss(trainer.model, batch)
        trainer.accelerator.backward(loss)

    forward_backward()  # allocates the gradients
    before = peak_rss_reset()
    forward_backward()
    return {"samples": samples, "added_bytes": _status_bytes("VmHWM") - before,
            "num_layers": trainer.model.config.num_hidden_layers, "hidden_size": trainer.model.config.hidden_size,
            "parameters": sum(p.numel() for p in trainer.model.parameters())}


def measure(model: str, sizes: list[int], prompt_tokens: int, answer_tokens: int, bf16: bool) -> dict:
    """Every size in a fresh process, and the straight line through them."""
    runs = []
    for samples in sizes:
        command = [sys.executable, __file__, "--worker", "--model", model, "--samples", str(samples),
                   "--prompt-tokens", str(prompt_tokens), "--answer-tokens", str(answer_tokens)] + (["--bf16"] if bf16 else [])
        result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=False)
        if result.returncode:
            raise RuntimeError(f"the pass of {samples} samples failed:\n{result.stderr[-3000:]}")
        runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
        print(f"{samples:4d} samples: +{runs[-1]['added_bytes'] / 2**20:,.0f} MiB", flush=True)
    slope, intercept = np.polyfit([r["samples"] for r in runs], [r["added_bytes"] for r in runs], 1)
    tokens = prompt_tokens + answer_tokens
    return {"model": model, "bf16": bf16, "prompt_tokens": prompt_tokens, "answer_tokens": answer_tokens, "runs": runs,
            "per_sample_mib": slope / 2**20, "fixed_mib": intercept / 2**20,
            "bytes_per_token_layer": slope / (tokens * runs[0]["num_layers"]),
            "bytes_per_token_layer_hidden": slope / (tokens * runs[0]["num_layers"] * runs[0]["hidden_size"]),
            "num_layers": runs[0]["num_layers"], "hidden_size": runs[0]["hidden_size"], "parameters": runs[0]["parameters"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded:SmolLM2-135M-Instruct")
    parser.add_argument("--samples", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--answer-tokens", type=int, default=12)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (needs a CPU with bf16 instructions to be quick)")
    parser.add_argument("--output", type=Path, default=None, help="write the figures to this JSON file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if any(n < 1 for n in args.samples) or args.prompt_tokens < 1 or args.answer_tokens < 2:
        parser.error("--samples must be >= 1, --prompt-tokens >= 1 and --answer-tokens >= 2")
    if args.worker:
        print(json.dumps(one_pass(args.model, args.samples[0], args.prompt_tokens, args.answer_tokens, args.bf16)))
        return
    figures = measure(args.model, args.samples, args.prompt_tokens, args.answer_tokens, args.bf16)
    print(f"per step sample: {figures['per_sample_mib']:,.1f} MiB; fixed: {figures['fixed_mib']:,.0f} MiB; "
          f"{figures['bytes_per_token_layer']:,.0f} bytes per token and layer")
    if args.output:
        args.output.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
