"""The elementwise C kernels (kernels/cpu/layer_ops.py) against their torch references,
swept over shapes, fp32 and bf16: RMSNorm and the residual add round where transformers does
(equal to torch up to one rounding from the fp32 sum of squares' order; the add exactly torch's),
SiLU * up within a rounding of the exact value (bf16: where torch's op-by-op chain may be two
away; fp32: a few ulp, e^-g being ~2 ulp); bf16 RoPE within a rounding of fp32; what the kernels
refuse. The runner with them: test_model_runner.py's bf16 test and the packed GGUF engines
(tests/models/test_gguf.py); agreement with HF bf16: loadtest/engine/bf16_agreement.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu.layer_ops import MIN_PART_ELEMS, LayerKernels, load_layer_ops, parts
from shared.runtime.model import apply_rope, rms_norm, rope_tables
from tests.runtime.helpers import built_or_skip, torch_threads

# One rounding, relative: 8 bits of mantissa (bf16), 24 (fp32).
STEP = {torch.bfloat16: 2**-7, torch.float32: 2**-23}
DTYPES = list(STEP)


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> LayerKernels:
    return built_or_skip(load_layer_ops(tmp_path_factory.mktemp("kernels")), "torch's ops")


def _close(got: torch.Tensor, want: torch.Tensor, steps: float) -> None:
    """Within ``steps`` roundings of ``want``'s dtype, relative to its magnitude (with a floor
    for values near 0)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.double(), want.double()
    floor = 1e-2 if want.dtype == torch.bfloat16 else 1e-30
    bound = steps * STEP[want.dtype] * (w.abs() + floor)
    assert bool(((g - w).abs() <= bound).all()), float(((g - w).abs() / bound).max())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "cols"), [(1, 896), (16, 576), (37, 64), (5, 7), (3, 4864)])
def test_rms_norm_and_the_fused_residual_add(
    kernels: LayerKernels, dtype: torch.dtype, rows: int, cols: int
) -> None:
    g = torch.Generator().manual_seed(rows * cols)
    hidden = (torch.randn(rows, cols, generator=g) * 5).to(dtype)
    delta = torch.randn(rows, cols, generator=g).to(dtype)
    weight = torch.randn(cols, generator=g).to(dtype)
    # fp32: the sum of squares in another order (a few ulp of it, halved by the square root),
    # then x * r and w * that rounded as torch rounds them
    steps = 1 if dtype == torch.bfloat16 else 16
    _close(kernels.rms_norm(hidden, weight, 1e-6), rms_norm(hidden, weight, 1e-6), steps)
    strided = torch.cat([hidden, hidden], dim=1)[:, :cols]  # rows a stride apart
    _close(kernels.rms_norm(strided, weight, 1e-6), rms_norm(hidden, weight, 1e-6), steps)
    want_hidden = hidden + delta
    want = rms_norm(want_hidden, weight, 1e-6)
    out = kernels.add_rms_norm(hidden, delta, weight, 1e-6)
    assert torch.equal(hidden, want_hidden)  # the add, in place, is torch's exactly
    _close(out, want, steps)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "inter"), [(1, 4864), (16, 1536), (7, 40), (3, 7), (2, 1)])
def test_silu_mul_within_a_rounding_of_exact(
    kernels: LayerKernels, dtype: torch.dtype, rows: int, inter: int
) -> None:
    g = torch.Generator().manual_seed(rows + inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 6).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    exact = (F.silu(gate.double()) * up.double()).to(dtype)
    out = kernels.silu_mul(gate_up)
    if dtype == torch.bfloat16:
        _close(out, exact, 1.01)
        _close(out, F.silu(gate) * up, 2.01)  # torch's bf16 chain rounds twice
    else:
        _close(out, exact, 8)  # e^-g to ~2 ulp, then 1 + e, g / it, * u
        _close(out, F.silu(gate) * up, 12)
    wide = torch.cat([gate_up, gate_up], dim=1)[:, : 2 * inter]  # rows a stride apart
    assert torch.equal(kernels.silu_mul(wide), out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_special_values(kernels: LayerKernels, dtype: torch.dtype) -> None:
    inf, nan = float("inf"), float("nan")
    gate = torch.tensor([inf, -200.0, 200.0, nan, 0.0, -88.5, -100.0])
    gate_up = torch.cat([gate, torch.full_like(gate, 2.0)])[None].to(dtype)
    out = kernels.silu_mul(gate_up).float()[0]
    assert out[0] == inf and out[2] == 400.0 and out[4] == 0.0 and out[3].isnan()
    assert all(abs(float(v)) < 1e-30 for v in (out[1], out[5], out[6]))


@pytest.mark.parametrize(("num_heads", "head_dim"), [(16, 64), (3, 128), (5, 6)])
def test_bf16_rope_within_a_rounding_of_fp32(
    kernels: LayerKernels, num_heads: int, head_dim: int
) -> None:
    num_tokens = 37
    g = torch.Generator().manual_seed(head_dim)
    fused = (torch.randn(num_tokens, (num_heads + 2) * head_dim, generator=g) * 4).bfloat16()
    qk = fused[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos, sin = rope_tables(torch.randint(0, 4000, (num_tokens,), generator=g), inv_freq,
                           torch.bfloat16)  # fmt: skip
    exact = apply_rope(qk.float(), cos.float(), sin.float())
    rest = fused[:, num_heads * head_dim :].clone()
    assert kernels.rotate(qk, cos, sin)
    # Relative to the row's scale: x*cos + x'*sin cancels, so bound by |x| + |x'|, not the sum.
    err = (qk.float() - exact).abs()
    assert float(err.max()) <= 4 * STEP[torch.bfloat16] * float(exact.abs().max())
    assert torch.equal(fused[:, num_heads * head_dim :], rest)


def test_refuses_what_it_does_not_take(kernels: LayerKernels) -> None:
    x = torch.randn(4, 8)
    with pytest.raises(ValueError):
        kernels.rms_norm(x.double(), torch.ones(8).double(), 1e-6)  # fp64
    with pytest.raises(ValueError):
        kernels.rms_norm(x, torch.ones(8).bfloat16(), 1e-6)  # the weight's dtype differs
    with pytest.raises(ValueError):
        kernels.add_rms_norm(x, x.bfloat16(), torch.ones(8), 1e-6)
    with pytest.raises(ValueError):
        kernels.silu_mul(torch.randn(4, 7).bfloat16())  # odd width
    with pytest.raises(ValueError):
        kernels.silu_mul(torch.randn(4, 8).half())
    cos = torch.ones(4, 1, 8, dtype=torch.bfloat16)
    assert not kernels.rotate(x.view(4, 1, 8), cos, cos)  # fp32: kernels/cpu/rope.py serves
    assert not kernels.rotate(x.bfloat16().view(4, 1, 8), cos, cos.float())  # fp32 tables


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_call_split_across_threads_gives_the_same_bits(
    kernels: LayerKernels, dtype: torch.dtype
) -> None:
    """Each call splits its rows on torch's threads (``parts``): every row is computed the same
    way whichever thread takes it, so one thread and four give the same bits."""
    g = torch.Generator().manual_seed(7)
    rows, hidden_size, inter, heads, head_dim = 67, 896, 4864, 14, 64
    x = torch.randn(rows, hidden_size, generator=g).to(dtype)
    delta = torch.randn(rows, hidden_size, generator=g).to(dtype)
    weight = torch.randn(hidden_size, generator=g).to(dtype)
    gate_up = torch.randn(rows, 2 * inter, generator=g).to(dtype)
    q = torch.randn(rows, heads, head_dim, generator=g).bfloat16()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos, sin = rope_tables(torch.arange(rows), inv_freq, torch.bfloat16)

    def run() -> list[torch.Tensor]:
        h, qr = x.clone(), q.clone()
        normed = kernels.add_rms_norm(h, delta, weight, 1e-6)
        assert kernels.rotate(qr, cos, sin)
        return [kernels.rms_norm(x, weight, 1e-6), normed, h, kernels.silu_mul(gate_up), qr]

    with torch_threads(1):
        assert parts(rows * inter) == 1
        one = run()
    with torch_threads(4):
        assert parts(rows * inter) == 4 and parts(MIN_PART_ELEMS - 1) == 1
        four = run()
    for a, b in zip(one, four, strict=True):
        assert torch.equal(a, b)
