"""The dense tile kernels (kernels/cpu/dense_tiles.py) against their torch reference, over the
shapes and row counts that take each of the kernel's paths (several tiles at once, one tile
against blocks of rows, a last group of fewer than 16 rows), and the layout round trip."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import dense_tiles
from kernels.cpu.dense_tiles import DenseTileWeight, load_dense_tile_kernels, reference
from shared.config import BatonConfig
from shared.runtime.linear_layout import decode_tiles, prepare_projections
from shared.runtime.model import Projection
from shared.runtime.model_runner import ModelRunner
from tests.runtime.helpers import tiny_model_dir

SHAPES = [(960, 576), (576, 1536), (33, 200), (40, 64), (7, 6), (1, 2)]
ROWS = [1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 33, 64]


def needs(dtype: torch.dtype) -> None:
    if not dense_tiles.available(dtype):
        pytest.skip(f"no {dtype} tile kernel in this build (the other forms serve)")


def case(shape: tuple[int, int], rows: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 1000 + rows)
    n, k = shape
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(rows, k, generator=g).to(dtype)
    return w, bias, x


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_tiles_compute_f_linear(shape: tuple[int, int], rows: int) -> None:
    needs(torch.float32)
    w, bias, x = case(shape, rows, torch.float32)
    tiled = DenseTileWeight(w)
    want = reference(x, w, bias)
    torch.testing.assert_close(tiled.linear(x, bias), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tiled.linear(x), want - bias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_tiles_compute_f_linear(shape: tuple[int, int], rows: int) -> None:
    needs(torch.bfloat16)
    w, bias, x = case(shape, rows, torch.bfloat16)
    tiled = DenseTileWeight(w)
    # fp32 sums of exact products, one rounding to bf16: within one bf16 ulp of the reference.
    want = reference(x, w, bias).float()
    got = tiled.linear(x, bias).float()
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_computes_the_same_in_any_batch(dtype: torch.dtype) -> None:
    """One FMA chain per output: a row's bits do not depend on how many rows came with it (the
    kernel's paths differ by batch size: several tiles at once, blocks of 16)."""
    needs(dtype)
    w, bias, x = case((200, 96), 40, dtype, seed=3)
    tiled = DenseTileWeight(w)
    whole = tiled.linear(x, bias)
    for rows in (1, 2, 3, 5, 16, 17, 33):
        assert torch.equal(tiled.linear(x[:rows], bias), whole[:rows]), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiles_round_trip(dtype: torch.dtype) -> None:
    needs(dtype)
    w = torch.randn(37, 10).to(dtype)
    tiled = DenseTileWeight(w)
    assert tiled.tiles.shape == (48, 10)  # rows padded to a multiple of 16
    assert torch.equal(tiled.weight(), w)
    kernels = load_dense_tile_kernels()
    assert kernels is not None
    ids = torch.tensor([36, 0, 17, 17])
    assert torch.equal(kernels.rows(tiled.tiles, ids, 0), w[ids])
    assert torch.equal(tiled.rows(ids.view(2, 2)), w[ids].view(2, 2, 10))
    with pytest.raises(IndexError):
        tiled.rows(torch.tensor([37]))


def test_bad_input_is_refused() -> None:
    needs(torch.float32)
    tiled = DenseTileWeight(torch.randn(8, 4))
    with pytest.raises(ValueError):
        tiled.linear(torch.randn(2, 5))
    with pytest.raises(ValueError):
        tiled.linear(torch.randn(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError):
        tiled.linear(torch.randn(2, 4), torch.randn(7))
    with pytest.raises(ValueError):
        DenseTileWeight(torch.randn(8, 4, dtype=torch.float64))
    if dense_tiles.available(torch.bfloat16):
        with pytest.raises(ValueError):
            DenseTileWeight(torch.randn(8, 5).bfloat16())  # pairs along k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_engine_holds_tiles_alone(dtype: torch.dtype) -> None:
    """decode's role: the tiled form serves every row count and the plain weight is dropped
    (one copy per engine); prefill's keeps its transposed weight."""
    w = torch.randn(24, 16).to(dtype)
    decode, prefill = Projection(16, 24, bias=True).to(dtype), Projection(16, 24).to(dtype)
    for proj in (decode, prefill):
        with torch.no_grad():
            proj.weight.copy_(w)
            if proj.bias is not None:
                proj.bias.normal_()
    prepare_projections(decode, role="decode")
    prepare_projections(prefill, role="prefill")
    assert not isinstance(prefill.packed, DenseTileWeight)
    if not decode_tiles(w):
        assert not isinstance(decode.packed, DenseTileWeight)
        return
    assert isinstance(decode.packed, DenseTileWeight) and decode.weight.is_meta
    x = torch.randn(3, 16).to(dtype)
    assert decode.bias is not None
    torch.testing.assert_close(
        decode.project(x).float(), reference(x, w, decode.bias).float(), rtol=1e-2, atol=1e-2
    )


def test_a_tied_head_in_tiles_serves_the_embedding() -> None:
    """The decode engine holds a tied vocabulary once (tiny qwen3 ties its head): the head's
    tiles answer the embedding's lookups, with the embedding's values."""
    needs(torch.float32)
    model_dir = tiny_model_dir("qwen3")
    decode = ModelRunner(BatonConfig(model=str(model_dir), num_kv_blocks=16), role="decode").model
    plain = ModelRunner(BatonConfig(model=str(model_dir), num_kv_blocks=16)).model
    assert isinstance(decode.lm_head.packed, DenseTileWeight)
    assert decode.embed_packed is decode.lm_head.packed
    assert decode.embed_tokens.weight.is_meta and decode.lm_head.weight.is_meta
    ids = torch.tensor([[0, 7], [5, plain.config.vocab_size - 1]])
    assert torch.equal(decode.embed_packed.rows(ids), plain.embed_tokens.weight[ids])
    assert decode.weight_bytes() < plain.weight_bytes()
