"""The C prefill attention (kernels/cpu/prefill_attention.py) against an fp64 reference
and SDPA, over head sizes (specialised and generic), groups and prompt lengths (one token, a
tile, one past it, several tiles); strided inputs, its thread split, the rows it must leave
alone, its input checks, and the backend's split between it and SDPA; over a bf16 model's rows,
the fp32 kernel on the widened rows, each output rounded once."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import cpu_isa
from kernels.cpu.prefill_attention import FreshPrompts, PrefillKernel, load_prefill_kernel
from shared.runtime.attention import TorchAttentionBackend, select_backend
from tests.runtime.helpers import built_or_skip, torch_threads

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> PrefillKernel:
    loaded = load_prefill_kernel(tmp_path_factory.mktemp("kernels"), max_threads=2)
    return built_or_skip(loaded, "SDPA")


def _qkv(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, seed: int):  # type: ignore[no-untyped-def]
    """Views of one fused projection's output, as the model passes them (strided rows)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g)
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    return (
        qkv[:, :q_end].view(num_tokens, num_heads, head_dim),
        qkv[:, q_end:k_end].view(num_tokens, num_kv_heads, head_dim),
        qkv[:, k_end:].view(num_tokens, num_kv_heads, head_dim),
    )


def _scores(q, k, v, first, end, scale, dtype):  # type: ignore[no-untyped-def]
    """One range's causal scores per query head (repeat_kv order) in ``dtype``, and its values."""
    group = q.shape[1] // k.shape[1]
    qs = q[first:end].to(dtype).transpose(0, 1)
    ks = k[first:end].to(dtype).repeat_interleave(group, 1).transpose(0, 1)
    vs = v[first:end].to(dtype).repeat_interleave(group, 1).transpose(0, 1)
    n = end - first
    scores = qs @ ks.transpose(1, 2) * scale
    return scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")), vs


def reference(q, k, v, ranges, scale):  # type: ignore[no-untyped-def]
    """Causal softmax attention in fp64, one range at a time."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for first, end in ranges:
        scores, vs = _scores(q, k, v, first, end, scale, torch.float64)
        out[first:end] = (scores.softmax(-1) @ vs).transpose(0, 1)
    return out


def _ranges(lens: list[int], gap: int = 0) -> tuple[list[tuple[int, int]], int]:
    ranges, start = [], 0
    for n in lens:
        ranges.append((start, start + n))
        start += n + gap
    return ranges, start


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(8, 4, 32), (4, 4, 16), (8, 2, 64), (4, 1, 128), (2, 2, 48)],  # 48: the generic loop
)
def test_matches_the_reference_over_shapes(
    kernel: PrefillKernel, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    rng = random.Random(head_dim)
    lens = [1, 15, 16, 17, 33, 130] + [rng.randint(1, 200) for _ in range(3)]
    ranges, num_tokens = _ranges(lens)
    q, k, v = _qkv(num_tokens, num_heads, num_kv_heads, head_dim, seed=head_dim)
    scale = head_dim**-0.5
    out = torch.empty(num_tokens, num_heads, head_dim)
    kernel.attend(q, k, v, FreshPrompts.of(ranges, num_tokens), scale, out)
    torch.testing.assert_close(out.double(), reference(q, k, v, ranges, scale), atol=2e-5, rtol=0)


def test_agrees_with_sdpa_as_the_model_uses_it(kernel: PrefillKernel) -> None:
    """Within float rounding of SDPA's causal kernel (what the torch path computes)."""
    ranges, num_tokens = _ranges([128] * 4 + [40])
    q, k, v = _qkv(num_tokens, 8, 4, 32, seed=1)
    out = torch.empty_like(q)
    kernel.attend(q, k, v, FreshPrompts.of(ranges, num_tokens), 32**-0.5, out)
    for first, end in ranges:
        sdpa = F.scaled_dot_product_attention(
            q[first:end].transpose(0, 1)[None],
            k[first:end].repeat_interleave(2, 1).transpose(0, 1)[None],
            v[first:end].repeat_interleave(2, 1).transpose(0, 1)[None],
            is_causal=True,
            scale=32**-0.5,
        )[0].transpose(0, 1)
        torch.testing.assert_close(out[first:end], sdpa, atol=2e-6, rtol=0)


def _bf16_emulation(q, k, v, ranges, scale):  # type: ignore[no-untyped-def]
    """What the kernel computes over bf16 rows, in torch: fp32 scores and softmax, the
    probabilities rounded to bf16 after their sum is taken, fp32 P V, the output rounded."""
    out = torch.zeros(q.shape, dtype=torch.bfloat16)
    for first, end in ranges:
        s, vs = _scores(q, k, v, first, end, scale, torch.float32)
        p = torch.exp(s - s.amax(-1, keepdim=True))
        o = (p.bfloat16().float() @ vs) * (1 / p.sum(-1, keepdim=True))
        out[first:end] = o.transpose(0, 1).bfloat16()
    return out


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (2, 2, 48)])
def test_bf16_rows_round_as_sdpa_rounds(
    kernel: PrefillKernel, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    """bf16 q, k, v (strided views of one projection) and out, the rows between the prompts left
    alone, the same bits on any thread count: within float rounding of the torch emulation of
    its arithmetic (an output a bf16 step apart where the fp32 sums round across a boundary),
    within bf16's rounding of the fp64 reference, and equal to SDPA's bf16 kernel for most
    outputs (it too rounds the probabilities to bf16: without that, fewer than 3 in 4 are)."""
    ranges, num_tokens = _ranges([1, 16, 17, 130], gap=2)
    q, k, v = (t.bfloat16() for t in _qkv(num_tokens, num_heads, num_kv_heads, head_dim, 7))
    prompts, scale = FreshPrompts.of(ranges, num_tokens), head_dim**-0.5
    outs = []
    for threads in (1, 2):
        out = torch.full((num_tokens, num_heads, head_dim), 7.0, dtype=torch.bfloat16)
        with torch_threads(threads):
            kernel.attend(q, k, v, prompts, scale, out)
        outs.append(out)
    out = outs[0]
    assert torch.equal(outs[1], out)
    covered = torch.zeros(num_tokens, dtype=torch.bool)
    for first, end in ranges:
        covered[first:end] = True
    assert bool((out[~covered] == 7.0).all())
    emulated = _bf16_emulation(q, k, v, ranges, scale)[covered]
    # One bf16 step, but for a rare output near zero: the kernel's exp is within two ulp of
    # torch's, so a probability can round to its other bf16 neighbour, which moves an output
    # that its values nearly cancel by more than its own step (2 of 94,464 under AVX2 on one CPU).
    step = (out[covered].float() - emulated.float()).abs() <= emulated.float().abs() * 2**-7
    assert float(step.float().mean()) > 0.999
    assert float((out[covered] == emulated).float().mean()) > 0.95
    torch.testing.assert_close(out[covered].double(), reference(q, k, v, ranges, scale)[covered],
                               atol=2e-2, rtol=1e-2)  # fmt: skip
    group = num_heads // num_kv_heads
    for first, end in ranges:
        sdpa = F.scaled_dot_product_attention(
            q[first:end].transpose(0, 1)[None],
            k[first:end].repeat_interleave(group, 1).transpose(0, 1)[None],
            v[first:end].repeat_interleave(group, 1).transpose(0, 1)[None],
            is_causal=True,
            scale=scale,
        )[0].transpose(0, 1)
        assert float((out[first:end] == sdpa).float().mean()) > 0.85, end - first
    with pytest.raises(ValueError, match="as q"):
        kernel.attend(q, k.float(), v, prompts, scale, out)


def test_leaves_other_rows_alone_and_splits_on_threads(kernel: PrefillKernel) -> None:
    """Rows between the ranges (another sequence's, computed by SDPA) are not written; two
    threads give the same bits as one."""
    ranges, num_tokens = _ranges([20, 37, 5], gap=3)
    q, k, v = _qkv(num_tokens, 4, 2, 32, seed=2)
    prompts = FreshPrompts.of(ranges, num_tokens)
    outs = []
    for threads in (1, 2):
        out = torch.full((num_tokens, 4, 32), 7.0)
        with torch_threads(threads):
            kernel.attend(q, k, v, prompts, 0.2, out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    covered = torch.zeros(num_tokens, dtype=torch.bool)
    for first, end in ranges:
        covered[first:end] = True
    assert bool((outs[0][~covered] == 7.0).all())
    torch.testing.assert_close(
        outs[0][covered].double(), reference(q, k, v, ranges, 0.2)[covered], atol=2e-5, rtol=0
    )


def test_refuses_what_it_cannot_compute(kernel: PrefillKernel) -> None:
    q, k, v = _qkv(10, 4, 2, 32, seed=3)
    prompts = FreshPrompts.of([(0, 10)], 10)
    out = torch.empty(10, 4, 32)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        kernel.attend(q.double(), k, v, prompts, 1.0, out)
    with pytest.raises(ValueError, match="rows of heads"):
        kernel.attend(q.transpose(0, 1).contiguous().transpose(0, 1), k, v, prompts, 1.0, out)
    with pytest.raises(ValueError, match="cover"):
        kernel.attend(q[:5], k[:5], v[:5], prompts, 1.0, out[:5])
    with pytest.raises(ValueError, match="do not lie within"):
        FreshPrompts.of([(4, 11)], 10)
    with pytest.raises(ValueError, match="do not lie within"):
        FreshPrompts.of([(3, 3)], 10)
    q48, k48, v48 = _qkv(10, 4, 2, 40, seed=4)  # 40: not a multiple of 16
    with pytest.raises(ValueError, match="unsupported"):
        kernel.attend(q48, k48, v48, prompts, 1.0, torch.empty(10, 4, 40))


def test_the_backend_sends_fresh_prompts_to_it_and_prefix_chunks_to_sdpa(
    kernel: PrefillKernel,
) -> None:
    """One forward with a fresh prompt and a chunk continuing a cached prefix: the same outputs
    as the torch path (SDPA for both)."""
    bs, num_blocks, heads, kv_heads, dim = 16, 16, 4, 2, 32
    scale = dim**-0.5
    with_kernel = TorchAttentionBackend(num_blocks, bs, kv_heads, scale, CPU, prefill_kernel=kernel)
    plain = TorchAttentionBackend(num_blocks, bs, kv_heads, scale, CPU)
    # Sequence 0: a fresh 20-token prompt in blocks 1-2. Sequence 1: 24 cached tokens in blocks
    # 3-4, then a chunk of 10 more (positions 24..33, blocks 4-5).
    tables = [[1, 2], [3, 4, 5]]
    slots = [1 * bs + i for i in range(16)] + [2 * bs + i for i in range(4)]
    slots += [(3 + p // bs) * bs + p % bs for p in range(24, 34)]
    args = (slots, tables, [20, 10], [20, 34])
    meta_c, meta_t = with_kernel.prefill_metadata(*args), plain.prefill_metadata(*args)
    assert meta_c.fresh is not None and len(meta_c.seqs) == 1 and meta_t.fresh is None
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(2, num_blocks, bs, kv_heads, dim, generator=g)
    q, k, v = _qkv(30, heads, kv_heads, dim, seed=6)
    out_c = meta_c.forward(q, k, v, cache.clone())
    out_t = meta_t.forward(q, k, v, cache.clone())
    torch.testing.assert_close(out_c, out_t, atol=2e-6, rtol=0)
    assert torch.equal(out_c[20:], out_t[20:])  # the prefix chunk: SDPA in both


def test_backend_choice(
    kernel: PrefillKernel, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """fp32 or bf16 CPU with a head size it takes, on a build with 16-lane registers: the
    prefill kernel too; otherwise SDPA alone (on AVX2 SDPA is the faster)."""
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path))
    with_kernel = "torch+c-decode+prefill" if kernel.serves else "torch+c-decode"
    assert kernel.serves == ("avx512f" in cpu_isa.cpu_flags() and cpu_isa.current() == "native")
    assert select_backend(CPU, 8, 16, 2, 1.0, head_dim=32).name == with_kernel
    bf16 = torch.bfloat16
    assert select_backend(CPU, 8, 16, 2, 1.0, dtype=bf16, head_dim=32).name == with_kernel
    assert select_backend(CPU, 8, 16, 2, 1.0, head_dim=40).name == "torch+c-decode"
    assert select_backend(CPU, 8, 16, 2, 1.0).name == "torch+c-decode"
    assert select_backend(CPU, 8, 16, 2, 1.0, cpu_attention="torch", head_dim=32).name == "torch"
