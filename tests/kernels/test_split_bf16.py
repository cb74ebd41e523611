"""The split-bf16 linear (kernels/cpu/split_bf16.py, kernels/cpu/csrc/split_bf16.c): x and w
each split into two bf16s, three AMX tile products a chunk, summed in fp32.

Swept over shapes against :func:`split_bf16.reference` (the same three products in torch):
within fp32 summation order of it per output. Against the float64 product its error must sit
near the split's (~1e-5 of the outputs' norm): below int16's, and far below what a dropped term
(bf16 x: ~2e-3) or a misplaced pair would give. The bits do not depend on the threads. A
QuantWeight whose many_rows is "split" runs it above small_max_rows. Skipped where the CPU has
no AMX (the other arithmetics serve there)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import split_bf16
from kernels.cpu.quant_formats import QuantType, dequantize, quantize
from kernels.cpu.quant_linear import QuantWeight

pytestmark = pytest.mark.skipif(not split_bf16.available(), reason="needs AMX-BF16")


def _relative(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> float:
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    return float((y.double() - exact).norm() / exact.norm())


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 16, 32), (5, 7, 64), (16, 16, 32), (31, 33, 96), (32, 32, 576), (67, 100, 160),
     (300, 577, 96), (513, 64, 1536)],
)  # fmt: skip
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_is_the_reference_up_to_summation_order(
    m: int, n: int, k: int, bias: bool
) -> None:
    g = torch.Generator().manual_seed(m * 7 + n + k)
    x = torch.randn(m, k, generator=g) * 3
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g) if bias else None
    y = split_bf16.linear(x, split_bf16.pack(w), n, b)
    ref = split_bf16.reference(x, w, b)
    # fp32 sums of k products in another order: k * 2^-24 of |x| . |w| at most
    bound = k * 2.0**-24 * (x.abs() @ w.abs().T) + 1e-6 * (0 if b is None else b.abs())
    assert ((y - ref).abs() <= bound + 1e-30).all()
    rel = _relative(y, x, w, b)
    assert rel < 2e-5, rel  # bf16 x alone: ~2e-3
    assert rel > _relative(F.linear(x, w, b), x, w, b)  # fp32 SGEMM is closer still


def test_rows_a_stride_apart_and_threads_never_change_a_bit() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(100, 256, generator=g)
    w = torch.randn(48, 128, generator=g)
    packed = split_bf16.pack(w)
    strided = x[:, :128]  # rows 256 floats apart
    want = split_bf16.linear(strided.contiguous(), packed, 48)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert torch.equal(split_bf16.linear(strided, packed, 48), want)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(split_bf16.linear(x[:37, :128], packed, 48), want[:37])


def test_bad_arguments_are_refused() -> None:
    w = torch.randn(16, 48)
    with pytest.raises(ValueError, match="32"):
        split_bf16.pack(w)
    packed = split_bf16.pack(torch.randn(16, 64))
    with pytest.raises(ValueError):
        split_bf16.linear(torch.randn(2, 64).double(), packed, 16)
    with pytest.raises(ValueError):
        split_bf16.linear(torch.randn(2, 64), packed, 32)  # fewer tiles than 32 rows need
    with pytest.raises(ValueError):
        split_bf16.pack(torch.randn(16, 64), torch.empty(10, dtype=torch.bfloat16))


@pytest.mark.parametrize("qtype", [QuantType.Q4_0, QuantType.Q4_1, QuantType.Q8_0],
                         ids=lambda t: t.name)  # fmt: skip
def test_a_packed_weight_runs_it_above_small_max_rows(qtype: QuantType) -> None:
    g = torch.Generator().manual_seed(int(qtype))
    raw = quantize(torch.randn(100, 576, generator=g) * 0.05, qtype)
    weight = QuantWeight(raw, qtype, 576, small_mode="int16", small_max_rows=63,
                         many_rows="split")  # fmt: skip
    weight.tile()
    dense = dequantize(raw, qtype, 576)
    x = torch.randn(80, 576, generator=g)
    b = torch.randn(100, generator=g)
    want = split_bf16.linear(x, split_bf16.pack(dense), 100, b)
    assert torch.equal(weight.linear(x, b), want)  # dequantized bit for bit, then the kernel
    assert _relative(weight.linear(x[:63], b), x[:63], dense, b) > 1e-5  # int16 below 64 rows
