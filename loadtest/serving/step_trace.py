"""Where an engine service's time went, from its BATON_STEP_TRACE file(s): wait, step, publish.

    BATON_STEP_TRACE=trace-{service}.jsonl python -m services up ...     # or serve-bench's
    python -m loadtest serve-bench --baton-env BATON_STEP_TRACE=$PWD/trace-{service}.jsonl ...
    python -m loadtest step-trace trace-decode.jsonl trace-prefill.jsonl

For each file (one engine service; services/shell/step_trace.py writes it): the share of the
traced wall time in each kind of span, the loop's own time between spans, and the steps: how
many, their wall time against the forward inside them, the gap from one step's end to the
next one's start while the engine had sequences running, and sequences per step. A decode
step's time per output token is its step wall time plus that gap; the rest of the columns say
which part grew.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

KINDS = ("step", "publish", "yield", "busy_wait", "idle", "gather")


def read(path: Path) -> list[dict[str, Any]]:
    spans = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(spans, key=lambda s: s["t"])


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(spans: list[dict[str, Any]]) -> dict[str, Any]:
    """Shares of the busy time (first non-idle span to the last span's end) and step figures."""
    busy = [s for s in spans if s["kind"] != "idle"]
    if not busy:
        return {"spans": len(spans)}
    start, end = busy[0]["t"], max(s["t"] + s["dt"] for s in busy)
    wall = max(end - start, 1e-9)
    inside = [s for s in spans if start <= s["t"] <= end]
    by_kind = {k: sum(s["dt"] for s in inside if s["kind"] == k) for k in KINDS}
    steps = [s for s in inside if s["kind"] == "step" and s.get("seqs")]
    gaps = [
        b["t"] - (a["t"] + a["dt"])
        for a, b in zip(steps, steps[1:], strict=False)
        if not any(a["t"] < s["t"] < b["t"] and s["kind"] == "idle" for s in inside)
    ]
    forward = [s["forward_s"] for s in steps if s.get("forward_s") is not None]
    return {
        "wall_s": wall,
        "share": {k: v / wall for k, v in by_kind.items()},
        "loop_share": 1 - sum(by_kind.values()) / wall,
        "steps": len(steps),
        "step_ms_p50": 1e3 * pct([s["dt"] for s in steps], 0.5),
        "step_ms_p99": 1e3 * pct([s["dt"] for s in steps], 0.99),
        "forward_ms_mean": 1e3 * statistics.fmean(forward) if forward else float("nan"),
        "step_ms_mean": 1e3 * statistics.fmean(s["dt"] for s in steps) if steps else float("nan"),
        "gap_ms_p50": 1e3 * pct(gaps, 0.5),
        "gap_ms_p99": 1e3 * pct(gaps, 0.99),
        "gap_ms_mean": 1e3 * statistics.fmean(gaps) if gaps else float("nan"),
        "seqs_mean": statistics.fmean(s["seqs"] for s in steps) if steps else 0.0,
    }


def report(name: str, summary: dict[str, Any]) -> str:
    if "wall_s" not in summary:
        return f"{name}: no busy spans ({summary['spans']} spans)"
    share = summary["share"]
    kinds = "  ".join(f"{k} {100 * share[k]:.1f}%" for k in KINDS if share[k] > 0)
    loop = 100 * summary["loop_share"]
    return (
        f"{name}: busy {summary['wall_s']:.2f} s: {kinds}  loop {loop:.1f}%\n"
        f"  {summary['steps']} steps, {summary['seqs_mean']:.1f} seqs/step: step "
        f"{summary['step_ms_mean']:.2f} ms mean (p50 {summary['step_ms_p50']:.2f}, p99 "
        f"{summary['step_ms_p99']:.2f}), forward {summary['forward_ms_mean']:.2f} ms mean; gap to "
        f"the next step {summary['gap_ms_mean']:.2f} ms mean (p50 {summary['gap_ms_p50']:.2f}, "
        f"p99 {summary['gap_ms_p99']:.2f})"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest step-trace", description=__doc__)
    ap.add_argument("files", nargs="+", type=Path, help="BATON_STEP_TRACE files")
    ap.add_argument("--json", action="store_true", help="print the summaries as JSON")
    args = ap.parse_args(argv)
    summaries = {str(f): summarize(read(f)) for f in args.files}
    if args.json:
        print(json.dumps(summaries, indent=1))
    else:
        print("\n".join(report(name, s) for name, s in summaries.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
