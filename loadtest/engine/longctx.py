"""Long prompts at the bench shape: memory per request, TTFT and TPOT with an exact, an int8 and
a sliding-window KV cache.

    python -m loadtest longctx                          # 2k and 8k prompts, 4 requests each
    python -m loadtest longctx --lengths 2048 --requests 8 --output-len 64
    python -m loadtest longctx --preset qwen2-0.5b --lengths 2048    # a real size (4k positions)

The production engines (``shared.engine.build``: prefill and decode, each its own ModelRunner
and cache, the spill store between them) run in this process on the bench shape with room for
long positions (``--preset bench-long``; shapes in loadtest/models.py), one torch
thread each, as the services would (the broker hops, a few ms, are left out: long prompts are
seconds of prefill). Per cache and prompt length, ``--requests`` prompts of that length arrive
at once and each generates ``--output-len`` tokens:

- ``exact``: fp32 KV (the parity contract);
- ``int8``: int8 KV with the last ``--fp-window`` tokens also in fp32 (``BATON_KV_CACHE_DTYPE=
  int8``, ``BATON_KV_FP_WINDOW``; shared/runtime/fp_window.py);
- ``window``: a model of the same shape with a ``--window``-token sliding window (Mistral's
  layout for a llama preset, every layer; Qwen2's for qwen2-0.5b, its upper layers), fp32
  (blocks outside the window released in both engines, never handed off).

Printed: decode's KV memory per request (the most blocks and slots it held at once over the
run, divided by the requests, in MiB), TTFT (arrival to the first token, median over the
requests: they queue behind each other's chunks under the 2,048-token budget), TPOT (median of
decode's step time while every request decodes) and the handoff's bytes per request. A bar
chart goes to ``loadtest/results/longctx.png`` and the figures to ``longctx.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from loadtest.models import arch_of, preset_model
from loadtest.plots import Panel, grouped_bars
from shared.config import REPO_ROOT, BatonConfig
from shared.engine.build import build_decode_engine, build_prefill_engine
from shared.engine.outputs import NewRequest
from shared.wire.sampling import SamplingParams

RESULTS = REPO_ROOT / "loadtest" / "results"


@dataclasses.dataclass(frozen=True)
class Cache:
    name: str
    preset: str
    arch: str
    window: int | None = None  # the model's sliding window
    kv_cache_dtype: str = "auto"
    fp_window: int = 0


def run(cache: Cache, length: int, requests: int, output_len: int, seed: int) -> dict[str, Any]:
    path = preset_model(cache.preset, cache.arch, cache.window)
    with tempfile.TemporaryDirectory(prefix="baton-longctx-") as spill:
        common = dict(
            model=str(path),
            kv_cache_mb=1024,
            max_model_len=length + output_len + 16,
            max_prompt_tokens=length,
            kv_cache_dtype=cache.kv_cache_dtype,
            kv_fp_window=cache.fp_window,
            spill_dir=spill,
            spill_max_bytes=8 << 30,
            max_num_batched_tokens=2048,
        )
        prefill = build_prefill_engine(BatonConfig(**common), path)  # type: ignore[arg-type]
        decode = build_decode_engine(BatonConfig(**common), path)  # type: ignore[arg-type]
        rng = random.Random(seed)
        vocab = prefill.runner.model_config.vocab_size
        sampling = SamplingParams(max_tokens=output_len, ignore_eos=True)
        arrival = time.time()
        prompts = {
            f"r{i}": [rng.randrange(3, vocab) for _ in range(length)] for i in range(requests)
        }
        for rid, prompt in prompts.items():
            prefill.add(NewRequest(rid, prompt, sampling, arrival_time=arrival))
        ttft: dict[str, float] = {}
        handoff_bytes: list[int] = []
        steps: list[float] = []
        peak_blocks = 0
        done = 0
        while prefill.has_work() or decode.has_work():
            if prefill.has_work():
                out = prefill.step()
                now = time.time()
                for t in out.tokens:
                    ttft.setdefault(t.request_id, now - arrival)
                for h in out.handoffs:
                    handoff_bytes.append(h.kv.nbytes if h.kv else 0)
                    decode.add(NewRequest(h.request_id, prompts[h.request_id], sampling,
                                          list(h.output_token_ids), kv=h.kv))  # fmt: skip
            if decode.has_work():
                t0 = time.perf_counter()
                out = decode.step()
                if decode.num_running == requests and out.tokens:
                    steps.append(time.perf_counter() - t0)
                done += sum(t.finish_reason is not None for t in out.tokens)
                bm = decode.block_manager
                peak_blocks = max(peak_blocks, bm.num_used_blocks)
        block_bytes = decode.runner.block_bytes
        prefill.connector.close()
        decode.connector.close()
    return {
        "cache": cache.name,
        "prompt_len": length,
        "requests": requests,
        "kv_mib_per_request": peak_blocks * block_bytes / requests / 2**20,
        "ttft_s_median": statistics.median(ttft.values()),
        "tpot_ms_median": statistics.median(steps) * 1e3 if steps else float("nan"),
        "handoff_mib_per_request": statistics.mean(handoff_bytes) / 2**20,
        "finished": done,
    }


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    lengths = sorted({r["prompt_len"] for r in rows})
    caches = list(dict.fromkeys(r["cache"] for r in rows))
    by = {(r["cache"], r["prompt_len"]): r for r in rows}
    panels = [
        Panel(title, [f"{n} tokens" for n in lengths],
              {c: [by[c, n][key] if (c, n) in by else 0 for n in lengths] for c in caches})
        for key, title in (("kv_mib_per_request", "decode KV per request (MiB)"),
                           ("ttft_s_median", "TTFT median (s)"),
                           ("tpot_ms_median", "TPOT median (ms)"))
    ]  # fmt: skip
    grouped_bars(path, panels)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", default="2048,8192", help="prompt lengths, comma-separated")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--fp-window", type=int, default=128)
    p.add_argument("--window", type=int, default=1024, help="the windowed model's window")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", default="bench-long", help="the model's shape (loadtest/models.py)")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args()
    torch.set_num_threads(1)
    arch = arch_of(args.preset)
    windowed = "mistral" if arch == "llama" else arch
    caches = [
        Cache("exact", args.preset, arch),
        Cache(
            f"int8+fp{args.fp_window}",
            args.preset,
            arch,
            kv_cache_dtype="int8",
            fp_window=args.fp_window,
        ),  # fmt: skip
        Cache(f"window{args.window}", args.preset, windowed, window=args.window),
    ]
    header = f"{'cache':<14}{'prompt':>8}{'KV MiB/req':>12}{'TTFT s':>9}{'TPOT ms':>9}"
    print(header + f"{'handoff MiB':>13}")
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        for cache in caches:
            r = run(cache, length, args.requests, args.output_len, args.seed)
            rows.append(r)
            print(
                f"{r['cache']:<14}{length:>8}{r['kv_mib_per_request']:>12.2f}"
                f"{r['ttft_s_median']:>9.2f}{r['tpot_ms_median']:>9.2f}"
                f"{r['handoff_mib_per_request']:>13.2f}",
                flush=True,
            )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "longctx.json").write_text(json.dumps(rows, indent=2))
    plot(rows, args.out_dir / "longctx.png")
    print(f"wrote {args.out_dir / 'longctx.json'} and {args.out_dir / 'longctx.png'}")


if __name__ == "__main__":
    main()
