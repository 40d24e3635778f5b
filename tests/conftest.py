"""Shared fixtures: a tiny local chat model (no download) built once per test session. Generated games
go to a temporary cache, never to the user's."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from gigpo_trl.models import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_path(make_tiny_model) -> str:
    return make_tiny_model("tiny-model")


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory):
    """`make_tiny_model(name, hidden_size=64, tool_template=False)` builds a tiny model's folder and returns its path.
    `tool_template` gives it TRL's Qwen2.5 chat template, which renders and parses tool calls (the tiny model's own
    ChatML template does not render them; its special tokens are Qwen's)."""

    def make(name: str, *, hidden_size: int = 64, tool_template: bool = False) -> str:
        directory = build_tiny_model(tmp_path_factory.mktemp(name), hidden_size=hidden_size)
        if tool_template:
            from transformers import AutoTokenizer
            from trl.chat_template_utils import qwen2_5_chat_template

            tokenizer = AutoTokenizer.from_pretrained(directory)
            tokenizer.chat_template = qwen2_5_chat_template
            tokenizer.save_pretrained(directory)
        return str(directory)

    return make


if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n 2`: the workers share the cores, one thread each (and the
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # processes they start), instead of each taking every core
    torch.set_num_threads(1)

# One cache for the session, never the user's: `pytest -n 2`'s workers inherit the controller's environment, so they
# share the generated games and the converted embedded model (each written atomically) instead of making them twice.
os.environ.setdefault("GIGPO_TRL_TEST_CACHE", tempfile.mkdtemp(prefix="gigpo-trl-test-cache-"))
os.environ["GIGPO_TRL_CACHE"] = os.environ["GIGPO_TRL_TEST_CACHE"]
# Importing alfworld creates its data folder ($ALFWORLD_DATA, default ~/.cache/alfworld); the tests bring their own games.
os.environ["ALFWORLD_DATA"] = tempfile.mkdtemp(prefix="gigpo-trl-test-alfworld-")


@pytest.fixture(scope="session")
def tool_model_path(make_tiny_model) -> str:
    """The tiny model with TRL's Qwen2.5 chat template."""
    return make_tiny_model("tiny-tool-model", tool_template=True)


def pytest_collection_modifyitems(config, items):
    """The slow tests first (`@pytest.mark.slow`), in their collected order: under `pytest -n 2` (with `--dist
    worksteal`, setup.cfg) the long tests run early and the short ones fill the end, where a worker that runs out takes
    half of the other's queue, instead of one worker ending alone on a long test while the other sits idle."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
