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
