"""What the host tier of the KV cache costs a decode step (shared/runtime/kv_tiers.py).

    python -m loadtest host-tier --device cuda --out out/host_tier.json

A preset's model (``--preset``, default ``qwen2-0.5b``: Qwen2-0.5B's layer shapes; random weights:
the step's cost does not depend on them; loadtest/models.py) in bf16 on the device, ``--batch``
sequences of ``--context`` tokens prefilled, then ``--steps`` decode steps timed, once per host
fraction: the share of the batch's KV blocks that live in the host tier (the device pool holds the
rest; each step stages the host blocks it reads into the device pool and writes the extended ones
back). Beside it, the roofline of the staging: one pinned host-to-device copy of the same bytes.
Prints a table and writes JSON. A benchmark, not a test: it asserts nothing about speed. On CPU it
runs too (small sizes, fp32) so that it can be tried anywhere; the figures mean something on a GPU
only.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from loadtest.models import kv_block_bytes, preset_model
from shared.config import BatonConfig
from shared.runtime import BlockManager, SamplingParams, Sequence
from shared.runtime.model_runner import ModelRunner


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_point(model_dir: Path, args: argparse.Namespace, host_fraction: float) -> dict[str, Any]:
    bs = 16
    seq_blocks = math.ceil((args.context + args.steps + 1) / bs)
    total = args.batch * seq_blocks
    num_host = math.ceil(total * host_fraction)
    staging = seq_blocks if num_host else 0
    # The device pool holds what the host tier does not; staging covers one whole sequence.
    num_device = max(total - num_host, staging) + staging
    config = BatonConfig(
        model=str(model_dir),
        device=args.device,
        dtype=args.dtype,
        num_kv_blocks=num_device,
        max_model_len=seq_blocks * bs,  # so that staging is exactly seq_blocks
        enable_prefix_caching=False,
    )
    block_bytes = kv_block_bytes(args.preset, bs, getattr(torch, args.dtype).itemsize)
    runner = ModelRunner(config, kv_host_cache_bytes=num_host * block_bytes)
    assert runner.block_bytes == block_bytes
    device = runner.device
    tiers = runner.tiers
    bm = BlockManager(runner.num_kv_blocks, bs, False, tiers.num_device_blocks)
    g = torch.Generator().manual_seed(0)
    vocab = runner.model_config.vocab_size
    seqs = []
    for i in range(args.batch):
        prompt = torch.randint(3, vocab, (args.context,), generator=g).tolist()
        seq = Sequence(f"r{i}", prompt, SamplingParams(max_tokens=args.steps + 1, ignore_eos=True))
        bm.allocate(seq)
        seqs.append(seq)
    per_forward = max(1, args.prefill_tokens // args.context)
    for k in range(0, len(seqs), per_forward):
        chunk = seqs[k : k + per_forward]
        for seq, token in zip(
            chunk, runner.prefill(chunk, [s.num_tokens for s in chunk]), strict=True
        ):
            assert token is not None
            seq.num_computed_tokens = seq.num_tokens
            seq.append_token(token)
    tier = runner.host_tier
    staged_before = tier.num_staged_blocks if tier else 0
    times = []
    for _ in range(args.steps):
        for seq in seqs:
            bm.append_slot(seq)
        sync(device)
        t0 = time.perf_counter()
        tokens = runner.decode(seqs)
        sync(device)
        times.append(time.perf_counter() - t0)
        for seq, token in zip(seqs, tokens, strict=True):
            seq.num_computed_tokens = seq.num_tokens
            seq.append_token(token)
    warm = times[2:] if len(times) > 4 else times
    step_s = statistics.median(warm)
    staged = ((tier.num_staged_blocks if tier else 0) - staged_before) / args.steps
    staged_bytes = staged * runner.block_bytes
    return {
        "host_fraction": host_fraction,
        "device_blocks": tiers.num_device_blocks,
        "staging_blocks": tiers.num_staging_blocks,
        "host_blocks": tiers.num_host_blocks,
        "host_blocks_used": bm.num_host_blocks_used,
        "step_ms": step_s * 1e3,
        "tokens_per_s": args.batch / step_s,
        "staged_mb_per_step": staged_bytes / 2**20,
        "staged_gb_per_s": staged_bytes / step_s / 1e9,
        "kv_gb": total * runner.block_bytes / 1e9,
    }


def copy_roofline(nbytes: int, device: torch.device) -> float | None:
    """GB/s of one pinned host-to-device copy of ``nbytes`` (median of 5)."""
    if device.type != "cuda" or nbytes <= 0:
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(6):
        sync(device)
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        sync(device)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[1:]) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, else float32")
    parser.add_argument("--preset", default="qwen2-0.5b", help="the model's shape")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--prefill-tokens", type=int, default=16384)
    parser.add_argument("--host-fractions", type=float, nargs="+", default=[0.0, 0.25, 0.5])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    results: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "out"}}
    model_dir = preset_model(args.preset)
    with torch.inference_mode():
        points = [run_point(model_dir, args, f) for f in args.host_fractions]
    base = points[0]["step_ms"]
    for p in points:
        p["step_vs_device_only"] = p["step_ms"] / base
    results["points"] = points
    biggest = max(p["staged_mb_per_step"] for p in points)
    results["pinned_h2d_gb_per_s"] = copy_roofline(int(biggest * 2**20), torch.device(args.device))
    head = ("host share", "step ms", "x device", "tok/s", "staged MB", "GB/s")
    print(" ".join(f"{h:>10}" for h in head))
    for p in points:
        keys = ("host_fraction", "step_ms", "step_vs_device_only", "tokens_per_s")
        row = [f"{p[k]:>10.2f}" for k in keys]
        row += [f"{p['staged_mb_per_step']:>10.1f}", f"{p['staged_gb_per_s']:>10.1f}"]
        print(" ".join(row))
    print(
        f"pinned host-to-device copy of the largest staging: {results['pinned_h2d_gb_per_s']} GB/s"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
