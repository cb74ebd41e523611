"""Baton's benchmark runner: serving figures, a Hugging Face baseline and the compute floor.

    python -m loadtest.bench --spawn                      # 64 x (128 in, 64 out), all at once
    python -m loadtest.bench --spawn --rates 2,4,8,16     # Poisson sweep, latency vs rate plot
    python -m loadtest.bench                              # against the Baton at BATON_AMQP_URL

A run: resolve the model dir; time a torch.mm of the model's shapes and HF ``generate`` on the
same prompts *before* Baton starts (so they do not share the cores); start Baton if ``--spawn``
(in its own vhost); warm up; run the workload(s); stop Baton; report; write JSON and a PNG.
Latencies are the client's view; definitions in loadtest/workload.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from loadtest.workload import (
    RequestResult,
    RequestSpec,
    Slo,
    Summary,
    format_summary,
    make_workload,
    parse_mix,
    percentile,
    read_vocab,
    summarize,
    workload_flops,
)
from shared.client import BatonClient, BatonUnavailable, default_amqp_url
from shared.config import DEFAULT_MODEL_DIR, REPO_ROOT, BatonConfig
from shared.logging import configure_logging
from shared.protocol import DoneReply

BENCH_MODEL_DIR = REPO_ROOT / "models" / "bench-llama"
DEFAULT_OUT = REPO_ROOT / "loadtest" / "results" / "bench.json"


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- model ----------------------------------------------------------------------------------


def resolve_model(args: argparse.Namespace) -> Path:
    """--model, else the bench preset when spawning, else the running system's BATON_MODEL."""
    from shared.tiny_model import ensure_tiny_model

    if args.model:
        return Path(args.model)
    if args.spawn:
        return ensure_tiny_model(BENCH_MODEL_DIR, preset="bench", arch="llama")
    model_dir = BatonConfig.from_env().model_dir
    if model_dir == DEFAULT_MODEL_DIR:
        return ensure_tiny_model(DEFAULT_MODEL_DIR, preset="tiny", arch="llama")
    return model_dir


# --- compute floor and HF baseline (run while Baton is not) --------------------------------


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


def hf_baseline(model_dir: Path, specs: list[RequestSpec], batch_size: int) -> dict[str, Any]:
    """HF ``generate``, fp32 greedy, EOS suppressed (min_new_tokens), left-padded batches.

    A batch generates its longest requested output; only requested tokens are counted."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = model.generation_config.pad_token_id
    pad = 0 if pad is None else int(pad if not isinstance(pad, list) else pad[0])

    def run(batch: list[RequestSpec]) -> None:
        width = max(len(s.prompt_token_ids) for s in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, s in enumerate(batch):
            n = len(s.prompt_token_ids)
            ids[row, width - n :] = torch.tensor(s.prompt_token_ids)
            mask[row, width - n :] = 1
        out_len = max(s.max_tokens for s in batch)
        with torch.inference_mode():
            model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=out_len,
                min_new_tokens=out_len, do_sample=False, pad_token_id=pad,
            )  # fmt: skip

    run(specs[:2])  # warm-up, untimed (as Baton's warm-up request)
    t0 = time.perf_counter()
    for start in tqdm(range(0, len(specs), batch_size), desc="HF generate", file=sys.stderr):
        run(specs[start : start + batch_size])
    elapsed = time.perf_counter() - t0
    out_tokens = sum(s.max_tokens for s in specs)
    return {
        "batch_size": batch_size,
        "elapsed_s": elapsed,
        "output_tokens": out_tokens,
        "output_throughput": out_tokens / elapsed,
        "request_throughput": len(specs) / elapsed,
        "torch_threads": torch.get_num_threads(),
    }


# --- spawning Baton -------------------------------------------------------------------------


@contextlib.contextmanager
def spawned_baton(model_dir: Path, log_path: Path) -> Iterator[str]:
    """`python -m services up` in its own vhost (when rabbitmqctl can make one); yields the URL.

    Stopped with SIGTERM (the services drain and exit), SIGKILL only after 60 s."""
    base = default_amqp_url().rstrip("/")
    base = base.rsplit("/", 1)[0] if base.count("/") > 2 else base
    vhost = f"baton-bench-{uuid.uuid4().hex[:8]}"
    made_vhost = _rabbitmqctl("add_vhost", vhost) and _rabbitmqctl(
        "set_permissions", "-p", vhost, "guest", ".*", ".*", ".*"
    )
    url = f"{base}/{vhost}" if made_vhost else f"{base}/"
    env = {**os.environ, "BATON_MODEL": str(model_dir), "BATON_AMQP_URL": url}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services", "up"], cwd=REPO_ROOT, env=env,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        say(f"spawned Baton (pid {proc.pid}) on {url.split('@')[-1]}, log: {log_path}")
        try:
            yield url
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    say("Baton did not stop within 60 s of SIGTERM: killing its process group")
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            say(f"Baton stopped (exit code {proc.returncode})")
            if made_vhost:
                _rabbitmqctl("delete_vhost", vhost)
    if proc.returncode not in (0, -signal.SIGTERM):
        say(f"Baton log tail:\n{_tail(log_path)}")


def _rabbitmqctl(*args: str) -> bool:
    if shutil.which("rabbitmqctl") is None:
        return False
    done = subprocess.run(["rabbitmqctl", *args], capture_output=True, timeout=60)
    return done.returncode == 0


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


async def warm_up(url: str, vocab_size: int, timeout_s: float) -> float:
    """Until one small request completes (Baton may still be loading); returns seconds taken."""
    t0 = time.perf_counter()
    while True:
        left = timeout_s - (time.perf_counter() - t0)
        if left <= 0:
            raise TimeoutError(f"Baton did not serve a warm-up request within {timeout_s}s")
        try:
            async with await BatonClient.connect(url) as client:
                reply = await client.generate(
                    prompt_token_ids=[i % vocab_size for i in range(1, 9)], max_tokens=4,
                    ignore_eos=True, wait_s=left,
                )  # fmt: skip
            if isinstance(reply, DoneReply):
                return time.perf_counter() - t0
            raise RuntimeError(f"warm-up request failed: {reply.code}: {reply.message}")
        except BatonUnavailable:
            await asyncio.sleep(1.0)


# --- the load -------------------------------------------------------------------------------


async def run_load(
    url: str, specs: list[RequestSpec], *, max_concurrency: int | None, wait_s: float, label: str
) -> tuple[list[RequestResult], float]:
    """Publish ``specs`` at their arrival times; returns results and the run's duration."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    run_id = uuid.uuid4().hex[:6]
    results: list[RequestResult] = []
    async with await BatonClient.connect(url, default_wait_s=wait_s) as client:
        bar = tqdm(total=len(specs), desc=label, unit="req", file=sys.stderr)
        t0 = time.perf_counter()

        async def one(i: int, spec: RequestSpec) -> None:
            await asyncio.sleep(max(0.0, t0 + spec.arrival_s - time.perf_counter()))
            async with limit or contextlib.nullcontext():
                result = RequestResult(ok=False, num_prompt_tokens=len(spec.prompt_token_ids))
                try:
                    c = await client.complete(
                        prompt_token_ids=spec.prompt_token_ids, max_tokens=spec.max_tokens,
                        temperature=0.0, ignore_eos=True, priority=spec.priority,
                        request_id=f"bench-{run_id}-{i}",
                    )  # fmt: skip
                    result.ok, result.num_output_tokens = c.ok, c.num_output_tokens
                    result.ttft, result.e2e, result.itl = c.ttft_s, c.e2e_s, c.itl_s
                    result.finish_reason = c.finish_reason
                    result.error = c.error.code if c.error else None
                except asyncio.TimeoutError:
                    result.error = "client_timeout"
            results.append(result)
            bar.update(1)

        await asyncio.gather(*(one(i, s) for i, s in enumerate(specs)))
        duration = time.perf_counter() - t0
        bar.close()
    return results, duration


# --- report ---------------------------------------------------------------------------------


def plot(path: Path, runs: list[dict[str, Any]], slo: Slo) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if len(runs) > 1:  # a sweep: latency percentiles and throughput against the offered rate
        runs = [r for r in runs if r["rate"] is not None]  # an all-at-once run has no rate
        rates = [r["rate"] for r in runs]
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        for ax, key, bound in ((axes[0], "ttft", slo.ttft_s), (axes[1], "tpot", slo.tpot_s)):
            for q, style in (("p50", "o-"), ("p99", "s--")):
                ax.plot(rates, [r["summary"][key][q] for r in runs], style, label=q)
            ax.axhline(bound, color="red", lw=0.8, ls=":", label="SLO")
            ax.set(xlabel="request rate (req/s)", ylabel=f"{key.upper()} (s)", title=key.upper())
            ax.legend()
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_xticks(rates, [f"{r:g}" for r in rates])
        axes[2].plot(rates, [r["summary"]["request_throughput"] for r in runs], "o-", label="thpt")
        axes[2].plot(rates, [r["summary"]["goodput"] for r in runs], "s--", label="goodput")
        axes[2].set(xlabel="request rate (req/s)", ylabel="req/s", title="throughput / goodput")
        axes[2].legend()
    else:  # one run: the distributions, as empirical CDFs with the SLO and p50/p99 marked
        reqs = runs[0]["requests"]
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        panels: tuple[tuple[str, list[float], float | None], ...] = (
            ("TTFT", [r["ttft"] for r in reqs if r.get("ttft") is not None], slo.ttft_s),
            ("TPOT", [r["tpot"] for r in reqs if r.get("tpot") is not None], slo.tpot_s),
            ("ITL", [x for r in reqs for x in r.get("itl", [])], None),
        )
        for ax, (name, values, limit) in zip(axes, panels, strict=True):
            xs = sorted(1000 * v for v in values)
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post")
            for pct, dash in ((50.0, "--"), (99.0, ":")):
                if xs:
                    v = percentile(xs, pct)
                    ax.axvline(v, color="gray", lw=0.8, ls=dash, label=f"p{pct:g} {v:.1f} ms")
            if limit is not None:
                ax.axvline(1000 * limit, color="red", lw=1.0, label=f"SLO {1000 * limit:g} ms")
            ax.set(xlabel=f"{name} (ms)", ylabel="fraction of requests", title=name, ylim=(0, 1.02))
            ax.set_xlim(left=0)
            ax.legend(loc="lower right")
    fig.suptitle("Baton benchmark (client-side latencies)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging("warning", "console")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args)
    model_cfg = json.loads((model_dir / "config.json").read_text())
    vocab_size, special = read_vocab(model_dir)
    rates = [float(x) for x in args.rates.split(",")] if args.rates else [args.rate]
    prios = parse_mix(args.priorities) if args.priorities else None
    workloads = [
        make_workload(
            args.num_requests, args.input_len, args.output_len, vocab_size, seed=args.seed,
            range_ratio=args.random_range_ratio, rate=rate, exclude_ids=special, priorities=prios,
        )
        for rate in rates
    ]  # fmt: skip
    slo = Slo(args.slo_ttft, args.slo_tpot)
    say(f"model {model_dir} (vocab {vocab_size})")
    say(f"SLOs: TTFT <= {slo.ttft_s}s, TPOT <= {slo.tpot_s}s")

    mm_rows = sorted({min(args.max_concurrency or args.num_requests, 256), 2048})
    matmul = measure_matmul(model_cfg, mm_rows)
    peak_gflops = max(matmul.values())
    baseline = None if args.no_baseline else hf_baseline(model_dir, workloads[0], args.hf_batch)

    log_path = Path(args.out_json).with_suffix(".services.log")
    baton: contextlib.AbstractContextManager[str] = (
        spawned_baton(model_dir, log_path)
        if args.spawn
        else contextlib.nullcontext(args.url or default_amqp_url())
    )
    with baton as url:
        warm_s = asyncio.run(warm_up(url, vocab_size, args.startup_timeout))
        say(f"Baton serving (warm-up took {warm_s:.1f}s)")
        runs: list[dict[str, Any]] = []
        for rate, specs in zip(rates, workloads, strict=True):
            label = "all at once" if math.isinf(rate) else f"{rate:g} req/s"
            results, duration = asyncio.run(
                run_load(url, specs, max_concurrency=args.max_concurrency,
                         wait_s=args.wait_s, label=label)
            )  # fmt: skip
            runs.append({"rate": rate, "results": results, "duration": duration})

    report: dict[str, Any] = {
        "config": vars(args),
        "model": {"dir": str(model_dir), "config": model_cfg},
        "environment": _environment(),
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "matmul_gflops": matmul,
        "baseline_hf": baseline,
        "runs": [],
    }
    for run, specs in zip(runs, workloads, strict=True):
        summary = summarize(run["results"], run["duration"], slo)
        flops = workload_flops(model_cfg, specs)
        floor_s = flops["total"] / (peak_gflops * 1e9)
        out_tokens = sum(s.max_tokens for s in specs)
        floor = {**flops, "peak_gflops": peak_gflops, "floor_s": floor_s,
                 "floor_output_throughput": out_tokens / floor_s}  # fmt: skip
        print(format_summary(summary, title=f"Baton, {_label(run['rate'])}", slo=slo))
        _print_comparison(summary, baseline, floor)
        report["runs"].append({
            "rate": None if math.isinf(run["rate"]) else run["rate"],
            "summary": summary.to_dict(), "compute_floor": floor,
            "requests": [r.to_dict() for r in run["results"]],
        })  # fmt: skip

    out = Path(args.out_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_finite(report), indent=2, default=str, allow_nan=False) + "\n")
    png = out.with_suffix(".png")
    plot(png, report["runs"], slo)
    say(f"wrote {out} and {png}")
    return 0 if all(r["summary"]["failed"] == 0 for r in report["runs"]) else 1


def _finite(obj: Any) -> Any:
    """Strict JSON: NaN/inf (an empty statistic, the all-at-once rate) become null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _label(rate: float) -> str:
    return "all requests at once" if math.isinf(rate) else f"Poisson {rate:g} req/s"


def _print_comparison(s: Summary, baseline: dict[str, Any] | None, floor: dict[str, Any]) -> None:
    print(f"{'Baton output tokens/s:':<40}{s.output_throughput:>12.1f}")
    if baseline is not None:
        hf = baseline["output_throughput"]
        print(
            f"{'HF generate (batch ' + str(baseline['batch_size']) + ') tokens/s:':<40}{hf:>12.1f}"
        )
        print(f"{'Baton / HF:':<40}{s.output_throughput / hf:>11.2f}x")
    ceiling = floor["floor_output_throughput"]
    print(f"{'Workload FLOPs (matmul + attention):':<40}{floor['total'] / 1e9:>9.4g} GF")
    print(f"{'Measured peak fp32 matmul:':<40}{floor['peak_gflops']:>9.1f} GF/s")
    print(f"{'Compute floor (FLOPs / peak):':<40}{floor['floor_s'] * 1000:>10.1f}ms")
    print(f"{'Tokens/s the floor allows:':<40}{ceiling:>12.1f}")
    print(f"{'Baton at % of the floor:':<40}{100 * s.output_throughput / ceiling:>11.1f}%")
    print("=" * 52)


def _environment() -> dict[str, Any]:
    import torch

    return {
        "python": platform.python_version(), "platform": platform.platform(),
        "cpu_count": os.cpu_count(), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench", description=__doc__.split("\n")[0])
    p.add_argument("--spawn", action="store_true", help="start `python -m services up` itself")
    p.add_argument("--url", default=None, help="AMQP URL without --spawn (env BATON_AMQP_URL)")
    p.add_argument("--model", default=None, help="HF model dir (default: see resolve_model)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")  # fmt: skip
    p.add_argument("--rate", type=float, default=math.inf, help="Poisson req/s (default: inf)")
    p.add_argument("--rates", default=None, help="sweep, e.g. 2,4,8,16 (one run per rate)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--priorities", default=None, help='priority mix, e.g. "0:0.8,5:0.2"')
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO in seconds")
    p.add_argument("--slo-tpot", type=float, default=0.2, help="TPOT SLO in seconds")
    p.add_argument("--no-baseline", action="store_true", help="skip HF generate")
    p.add_argument("--hf-batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch threads for HF and matmul")
    p.add_argument("--wait-s", type=float, default=900.0, help="client wait limit per request")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--out-json", default=str(DEFAULT_OUT))
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
