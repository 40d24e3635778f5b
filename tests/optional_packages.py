"""Tests that need an optional package (vLLM, DeepSpeed) skip without it, except where CI asks for it by an
environment variable: then a missing package is an error, so that a broken install cannot pass as skipped tests."""

from __future__ import annotations

import importlib.util
import os

import pytest


def require(package: str, variable: str, install: str) -> None:
    """Skip the calling test (or test module) when `package` cannot be imported, or fail when `variable` is "1"."""
    if importlib.util.find_spec(package) is not None:
        return
    if os.environ.get(variable) == "1":
        raise ImportError(f"{variable}=1 but {package} is not installed ({install})")
    pytest.skip(f"needs {package} ({install})", allow_module_level=True)
