"""The engine's Triton attention backend agrees with its torch backend.

Without CUDA the kernels run in Triton's CPU interpreter (set before any kernel module is
imported, as tests/kernels does), so the engine-side wiring (argument order, dtypes, layouts,
the host-side bounds) is checked on every machine; on a GPU host it checks the real kernels.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

kernels = pytest.importorskip("kernels")
if not kernels.triton_available():
    pytest.skip("triton is not installed", allow_module_level=True)

from shared.runtime.attention import TorchAttentionBackend, TritonAttentionBackend  # noqa: E402
from shared.wire.sampling import SamplingParams  # noqa: E402
from tests.runtime.helpers import EnginePair, tiny_model_dir  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BS, HKV, HQ, D = 16, 2, 4, 16


def backends() -> tuple[TorchAttentionBackend, TritonAttentionBackend]:
    scale = D**-0.5
    return (
        TorchAttentionBackend(12, BS, HKV, scale, DEVICE),
        TritonAttentionBackend(kernels, BS, scale, DEVICE),
    )


def fresh_pool(g: torch.Generator) -> torch.Tensor:
    return torch.randn(2, 12, BS, HKV, D, generator=g).to(DEVICE)


def test_decode_attention_agrees() -> None:
    g = torch.Generator().manual_seed(0)
    torch_be, triton_be = backends()
    block_tables = [[3, 7], [1], [9, 2, 5]]
    context_lens = [20, 9, 40]
    slots = [
        bt[(n - 1) // BS] * BS + (n - 1) % BS
        for bt, n in zip(block_tables, context_lens, strict=True)
    ]
    q = torch.randn(3, HQ, D, generator=g).to(DEVICE)
    k = torch.randn(3, HKV, D, generator=g).to(DEVICE)
    v = torch.randn(3, HKV, D, generator=g).to(DEVICE)
    pool = fresh_pool(g)
    pool_b = pool.clone()
    want = torch_be.decode_metadata(slots, block_tables, context_lens).forward(q, k, v, pool)
    got = triton_be.decode_metadata(slots, block_tables, context_lens).forward(q, k, v, pool_b)
    assert torch.equal(pool, pool_b)  # both stored the new K/V at the same slots
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_prefill_attention_with_and_without_prefix_agrees() -> None:
    g = torch.Generator().manual_seed(1)
    torch_be, triton_be = backends()
    block_tables = [[4, 0], [6, 8, 10]]
    query_lens = [17, 12]  # seq 0: whole prompt; seq 1: a chunk after 21 cached tokens
    context_lens = [17, 33]
    slots = [
        bt[p // BS] * BS + p % BS
        for bt, ql, n in zip(block_tables, query_lens, context_lens, strict=True)
        for p in range(n - ql, n)
    ]
    total = sum(query_lens)
    q = torch.randn(total, HQ, D, generator=g).to(DEVICE)
    k = torch.randn(total, HKV, D, generator=g).to(DEVICE)
    v = torch.randn(total, HKV, D, generator=g).to(DEVICE)
    pool = fresh_pool(g)
    pool_b = pool.clone()
    meta_t = torch_be.prefill_metadata(slots, block_tables, query_lens, context_lens)
    meta_k = triton_be.prefill_metadata(slots, block_tables, query_lens, context_lens)
    want = meta_t.forward(q, k, v, pool)
    got = meta_k.forward(q, k, v, pool_b)
    assert torch.equal(pool, pool_b)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_engines_on_triton_backend_match_torch_backend(tmp_path: Path) -> None:
    """The production prefill and decode engines, once per backend: same tokens."""
    path = tiny_model_dir("llama")
    device = {"device": str(DEVICE)}
    outputs = []
    for use_triton in (False, True):
        pair = EnginePair.build(
            path,
            tmp_path / f"spill-{use_triton}",
            prefill_blocks=16,
            decode_blocks=16,
            prefill={**device, "max_num_batched_tokens": 24},  # 40-token prompt: chunked in 2
            decode=device,
        )
        if use_triton:
            for runner in (pair.prefill.runner, pair.decode.runner):
                runner.attn_backend = TritonAttentionBackend(
                    kernels, runner.block_size, runner.model_config.head_dim**-0.5, DEVICE
                )
        pair.add("a", list(range(3, 43)), SamplingParams(max_tokens=4, ignore_eos=True))
        pair.add("b", list(range(50, 55)), SamplingParams(max_tokens=4, ignore_eos=True))
        outputs.append(pair.run())
        # b (5 tokens) fits whole and passes a, which is chunked in the rest of each step
        assert pair.prefill_log.chunks("a") == [19, 21]
        pair.assert_clean()
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize(("arch", "window"), [("llama", None), ("mistral", 24)])
def test_int8_with_a_full_precision_window_on_triton_matches_torch(
    tmp_path: Path, arch: str, window: int | None
) -> None:
    """An int8 cache with a 16-token full-precision window (and a sliding window): decode on the
    packed-row Triton kernel (int8 rows and the window's slots in one pass), prefill on torch's,
    the same tokens as the torch backend."""
    path = tiny_model_dir(arch, window=window)
    kw = {"device": str(DEVICE), "kv_cache_dtype": "int8", "kv_fp_window": 16}
    outputs = []
    for use_triton in (False, True):
        pair = EnginePair.build(
            path,
            tmp_path / f"spill-{use_triton}",
            prefill=kw,
            decode={**kw, "cpu_attention": "torch"},
        )
        if use_triton:
            for runner in (pair.prefill.runner, pair.decode.runner):
                torch_be = runner.attn_backend
                assert isinstance(torch_be, TorchAttentionBackend)
                runner.attn_backend = TritonAttentionBackend(
                    kernels, BS, torch_be.scale, DEVICE, torch_be, runner.fp_window
                )
        pair.add("a", list(range(3, 43)), SamplingParams(max_tokens=30, ignore_eos=True))
        pair.add("b", list(range(50, 55)), SamplingParams(max_tokens=30, ignore_eos=True))
        outputs.append(pair.run())
        pair.assert_clean()
    assert outputs[0] == outputs[1]
