"""Projection weights on CPU (shared/runtime/linear_layout.py): transposed, packed for MKL where
torch has it, and the packed form used from PACKED_MIN_ROWS rows; MKL's packed GEMM
(shared/native/mkl_pack.py) against ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shared.native import mkl_pack
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
