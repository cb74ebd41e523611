"""Fixtures of the engine tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def model_dir() -> Path:
    """The tiny llama with random weights (built once, cached)."""
    # Imported here: a conftest loads before tests/conftest.py's pytest_configure, which must
    # precede torch (tests.runtime.helpers imports it).
    from tests.runtime.helpers import tiny_model_dir

    return tiny_model_dir("llama")
