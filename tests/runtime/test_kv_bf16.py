"""A bf16 KV cache under an fp32 model (``BATON_KV_CACHE_DTYPE=bfloat16``; "auto" under GGUF
weights kept packed, shared/runtime/kv_codec.py): each row rounded once as stored, attention over
it the same on every CPU path as fp32 attention over the rounded values, half of fp32's bytes,
and a prefill/decode pair over each CPU transport."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels.cpu.paged_decode_attention import load_kernel
from shared.runtime.attention import TorchAttentionBackend
from shared.runtime.kv_codec import make_kv_codec
from shared.runtime.loader import keeps_packed
from tests.runtime.helpers import (
    KV_TRANSPORTS,
    assert_prefix_chunk_reads_the_cache,
    cache_pair_agreement,
    make_runner,
    scattered_tables,
    tiny_model_dir,
)

BF16, AUTO = make_kv_codec("bfloat16"), make_kv_codec("auto")
CPU = torch.device("cpu")


def test_auto_is_bf16_under_packed_weights_and_the_models_dtype_otherwise() -> None:
    assert AUTO.cache_dtype(torch.float32) == torch.float32
    assert make_kv_codec("auto", packed_weights=True).cache_dtype(torch.float32) == torch.bfloat16
    assert BF16.cache_dtype(torch.float32) == torch.bfloat16
    assert make_kv_codec("float32", packed_weights=True).cache_dtype(torch.float32) == torch.float32
    x = torch.randn(3, 2, 8)
    assert torch.equal(BF16.encode(x), x.to(torch.bfloat16))  # to nearest, ties to even
    assert torch.equal(BF16.decode(BF16.encode(x), torch.float32), x.bfloat16().float())
    assert not keeps_packed(tiny_model_dir("llama"), "auto", CPU)  # safetensors: nothing packed


def _decode(
    backend: TorchAttentionBackend,
    layer: torch.Tensor,
    context_lens: list[int],
    group: int,
    round_new: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step's attention over ``layer`` (the new rows stored first; ``round_new``:
    rounded to bf16 values beforehand) and the layer after it."""
    bs, hkv, d = layer.shape[2], layer.shape[3], layer.shape[4]
    tables, slots = scattered_tables(context_lens, layer.shape[1], bs)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(len(context_lens), hkv * group, d, generator=g)
    k, v = torch.randn(2, len(context_lens), hkv, d, generator=g)
    if round_new:
        k, v = k.bfloat16().float(), v.bfloat16().float()
    layer = layer.clone()
    out = backend.decode_metadata(slots, tables, context_lens).forward(q, k, v, layer)
    return out, layer


@pytest.mark.parametrize(("context_lens", "group"), [([1, 17, 40], 2), ([33, 5], 1), ([64], 3)])
def test_decode_over_bf16_equals_fp32_attention_over_the_rounded_values(
    context_lens: list[int], group: int
) -> None:
    """The C kernel and the torch path over the bf16 cache (the new rows stored rounded), and
    fp32 attention over the same values widened: one result up to summation order."""
    bs, hkv, d, num_blocks = 16, 2, 32, 24
    cache = torch.randn(2, num_blocks, bs, hkv, d).to(torch.bfloat16)
    fp32 = TorchAttentionBackend(num_blocks, bs, hkv, d**-0.5, CPU, AUTO)
    ref, ref_layer = _decode(fp32, cache.float(), context_lens, group, round_new=True)
    paths = [TorchAttentionBackend(num_blocks, bs, hkv, d**-0.5, CPU, BF16)]
    kernel = load_kernel()
    if kernel is not None:
        paths.append(TorchAttentionBackend(num_blocks, bs, hkv, d**-0.5, CPU, BF16, kernel))
    for backend in paths:
        out, layer = _decode(backend, cache, context_lens, group)
        assert out.dtype == torch.float32 and layer.dtype == torch.bfloat16
        assert torch.equal(layer.float(), ref_layer)  # each new row rounded once, as stored
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_prefill_over_a_cached_prefix_reads_the_bf16_rows() -> None:
    cache = torch.randn(2, 8, 16, 2, 32).to(torch.bfloat16)
    assert_prefix_chunk_reads_the_cache(BF16, cache, cache.float(), lambda x: x.bfloat16().float())


def test_a_bf16_cache_holds_twice_the_blocks_of_fp32() -> None:
    model = tiny_model_dir("llama")
    fp32 = make_runner(model, num_kv_blocks=0, kv_cache_mb=4)
    bf16 = make_runner(model, num_kv_blocks=0, kv_cache_mb=4, kv_cache_dtype="bfloat16")
    assert bf16.kv_cache.dtype == torch.bfloat16 and bf16.dtype == torch.float32
    assert 2 * bf16.block_bytes == fp32.block_bytes
    assert bf16.num_kv_blocks == 2 * fp32.num_kv_blocks


@pytest.mark.parametrize("transport", KV_TRANSPORTS)
def test_bf16_pair_serves_and_mostly_agrees_with_fp32(tmp_path: Path, transport: str) -> None:
    share = cache_pair_agreement(tiny_model_dir("llama"), tmp_path, transport, "bfloat16")
    # Random weights: near-ties everywhere, so a floor against a broken path.
    assert share >= 0.5
