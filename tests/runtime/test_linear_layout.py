"""Projection weights on CPU (shared/runtime/linear_layout.py): transposed, packed for oneDNN or
MKL where torch has it, and each packed form used for its row counts; MKL's packed GEMM
(kernels/cpu/mkl_pack.py) and oneDNN's (kernels/cpu/onednn_pack.py) against ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import mkl_pack, onednn_pack
from shared.runtime.linear_layout import prepare_projections
from shared.runtime.model import PACKED_MIN_ROWS, Projection

needs_mkl = pytest.mark.skipif(not mkl_pack.available(), reason="torch built without MKL")


class Toy(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.up = Projection(8, 16, bias=False)
        self.down = Projection(16, 8, bias=True)
        self.head = Projection(8, 32, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        # Projection leaves its memory as allocated (a loader fills it): values of our own.
        with torch.no_grad():
            for param in self.parameters():
                param.normal_()


class SpyPacked(mkl_pack.PackedWeight):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(weight)
        self.rows: list[int] = []

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return super().linear(x, bias)


@pytest.mark.parametrize("tied", [False, True])
def test_weights_keep_their_values_and_products(tied: bool) -> None:
    torch.manual_seed(0)
    model = Toy(tied)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    xs = {n: torch.randn(n_rows, 8) for n, n_rows in (("few", 1), ("many", 9))}
    h = torch.randn(9, 16)
    want = {k: F.linear(x, model.head.weight) for k, x in xs.items()}
    want_down = F.linear(h, before["down.weight"], before["down.bias"])
    packed = prepare_projections(model)
    assert packed == (3 if mkl_pack.available() else 0)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert model.up.weight.t().is_contiguous() and not model.up.weight.requires_grad
    assert model.embed.weight.is_contiguous()
    assert (model.head.weight is model.embed.weight) == tied
    for k, x in xs.items():
        torch.testing.assert_close(model.head.project(x), want[k], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.down.project(h), want_down, rtol=1e-5, atol=1e-5)


@needs_mkl
def test_the_packed_form_serves_from_packed_min_rows() -> None:
    proj = Projection(8, 16, bias=False)
    prepare_projections(proj)
    spy = SpyPacked(proj.weight)
    proj.packed = spy
    for rows in (1, PACKED_MIN_ROWS - 1, PACKED_MIN_ROWS, 64):
        proj.project(torch.randn(rows, 8))
    proj.project(torch.randn(2, PACKED_MIN_ROWS, 8))  # not 2-D: the plain path
    assert spy.rows == [PACKED_MIN_ROWS, 64]


@needs_mkl
@pytest.mark.parametrize("rows", [0, 1, 3, 16, 64, 300])
@pytest.mark.parametrize("shape", [(512, 256), (4096, 256), (7, 13)])
def test_a_packed_weight_computes_what_f_linear_does(rows: int, shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(shape, generator=g)
    bias = torch.randn(shape[0], generator=g)
    packed = mkl_pack.PackedWeight(w.t().contiguous().t())  # any layout in
    x = torch.randn(rows, shape[1], generator=g)
    torch.testing.assert_close(packed.linear(x), F.linear(x, w), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(packed.linear(x, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-4)
    strided = torch.randn(shape[1], rows, generator=g).t()  # a non-contiguous input
    torch.testing.assert_close(packed.linear(strided), F.linear(strided, w), rtol=1e-5, atol=1e-4)


@needs_mkl
def test_a_packed_weight_refuses_what_it_cannot_compute() -> None:
    packed = mkl_pack.PackedWeight(torch.randn(8, 4))
    with pytest.raises(ValueError):
        packed.linear(torch.randn(2, 5))
    with pytest.raises(ValueError):
        packed.linear(torch.randn(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError):
        mkl_pack.PackedWeight(torch.randn(8, 4, dtype=torch.float64))


needs_onednn = pytest.mark.skipif(
    not onednn_pack.available(torch.float32), reason="torch built without oneDNN"
)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 3, 4, 16, 48, 64, 300])
@pytest.mark.parametrize("shape", [(1152, 896), (896, 4864), (7, 13)])
def test_a_onednn_weight_computes_what_f_linear_does(
    dtype: torch.dtype, rows: int, shape: tuple[int, int]
) -> None:
    if not onednn_pack.available(dtype):
        pytest.skip(f"no native {dtype} in oneDNN on this CPU (the plain path serves)")
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(shape, generator=g) / shape[1] ** 0.5).to(dtype)
    bias = torch.randn(shape[0], generator=g).to(dtype)
    x = torch.randn(rows, shape[1], generator=g).to(dtype)
    packed = onednn_pack.OneDnnWeight(w.t().contiguous().t())  # any layout in
    # fp32: another summation order; bf16: fp32 accumulation, one rounding of the output.
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    want = F.linear(x.float(), w.float(), bias.float())
    torch.testing.assert_close(packed.linear(x, bias).float(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(packed.linear(x).float(), want - bias.float(), rtol=tol, atol=tol)
    with pytest.raises(ValueError):
        packed.linear(torch.randn(2, shape[1] + 1).to(dtype))


@needs_onednn
def test_projections_take_onednn_in_its_row_range() -> None:
    proj = Projection(8, 16, bias=True)
    prepare_projections(proj)
    assert isinstance(proj.packed, onednn_pack.OneDnnWeight)
    lo, hi = onednn_pack.ROWS[torch.float32]
    served: list[int] = []
    linear = proj.packed.linear

    def spy(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        served.append(x.shape[0])
        return linear(x, bias)

    proj.packed.linear = spy  # type: ignore[method-assign]
    for rows in (1, lo - 1, lo, hi, hi + 1, 2048):
        proj.project(torch.randn(rows, 8))
    assert served == [lo, hi]


def test_without_onednn_fp32_packs_for_mkl_and_bf16_stays_plain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A CPU without native bf16 (no avx512_bf16 / AMX) or a torch without oneDNN: no crash,
    MKL's form for fp32 where it exists, F.linear for bf16."""
    onednn_pack.available.cache_clear()
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    try:
        # fp32 large enough that MKL's packed buffer is not much more than the weight (1.15x;
        # 2.2x at 2048 x 1024, 8.7x at 576 x 576: those stay transposed).
        fp32, bf16 = Projection(2048, 16384, bias=False), Projection(8, 16, bias=False).bfloat16()
        small = Projection(8, 16, bias=False)
        for module in (fp32, bf16, small):
            with (
                torch.no_grad()
            ):  # Projection leaves its memory to the loader: NaN compares unequal
                module.weight.normal_()
            prepare_projections(module)
        assert bf16.packed is None and small.packed is None
        assert isinstance(fp32.packed, mkl_pack.PackedWeight) == mkl_pack.available()
        x = torch.randn(5, 8).bfloat16()
        assert torch.equal(bf16.project(x), F.linear(x, bf16.weight))
    finally:
        onednn_pack.available.cache_clear()


def test_the_prefill_engine_keeps_two_byte_x_where_it_gains() -> None:
    """BATON_PACKED_PREFILL=int16 runs where it beats the exact path: AVX-512 VNNI tiles, and
    not for a bf16 model on a CPU with a bf16 GEMM (docs/perf-log.md, "Packed prefill on the
    tiles"); int8 wherever there are tiles; nothing without them."""
    from kernels.cpu.quant_linear import bf16_gemm, load_quant_kernels
    from shared.runtime.linear_layout import prefill_arith

    kernels = load_quant_kernels()
    isa = "none" if kernels is None or kernels.tile_rows == 0 else kernels.tiles_isa
    assert prefill_arith("exact") == "exact"
    assert prefill_arith("int8") == ("exact" if isa == "none" else "int8")
    vnni = isa == "avx512-vnni"
    assert prefill_arith("int16") == ("int16" if vnni else "exact")
    bf16 = "int16" if vnni and not bf16_gemm() else "exact"
    assert prefill_arith("int16", torch.bfloat16) == bf16


def test_auto_takes_the_split_kernel_where_the_cpu_has_amx() -> None:
    """BATON_PACKED_PREFILL=auto (the default): bf16x3 where the split kernel runs (AMX), else
    int16 where it gains, else exact; bf16x3 asked for elsewhere is exact; a bf16 model on a
    CPU with a bf16 GEMM takes its exact path whatever is asked but int8; bf16 needs a bf16
    GEMM."""
    from kernels.cpu import split_bf16
    from kernels.cpu.quant_linear import bf16_gemm, load_quant_kernels
    from shared.config import BatonConfig
    from shared.runtime.linear_layout import prefill_arith

    assert BatonConfig().packed_prefill == "auto"
    kernels = load_quant_kernels()
    isa = "none" if kernels is None or kernels.tile_rows == 0 else kernels.tiles_isa
    split = isa != "none" and split_bf16.available()
    int16 = prefill_arith("int16")
    assert prefill_arith("auto") == ("bf16x3" if split else int16)
    assert prefill_arith("bf16x3") == ("bf16x3" if split else "exact")
    if bf16_gemm():
        for choice in ("auto", "bf16x3", "int16"):
            assert prefill_arith(choice, torch.bfloat16) == "exact"
    # "bf16": the bf16 GEMM where there is one, for an fp32 model (a bf16 model's exact path)
    assert prefill_arith("bf16") == ("bf16" if bf16_gemm() else "exact")
    assert prefill_arith("bf16", torch.bfloat16) == "exact"


def test_the_decode_engine_takes_the_bf16_tiles_where_the_cpu_has_amx() -> None:
    """BATON_PACKED_DECODE=auto (the default): small_mode "bf16" (int8 below the kernels'
    bf16_rows, AMX's bf16 tiles from it) where the CPU has AMX, else int8; "int8" is int8
    everywhere; an unknown choice is refused, by prepare_projections too. Only the decode role
    takes it."""
    from kernels.cpu.quant_formats import QuantType, quantize
    from kernels.cpu.quant_linear import QuantWeight, load_quant_kernels
    from shared.config import BatonConfig
    from shared.runtime.linear_layout import decode_arith, packed_form

    assert BatonConfig().packed_decode == "auto"
    kernels = load_quant_kernels()
    amx = kernels is not None and kernels.bf16_rows > 0
    assert decode_arith("auto") == decode_arith("bf16") == ("bf16" if amx else "int8")
    assert decode_arith("int8") == "int8"
    with pytest.raises(ValueError, match="BATON_PACKED_DECODE"):
        decode_arith("int4")
    with pytest.raises(ValueError, match="BATON_PACKED_DECODE"):
        prepare_projections(nn.Sequential(), packed_decode="int4")
    if kernels is None or kernels.tile_rows == 0:
        return
    raw = quantize(torch.randn(32, 64), QuantType.Q8_0)
    for role, choice, mode in (("decode", "auto", decode_arith("auto")), ("decode", "int8", "int8"),
                               (None, "auto", "int8")):  # fmt: skip
        weight = QuantWeight(raw.clone(), QuantType.Q8_0, 64, kernels)
        packed_form(weight, role, False, decode=decode_arith(choice))
        assert weight.tiled and weight.small_mode == mode, (role, choice)
