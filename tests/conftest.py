"""Shared fixtures: a tiny local chat model (no download) built once per test session."""

from __future__ import annotations

import pytest

from gigpo_trl.models import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-model")))
