"""GGUF Q8_0 / Q4_0 / Q4_1 weights: the torch reference (kernels/cpu/quant_formats.py) against
gguf-py bit for bit, and the C kernels (kernels/cpu/quant_linear.py) against the reference.

The int8 kernel rounds each x element to int8 per block of 32 (dx = amax / 127), so its one
error next to ``x @ dequantize(W).T`` is at most ``dx / 2`` per element of x:

    |y - ref| <= sum_b amax(x_b) / 254 * sum_{j in b} |w_j|   (+ fp32 rounding: 1e-5 |x| . |w|)

Every output is held to that bound (it is not a statistical tolerance: no output may exceed
it), and the error must stay far below that of a plausible layout bug (the two halves of each
block swapped). The fp32 kernel (small_mode "f32") differs from ``F.linear(x, dequantize(W))``
only in the order of its fp32 sums: held to 1e-5 of ``|x| . |w|``. Above ``small_max_rows`` the
linear is ``F.linear`` on the exact dequantized weight, so it is compared with ``torch.equal``.
"""

from __future__ import annotations

import ctypes
import mmap
import platform
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import quant_linear as cpu_quant_linear
from kernels.cpu.build import load_library
from kernels.cpu.quant_formats import (
    BLOCK,
    PACKED_TYPES,
    QuantType,
    block_bytes,
    dequantize,
    dequantize_rows,
    quantize,
    row_bytes,
)
from kernels.cpu.quant_linear import (
    FLAGS,
    INT8_MAX_ROWS,
    SMALL_MODES,
    SOURCE,
    TILES_SOURCE,
    QuantKernels,
    QuantWeight,
    load_quant_kernels,
)
from tests.runtime.helpers import built_or_skip, torch_threads

pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

TYPES = list(PACKED_TYPES.values())
# fp16 scales worth a look: zeros, signs, the largest finite, the smallest normal and
# subnormal, one below 1, infinities (NaN encodings are left out: which of two NaN operands
# survives (d * q) + m is numpy's and the compiler's choice, not a property of the format).
EDGE_F16 = [0.0, -0.0, 1.0, -1.0, 65504.0, -65504.0, 2.0**-14, 2.0**-24, -(2.0**-24), 0.999,
            float("inf"), float("-inf")]  # fmt: skip


@pytest.fixture(scope="module")
def kernels() -> QuantKernels:
    return built_or_skip(load_quant_kernels(), "torch's dequantize + F.linear")


def _gguf_type(qtype: QuantType) -> GGMLQuantizationType:
    return GGMLQuantizationType(int(qtype))


def _random_blocks(n: int, k: int, qtype: QuantType, g: torch.Generator) -> torch.Tensor:
    """Random block bytes with finite-or-infinite fp16 scales, edge values among them."""
    raw = torch.randint(0, 256, (n, row_bytes(qtype, k)), dtype=torch.uint8, generator=g)
    blocks = raw.view(-1, block_bytes(qtype))
    scales = blocks[:, : 4 if qtype == QuantType.Q4_1 else 2].contiguous().view(torch.float16)
    scales[scales.isnan()] = 0.5
    edge = torch.tensor(EDGE_F16, dtype=torch.float16)
    pick = torch.randint(0, len(EDGE_F16), scales.shape, generator=g)
    edge_rows = torch.rand(scales.shape[0], generator=g) < 0.3
    scales[edge_rows] = edge[pick[edge_rows]]
    blocks[:, : scales.shape[1] * 2] = scales.view(torch.uint8)
    return raw


def _seeded_weight(
    seed: int, n: int, k: int, qtype: QuantType
) -> tuple[torch.Generator, torch.Tensor]:
    """A generator seeded with ``seed``, and a random ``[n, k]`` weight it drew, quantized."""
    g = torch.Generator().manual_seed(seed)
    return g, quantize(torch.randn(n, k, generator=g), qtype)


def _same_bits(a: torch.Tensor, b: np.ndarray) -> None:
    assert a.dtype == torch.float32 and tuple(a.shape) == b.shape
    got, want = a.numpy().view(np.uint32), b.astype(np.float32).view(np.uint32)
    assert np.array_equal(got, want), f"{int((got != want).sum())} of {got.size} differ"


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # gguf-py's inf * 0
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_is_gguf_bit_for_bit(qtype: QuantType, kernels: QuantKernels) -> None:
    g = torch.Generator().manual_seed(int(qtype))
    raw = _random_blocks(61, 96, qtype, g)
    want = gguf_dequantize(raw.numpy(), _gguf_type(qtype))
    assert np.isinf(want).any() and np.isnan(want).any() and (want == 0).any()
    _same_bits(dequantize(raw, qtype, 96), want)
    _same_bits(QuantWeight(raw, qtype, 96, kernels).dequantize(), want)  # the C entry
    ids = torch.tensor([[3, 0], [60, 3]])
    _same_bits(dequantize_rows(raw, qtype, 96, ids), want[ids.numpy()])
    _same_bits(QuantWeight(raw, qtype, 96, kernels).rows(ids), want[ids.numpy()])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_quantize_is_gguf_and_round_trips(qtype: QuantType) -> None:
    g = torch.Generator().manual_seed(10 + int(qtype))
    w = torch.randn(40, 128, generator=g) * torch.logspace(-4, 3, 40).unsqueeze(1)
    w[0] = 0.0  # d = 0
    w[1] = 3.0  # constant block
    w[2, :32] = 0.0
    w[2, 5] = -7.0  # one spike
    w[3, :32] = torch.linspace(-1, 1, 32)  # the largest magnitude twice, signs opposite
    raw = quantize(w, qtype)
    assert raw.dtype == torch.uint8 and raw.shape == (40, row_bytes(qtype, 128))
    assert np.array_equal(raw.numpy(), gguf_quantize(w.numpy(), _gguf_type(qtype)))
    back = dequantize(raw, qtype, 128)
    # per block: nearest level (Q4_0's -max end may clamp one step), plus fp16 rounding of d, m
    d = raw.view(-1, block_bytes(qtype))[:, :2].contiguous().view(torch.float16).float().abs()
    err = (back - w).abs().view(-1, BLOCK).amax(dim=1, keepdim=True)
    assert bool((err <= (1.05 if qtype == QuantType.Q4_0 else 0.6) * d + 1e-30).all())


def _bound(x: torch.Tensor, w: torch.Tensor, steps: float = 254) -> torch.Tensor:
    """The int8 kernel's worst-case error for each output (the module docstring), float64: x
    within amax / ``steps`` (int8: half of amax / 127; int16: amax / (127 * 256))."""
    m, k = x.shape
    xb = x.double().abs().view(m, k // BLOCK, BLOCK).amax(-1)
    wb = w.double().abs().view(w.shape[0], k // BLOCK, BLOCK).sum(-1)
    return xb @ wb.T / steps * 1.001 + 1e-5 * (x.double().abs() @ w.double().abs().T)


def _halves_swapped(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    return w.view(n, k // BLOCK, 2, BLOCK // 2).flip(2).reshape(n, k)


# An int8 linear as QuantKernels.linear takes it: (raw, qtype, k, x, bias) -> y.
Linear = Callable[[torch.Tensor, QuantType, int, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _check_int8(
    linear: Linear, qtype: QuantType, n: int, k: int, rows: list[int], steps: float = 254
) -> float:
    """An int8 kernel on x[:m] for each m in rows against the bound (``steps``: an int16
    kernel's, 127 * 256); the worst error/bound."""
    g, raw = _seeded_weight(n * 7919 + k * 31 + int(qtype), n, k, qtype)
    w = dequantize(raw, qtype, k)
    x = torch.randn(max(rows), k, generator=g) * (1 + 4 * torch.rand(max(rows), 1, generator=g))
    x[0, :BLOCK] = 0.0  # a zero block: dx = 0
    bias = torch.randn(n, generator=g)
    ref = x.double() @ w.double().T
    bound = _bound(x, w, steps)
    wrong = (x.double() @ _halves_swapped(w).double().T - ref).abs().max()
    worst = 0.0
    for m in rows:
        y = linear(raw, qtype, k, x[:m], None)
        err = (y.double() - ref[:m]).abs()
        assert bool((err <= bound[:m]).all()), (m, float((err / bound[:m]).max()))
        assert float(err.max()) < 0.05 * float(wrong), (m, float(err.max()), float(wrong))
        worst = max(worst, float((err / bound[:m]).max()))
    # the bias is added to the same sums
    with_bias = linear(raw, qtype, k, x[:3], bias)
    assert torch.equal(with_bias, linear(raw, qtype, k, x[:3], None) + bias)
    return worst


ROWS = [1, 2, 3, 4, 5, 7, 8, 16, 17, 33, 64, 65, 200]


def _check_f32(kernels: QuantKernels, qtype: QuantType, n: int, k: int, rows: list[int]) -> None:
    """The fp32 kernel on x[:m] against F.linear on the dequantized weight: fp32 sums' order."""
    g, raw = _seeded_weight(n * 7919 + k * 31 + int(qtype) + 1, n, k, qtype)
    w = dequantize(raw, qtype, k)
    x = torch.randn(max(rows), k, generator=g) * (1 + 4 * torch.rand(max(rows), 1, generator=g))
    bias = torch.randn(n, generator=g)
    ref = x.double() @ w.double().T
    tol = 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-30
    for m in rows:
        y = kernels.linear_f32(raw, qtype, k, x[:m], None)
        assert bool(((y.double() - ref[:m]).abs() <= tol[:m]).all()), (m, qtype.name, n, k)
        assert bool(((F.linear(x[:m], w) - y).abs() <= 2 * tol[:m]).all())
    with_bias = kernels.linear_f32(raw, qtype, k, x[:3], bias)
    assert torch.equal(with_bias, kernels.linear_f32(raw, qtype, k, x[:3], None) + bias)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("k", [32, 64, 576, 1536])
def test_f32_kernel_is_f_linear_up_to_summation_order(kernels: QuantKernels, qtype: QuantType,
                                                      k: int) -> None:  # fmt: skip
    for n in (1, 7, 64, 192, 577):
        _check_f32(kernels, qtype, n, k, ROWS if n in (7, 577) else [1, 8, 17])


def test_f32_kernel_dequantizes_edge_scales_like_the_reference(kernels: QuantKernels) -> None:
    """Infinite, zero and subnormal scales: the same non-finite outputs as F.linear."""
    for qtype in TYPES:
        raw = _random_blocks(9, 64, qtype, torch.Generator().manual_seed(2))
        w = dequantize(raw, qtype, 64)
        x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
        y, ref = kernels.linear_f32(raw, qtype, 64, x, None), F.linear(x, w)
        assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())
        fin = ref.isfinite()
        tol = 1e-5 * (x.abs() @ w.abs().nan_to_num(posinf=0.0).T) + 1e-30
        assert bool(((y - ref).abs()[fin] <= tol[fin]).all())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("k", [32, 64, 576, 1536])
def test_int8_kernel_within_its_rounding_bound(kernels: QuantKernels, qtype: QuantType,
                                               k: int) -> None:  # fmt: skip
    for n in (1, 7, 64, 192, 577):
        _check_int8(kernels.linear, qtype, n, k, ROWS if n in (7, 577) else [1, 8, 17])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_int16_kernel_within_its_rounding_bound(kernels: QuantKernels, qtype: QuantType) -> None:
    """x in two bytes a value (small_mode "int16", tiled weights): within amax / (127 * 256)
    of x per element, and ~1/256 of the int8 kernel's typical error."""
    if kernels.tile_rows == 0:
        pytest.skip("this build has no tiled kernels")
    wide = partial(_tiled, kernels, wide=True)
    for n, k in ((7, 64), (66, 576), (577, 1536)):
        _check_int8(wide, qtype, n, k, ROWS if n == 66 else [1, 17], steps=127 * 256)
    g = torch.Generator().manual_seed(6)
    raw = quantize(torch.randn(576, 576, generator=g), qtype)
    x = torch.randn(16, 576, generator=g)
    ref = x.double() @ dequantize(raw, qtype, 576).double().T
    rel = float((wide(raw, qtype, 576, x, None).double() - ref).norm() / ref.norm())
    assert 1e-7 < rel < 1e-4, (qtype.name, rel)
    _check_non_finite(wide)


def test_int8_error_is_activation_rounding_sized(kernels: QuantKernels) -> None:
    """Typical error, Gaussian x: x's rounding error has std dx / sqrt(12), dx = amax / 127
    with amax ~2.2 std over a block of 32, so ~5e-3 of the outputs' norm."""
    g = torch.Generator().manual_seed(5)
    for qtype in TYPES:
        raw = quantize(torch.randn(576, 576, generator=g), qtype)
        x = torch.randn(16, 576, generator=g)
        ref = x.double() @ dequantize(raw, qtype, 576).double().T
        y = kernels.linear(raw, qtype, 576, x, None).double()
        rel = float((y - ref).norm() / ref.norm())
        assert 1e-3 < rel < 1e-2, (qtype.name, rel)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_many_rows_are_exactly_f_linear_on_the_dequantized_weight(
    kernels: QuantKernels, qtype: QuantType
) -> None:
    g, raw = _seeded_weight(20 + int(qtype), 192, 576, qtype)
    weight = QuantWeight(raw, qtype, 576, kernels)
    x = torch.randn(INT8_MAX_ROWS + 3, 576, generator=g)
    bias = torch.randn(192, generator=g)
    w = dequantize(raw, qtype, 576)
    assert torch.equal(weight.linear(x), F.linear(x, w))
    assert torch.equal(weight.linear(x, bias), F.linear(x, w, bias))
    assert torch.equal(weight.linear(x[:, :576]), F.linear(x, w))  # the scratch, reused


def test_a_weight_too_big_for_the_scratch_is_dequantized_per_call(
    kernels: QuantKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_quant_linear, "SCRATCH_MAX_BYTES", 64 * 96 * 4 - 1)
    raw = quantize(torch.randn(64, 96), QuantType.Q4_0)
    x = torch.randn(INT8_MAX_ROWS + 3, 96)
    want = F.linear(x, dequantize(raw, QuantType.Q4_0, 96))
    assert torch.equal(QuantWeight(raw, QuantType.Q4_0, 96, kernels).linear(x), want)


def _check_bits_never_change(weigh: Callable[[torch.Tensor, QuantType], QuantWeight]) -> None:
    """The same bits whatever the threads, the batch or the tile an x row sits in, for
    ``weigh(raw, qtype)``: the weight under test over 577 rows of 576, and over its first five."""
    g = torch.Generator().manual_seed(3)
    for qtype in TYPES:
        raw = quantize(torch.randn(577, 576, generator=g), qtype)
        weight = weigh(raw, qtype)
        x = torch.randn(19, 576, generator=g)
        with torch_threads(1):
            one = weight.linear(x)
        with torch_threads(2):
            assert cpu_quant_linear.linear_parts(19, 577, 576) == 2
            assert torch.equal(weight.linear(x), one)
            assert torch.equal(weight.linear(x[:1]), one[:1])
        for i in (0, 8, 18):  # alone, or in any tile of a batch: the same sums
            assert torch.equal(weight.linear(x[i : i + 1]), one[i : i + 1])
        assert torch.equal(weigh(raw[:5], qtype).linear(x), one[:, :5])


@pytest.mark.parametrize("mode", SMALL_MODES)
def test_threads_batches_and_tiles_never_change_a_bit(kernels: QuantKernels, mode: str) -> None:
    if mode == "int16" and kernels.tile_rows == 0:
        pytest.skip("int16 runs on tiled weights only")

    def weigh(raw: torch.Tensor, qtype: QuantType) -> QuantWeight:
        # the small kernel for every batch here (19 rows); int16's on the tiles
        weight = QuantWeight(raw, qtype, 576, kernels, small_mode=mode, small_max_rows=64)
        if mode == "int16":
            assert weight.tile()
        return weight

    _check_bits_never_change(weigh)


def test_both_small_modes_and_the_threshold_are_reachable(kernels: QuantKernels) -> None:
    g, raw = _seeded_weight(12, 64, 96, QuantType.Q4_1)
    x = torch.randn(6, 96, generator=g)
    w = dequantize(raw, QuantType.Q4_1, 96)
    f32 = QuantWeight(raw, QuantType.Q4_1, 96, kernels, small_mode="f32")
    int8 = QuantWeight(raw, QuantType.Q4_1, 96, kernels, small_mode="int8")
    assert torch.equal(f32.linear(x), kernels.linear_f32(raw, QuantType.Q4_1, 96, x, None))
    assert torch.equal(int8.linear(x), kernels.linear(raw, QuantType.Q4_1, 96, x, None))
    assert not torch.equal(f32.linear(x), int8.linear(x))
    assert int8.small_max_rows == INT8_MAX_ROWS
    assert QuantWeight(raw, QuantType.Q4_1, 96, kernels).small_mode == cpu_quant_linear.SMALL_MODE
    for weight in (f32, int8):  # 0: always dequantize + SGEMM, exactly F.linear
        weight.small_max_rows = 0
        assert torch.equal(weight.linear(x), F.linear(x, w))
        assert torch.equal(weight._linear(x, None), F.linear(x, w))
    picked = int8.select_rows(torch.tensor([3, 1]))
    assert picked.small_mode == "int8" and picked.small_max_rows == 0
    few = QuantWeight(raw, QuantType.Q4_1, 96, kernels, small_mode="f32", small_max_rows=4)
    assert torch.equal(few.linear(x), F.linear(x, w))  # 6 > 4 rows: dequantize + SGEMM
    with pytest.raises(ValueError):
        QuantWeight(raw, QuantType.Q4_1, 96, kernels, small_mode="fp8")


def _check_non_finite(linear: Linear) -> None:
    """A NaN in a row of x makes the row's outputs NaN, an inf makes them non-finite."""
    for qtype in TYPES:
        raw = quantize(torch.randn(9, 64), qtype)
        x = torch.randn(3, 64)
        x[0, 40] = float("nan")
        x[2, 3] = float("inf")
        y = linear(raw, qtype, 64, x, None)
        assert bool(y[0].isnan().all()) and bool(y[1].isfinite().all())
        assert not bool(y[2].isfinite().any())


def test_non_finite_x(kernels: QuantKernels) -> None:
    _check_non_finite(kernels.linear)


def test_bf16_above_the_small_kernel_is_a_bf16_gemm(kernels: QuantKernels) -> None:
    """A prompt's bf16 rows over a packed weight: the weight dequantized and rounded to bf16,
    then a bf16 GEMM where the CPU has one (a bf16 model of the dequantized weights); else the
    fp32 path, rounded at the end."""
    g, raw = _seeded_weight(5, 64, 96, QuantType.Q4_1)
    weight = QuantWeight(raw, QuantType.Q4_1, 96, kernels, small_max_rows=0)
    x = torch.randn(40, 96, generator=g).bfloat16()
    bias = torch.randn(64, generator=g).bfloat16()
    out = weight.linear(x, bias)
    assert out.dtype == torch.bfloat16
    w = weight.dequantize()
    if cpu_quant_linear.bf16_gemm():
        assert torch.equal(out, F.linear(x, w.bfloat16(), bias))
    else:
        assert torch.equal(out, F.linear(x.float(), w, bias.float()).bfloat16())


def test_many_rows_bf16_is_the_bf16_gemm_for_fp32_rows(kernels: QuantKernels) -> None:
    """``many_rows="bf16"`` (the prefill engine's "bf16"): fp32 rows above small_max_rows take
    the bf16 GEMM of the path above, widened back to fp32; the fp32 path without one."""
    g, raw = _seeded_weight(6, 64, 96, QuantType.Q8_0)
    weight = QuantWeight(raw, QuantType.Q8_0, 96, kernels, small_max_rows=0, many_rows="bf16")
    x = torch.randn(40, 96, generator=g)
    bias = torch.randn(64, generator=g)
    out = weight.linear(x, bias)
    assert out.dtype == torch.float32
    w = weight.dequantize()
    if cpu_quant_linear.bf16_gemm():
        want = F.linear(x.bfloat16(), w.bfloat16(), bias.bfloat16()).float()
    else:
        want = F.linear(x, w, bias)
    assert torch.equal(out, want)
    with pytest.raises(ValueError, match="many_rows"):
        QuantWeight(raw, QuantType.Q8_0, 96, kernels, many_rows="fp8")


def test_bf16_strided_bias_and_refusals(kernels: QuantKernels) -> None:
    g, raw = _seeded_weight(4, 64, 96, QuantType.Q4_1)
    weight = QuantWeight(raw, QuantType.Q4_1, 96, kernels)
    x = torch.randn(5, 96, generator=g)
    bias = torch.randn(64, generator=g)
    want = weight.linear(x, bias)
    out = weight.linear(x.bfloat16(), bias.bfloat16())
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, weight.linear(x.bfloat16().float(), bias.bfloat16().float()).bfloat16())
    wide = torch.cat([x, x], dim=1)[:, :96]  # rows a stride apart
    assert torch.equal(weight.linear(wide, bias), want)
    assert torch.equal(weight.linear(x.t().contiguous().t(), bias), want)  # columns strided
    assert weight.linear(x[:0]).shape == (0, 64)
    for bad in (x.double(), x[:, :64], x[0]):
        with pytest.raises(ValueError):
            weight.linear(bad)
    with pytest.raises(ValueError):
        weight.linear(x, bias[:3])
    with pytest.raises(ValueError):
        QuantWeight(raw, QuantType.Q4_1, 64)  # rows of the wrong length
    with pytest.raises(ValueError):
        QuantWeight(raw, 12, 96)  # Q4_K: not a supported type
    with pytest.raises(ValueError):
        row_bytes(QuantType.Q8_0, 48)


def test_fused_permuted_and_without_a_compiler(kernels: QuantKernels) -> None:
    g = torch.Generator().manual_seed(6)
    parts = [quantize(torch.randn(n, 64, generator=g), QuantType.Q8_0) for n in (3, 5)]
    fused = QuantWeight.cat([QuantWeight(p, QuantType.Q8_0, 64, kernels) for p in parts])
    assert fused.shape == (8, 64) and fused.nbytes == 8 * row_bytes(QuantType.Q8_0, 64)
    order = torch.tensor([7, 0, 3])
    picked = fused.select_rows(order)
    assert torch.equal(picked.dequantize(), fused.dequantize()[order])
    x = torch.randn(300, 64, generator=g)
    plain = QuantWeight(fused.raw, QuantType.Q8_0, 64, kernels=None)  # the torch reference
    w = dequantize(fused.raw, QuantType.Q8_0, 64)
    assert torch.equal(plain.linear(x[:2]), F.linear(x[:2], w))
    assert torch.equal(plain.linear(x), F.linear(x, w))
    assert torch.equal(plain.dequantize(), w)


def _guarded(data: torch.Tensor) -> tuple[torch.Tensor, mmap.mmap]:
    """``data``'s bytes ending exactly at an unreadable page: a read past them faults."""
    page = mmap.PAGESIZE
    size = data.numel()
    pages = -(-size // page) + 1
    buf = mmap.mmap(-1, pages * page, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(base + (pages - 1) * page, page, 0) == 0  # PROT_NONE
    arr = np.frombuffer(buf, dtype=np.uint8, count=size, offset=(pages - 1) * page - size)
    tensor = torch.from_numpy(arr).view(data.shape)
    tensor.copy_(data)
    return tensor, buf


@pytest.mark.skipif(platform.system() != "Linux", reason="mprotect guard page")
def test_no_read_past_the_weights(kernels: QuantKernels) -> None:
    g = torch.Generator().manual_seed(8)
    for qtype in TYPES:
        for n, k in ((5, 96), (1, 32), (4, 64)):
            raw = quantize(torch.randn(n, k, generator=g), qtype)
            guarded, _keep = _guarded(raw)
            weight = QuantWeight(guarded, qtype, k, kernels)
            assert weight.raw.data_ptr() == guarded.data_ptr()
            x = torch.randn(9, k, generator=g)
            assert torch.equal(weight.linear(x), kernels.linear(raw, qtype, k, x, None))
            assert torch.equal(weight.dequantize(), dequantize(raw, qtype, k))


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# The other builds of the kernel, where this CPU can run them (-O1: they are checked, not timed).
VARIANTS = {
    "avx2": (("-march=x86-64-v3",), {"avx2", "fma", "f16c", "bmi2"}),
    "avx2-vnni": (("-march=x86-64-v3", "-mavx512vnni", "-mavx512vl"),
                  {"avx2", "fma", "f16c", "bmi2", "avx512_vnni", "avx512vl"}),
    "portable": (("-march=x86-64-v2",), {"sse4_2", "popcnt"}),
}  # fmt: skip


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
def _tiled(
    kernels: QuantKernels,
    raw: torch.Tensor,
    qtype: QuantType,
    k: int,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    wide: bool = False,
) -> torch.Tensor:
    """``QuantKernels.linear``'s arguments through the tiled kernel of ``kernels`` (``wide``:
    x in two bytes a value)."""
    tiles = kernels.pack_tiles(raw, qtype, k)
    return kernels.linear_tiles(tiles, qtype, raw.shape[0], k, x, bias, wide)


@pytest.mark.parametrize("isa", list(VARIANTS))
def test_other_builds(isa: str) -> None:
    march, needs = VARIANTS[isa]
    if platform.machine() != "x86_64" or not needs <= _cpu_flags():
        pytest.skip(f"this CPU cannot run the {isa} build")
    flags = tuple(f for f in FLAGS if f not in ("-O3", "-march=native")) + ("-O1", *march)
    built = load_library(SOURCE, flags, None, fallback="nothing (a test build)")
    tiles = load_library(TILES_SOURCE, flags, None, fallback="nothing (a test build)")
    variant = QuantKernels(*built_or_skip(built, "the native build"), tiles)
    assert variant.isa == isa
    # AVX2 builds tile every type (bit for bit as AVX-512 VNNI's tiles); portable C keeps rows
    assert tiles is not None
    tiled = isa.startswith("avx2")
    assert variant.tiles_isa == ("avx2" if tiled else "none")
    assert QuantWeight(quantize(torch.randn(3, 64), QuantType.Q8_0), QuantType.Q8_0, 64,
                       variant).tile() == tiled  # fmt: skip
    native = load_quant_kernels()
    for qtype in TYPES if tiled else []:
        raw = quantize(torch.randn(577, 576, generator=torch.Generator().manual_seed(2)), qtype)
        weight = QuantWeight(raw.clone(), qtype, 576, variant)
        assert weight.tile()
        x = torch.randn(19, 576)
        got = weight.linear(x)
        _check_int8(partial(_tiled, variant), qtype, 66, 576, [1, 2, 9, 17])
        _check_int8(partial(_tiled, variant, wide=True), qtype, 66, 576, [1, 17], 127 * 256)
        if native is not None and native.tiles_isa == "avx512-vnni":
            assert torch.equal(got, _tiled(native, raw, qtype, 576, x, None))
            assert torch.equal(_tiled(variant, raw, qtype, 576, x, None, wide=True),
                               _tiled(native, raw, qtype, 576, x, None, wide=True))  # fmt: skip
    for qtype in TYPES:
        for n, k in ((7, 64), (66, 576)):
            _check_int8(variant.linear, qtype, n, k, [1, 2, 9, 17])
            _check_f32(variant, qtype, n, k, [1, 2, 5, 9])
        raw = _random_blocks(9, 64, qtype, torch.Generator().manual_seed(1))
        want = gguf_dequantize(raw.numpy(), _gguf_type(qtype))
        _same_bits(QuantWeight(raw, qtype, 64, variant).dequantize(), want)
    _check_non_finite(variant.linear)
