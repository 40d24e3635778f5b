"""Start a test's worker script (tests/distributed_run.py by default) in several processes, under torchrun or
`accelerate launch`, and read what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.gpu_check import free_port

TESTS = Path(__file__).resolve().parent
SCRIPT = TESTS / "distributed_run.py"
REPO = TESTS.parent


def torchrun(num_processes: int) -> list[str]:
    """Plain data parallelism: torchrun's processes, gloo between them (no DeepSpeed), on a free port (tests run at
    once, `pytest -n 2`, would both take torchrun's default 29500)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(num_processes),
            "--master_port", str(free_port())]


def run_script(launcher: Sequence[str], *arguments: str, script: Path = SCRIPT,
               timeout: float = 400) -> subprocess.CompletedProcess:
    """Run `script` under `launcher` from the repository root, with bench/ and the test helpers importable."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)])}
    return subprocess.run([*launcher, str(script), *arguments], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env=environment)


def finished_run(launcher: Sequence[str], model_dir: str, output_dir: Path, *options: str, script: Path = SCRIPT,
                 timeout: float = 400) -> dict:
    """Run `script MODEL_DIR OUTPUT_DIR [options]` to its end (failing the test with the processes' output otherwise)
    and return what its main process wrote to OUTPUT_DIR/metrics.json, plus the folder under "output_dir"."""
    result = run_script(launcher, model_dir, str(output_dir), *options, script=script, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return {**json.loads((output_dir / "metrics.json").read_text()), "output_dir": output_dir}
