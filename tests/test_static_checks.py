"""The type checker and the linter over everything that ships, operators' scripts included.

``deploy/`` and ``loadtest/`` are run by hand, not imported by the suite: a rename in the code
they call broke ``make compose-check`` once without any test noticing. mypy reads every script
against the code it calls, so such a rename fails here. Its cache lives in BATON_CACHE_DIR:
a fresh clone on a machine that ran the suite before re-checks only what changed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shared.config import default_cache_dir

ROOT = Path(__file__).resolve().parents[1]
TREES = ["services", "shared", "loadtest", "deploy", "kernels"]

pytestmark = pytest.mark.slow


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def test_mypy_passes_over_every_tree() -> None:
    cache = default_cache_dir() / "mypy"
    out = _run("mypy", "--cache-dir", str(cache), *TREES)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


def test_ruff_passes() -> None:
    out = _run("ruff", "check", "--no-cache", ".")
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
