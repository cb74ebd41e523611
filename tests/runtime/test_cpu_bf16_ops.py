"""The bf16 C kernels (shared/runtime/cpu_bf16_ops.py) against their torch references, swept
over shapes: RMSNorm and the residual add round where transformers does (equal to torch up to one
bf16 step from the fp32 sum order), SiLU * up and RoPE round once (within a bf16 step of the fp32
value, where torch's op-by-op chain may be two away); what the kernels refuse. The runner with
them: test_model_runner.py's bf16 test; agreement with HF bf16: loadtest/bf16_agreement.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.runtime.cpu_bf16_ops import MIN_PART_ELEMS, Bf16Kernels, load_bf16_ops, parts
from shared.runtime.model import apply_rope, rms_norm, rope_tables
from tests.runtime.helpers import built_or_skip, torch_threads

BF16_STEP = 2**-7  # one bf16 rounding, relative: 8 bits of mantissa


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> Bf16Kernels:
    return built_or_skip(load_bf16_ops(tmp_path_factory.mktemp("kernels")), "torch's bf16 ops")


def _close(got: torch.Tensor, want: torch.Tensor, steps: float) -> None:
    """Within ``steps`` bf16 roundings of ``want``'s magnitude (with a floor for values near 0)."""
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    g, w = got.float(), want.float()
    bound = steps * BF16_STEP * (w.abs() + 1e-2)
    assert bool(((g - w).abs() <= bound).all()), float(((g - w).abs() / bound).max())


@pytest.mark.parametrize(("rows", "cols"), [(1, 896), (16, 896), (37, 64), (5, 7), (3, 4864)])
def test_rms_norm_and_the_fused_residual_add(kernels: Bf16Kernels, rows: int, cols: int) -> None:
    g = torch.Generator().manual_seed(rows * cols)
    hidden = (torch.randn(rows, cols, generator=g) * 5).bfloat16()
    delta = torch.randn(rows, cols, generator=g).bfloat16()
    weight = torch.randn(cols, generator=g).bfloat16()
    _close(kernels.rms_norm(hidden, weight, 1e-6), rms_norm(hidden, weight, 1e-6), 1)
    strided = torch.cat([hidden, hidden], dim=1)[:, :cols]  # rows a stride apart
    _close(kernels.rms_norm(strided, weight, 1e-6), rms_norm(hidden, weight, 1e-6), 1)
    want_hidden = hidden + delta
    want = rms_norm(want_hidden, weight, 1e-6)
    out = kernels.add_rms_norm(hidden, delta, weight, 1e-6)
    assert torch.equal(hidden, want_hidden)  # the add, in place, is torch's exactly
    _close(out, want, 1)


@pytest.mark.parametrize(("rows", "inter"), [(1, 4864), (16, 4864), (7, 40), (3, 7), (2, 1)])
def test_silu_mul_within_a_rounding_of_fp32(kernels: Bf16Kernels, rows: int, inter: int) -> None:
    g = torch.Generator().manual_seed(rows + inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 6).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    exact = (F.silu(gate.float()) * up.float()).bfloat16()
    out = kernels.silu_mul(gate_up)
    _close(out, exact, 1.01)
    _close(out, F.silu(gate) * up, 2.01)  # torch's bf16 chain rounds twice
    wide = torch.cat([gate_up, gate_up], dim=1)[:, : 2 * inter]  # rows a stride apart
    assert torch.equal(kernels.silu_mul(wide), out)


def test_silu_mul_special_values(kernels: Bf16Kernels) -> None:
    inf, nan = float("inf"), float("nan")
    gate = torch.tensor([inf, -200.0, 200.0, nan, 0.0, -88.5])
    gate_up = torch.cat([gate, torch.full_like(gate, 2.0)])[None].bfloat16()
    out = kernels.silu_mul(gate_up).float()[0]
    assert out[0] == inf and out[2] == 400.0 and out[4] == 0.0
    assert out[3].isnan() and abs(float(out[1])) < 1e-30 and abs(float(out[5])) < 1e-30


@pytest.mark.parametrize(("num_heads", "head_dim"), [(16, 64), (3, 128), (5, 6)])
def test_rope_within_a_rounding_of_fp32(
    kernels: Bf16Kernels, num_heads: int, head_dim: int
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
    assert float(err.max()) <= 4 * BF16_STEP * float(exact.abs().max())
    assert torch.equal(fused[:, num_heads * head_dim :], rest)


def test_refuses_what_it_does_not_take(kernels: Bf16Kernels) -> None:
    x = torch.randn(4, 8)
    with pytest.raises(ValueError):
        kernels.rms_norm(x, torch.ones(8), 1e-6)  # fp32
    with pytest.raises(ValueError):
        kernels.silu_mul(torch.randn(4, 7).bfloat16())  # odd width
    cos = torch.ones(4, 1, 8, dtype=torch.bfloat16)
    assert not kernels.rotate(x.view(4, 1, 8), cos, cos)  # fp32: the torch form serves
    assert not kernels.rotate(x.bfloat16().view(4, 1, 8), cos, cos.float())  # fp32 tables


def test_a_call_split_across_threads_gives_the_same_bits(kernels: Bf16Kernels) -> None:
    """Each call splits its rows on torch's threads (``parts``): every row is computed the same
    way whichever thread takes it, so one thread and four give the same bits."""
    g = torch.Generator().manual_seed(7)
    rows, hidden_size, inter, heads, head_dim = 67, 896, 4864, 14, 64
    x = torch.randn(rows, hidden_size, generator=g).bfloat16()
    delta = torch.randn(rows, hidden_size, generator=g).bfloat16()
    weight = torch.randn(hidden_size, generator=g).bfloat16()
    gate_up = torch.randn(rows, 2 * inter, generator=g).bfloat16()
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
