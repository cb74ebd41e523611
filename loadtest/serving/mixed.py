"""A mixed workload: short requests streaming while ~1.5k-token prompts arrive in a burst.

    python -m loadtest bench --spawn --mixed              # bench model, both configurations
    python -m loadtest bench --spawn --mixed --mixed-rate 6 --requests 60

Per configuration Baton is spawned once and serves two phases, the same short requests in each
(64-token prompts, 64 output tokens, Poisson arrivals): **steady**, shorts only; **burst**, the
shorts plus 10% as many long prompts (~1,500 tokens, 16 output tokens) arriving together a third
of the way in. Three configurations: **chunked** prefill (``BATON_MAX_NUM_BATCHED_TOKENS=256``:
a long prompt is computed in chunks, short prompts join the batches beside them), **unchunked**
(2048: a long prompt is one forward that a short prompt waits behind), and **own-cores**: chunked,
with prefill and decode pinned to separate halves of the cores (``BATON_PREFILL_CPUS`` /
``BATON_DECODE_CPUS``), the CPU analogue of disaggregation onto separate GPUs (needs 2+ cores).

Printed side by side: the short requests' TTFT p99 (what chunking is for) and TPOT p99 (what
disaggregation is for: decode runs elsewhere, so a prefill burst should not slow it; the claim is
burst/steady <= 1.2x), and a plot (``<out>_mixed.png``). Unpinned, prefill and decode share the
cores, so their TPOT ratio measures that sharing, not only the design; own-cores measures the
design.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path
from typing import Any

from loadtest.plots import Panel, grouped_bars
from loadtest.serving.driver import finite, run_load, say, spawned_baton, warm_up
from loadtest.serving.workload import RequestResult, RequestSpec, make_workload, percentile
from services.shell.cpus import split_engine_cpus

# Engines sharing every core: explicitly unpinned (``services up`` pins them apart by default).
SHARED_CORES = {"BATON_PREFILL_CPUS": "", "BATON_DECODE_CPUS": ""}
CHUNKED = {"BATON_MAX_NUM_BATCHED_TOKENS": "256", **SHARED_CORES}
UNCHUNKED = {"BATON_MAX_NUM_BATCHED_TOKENS": "2048", **SHARED_CORES}


def configs() -> dict[str, dict[str, str]]:
    """name -> the services' environment. own-cores: prefill on the first half of this process's
    CPUs, decode on the rest, as ``services up`` does by default (the broker and the light
    services stay unpinned)."""
    out = {"chunked": CHUNKED, "unchunked": UNCHUNKED}
    split = split_engine_cpus(frozenset(os.sched_getaffinity(0)))
    if split is not None:
        own = {"BATON_PREFILL_CPUS": split[0], "BATON_DECODE_CPUS": split[1]}
        out["own-cores"] = {**CHUNKED, **own}
    return out


SHORT_PROMPT, SHORT_OUTPUT = 64, 64
LONG_PROMPT, LONG_OUTPUT = 1500, 16
LONG_SHARE = 0.1
BURST_SPREAD_S = 0.2  # the longs arrive within this window


def phases(
    num_short: int, rate: float, vocab: int, special: frozenset[int], seed: int
) -> dict[str, list[RequestSpec]]:
    shorts = make_workload(num_short, SHORT_PROMPT, SHORT_OUTPUT, vocab, seed=seed, rate=rate,
                           exclude_ids=special)  # fmt: skip
    num_long = max(1, round(LONG_SHARE * num_short))
    at = shorts[len(shorts) // 3].arrival_s
    longs = [
        RequestSpec(s.prompt_token_ids, LONG_OUTPUT, at + BURST_SPREAD_S * i / num_long)
        for i, s in enumerate(
            make_workload(
                num_long, LONG_PROMPT, LONG_OUTPUT, vocab, seed=seed + 1, exclude_ids=special
            )
        )  # fmt: skip
    ]
    return {"steady": shorts, "burst": sorted(shorts + longs, key=lambda s: s.arrival_s)}


def short_stats(results: list[RequestResult]) -> dict[str, float]:
    short = [r for r in results if r.ok and r.num_prompt_tokens < LONG_PROMPT // 2]
    ttft = [r.ttft for r in short if r.ttft is not None]
    tpot = [t for r in short if (t := r.tpot) is not None]
    return {
        "num_short": len(short),
        "failed": sum(not r.ok for r in results),
        "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
        "tpot_p50": percentile(tpot, 50), "tpot_p99": percentile(tpot, 99),
    }  # fmt: skip


async def _serve(url: str, specs: dict[str, list[RequestSpec]], vocab: int, wait_s: float,
                 name: str) -> dict[str, dict[str, float]]:  # fmt: skip
    await warm_up(url, vocab, 300.0)
    # One long prompt and a few shorts first, discarded: the first forwards of each shape are
    # slow (allocator, kernels' first calls) and would land in the first phase's tail.
    burst = specs["burst"]
    warm = [s for s in burst if len(s.prompt_token_ids) == LONG_PROMPT][:1] + burst[:4]
    await run_load(url, [RequestSpec(s.prompt_token_ids, s.max_tokens) for s in warm],
                   max_concurrency=None, wait_s=wait_s, label=f"{name}/warm-up")  # fmt: skip
    out = {}
    for phase, workload in specs.items():
        results, _, _ = await run_load(url, workload, max_concurrency=None, wait_s=wait_s,
                                       label=f"{name}/{phase}")  # fmt: skip
        out[phase] = short_stats(results)
    return out


def mixed_main(
    args: argparse.Namespace, model_dir: Path, vocab: int, special: frozenset[int]
) -> int:
    specs = phases(args.num_requests, args.mixed_rate, vocab, special, args.seed)
    report: dict[str, Any] = {"model": str(model_dir), "rate": args.mixed_rate, "configs": {}}
    out = Path(args.out_json)
    chosen = configs()
    if args.mixed_configs:
        names = args.mixed_configs.split(",")
        unknown = set(names) - set(chosen)
        if unknown:
            raise SystemExit(f"--mixed-configs: unknown {sorted(unknown)}; known {sorted(chosen)}")
        chosen = {n: chosen[n] for n in names}
    for name, env in chosen.items():
        log_path = out.with_name(f"{out.stem}_mixed_{name}.services.log")
        with spawned_baton(model_dir, log_path, env=env) as target:
            report["configs"][name] = asyncio.run(
                _serve(target.url, specs, vocab, args.wait_s, name)
            )
    print(format_mixed(report))
    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.with_name(out.stem + "_mixed.json")
    path.write_text(json.dumps(finite(report), indent=2) + "\n")
    png = out.with_name(out.stem + "_mixed.png")
    plot_mixed(png, report)
    say(f"wrote {path}, {png}")
    failed = sum(p["failed"] for c in report["configs"].values() for p in c.values())
    return 0 if failed == 0 else 1


def format_mixed(report: dict[str, Any]) -> str:
    lines = [f"{' Mixed workload: short requests, steady vs a burst of long prompts ':=^78}",
             f"{'config':<11}{'phase':<8}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}"
             f"{'TPOT p99':>10}{'shorts':>8}{'failed':>8}"]  # fmt: skip
    for name, cfg in report["configs"].items():
        for phase, s in cfg.items():
            lines.append(
                f"{name:<11}{phase:<8}{1000 * s['ttft_p50']:>9.0f}ms{1000 * s['ttft_p99']:>8.0f}ms"
                f"{1000 * s['tpot_p50']:>8.1f}ms{1000 * s['tpot_p99']:>8.1f}ms"
                f"{s['num_short']:>8}{s['failed']:>8}"
            )
    lines.append("-" * 78)
    for name, cfg in report["configs"].items():
        ratio = cfg["burst"]["tpot_p99"] / cfg["steady"]["tpot_p99"]
        lines.append(f"{name}: short TPOT p99 burst / steady = {ratio:.2f}x (claim <= 1.2x)")
    if {"chunked", "unchunked"} <= set(report["configs"]):
        c, u = report["configs"]["chunked"]["burst"], report["configs"]["unchunked"]["burst"]
        lines.append(
            f"burst: short TTFT p99 chunked / unchunked = {c['ttft_p99'] / u['ttft_p99']:.2f}x"
        )
    lines.append("=" * 78)
    return "\n".join(lines)


def plot_mixed(path: Path, report: dict[str, Any]) -> None:
    names = list(report["configs"])
    panels = [
        Panel(title, names,
              {phase: [1000 * report["configs"][n][phase][key] for n in names]
               for phase in ("steady", "burst")}, fmt)
        for key, title, fmt in (("ttft_p99", "short-request TTFT p99", "%.0f"),
                                ("tpot_p99", "short-request TPOT p99", "%.1f"))
    ]  # fmt: skip
    title = f"Mixed workload ({report['rate']:g} short req/s, 10% ~1.5k-token prompts)"
    grouped_bars(path, panels, ylabel="ms", title=title)
