"""GGUF weights regrouped into tiles of 16 rows (kernels/cpu/csrc/quant_tiles.c) and their
int8 kernel: the layout against a torch reference of it, byte for byte; the round trip back to
rows; the dequantize of a tiled weight bit for bit with gguf-py's; the kernel within the int8
rounding bound of ``x @ dequantize(W).T`` (test_quant_linear.py's), equal to the row layout's
kernel up to the fp32 sums' order, and the same bits whatever the threads, batch or tile; a tiled
QuantWeight serving every method as before. Where the build has no tiled kernel (portable C, no
AVX2) weights keep their rows: checked in test_quant_linear.py's test_other_builds, which also
checks the AVX2 build's tiles bit for bit against the AVX-512 VNNI build's."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import quant_linear as cpu_quant_linear
from kernels.cpu.quant_formats import BLOCK, QuantType, block_bytes, dequantize, quantize
from kernels.cpu.quant_linear import QuantKernels, QuantWeight, load_quant_kernels
from tests.runtime.helpers import built_or_skip
from tests.runtime.test_quant_linear import (
    ROWS,
    TYPES,
    Linear,
    _check_bits_never_change,
    _check_int8,
    _check_non_finite,
    _random_blocks,
    _seeded_weight,
    _tiled,
)

TR = 16  # rows a tile holds


@pytest.fixture(scope="module")
def kernels() -> QuantKernels:
    k = built_or_skip(load_quant_kernels(), "torch's dequantize + F.linear")
    if k.tile_rows == 0:
        pytest.skip(f"this build ({k.tiles_isa}) has no tiled kernel: weights keep their rows")
    assert k.tile_rows == TR
    return k


def _tiles_reference(raw: torch.Tensor, qtype: QuantType, k: int) -> torch.Tensor:
    """The tiled layout in torch (the C file's comment): per group of 16 rows and block, the
    16 d (and 16 m), then the quants in chunks of 4 bytes a row, Q8_0's top bits flipped; rows
    padded with zero bytes."""
    n, nb, bb = raw.shape[0], k // BLOCK, block_bytes(qtype)
    head = 4 if qtype == QuantType.Q4_1 else 2
    groups = -(-n // TR)
    blocks = torch.zeros(groups * TR, nb, bb, dtype=torch.uint8)
    blocks[:n] = raw.view(n, nb, bb)
    if qtype == QuantType.Q8_0:
        blocks[:n, :, head:] ^= 0x80
    blocks = blocks.view(groups, TR, nb, bb).transpose(1, 2)  # [group, block, lane, byte]
    scales = blocks[..., :head].reshape(groups, nb, TR, head // 2, 2).transpose(2, 3)
    quants = blocks[..., head:]
    chunks = quants.reshape(groups, nb, TR, -1, 4).transpose(2, 3)  # [.., chunk, lane, 4]
    tile = torch.cat([scales.reshape(groups, nb, -1), chunks.reshape(groups, nb, -1)], dim=2)
    return tile.reshape(groups * TR, nb * bb)


def _tiled_linear(kernels: QuantKernels) -> Linear:
    """QuantKernels.linear's arguments, run by the tiled kernel."""
    return partial(_tiled, kernels)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("n", "k"), [(1, 32), (7, 64), (16, 96), (33, 576), (577, 1536)])
def test_layout_round_trip_and_dequantize(
    kernels: QuantKernels, qtype: QuantType, n: int, k: int
) -> None:
    g = torch.Generator().manual_seed(n * 31 + k + int(qtype))
    raw = _random_blocks(n, k, qtype, g)
    tiles = kernels.pack_tiles(raw, qtype, k)
    assert tiles.shape == (-(-n // TR) * TR, raw.shape[1])
    assert torch.equal(tiles, _tiles_reference(raw, qtype, k))
    assert torch.equal(kernels.unpack_tiles(tiles, qtype, k, n, None), raw)
    ids = torch.randint(0, n, (5,), generator=g)
    assert torch.equal(kernels.unpack_tiles(tiles, qtype, k, n, ids), raw[ids])
    want = dequantize(raw, qtype, k)
    out = torch.empty(n, k)
    kernels.dequantize_tiles(tiles, qtype, k, out, n, None)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))  # bits: NaN, -0.0 too
    picked = torch.empty(5, k)
    kernels.dequantize_tiles(tiles, qtype, k, picked, n, ids)
    assert torch.equal(picked.view(torch.int32), want[ids].view(torch.int32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("k", [32, 64, 576, 1536])
def test_int8_kernel_within_its_rounding_bound(
    kernels: QuantKernels, qtype: QuantType, k: int
) -> None:
    linear = _tiled_linear(kernels)
    for n in (1, 7, 16, 64, 192, 577):
        _check_int8(linear, qtype, n, k, ROWS if n in (7, 577) else [1, 8, 17])


def test_non_finite_x(kernels: QuantKernels) -> None:
    _check_non_finite(_tiled_linear(kernels))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_row_layouts_kernel_up_to_summation_order(
    kernels: QuantKernels, qtype: QuantType
) -> None:
    """The same rounding of x, the same integer dots: only the fp32 sums' order differs."""
    g, raw = _seeded_weight(40 + int(qtype), 200, 576, qtype)
    x = torch.randn(19, 576, generator=g)
    tiled = _tiled_linear(kernels)(raw, qtype, 576, x, None)
    rows = kernels.linear(raw, qtype, 576, x, None)
    w = dequantize(raw, qtype, 576)
    tol = 1e-5 * (x.abs() @ w.abs().T)
    assert bool(((tiled - rows).abs() <= tol).all())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_wide_kernel_on_amx_is_vpdpbusds_bit_for_bit(
    kernels: QuantKernels, qtype: QuantType
) -> None:
    """From 16 rows the wide kernel runs on AMX's int8 tiles where the CPU grants them
    (kernels/cpu/csrc/quant_tiles_amx.h): the same integer dots, the same float steps in the
    same order, so the same bits as vpdpbusd's, whatever the rows (a partial last tile), the
    groups (a partial last group), a bias or x's row stride."""
    if kernels.wide_isa != "amx-int8":
        pytest.skip(f"the wide kernel runs on {kernels.wide_isa} here")
    g = torch.Generator().manual_seed(int(qtype))
    for n, k, m in ((16, 32, 16), (33, 64, 17), (100, 576, 48), (577, 1536, 131)):
        raw = quantize(torch.randn(n, k, generator=g) * 0.05, qtype)
        tiles = kernels.pack_tiles(raw, qtype, k)
        x = torch.randn(m, 2 * k, generator=g)[:, :k]  # rows 2k apart
        b = torch.randn(n, generator=g)
        for bias in (None, b):
            amx = kernels.linear_tiles(tiles, qtype, n, k, x, bias, wide=True)
            vnni = kernels.linear_tiles(tiles, qtype, n, k, x, bias, wide=True, amx=False)
            assert torch.equal(amx, vnni), (qtype.name, n, k, m)


def test_threads_batches_and_tiles_never_change_a_bit(kernels: QuantKernels) -> None:
    def tiled(raw: torch.Tensor, qtype: QuantType) -> QuantWeight:
        weight = QuantWeight(raw, qtype, 576, kernels)
        padded = (raw.shape[0] + TR - 1) // TR * TR  # 577 rows: 592
        assert weight.tile() and weight.tiled and weight.raw.shape[0] == padded
        return weight

    _check_bits_never_change(tiled)


def test_a_tiled_weight_serves_every_method(kernels: QuantKernels) -> None:
    g, raw = _seeded_weight(9, 50, 96, QuantType.Q4_1)
    plain = QuantWeight(raw, QuantType.Q4_1, 96, kernels)
    weight = QuantWeight(raw.clone(), QuantType.Q4_1, 96, kernels)
    assert weight.tile() and weight.tile()  # once; again is a no-op
    assert weight.nbytes == 64 * raw.shape[1] and "tiled" in repr(weight)
    w = dequantize(raw, QuantType.Q4_1, 96)
    assert torch.equal(weight.dequantize(), w)
    ids = torch.tensor([[3, 49], [0, 3]])
    assert torch.equal(weight.rows(ids), w[ids])
    with pytest.raises(IndexError):
        weight.rows(torch.tensor([50]))
    order = torch.tensor([7, 0, 33])
    picked = weight.select_rows(order)
    assert not picked.tiled and torch.equal(picked.raw, raw[order])
    fused = QuantWeight.cat([weight, plain])
    assert not fused.tiled and torch.equal(fused.raw, torch.cat([raw, raw]))
    x = torch.randn(6, 96, generator=g)
    bias = torch.randn(50, generator=g)
    assert torch.equal(weight.linear(x, bias), kernels.linear_tiles(weight.raw, QuantType.Q4_1,
                                                                    50, 96, x, bias))  # fmt: skip
    xb = torch.randn(6, 2 * 96, generator=g).bfloat16()[:, :96]  # bf16 rows 2k apart
    want = kernels.linear_tiles(weight.raw, QuantType.Q4_1, 50, 96, xb.float(), bias).bfloat16()
    assert torch.equal(weight.linear(xb, bias), want)  # the io16 entry: the fp32 call's bits
    many = torch.randn(cpu_quant_linear.INT8_MAX_ROWS + 1, 96, generator=g)
    assert torch.equal(weight.linear(many, bias), F.linear(many, w, bias))  # dequantize + SGEMM
    weight.small_mode = "f32"  # no fp32 kernel over tiles: dequantize + SGEMM, exact
    assert torch.equal(weight.linear(x), F.linear(x, w))
    assert not QuantWeight(raw, QuantType.Q4_1, 96, kernels=None).tile()  # the torch reference


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_bf16_rows_in_and_out_are_the_fp32_call_rounded(
    kernels: QuantKernels, qtype: QuantType
) -> None:
    """A bf16 model's decode program calls the small kernels with bf16 x and y
    (:meth:`QuantKernels.io16_twin`): the bits of widening x, the fp32 call and torch's rounding
    of its y, whatever the rows (across AMX's bf16_rows where it has them), a bias, x's row
    stride or the threads, with non-finite values kept."""
    g = torch.Generator().manual_seed(int(qtype) + 23)
    n, k = 100, 576
    tiles = kernels.pack_tiles(quantize(torch.randn(n, k, generator=g) * 0.05, qtype), qtype, k)
    for fn in (kernels._tiles_linear, kernels._tiles_linear_amx_bf16):
        io16 = kernels.io16_twin(fn)
        assert io16 is not None
        given = torch.randn(n, generator=g)
        for m, bias, parts in ((1, None, 1), (16, given, 2), (33, given, 2), (64, None, 2)):
            x = torch.randn(m, 2 * k, generator=g).bfloat16()[:, :k]  # rows 2k apart
            x[0, 5] = float("inf")
            b = None if bias is None else bias.data_ptr()
            y32 = torch.empty(m, n)
            x32 = x.float()
            assert fn(tiles.data_ptr(), int(qtype), n, k, x32.data_ptr(), m, k, b,
                      y32.data_ptr(), parts) == 0  # fmt: skip
            y = torch.empty(m, n, dtype=torch.bfloat16)
            assert io16(tiles.data_ptr(), int(qtype), n, k, x.data_ptr(), m, x.stride(0), b,
                        y.data_ptr(), parts) == 0  # fmt: skip
            want = y32.bfloat16()
            assert torch.equal(y.isnan(), want.isnan()), (qtype.name, m)
            assert torch.equal(y.nan_to_num(0.0), want.nan_to_num(0.0)), (qtype.name, m)
    assert kernels.io16_twin(kernels._tiles_linear_wide) is None
