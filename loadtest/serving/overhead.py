"""``--fixed-overhead``: the pipeline's fixed cost per request beyond the model forward."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
from pathlib import Path
from typing import Any

from loadtest.serving import stage_profile
from loadtest.serving.driver import finite, run_load, say, target_for, warm_up
from loadtest.serving.workload import (
    make_workload,
    percentile,
)


def fixed_overhead_main(
    args: argparse.Namespace, model_dir: Path, vocab_size: int, special: frozenset[int]
) -> int:
    """``--fixed-overhead``: 1-token prompts asking for 1 token, one at a time on an idle Baton;
    the client's end-to-end p50 beside the engine's forward time for that one token."""
    n = args.overhead_requests
    specs = make_workload(n, 1, 1, vocab_size, seed=args.seed, exclude_ids=special)
    with target_for(args, model_dir) as target:
        warm_s = asyncio.run(warm_up(target.url, vocab_size, args.startup_timeout))
        say(f"Baton serving (warm-up took {warm_s:.1f}s)")
        ports = target.metrics_ports or {}
        before = _scrape_all(ports)
        results, duration, _ = asyncio.run(
            run_load(target.url, specs, max_concurrency=1, wait_s=args.wait_s, label="1-token")
        )
        after = _scrape_all(ports)
    done = [r for r in results if r.ok]
    e2e = [r.e2e for r in done if r.e2e is not None]
    ttft = [r.ttft for r in done if r.ttft is not None]
    fig: dict[str, Any] = {"requests": n, "completed": len(done), "duration_s": duration,
                           "client_e2e_p50_s": percentile(e2e, 50),
                           "client_e2e_p99_s": percentile(e2e, 99),
                           "client_ttft_p50_s": percentile(ttft, 50)}  # fmt: skip
    for key, service, name in (
        ("prefill_forward", "prefill", "baton:forward_seconds"),
        ("decode_forward", "decode", "baton:forward_seconds"),
        ("handoff_write", "prefill", "baton:handoff_seconds"),
        ("handoff_read", "decode", "baton:handoff_seconds"),
        ("server_e2e", "detokenizer", "baton:pipeline_e2e_request_latency_seconds"),
    ):
        if service in before and service in after:
            total, count = stage_profile.hist_delta(before[service], after[service], name)
            fig[f"{key}_per_request_s"], fig[f"{key}_count"] = total / max(len(done), 1), count
    print(format_overhead(fig))
    out = Path(args.out_json)
    out = out.with_name(out.stem + "_overhead.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(finite(fig), indent=2) + "\n")
    say(f"wrote {out}")
    return 0 if len(done) == n else 1


def _scrape_all(ports: dict[str, int]) -> dict[str, stage_profile.Samples]:
    out = {}
    for name, port in ports.items():
        with contextlib.suppress(OSError):
            out[name] = stage_profile.scrape(port)
    return out


def format_overhead(f: dict[str, Any]) -> str:
    width = 64
    lines = [f" Fixed overhead: {f['requests']} x (1-token prompt -> 1 token) ".center(width, "=")]

    def row(label: str, seconds: float | None, extra: str = "") -> None:
        value = "-" if seconds is None or math.isnan(seconds) else f"{1000 * seconds:.2f}"
        lines.append(f"{label:<44}{value:>10}{extra}")

    row("Client E2E p50 (ms):", f["client_e2e_p50_s"])
    row("Client E2E p99 (ms):", f["client_e2e_p99_s"])
    row("Client TTFT p50 (ms):", f["client_ttft_p50_s"])
    row("Server E2E mean (ms, arrival -> reply):", f.get("server_e2e_per_request_s"))
    forward = 0.0
    for key in ("prefill_forward", "decode_forward", "handoff_write", "handoff_read"):
        label = key.replace("_", " ").capitalize()
        secs = f.get(f"{key}_per_request_s")
        count = f.get(f"{key}_count")
        row(f"{label} per request (ms):", secs, f"  ({count:g} calls)" if count is not None else "")
        if secs is not None and "forward" in key:
            forward += secs
    if f.get("prefill_forward_per_request_s") is not None:
        row("Pipeline overhead beyond the forward (ms):", f["client_e2e_p50_s"] - forward)
    else:
        lines.append("(no /metrics scrape: run with --spawn, or --metrics-port)")
    lines.append("=" * width)
    return "\n".join(lines)
