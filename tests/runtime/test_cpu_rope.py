"""The C RoPE (kernels/cpu/rope.py): bit-identical to the model's torch form over head
sizes, positions and strided rows (views of a fused projection), in place; what it refuses."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu.rope import RopeKernel, load_rope
from shared.runtime.model import apply_rope, rope_tables
from tests.runtime.helpers import built_or_skip


@pytest.fixture(scope="module")
def rope(tmp_path_factory: pytest.TempPathFactory) -> RopeKernel:
    return built_or_skip(load_rope(tmp_path_factory.mktemp("kernels")), "torch's RoPE")


def _inv_freq(head_dim: int) -> torch.Tensor:
    return 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


@pytest.mark.parametrize(("num_heads", "head_dim"), [(12, 32), (6, 16), (3, 64), (2, 128), (5, 6)])
def test_bit_identical_to_the_torch_form_in_place(
    rope: RopeKernel, num_heads: int, head_dim: int
) -> None:
    num_tokens = 37
    g = torch.Generator().manual_seed(head_dim)
    fused = torch.randn(num_tokens, (num_heads + 3) * head_dim, generator=g) * 10
    qk = fused[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)  # strided rows
    positions = torch.randint(0, 4000, (num_tokens,), generator=g)
    cos, sin = rope_tables(positions, _inv_freq(head_dim), torch.float32)
    expected = apply_rope(qk, cos, sin)
    rest = fused[:, num_heads * head_dim :].clone()
    assert rope.takes(qk, cos, sin)
    out = rope(qk, cos, sin)
    assert out.data_ptr() == qk.data_ptr()  # in place
    assert torch.equal(out, expected)
    assert torch.equal(fused[:, num_heads * head_dim :], rest)  # the rest of the row untouched


def test_what_it_refuses(rope: RopeKernel) -> None:
    cos, sin = rope_tables(torch.arange(4), _inv_freq(32), torch.float32)
    x = torch.randn(4, 2, 32)
    assert not rope.takes(x.double(), cos, sin)
    assert not rope.takes(x.transpose(0, 1).contiguous().transpose(0, 1), cos, sin)
    assert not rope.takes(x[:3], cos, sin)  # one table row per token
    assert not rope.takes(
        torch.randn(4, 2, 1024), *rope_tables(torch.arange(4), _inv_freq(1024), torch.float32)
    )
    with pytest.raises(ValueError, match="not in place"):
        rope(x.double(), cos, sin)
