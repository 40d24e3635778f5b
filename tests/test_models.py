"""The models that need no download: the embedded model's one-time conversion is written whole by any process of a
launched run, whatever its rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed
import torch.multiprocessing

from gigpo_trl.models import _in_fresh_process, build_tiny_model


def write_model_on_rank_1(rank: int, store: str, folder: str, fresh: bool) -> None:
    """One of 2 processes of a gloo group, as torchrun or accelerate launch starts them: rank 1 saves a model."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        if rank == 1:
            if fresh:
                _in_fresh_process(build_tiny_model, folder)
            else:
                build_tiny_model(folder)
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_model_saved_by_the_rank_1_process_of_a_launched_run_is_written_whole_in_a_fresh_process(tmp_path):
    def saved(fresh: bool) -> set[str]:
        folder = tmp_path / ("fresh" if fresh else "in-process")
        torch.multiprocessing.spawn(write_model_on_rank_1, args=(str(tmp_path / f"store-{fresh}"), str(folder), fresh),
                                    nprocs=2)
        return {path.name for path in Path(folder).iterdir()}

    # Why the embedded model is converted in a fresh process: inside the launched one, transformers' save_pretrained
    # writes nothing on rank 1 (the tokenizer is still written: a folder that looks whole and does not load).
    in_process = saved(fresh=False)
    assert "tokenizer.json" in in_process and "config.json" not in in_process
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= saved(fresh=True)
