"""The tiled GGUF linear in a bf16 model's arithmetic on AMX's bf16 tiles
(kernels/cpu/csrc/quant_tiles_bf16.h): ``F.linear`` over x and the dequantized weight each rounded
to bf16, up to the fp32 sums' order, whatever the type, shape, bias or x's row stride; the same
bits whatever the threads or the batch a row sits in; and small_mode "bf16" (the decode engine's
form on AMX) the int8 kernel below ``bf16_rows`` rows and these tiles from it, bit for bit (with
bf16 rows in and out: tests/runtime/test_quant_tiles.py). Where
the CPU or the build has no AMX the kernel refuses and the form is the int8 kernel's
(tests/runtime/test_linear_layout.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu.quant_formats import QuantType, dequantize, quantize
from kernels.cpu.quant_linear import QuantKernels, QuantWeight, load_quant_kernels
from tests.runtime.helpers import built_or_skip, torch_threads
from tests.runtime.test_quant_linear import TYPES


@pytest.fixture(scope="module")
def kernels() -> QuantKernels:
    k = built_or_skip(load_quant_kernels(), "torch's dequantize + F.linear")
    if k.bf16_rows == 0:
        pytest.skip(f"no AMX bf16 tiles here (tiles: {k.tiles_isa})")
    return k


def _bf16_linear(kernels: QuantKernels, tiles: torch.Tensor, qtype: QuantType, n: int, k: int,
                 x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    return kernels.linear_tiles_bf16(tiles, qtype, n, k, x, bias)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_bf16_model_up_to_summation_order(kernels: QuantKernels, qtype: QuantType) -> None:
    """Partial last groups and runs (n not a multiple of 16 or 64), partial x blocks, a bias,
    x's rows 2k apart."""
    g = torch.Generator().manual_seed(int(qtype) + 40)
    for n, k, m in ((16, 32, 1), (33, 64, 17), (100, 576, 48), (577, 1536, 131), (960, 576, 64)):
        raw = quantize(torch.randn(n, k, generator=g) * 0.05, qtype)
        tiles = kernels.pack_tiles(raw, qtype, k)
        x = torch.randn(m, 2 * k, generator=g)[:, :k]
        bias = torch.randn(n, generator=g)
        w = dequantize(raw, qtype, k).bfloat16().double()
        xb = x.bfloat16().double()
        for b in (None, bias):
            got = _bf16_linear(kernels, tiles, qtype, n, k, x, b)
            want = F.linear(xb, w, None if b is None else b.double())
            tol = 1e-5 * (xb.abs() @ w.abs().T) + 1e-30
            assert bool(((got.double() - want).abs() <= tol).all()), (qtype.name, n, k, m)


def test_threads_and_batches_never_change_a_bit(kernels: QuantKernels) -> None:
    g = torch.Generator().manual_seed(5)
    for qtype in TYPES:
        raw = quantize(torch.randn(577, 576, generator=g), qtype)
        tiles = kernels.pack_tiles(raw, qtype, 576)
        x = torch.randn(70, 576, generator=g)
        with torch_threads(1):
            one = _bf16_linear(kernels, tiles, qtype, 577, 576, x, None)
        with torch_threads(2):
            assert torch.equal(_bf16_linear(kernels, tiles, qtype, 577, 576, x, None), one)
            for i, j in ((0, 1), (3, 40), (33, 70)):  # in any x block of any batch
                part = _bf16_linear(kernels, tiles, qtype, 577, 576, x[i:j], None)
                assert torch.equal(part, one[i:j]), (qtype.name, i, j)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_small_mode_bf16_switches_at_bf16_rows(kernels: QuantKernels, qtype: QuantType) -> None:
    g = torch.Generator().manual_seed(int(qtype) + 7)
    raw = quantize(torch.randn(200, 576, generator=g) * 0.05, qtype)
    weight = QuantWeight(raw, qtype, 576, kernels, small_mode="bf16", small_max_rows=1 << 62)
    assert weight.tile()
    rows = kernels.bf16_rows
    for m in (1, rows - 1, rows, 2 * rows + 3):
        x = torch.randn(m, 576, generator=g)
        want = (
            kernels.linear_tiles(weight.raw, qtype, 200, 576, x, None)
            if m < rows
            else _bf16_linear(kernels, weight.raw, qtype, 200, 576, x, None)
        )
        assert torch.equal(weight.linear(x), want), m
