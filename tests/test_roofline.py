"""The bench's roofline arithmetic, per-phase CPU summary and model-shape presets (no timing)."""

from __future__ import annotations

import pytest

from loadtest.engine import roofline
from loadtest.models import arch_of
from loadtest.serving import phase_cpu
from loadtest.serving.bench_args import SHAPES, parse_args
from shared.models.tiny.builder import PRESETS

# A toy config small enough to check by hand.
TOY = {"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
       "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 16,
       "vocab_size": 10}  # fmt: skip
# Qwen2-0.5B's shapes, as shared/models/tiny/builder.py's "qwen2-0.5b" preset (4k vocabulary).
QWEN = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 4864,
        "vocab_size": 4096}  # fmt: skip


def test_toy_shape_params_and_kv_bytes() -> None:
    s = roofline.Shape.of(TOY)
    # q, o: 8x8 each; k, v: 8x4 each -> 8*(2*2+2*1)*4 = 192; MLP 3*8*16 = 384.
    assert s.layer_params == 576
    assert s.body_params == 1152
    assert s.head_params == 80
    assert s.kv_bytes_per_token("float32") == 2 * 2 * 1 * 4 * 4 == 64
    assert s.kv_bytes_per_token("bfloat16") == 32


def test_head_dim_defaults_to_hidden_over_heads() -> None:
    cfg = {k: v for k, v in TOY.items() if k not in ("head_dim", "num_key_value_heads")}
    s = roofline.Shape.of(cfg)
    assert (s.head_dim, s.kv_heads) == (4, 2)


def test_qwen2_0_5b_shape() -> None:
    s = roofline.Shape.of(QWEN)
    assert s.layer_params == 14_909_440  # 896*32*64 attention + 3*896*4864 MLP
    assert s.body_params == 357_826_560
    assert s.head_params == 3_670_016
    assert s.kv_bytes_per_token("float32") == 24_576


def test_decode_floor_qwen2_bf16() -> None:
    s = roofline.Shape.of(QWEN)
    d = roofline.decode_floor(s, "bfloat16", batch=16, context=144, bandwidth_gbs=10.0,
                              peak_gflops=100.0)  # fmt: skip
    assert d["weight_bytes"] == (357_826_560 + 3_670_016) * 2 == 722_993_152
    assert d["kv_bytes"] == 16 * 144 * 12_288 == 28_311_552
    assert d["memory_s"] == pytest.approx(751_304_704 / 1e10)
    # 2 x params x 16 tokens, + 4*24*14*64 per (query, key) pair x 16 x 144 pairs.
    assert d["flops"] == 2 * 361_496_576 * 16 + 86_016 * 16 * 144 == 11_766_071_296
    assert d["compute_s"] == pytest.approx(0.11766071296)
    assert d["floor_s"] == d["compute_s"]  # at 100 GFLOP/s this batch is compute-bound
    fast = roofline.decode_floor(s, "bfloat16", 16, 144, 10.0, 1000.0)
    assert fast["floor_s"] == fast["memory_s"]


def test_prefill_flops_toy() -> None:
    f = roofline.prefill_flops(roofline.Shape.of(TOY), [3, 5])
    assert f["tokens"] == 8
    assert f["matmul"] == 2 * 1152 * 8 + 2 * 80 * 2 == 18_752
    assert f["body_matmul"] == 2 * 1152 * 8
    # 4*2*2*4 = 64 FLOPs per (query, key) pair; causal pairs 3*4/2 + 5*6/2 = 21.
    assert f["attention"] == 64 * 21 == 1344
    assert f["total"] == 20_096


def _summary(tpot_p50: float, ttft_max: float) -> dict[str, dict[str, float]]:
    return {"tpot": {"p50": tpot_p50}, "ttft": {"max": ttft_max}}


def test_roofline_rows_from_the_profile_and_from_the_client() -> None:
    probes = {"bandwidth_gbs": 10.0, "gemm_gflops": 100.0, "gemm_shape": [2048, 8, 16],
              "threads": 2, "probe_s": 1.0}  # fmt: skip
    prompts, outputs = [3, 5], [2, 4]  # mean context (3+1 + 5+2) / 2 = 5.5
    profile = {"stages": [
        {"stage": "decode forward (+sampling)", "seconds": 2.0, "count": 4},
        {"stage": "prefill forward (+sampling)", "seconds": 0.5, "count": 1},
    ]}  # fmt: skip
    r = roofline.roofline(TOY, "float32", probes, prompts, outputs, _summary(0.1, 0.3), profile)
    assert r["decode_step"]["batch"] == 2 and r["decode_step"]["context"] == 5.5
    dec, client, pre = r["rows"]
    assert dec["measured_s"] == 0.5 and "profile" in dec["source"]
    assert client["measured_s"] == 0.1 and client["floor_s"] == dec["floor_s"]
    assert dec["pct_of_floor"] == pytest.approx(100 * dec["floor_s"] / 0.5)
    assert pre["floor_s"] == pytest.approx(20_096 / 100e9)
    assert pre["measured_s"] == 0.5 and pre["bound"] == "GEMM peak"
    # Without a profile: TPOT p50 and the wave's slowest TTFT.
    r = roofline.roofline(TOY, "float32", probes, prompts, outputs, _summary(0.1, 0.3), None)
    dec, pre = r["rows"]
    assert (dec["measured_s"], pre["measured_s"]) == (0.1, 0.3)
    assert "TPOT" in dec["source"] and "TTFT" in pre["source"]
    assert "% of floor" in roofline.format_roofline(r)


def test_packed_weights_floor_their_decode_step_at_their_bytes_and_arithmetic() -> None:
    """A packed GGUF run: the decode step reads the packed bytes and computes at the decode
    arithmetic's peak (int8); prefill keeps the dtype's GEMM peak unless it runs int8 too."""
    probes = {"bandwidth_gbs": 10.0, "gemm_gflops": 100.0, "gemm_shape": [2048, 8, 16],
              "threads": 2, "probe_s": 1.0, "decode_arith": "int8",
              "decode_gemm_gflops": 400.0}  # fmt: skip
    prompts, outputs = [3, 5], [2, 4]
    r = roofline.roofline(TOY, "float32", probes, prompts, outputs, _summary(0.1, 0.3), None,
                          weight_bytes=123)  # fmt: skip
    step = r["decode_step"]
    assert step["weight_bytes"] == 123
    assert step["compute_s"] == pytest.approx(step["flops"] / 400e9)
    assert r["prefill"]["floor_s"] == pytest.approx(20_096 / 100e9)
    assert "int8" in roofline.format_roofline(r)
    # A prefill engine on the tiled kernels: the layers' matmuls at their arithmetic's peak
    # (int16: two int8 passes), the head and attention at the dtype's.
    body = 2 * 1152 * 8
    for arith, passes in (("int8", 1), ("int16", 2)):
        r = roofline.roofline(TOY, "float32", probes, prompts, outputs, _summary(0.1, 0.3), None,
                              weight_bytes=123,
                              prefill_body_gflops=roofline.packed_gflops(arith, 400.0))  # fmt: skip
        want = (20_096 - body) / 100e9 + body * passes / 400e9
        assert r["prefill"]["floor_s"] == pytest.approx(want)
    # bf16x3 (the split kernel): three bf16 tile products per product, at the bf16 GEMM's peak
    assert roofline.packed_gflops("bf16x3", 400.0, 900.0) == pytest.approx(300.0)
    with pytest.raises(ValueError, match="bf16"):
        roofline.packed_gflops("bf16x3", 400.0)


def test_the_int8_probe_runs() -> None:
    assert roofline.probe_gemm("int8", 64, 64, 64, budget_s=0.1) > 0


def test_phase_summary_splits_prefill_and_decode() -> None:
    samples = [
        (0.0, {"prefill": 0.0, "decode": 0.0}),
        (1.0, {"prefill": 0.9, "decode": 0.3}),  # prefill busy: 0.9 and 0.3 cores
        (2.0, {"prefill": 1.8, "decode": 0.5}),  # prefill busy
        (3.0, {"prefill": 1.8, "decode": 1.5}),  # decode only: 1.0 core
        (4.0, {"prefill": 1.81, "decode": 1.51}),  # idle
    ]
    p = phase_cpu.summarize(samples)
    assert list(p) == ["prefill busy", "decode only", "idle/other"]
    assert p["prefill busy"]["wall_s"] == 2.0
    assert p["prefill busy"]["cores"] == pytest.approx({"prefill": 0.9, "decode": 0.25})
    assert p["decode only"]["cores"] == pytest.approx({"prefill": 0.0, "decode": 1.0})
    assert p["idle/other"]["wall_s"] == 1.0
    assert "prefill busy" in phase_cpu.format_phases(p, cores=2)


def test_model_shape_presets_fill_only_what_is_not_given() -> None:
    a = parse_args(["--model-shape", "qwen2-0.5b"])
    assert (a.num_requests, a.input_len, a.output_len, a.dtype) == (16, 128, 32, "float32")
    a = parse_args(["--model-shape", "qwen2-0.5b", "--requests", "64", "--prompt-len", "256",
                    "--output-len", "64", "--dtype", "bfloat16"])  # fmt: skip
    assert (a.num_requests, a.input_len, a.output_len, a.dtype) == (64, 256, 64, "bfloat16")
    a = parse_args([])
    assert (a.num_requests, a.input_len, a.output_len) == (64, 128, 64)
    assert {s.preset for s in SHAPES.values()} <= set(PRESETS)  # shapes are the builder's
    assert arch_of(SHAPES["qwen2-0.5b"].preset) == "qwen2"


def test_best_of_two_probes_keeps_the_faster_figures() -> None:
    a = {"bandwidth_gbs": 20.0, "gemm_gflops": 300.0, "probe_s": 1.0, "dtype": "float32"}
    b = {"bandwidth_gbs": 25.0, "gemm_gflops": 120.0, "probe_s": 2.0, "dtype": "float32"}
    m = roofline.best_of(a, b)
    assert (m["bandwidth_gbs"], m["gemm_gflops"], m["probe_s"]) == (25.0, 300.0, 3.0)
    assert m["gemm_gflops_runs"] == [300.0, 120.0] and m["dtype"] == "float32"
    a = {**a, "decode_arith": "int8", "decode_gemm_gflops": 700.0}
    b = {**b, "decode_arith": "int8", "decode_gemm_gflops": 800.0}
    assert roofline.best_of(a, b)["decode_gemm_gflops"] == 800.0
