"""One decode step and one prefill wave of a real-size model, timed and profiled by op.

    python3 -m loadtest.engine.step_profile \
        [--model DIR|FILE.gguf] [--dtype float32 bfloat16] [--threads 1 2] \
        [--weight-format dequantized packed] [--decode-program on off] \
        [--packed-decode auto int8 bf16] \
        [--batch 16] [--prompt 128] [--context 160] [--attention auto|torch] [--profile] \
        [--contend 3.4,10]

``--model`` defaults to the ``qwen2-0.5b`` preset's random model (``models/qwen2-0.5b-qwen2``,
built on first use: loadtest/models.py).
The runner is the decode engine's own (ModelRunner from a BatonConfig with its weight forms, CPU
kernels as the services pick them). Prefill: ``batch`` prompts of ``prompt`` tokens in one forward.
Decode: steps of the whole batch until the context reaches ``context`` tokens; the median step over
the last half is reported. Floors beside them, by the bench's rules (loadtest/engine/roofline.py:
``decode_floor``, the larger of (weight + KV bytes) / memory bandwidth and FLOPs / GEMM peak;
``prefill_flops`` / GEMM peak), with its probes: bandwidth on every usable core (the machine's),
the GEMM at 2048 x hidden x intermediate in the model's dtype on the run's threads (a decode step
over packed GGUF weights, which computes in int8: the int8 GEMM's).
``--contend BUSY_MS,PERIOD_MS`` then replays one decode step in blocks, alternately quiet and
beside a process busy ``BUSY_MS`` in every ~``PERIOD_MS`` (as the broker and the light services
are beside the engines on a small machine): a step split across threads waits for any thread
the kernel preempts, so this is what sharing the cores costs a step.
A benchmark: it prints figures and asserts nothing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import time

from kernels.cpu import cpu_isa, mkl_dispatch
from kernels.cpu.build import usable_cpus
from shared.config import BatonConfig

if __name__ == "__main__":  # the engine's MKL kernels, as the services choose them
    cpu_isa.apply(BatonConfig.from_env().cpu_isa)
    mkl_dispatch.ensure(BatonConfig.from_env().mkl_dispatch)

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from kernels.cpu.quant_linear import QuantWeight  # noqa: E402
from loadtest.engine import roofline  # noqa: E402
from loadtest.models import preset_model  # noqa: E402
from shared.models.catalog import resolve_model  # noqa: E402
from shared.runtime import BlockManager, ModelRunner, SamplingParams, Sequence  # noqa: E402
from shared.runtime.linear_layout import PACKED_DECODES  # noqa: E402
from shared.runtime.model import Projection  # noqa: E402


def bandwidth_gbs() -> float:
    """The machine's, on every usable core (one core does not saturate it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(usable_cpus())
    try:
        return roofline.probe_bandwidth()
    finally:
        torch.set_num_threads(threads)


# The competing process of --contend: busy BUSY ms, then idle for the rest of a period drawn
# around PERIOD ms (a fixed period would lock onto the step's rhythm).
_BUSY_LOOP = """
import random, sys, time
busy, period = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < busy:
        pass
    time.sleep(max(0.0, period * random.uniform(0.5, 1.5) - busy))
"""


def rewind(seqs: list[Sequence]) -> None:
    """Make the next decode of ``seqs`` replay their last step (the same token, the same KV
    slots): a step timed or profiled again without the context growing."""
    for s in seqs:
        s.num_computed_tokens = s.num_tokens - 1


def contention(
    runner: ModelRunner, seqs: list[Sequence], busy_ms: float, period_ms: float
) -> dict[str, list[float]]:
    """Seconds of the same decode step (``seqs`` just decoded once), in 16 blocks of 25 steps
    alternating quiet and beside the busy loop."""
    times: dict[str, list[float]] = {"quiet": [], "contended": []}
    for block in range(16):
        mode = ("quiet", "contended")[block % 2]
        rival = None
        if mode == "contended":
            cmd = [sys.executable, "-c", _BUSY_LOOP, str(busy_ms), str(period_ms)]
            rival = subprocess.Popen(cmd)
            time.sleep(0.1)  # started and looping
        try:
            for _ in range(25):
                rewind(seqs)
                t = time.perf_counter()
                runner.decode(seqs)
                times[mode].append(time.perf_counter() - t)
        finally:
            if rival is not None:
                rival.kill()
                rival.wait()
    return times


def run(
    args: argparse.Namespace,
    threads: int,
    dtype: str,
    weight_format: str,
    program: str,
    kv: str,
    packed_decode: str,
) -> None:
    torch.set_num_threads(threads)
    config = BatonConfig(
        model=args.model, num_kv_blocks=args.kv_blocks, dtype=dtype, cpu_attention=args.attention,
        weight_format=weight_format, decode_program=program == "on", kv_cache_dtype=kv,
        packed_decode=packed_decode,
    )  # fmt: skip
    runner = ModelRunner(config, role="decode")  # the forms the decode service keeps
    model_dir = resolve_model(args.model)
    shape = roofline.Shape.of(json.loads((model_dir / "config.json").read_text()))
    # What the engine computes in: a bf16 request on a CPU without bf16 runs in fp32
    # (loader.resolve_dtype), and its floor is fp32's.
    computed = str(runner.dtype).removeprefix("torch.")
    label = f"{dtype} {weight_format}" + (f" (computed in {computed})" if computed != dtype else "")
    label += f" program {'on' if runner.model.decode_programs is not None else 'off'}"
    cache_dtype = str(runner.kv_cache.dtype).removeprefix("torch.")
    label += f" kv {cache_dtype}"
    if runner.model.quantized:
        label += f" packed-decode {packed_decode}"
    bm = BlockManager(
        runner.num_kv_blocks, runner.block_size, True,
        num_device_blocks=runner.tiers.num_device_blocks, kv_window=runner.model_config.kv_window,
        **runner.fp_slots_config(),
    )  # fmt: skip
    vocab = runner.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(temperature=0.0, max_tokens=args.context, ignore_eos=True)

    def wave() -> tuple[float, list[float], list[Sequence]]:
        seqs = [
            Sequence(f"r{i}", torch.randint(3, vocab, (args.prompt,), generator=g).tolist(), sp)
            for i in range(args.batch)
        ]
        for s in seqs:
            bm.allocate(s)
        t = time.perf_counter()
        toks = runner.prefill(seqs, [s.num_tokens for s in seqs])
        prefill_s = time.perf_counter() - t
        for s, tok in zip(seqs, toks, strict=True):
            assert tok is not None
            s.num_computed_tokens = s.num_tokens
            s.append_token(tok)
        steps = []
        while seqs[0].num_tokens < args.context:
            for s in seqs:
                bm.append_slot(s)
            t = time.perf_counter()
            out = runner.decode(seqs)
            steps.append(time.perf_counter() - t)
            for s, tok in zip(seqs, out, strict=True):
                s.num_computed_tokens = s.num_tokens
                s.append_token(tok)
        return prefill_s, steps, seqs

    def free(seqs: list[Sequence]) -> None:
        for s in seqs:
            bm.free(s)

    free(wave()[2])  # warm-up
    prefills, decodes = [], []
    for i in range(args.repeats):
        p, steps, seqs = wave()
        if args.contend and i == args.repeats - 1:
            busy_ms, period_ms = (float(x) for x in args.contend.split(","))
            for mode, t in contention(runner, seqs, busy_ms, period_ms).items():
                print(f"{label} threads={threads} decode b{args.batch}@{args.context} {mode:9s}"
                      f" (busy {busy_ms:g} ms in ~{period_ms:g}): median"
                      f" {statistics.median(t) * 1e3:6.2f} ms, mean {statistics.mean(t) * 1e3:6.2f}"
                      f" ms over {len(t)} steps", flush=True)  # fmt: skip
        free(seqs)
        prefills.append(p)
        decodes.append(statistics.median(steps[len(steps) // 2 :]))
    prefill_ms, decode_ms = min(prefills) * 1e3, min(decodes) * 1e3
    bw = bandwidth_gbs()
    gemm = (2048, shape.hidden, shape.intermediate)
    peak = roofline.probe_gemm(computed, *gemm)
    # Packed GGUF weights compute in int8 (x quantized per block, integer dot products): the
    # decode step's compute floor is the int8 GEMM's, and so is the prefill layers' where the
    # weights are on the tiled kernel (the decode engine's forms: every row count).
    arith = "int8" if runner.model.quantized else computed
    decode_peak = roofline.probe_gemm(arith, *gemm) if arith != computed else peak
    # The median step is one of the last half, at a context of about (prompt + 3 x context) / 4.
    step = roofline.decode_floor(
        shape, computed, args.batch, (args.prompt + 3 * args.context) / 4, bw, decode_peak,
        weight_bytes=runner.model.weight_bytes(),
        kv_dtype=None if runner.kv_codec.quantized else cache_dtype,
    )  # fmt: skip
    tiled = any(isinstance(m, Projection) and isinstance(m.packed, QuantWeight) and m.packed.tiled
                for m in runner.model.modules())  # fmt: skip
    prefill_floor = 1e3 * roofline.prefill_floor_s(
        roofline.prefill_flops(shape, [args.prompt] * args.batch), peak,
        decode_peak if tiled else None,
    )  # fmt: skip
    bound = "memory" if step["memory_s"] >= step["compute_s"] else "compute"
    print(
        f"{label} threads={threads} decode b{args.batch}@{args.context}: {decode_ms:7.1f} ms"
        f" (floor {step['floor_s'] * 1e3:5.1f} ms, {bound}: {step['weight_bytes'] / 1e9:.3f} GB"
        f" weights + {step['kv_bytes'] / 1e9:.3f} GB KV at {bw:.1f} GB/s,"
        f" {step['flops'] / 1e9:.1f} GFLOP at {decode_peak:.0f} GF/s {arith};"
        f" {step['floor_s'] * 1e3 / decode_ms:.0%}; bandwidth floor"
        f" {step['memory_s'] * 1e3:5.1f} ms, {step['memory_s'] * 1e3 / decode_ms:.0%})"
        f"  prefill {args.batch}x{args.prompt}:"
        f" {prefill_ms:7.1f} ms (floor {prefill_floor:6.1f} ms at {peak:.0f} GF/s"
        f"{f', layers at {decode_peak:.0f} int8' if tiled else ''};"
        f" {prefill_floor / prefill_ms:.0%})",
        flush=True,
    )
    if args.profile:
        seqs = [
            Sequence(f"p{i}", torch.randint(3, vocab, (args.prompt,), generator=g).tolist(), sp)
            for i in range(args.batch)
        ]
        for s in seqs:
            bm.allocate(s)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            toks = runner.prefill(seqs, [s.num_tokens for s in seqs])
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
        for s, tok in zip(seqs, toks, strict=True):
            assert tok is not None
            s.num_computed_tokens = s.num_tokens
            s.append_token(tok)
            bm.append_slot(s)
        runner.decode(seqs)
        rewind(seqs)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            runner.decode(seqs)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
        free(seqs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="as BATON_MODEL names one (default: qwen2-0.5b preset)")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--weight-format", nargs="+", default=["auto"],
        help="BATON_WEIGHT_FORMAT (a GGUF model): auto, packed, dequantized",
    )  # fmt: skip
    parser.add_argument(
        "--decode-program", nargs="+", default=["on"], choices=["on", "off"],
        help="BATON_DECODE_PROGRAM: the decode step's layers as one native call, or eager",
    )  # fmt: skip
    parser.add_argument(
        "--kv-cache-dtype", nargs="+", default=["auto"],
        help="BATON_KV_CACHE_DTYPE: auto (packed GGUF: bfloat16), bfloat16, float32, int8",
    )  # fmt: skip
    parser.add_argument(
        "--packed-decode", nargs="+", default=["auto"], choices=list(PACKED_DECODES),
        help="BATON_PACKED_DECODE (a GGUF model kept packed): auto, int8, bf16",
    )  # fmt: skip
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--kv-blocks", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--attention", default="auto", help="BATON_CPU_ATTENTION: auto or torch")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--contend", default="", metavar="BUSY_MS,PERIOD_MS",
        help="also replay a decode step beside a process busy BUSY_MS in every ~PERIOD_MS",
    )  # fmt: skip
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    args.model = args.model or str(preset_model("qwen2-0.5b"))
    for setting in itertools.product(args.threads, args.dtype, args.weight_format,
                                     args.decode_program, args.kv_cache_dtype,
                                     args.packed_decode):  # fmt: skip
        run(args, *setting)


if __name__ == "__main__":
    main()
