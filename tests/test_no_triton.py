"""The CPU path runs where triton is not installed (pyproject.toml installs it only on Linux
x86-64): every service module imports, and prefill and decode engines serve the tiny model, with
a float and an int8 KV cache, in a process where ``import triton`` fails."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent(
    """
    import importlib
    import sys

    sys.modules["triton"] = None  # `import triton` raises ImportError, as where it is absent

    for name in ("services.tokenizer.service", "services.prefill.service",
                 "services.decode.service", "services.detokenizer.service",
                 "services.gateway.service", "services.cli", "kernels"):
        importlib.import_module(name)

    from shared.runtime import SamplingParams
    from tests.runtime.helpers import EnginePair, tiny_model_dir

    model_dir = tiny_model_dir("llama")
    sampling = SamplingParams(max_tokens=6, repetition_penalty=1.3, min_tokens=2)
    # int8 through the C kernels and through torch (which quantizes with kernels.triton.int8_ref)
    setups = ({"kv_cache_dtype": "auto"}, {"kv_cache_dtype": "int8"},
              {"kv_cache_dtype": "int8", "cpu_attention": "torch"})
    for i, engines in enumerate(setups):
        with EnginePair.build(model_dir, sys.argv[1] + f"/{i}", prefill=engines,
                              decode=engines) as pair:
            pair.add(f"r{i}", [1, 2, 3, 4, 5], sampling)
            tokens = pair.run()[f"r{i}"]
            assert len(tokens) == 6, tokens
    leaked = [m for m in sys.modules if m == "triton" or m.startswith("triton.")]
    assert sys.modules["triton"] is None and leaked == ["triton"], leaked
    print("ok")
    """
)


@pytest.mark.slow
def test_cpu_engines_serve_without_triton(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-4000:]
