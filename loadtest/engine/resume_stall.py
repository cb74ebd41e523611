"""The resume stall: what readmitting a swapped-out sequence costs the decode step that
readmits it, with and without prefetch on resume (shared/engine/kv_prefetch.py).

    python -m loadtest.engine.resume_stall [--model DIR]   # default: the qwen2-0.5b preset's model

A source decode engine swaps ``--resumes`` sequences of ``--context`` tokens out to the spill
store (a priority-9 request preempting each, by priority preemption), and a target decode engine
running ``--batch`` sequences resumes them, one every few steps, alternately with
``BATON_DECODE_KV_PREFETCH`` off and on (off first in even rounds, on first in odd ones). Per
resume it times the step that admits the sequence and the one after it, against the median step
of the same batch without a resume; the stall is the excess. Prints a table and writes JSON. A
benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from loadtest.models import preset_model
from shared.config import BatonConfig
from shared.engine.build import build_decode_engine
from shared.engine.outputs import Handoff, NewRequest
from shared.wire.sampling import SamplingParams

FOREVER = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)


def prompt(i: int, n: int) -> list[int]:
    return [(31 * i + 7 * j) % 250 + 5 for j in range(n)]  # within every tiny vocab


def swapped_out(cfg: BatonConfig, model: Path, args: argparse.Namespace) -> list[Handoff]:
    """``--resumes`` sequences swapped out to the spill store by a source engine."""
    src = build_decode_engine(cfg.replace(max_num_seqs=1, decode_preempt_min_steps=0), model)
    handoffs: list[Handoff] = []
    for i in range(args.resumes):
        now = time.time()
        src.add(NewRequest(f"s{i}", prompt(i, args.context), FOREVER, [5], 0, now))
        for _ in range(3):  # its KV computed here, then a decode step or two
            src.step()
        short = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        src.add(NewRequest(f"u{i}", prompt(1000 + i, 8), short, [5], 9, now))
        while src.has_work():  # the urgent one preempts it (swap), then finishes
            handoffs += src.step().handoffs
    src.close()
    assert len(handoffs) == args.resumes, "every sequence swapped out once"
    return handoffs


def run(cfg: BatonConfig, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    handoffs = swapped_out(cfg, model, args)
    dst = build_decode_engine(cfg, model)
    for i in range(args.batch):
        dst.add(NewRequest(f"b{i}", prompt(500 + i, args.batch_context), FOREVER, [5]))
    while any(s.num_computed_tokens < s.num_tokens - 1 for s in dst.scheduler.running.values()) \
            or len(dst.scheduler.running) < args.batch:  # fmt: skip
        dst.step()

    def timed() -> float:
        t0 = time.perf_counter()
        dst.step()
        return time.perf_counter() - t0

    steady = [timed() for _ in range(args.gap)]
    admit, join = [], []
    for i, h in enumerate(handoffs):
        dst.add(NewRequest(h.request_id, prompt(i, args.context), FOREVER, h.output_token_ids,
                           kv=h.kv))  # fmt: skip
        admit.append(timed())
        join.append(timed())
        steady += [timed() for _ in range(args.gap)]
    dst.close()
    base = statistics.median(steady)
    return {
        "prefetch": cfg.decode_kv_prefetch,
        "steady_step_ms": base * 1e3,
        "admit_stall_ms": statistics.mean(t - base for t in admit) * 1e3,
        "next_stall_ms": statistics.mean(t - base for t in join) * 1e3,
        "swaps_in": dst.num_swaps_in,
        "prefetch_hits": dst.prefetch.num_hits if dst.prefetch is not None else 0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=None, help="default: models/qwen2-0.5b-qwen2")
    p.add_argument("--context", type=int, default=1024, help="tokens of each resumed sequence")
    p.add_argument("--batch", type=int, default=4, help="sequences decoding meanwhile")
    p.add_argument("--batch-context", type=int, default=128)
    p.add_argument("--resumes", type=int, default=4)
    p.add_argument("--gap", type=int, default=3, help="steady steps between resumes")
    p.add_argument("--rounds", type=int, default=2, help="off/on alternations")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    args.model = args.model or preset_model("qwen2-0.5b")  # built on first use
    torch.set_num_threads(args.threads)
    blocks = args.batch * (args.batch_context + 200) + 2 * args.resumes * (args.context + 200)
    rows = []
    with tempfile.TemporaryDirectory(dir="/dev/shm") as spill:
        cfg = BatonConfig(model=str(args.model), num_kv_blocks=blocks // 16 + 16, spill_dir=spill,
                          max_num_seqs=args.batch + args.resumes)  # fmt: skip
        for round_ in range(args.rounds):
            # off/on, then on/off: order effects cancel
            for prefetch in (round_ % 2 == 1, round_ % 2 == 0):
                rows.append(run(cfg.replace(decode_kv_prefetch=prefetch), args.model, args))
                print(json.dumps(rows[-1]))
    print(
        f"\n{'prefetch':>8} {'steady ms':>10} {'admit-step stall ms':>20} "
        f"{'next-step stall ms':>19}"
    )
    for row in rows:
        print(f"{row['prefetch']!s:>8} {row['steady_step_ms']:10.1f} {row['admit_stall_ms']:20.1f} "
              f"{row['next_stall_ms']:19.1f}")  # fmt: skip
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = vars(args) | {"model": str(args.model), "out": str(args.out)}
        args.out.write_text(json.dumps({"args": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
