"""The research tests use the test suite's fixtures (the tiny local model) and, by importing them, its isolated
caches (generated games never go to the user's cache)."""

from tests.conftest import make_tiny_model, tiny_model_path  # noqa: F401
