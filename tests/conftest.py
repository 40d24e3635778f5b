"""Shared fixtures: a tiny local chat model (no download) built once per test session. Generated games
go to a temporary cache, never to the user's."""

from __future__ import annotations

import os
import tempfile

import pytest

from gigpo_trl.models import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-model")))


os.environ["GIGPO_TRL_CACHE"] = tempfile.mkdtemp(prefix="gigpo-trl-test-cache-")
# Importing alfworld creates its data folder ($ALFWORLD_DATA, default ~/.cache/alfworld); the tests bring their own games.
os.environ["ALFWORLD_DATA"] = tempfile.mkdtemp(prefix="gigpo-trl-test-alfworld-")


@pytest.fixture(scope="session")
def tool_model_path(tmp_path_factory) -> str:
    """The tiny model with TRL's Qwen2.5 chat template, which renders and parses tool calls (its own ChatML template
    does not render them; its special tokens are Qwen's)."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template

    directory = build_tiny_model(tmp_path_factory.mktemp("tiny-tool-model"))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = qwen2_5_chat_template
    tokenizer.save_pretrained(directory)
    return str(directory)
