"""The bench's roofline: how close Baton's decode steps and prefill get to this machine's limits.

Two probes, run in the bench process before Baton starts and again after it stops (all cores,
torch's default threads; the better of the two runs counts):
- memory bandwidth: ``sum`` over a tensor far larger than the last-level cache (read-only, as
  streaming weights is), best of several trials, GB/s;
- GEMM peak: ``torch.mm`` at a prefill-like shape (2048 x hidden x intermediate) in the run's
  dtype, best of several trials, GFLOP/s; for a decode step over packed GGUF weights, which
  computes in int8 (x quantized per block, integer dot products), ``torch._int_mm`` too.

Floors, from the model's config.json (llama/qwen2 layouts):
- a decode step at batch B reads every matmul weight once (layers + LM head, in the dtype, or
  as packed) and the KV of each sequence's context: ``(weight bytes + B x context x KV
  bytes/token) / bandwidth``; it also needs ``2 x matmul params x B`` FLOPs (+ attention) at
  the decode arithmetic's GEMM peak, so the floor is the larger of the memory and the compute
  time;
- a prefill wave of T prompt tokens: ``(2 x layer params x T + attention FLOPs) / GEMM peak``
  (causal attention, 4·layers·heads·head_dim per (query, key) pair; the LM head once per
  request).

Baton's measured decode step is the decode service's forward time per step from the profile
(``baton:forward_seconds``), else TPOT p50; its prefill the prefill service's forward seconds
from the profile, else the slowest TTFT of an all-at-once wave. "% of floor" = floor / measured.
The floors are the whole machine's, while each engine runs on half the cores by default
(BATON_*_TORCH_THREADS): that choice is part of the gap, by design of the measure.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Shape:
    """The matmul-relevant sizes of a decoder-only model."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, cfg: Mapping[str, Any]) -> Shape:
        h, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        return cls(
            hidden=h, layers=int(cfg["num_hidden_layers"]), heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or h // heads),
            intermediate=int(cfg["intermediate_size"]), vocab=int(cfg["vocab_size"]),
        )  # fmt: skip

    @property
    def layer_params(self) -> int:
        """q, k, v, o projections and the gated MLP (biases and norms are negligible)."""
        attn = self.hidden * (2 * self.heads + 2 * self.kv_heads) * self.head_dim
        return attn + 3 * self.hidden * self.intermediate

    @property
    def body_params(self) -> int:
        return self.layers * self.layer_params

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden

    def kv_bytes_per_token(self, dtype: str) -> int:
        """K and V of one token in every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[dtype]

    def attention_flops(self, queries: int, keys_each: float) -> float:
        """QK^T and PV: 4·layers·heads·head_dim per (query, key) pair."""
        return 4.0 * self.layers * self.heads * self.head_dim * queries * keys_each


def decode_floor(
    shape: Shape,
    dtype: str,
    batch: int,
    context: float,
    bandwidth_gbs: float,
    peak_gflops: float,
    weight_bytes: float | None = None,
    kv_dtype: str | None = None,
) -> dict[str, float]:
    """Seconds a decode step of ``batch`` sequences of mean ``context`` tokens needs at least.
    ``weight_bytes``: what the engine's weights take where not ``dtype``'s (packed GGUF);
    ``kv_dtype``: the cache's dtype where not ``dtype`` (packed GGUF: bf16)."""
    if weight_bytes is None:
        weight_bytes = (shape.body_params + shape.head_params) * DTYPE_BYTES[dtype]
    kv_bytes = batch * context * shape.kv_bytes_per_token(kv_dtype or dtype)
    flops = 2.0 * (shape.body_params + shape.head_params) * batch
    flops += shape.attention_flops(batch, context)
    memory_s = (weight_bytes + kv_bytes) / (bandwidth_gbs * 1e9)
    compute_s = flops / (peak_gflops * 1e9)
    return {"weight_bytes": float(weight_bytes), "kv_bytes": float(kv_bytes), "flops": flops,
            "memory_s": memory_s, "compute_s": compute_s,
            "floor_s": max(memory_s, compute_s)}  # fmt: skip


def prefill_flops(shape: Shape, prompt_lens: Sequence[int]) -> dict[str, float]:
    """FLOPs of prefilling the prompts (causal attention; the LM head once per prompt)."""
    tokens = sum(prompt_lens)
    body = 2.0 * shape.body_params * tokens
    matmul = body + 2.0 * shape.head_params * len(prompt_lens)
    attention = sum(shape.attention_flops(n, (n + 1) / 2) for n in prompt_lens)
    return {"tokens": float(tokens), "matmul": matmul, "body_matmul": body,
            "attention": attention, "total": matmul + attention}  # fmt: skip


# int8 dot products a packed projection does per product, by its arithmetic: "int16"
# (activations in two bytes, kernels/cpu/quant_linear.py) does two of the int8 kernel's.
INT8_PASSES = {"int8": 1, "int16": 2}
# bf16 GEMM products per product: bf16x3's three (kernels/cpu/split_bf16.py), bf16's one
BF16_PASSES = {"bf16x3": 3, "bf16": 1}


def packed_gflops(arith: str, int8_gflops: float, bf16_gflops: float | None = None) -> float:
    """The peak of a packed projection's ``arith``: "int8" or "int16" from the int8 GEMM's,
    "bf16x3" or "bf16" from the bf16 GEMM's (``bf16_gflops``, required for them)."""
    if arith in BF16_PASSES:
        if bf16_gflops is None:
            raise ValueError(f"{arith}'s peak needs the bf16 GEMM's")
        return bf16_gflops / BF16_PASSES[arith]
    return int8_gflops / INT8_PASSES[arith]


def prefill_floor_s(
    flops: Mapping[str, float], peak_gflops: float, body_gflops: float | None = None
) -> float:
    """A prefill's compute floor (:func:`prefill_flops`): the layers' matmuls at
    ``body_gflops`` where they run other arithmetic than the rest (packed GGUF weights on the
    integer kernels; the head stays exact), the rest at ``peak_gflops``."""
    body, rest = flops["body_matmul"], flops["total"] - flops["body_matmul"]
    return rest / (peak_gflops * 1e9) + body / ((body_gflops or peak_gflops) * 1e9)


# --- probes --------------------------------------------------------------------------------------


def probe_bandwidth(mib: int = 512, trials: int = 5) -> float:
    """GB/s of reading a ``mib`` MiB fp32 tensor (a sum, all threads), best of ``trials``."""
    import torch

    x = torch.ones(mib * 2**20 // 4)
    x.sum()
    best = math.inf
    for _ in range(trials):  # best of several: other processes only ever slow a trial down
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def probe_gemm(dtype: str, m: int, k: int, n: int, budget_s: float = 2.0) -> float:
    """GFLOP/s of ``torch.mm`` [m, k] x [k, n] in ``dtype``, best of trials within ``budget_s``.
    ``int8``: ``torch._int_mm`` (int8 x int8 -> int32, oneDNN's VNNI / AMX-INT8 kernels), the
    arithmetic of a packed GGUF weight's decode kernel (int8 x, integer dot products): its
    operations a second, counted as FLOPs are."""
    import torch

    if dtype == "int8":
        a = torch.randint(-127, 128, (m, k), dtype=torch.int8)
        b = torch.randint(-127, 128, (k, n), dtype=torch.int8)
        mm = torch._int_mm
    else:
        tdt = getattr(torch, dtype)
        a, b = torch.randn(m, k).to(tdt), torch.randn(k, n).to(tdt)
        mm = torch.mm
    mm(a, b)  # warm-up: packing, kernel choice
    best, t_end = math.inf, time.perf_counter() + budget_s
    for i in range(20):
        t0 = time.perf_counter()
        mm(a, b)
        best = min(best, time.perf_counter() - t0)
        if i >= 2 and time.perf_counter() > t_end:
            break
    return 2.0 * m * k * n / best / 1e9


def probe(cfg: Mapping[str, Any], dtype: str, decode_arith: str | None = None) -> dict[str, Any]:
    """Both probes (a few seconds); the GEMM at 2048 x hidden x intermediate in ``dtype``, and
    in ``decode_arith`` where a decode step computes in another (``int8``: packed GGUF
    weights) as ``decode_gemm_gflops``."""
    import torch

    shape = Shape.of(cfg)
    gemm = (2048, shape.hidden, shape.intermediate)
    t0 = time.perf_counter()
    out = {"bandwidth_gbs": probe_bandwidth(), "gemm_gflops": probe_gemm(dtype, *gemm),
           "gemm_shape": list(gemm), "dtype": dtype,
           "threads": torch.get_num_threads()}  # fmt: skip
    arith = decode_arith or dtype
    out["decode_arith"] = arith
    out["decode_gemm_gflops"] = out["gemm_gflops"] if arith == dtype else probe_gemm(arith, *gemm)
    out["probe_s"] = time.perf_counter() - t0
    return out


def best_of(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """Two probes' results merged: the higher bandwidth and GEMM rates, the probe time summed."""
    out = {**a, "probe_s": a["probe_s"] + b["probe_s"]}
    for key in ("bandwidth_gbs", "gemm_gflops", "decode_gemm_gflops"):
        if key not in a:  # a probe from before the decode arithmetic's figure
            continue
        out[key] = max(a[key], b[key])
        out[key + "_runs"] = [a[key], b[key]]
    return out


# --- Baton against the floors ---------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    phase: str
    floor_s: float
    measured_s: float | None
    source: str
    bound: str  # what sets the floor: "memory", "compute" or "GEMM peak"

    @property
    def pct(self) -> float | None:
        return 100 * self.floor_s / self.measured_s if self.measured_s else None


def roofline(
    cfg: Mapping[str, Any],
    dtype: str,
    probes: Mapping[str, Any],
    prompt_lens: Sequence[int],
    output_lens: Sequence[int],
    summary: Mapping[str, Any],
    profile: Mapping[str, Any] | None,
    weight_bytes: float | None = None,
    prefill_body_gflops: float | None = None,
    kv_dtype: str | None = None,
) -> dict[str, Any]:
    """The decode-step and prefill rows of an all-at-once run (JSON-ready). ``weight_bytes``:
    what a decode step reads of the weights where not ``dtype``'s (packed GGUF);
    ``prefill_body_gflops``: the peak of the prefill layers' arithmetic where not ``dtype``'s
    (:func:`packed_gflops`); ``kv_dtype``: the cache's where not ``dtype``'s."""
    shape = Shape.of(cfg)
    bw, peak = float(probes["bandwidth_gbs"]), float(probes["gemm_gflops"])
    decode_peak = float(probes.get("decode_gemm_gflops", peak))
    batch = len(prompt_lens)
    # Mean context over the decode steps: the prompt plus half the output, averaged.
    context = sum(p + o / 2 for p, o in zip(prompt_lens, output_lens, strict=True)) / batch
    step = decode_floor(shape, dtype, batch, context, bw, decode_peak, weight_bytes, kv_dtype)
    pre = prefill_flops(shape, prompt_lens)
    pre_floor = prefill_floor_s(pre, peak, prefill_body_gflops)

    stages = {r["stage"]: r for r in (profile or {}).get("stages", [])}
    dec, pf = stages.get("decode forward (+sampling)"), stages.get("prefill forward (+sampling)")
    tpot = summary["tpot"]["p50"]
    step_s, step_src = tpot, "TPOT p50 (client)"
    if dec and dec.get("seconds") and dec.get("count"):
        # The mean over the profiled pass's steps, the ramp's smaller batches included.
        step_s, step_src = dec["seconds"] / dec["count"], "decode forward / step (profile)"
    if pf and pf.get("seconds"):
        pre_s, pre_src = pf["seconds"], "prefill forward seconds (profile)"
    else:
        pre_s, pre_src = summary["ttft"]["max"], "slowest TTFT of the wave (client)"
    bound = "memory" if step["memory_s"] >= step["compute_s"] else "compute"
    rows = [
        Row(f"decode step, batch {batch}, ctx {context:.0f}", step["floor_s"], step_s, step_src,
            bound),
        Row(f"prefill wave, {int(pre['tokens'])} tokens", pre_floor, pre_s, pre_src, "GEMM peak"),
    ]  # fmt: skip
    if step_src != "TPOT p50 (client)":  # the client's view too: steps plus waits for the cores
        rows.insert(1, Row("  the same, as the client sees it", step["floor_s"], tpot,
                           "TPOT p50 (client)", bound))  # fmt: skip
    return {
        "probes": dict(probes), "dtype": dtype, "decode_step": {**step, "batch": batch,
        "context": context}, "prefill": {**pre, "floor_s": pre_floor},
        "rows": [{**asdict(r), "pct_of_floor": r.pct} for r in rows],
    }  # fmt: skip


def format_roofline(r: Mapping[str, Any]) -> str:
    p, d = r["probes"], r["decode_step"]
    width = 92
    lines = [f" Roofline ({r['dtype']}) ".center(width, "=")]
    lines.append(f"measured: memory bandwidth {p['bandwidth_gbs']:.1f} GB/s, "
                 f"GEMM {'x'.join(map(str, p['gemm_shape']))} {p['gemm_gflops']:.1f} GFLOP/s "
                 f"({p['threads']} threads, probes {p['probe_s']:.1f} s)")  # fmt: skip
    if p.get("decode_arith", r["dtype"]) != r["dtype"]:
        lines.append(f"decode step's arithmetic: {p['decode_arith']}, GEMM"
                     f" {p['decode_gemm_gflops']:.1f} G/s (packed weights)")  # fmt: skip
    if "gemm_gflops_runs" in p:
        runs = zip(p["bandwidth_gbs_runs"], p["gemm_gflops_runs"], strict=True)
        each = ", ".join(f"{bw:.1f} GB/s {g:.1f} GFLOP/s" for bw, g in runs)
        lines.append(f"  probes before/after Baton: {each} (best counts; fp32: or matmul timing)")
    lines.append(f"decode step reads {d['weight_bytes'] / 1e6:.1f} MB weights + "
                 f"{d['kv_bytes'] / 1e6:.1f} MB KV: memory {1000 * d['memory_s']:.2f} ms, "
                 f"compute {1000 * d['compute_s']:.2f} ms")  # fmt: skip
    lines.append(f"{'phase':<34}{'floor ms':>10}{'Baton ms':>10}{'% of floor':>12}  bound; source")
    for row in r["rows"]:
        meas = "-" if row["measured_s"] is None else f"{1000 * row['measured_s']:.1f}"
        pct = "-" if row["pct_of_floor"] is None else f"{row['pct_of_floor']:.1f}%"
        lines.append(f"{row['phase']:<34}{1000 * row['floor_s']:>10.1f}{meas:>10}{pct:>12}  "
                     f"{row['bound']}; {row['source']}")  # fmt: skip
    lines.append("=" * width)
    return "\n".join(lines)


def plot_roofline(ax: Any, r: Mapping[str, Any]) -> None:
    """% of floor per phase as bars (one axis for all: the phases' milliseconds differ 100-fold),
    each labelled with its floor and measured milliseconds."""
    rows = r["rows"]
    ys = list(range(len(rows)))[::-1]
    ax.barh(ys, [x["pct_of_floor"] or 0 for x in rows], 0.6)
    for y, x in zip(ys, rows, strict=True):
        meas = "-" if x["measured_s"] is None else f"{1000 * x['measured_s']:.0f}"
        pct = x["pct_of_floor"] or 0
        ax.text(2, y, f"{x['phase'].strip()}: floor {1000 * x['floor_s']:.0f} ms, Baton {meas} ms"
                f" ({pct:.0f}%)", va="center", fontsize=7)  # fmt: skip
    ax.set_yticks([])
    ax.set(xlabel="% of floor (floor / measured)", xlim=(0, 100),
           title=f"roofline ({r['dtype']}), {r['probes']['bandwidth_gbs']:.0f} GB/s, "
           f"{r['probes']['gemm_gflops']:.0f} GFLOP/s")  # fmt: skip
