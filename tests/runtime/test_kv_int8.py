"""int8 KV cache (``BATON_KV_CACHE_DTYPE=int8``, shared/runtime/kv_codec.py): the packed rows,
attention over them against float attention over the same dequantised values, the cache's size,
a prefill/decode pair over each CPU transport, and a refused handoff between unlike caches.

The exact contract stays fp32 (``auto``); int8 reports agreement (``python -m
loadtest kv-dtype``), and here only a loose floor guards against a broken path.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels.triton.int8_kv import dequantize_kv_ref, quantize_kv_ref
from shared.kv_transfer.shm import ShmConnector
from shared.runtime.attention import TorchAttentionBackend
from shared.runtime.kv_codec import Int8KV, make_kv_codec
from tests.runtime.helpers import (
    KV_TRANSPORTS,
    assert_prefix_chunk_reads_the_cache,
    cache_pair_agreement,
    make_runner,
    scattered_tables,
    tiny_model_dir,
)

INT8 = Int8KV()


def test_packed_rows_hold_the_kernels_quantisation() -> None:
    x = torch.randn(5, 3, 32) * torch.logspace(-3, 2, 5)[:, None, None]
    rows = INT8.encode(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, 3, 36)
    values, scale = quantize_kv_ref(x)
    assert torch.equal(rows[..., :32], values)
    dequant = dequantize_kv_ref(values, scale, torch.float32)
    assert torch.equal(INT8.decode(rows, torch.float32), dequant)
    err = (INT8.decode(rows, torch.float32) - x).abs().amax(-1)
    assert (err <= x.abs().amax(-1) / 254 * (1 + 1e-6)).all()
    zeros = torch.zeros(2, 32)
    assert torch.equal(INT8.decode(INT8.encode(zeros), torch.float32), zeros)


def test_unknown_kv_cache_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="BATON_KV_CACHE_DTYPE='fp4'"):
        make_kv_codec("fp4")


def _caches(num_blocks: int, bs: int, hkv: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same random KV as an int8 layer and as a float layer of its dequantised values."""
    kv = torch.randn(2, num_blocks, bs, hkv, d)
    packed = INT8.encode(kv)
    return packed, INT8.decode(packed, torch.float32)


@pytest.mark.parametrize(("context_lens", "group"), [([1, 17, 40], 2), ([33, 5], 1), ([64], 4)])
def test_decode_attention_equals_float_attention_on_dequantised_kv(
    context_lens: list[int], group: int
) -> None:
    bs, hkv, d, num_blocks = 16, 2, 32, 24
    packed, dequant = _caches(num_blocks, bs, hkv, d)
    tables, slots = scattered_tables(context_lens, num_blocks, bs)
    q = torch.randn(len(context_lens), hkv * group, d)
    k, v = torch.randn(2, len(context_lens), hkv, d)
    outs = []
    for codec, layer, new_k, new_v in (
        (INT8, packed, k, v),
        (make_kv_codec("auto"), dequant, INT8.decode(INT8.encode(k), torch.float32),
         INT8.decode(INT8.encode(v), torch.float32)),
    ):  # fmt: skip
        backend = TorchAttentionBackend(num_blocks, bs, hkv, d**-0.5, torch.device("cpu"), codec)
        meta = backend.decode_metadata(slots, tables, context_lens)
        outs.append(meta.forward(q, new_k, new_v, layer.clone()))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_prefill_over_a_cached_prefix_reads_dequantised_kv() -> None:
    packed, dequant = _caches(8, 16, 2, 32)
    assert_prefix_chunk_reads_the_cache(
        INT8, packed, dequant, lambda x: INT8.decode(INT8.encode(x), torch.float32)
    )


def test_int8_cache_is_about_a_quarter_of_fp32() -> None:
    model = tiny_model_dir("llama")
    fp32 = make_runner(model, num_kv_blocks=0, kv_cache_mb=4)
    int8 = make_runner(model, num_kv_blocks=0, kv_cache_mb=4, kv_cache_dtype="int8")
    head_dim = fp32.model_config.head_dim
    assert int8.kv_cache.dtype == torch.int8 and int8.kv_cache.shape[-1] == head_dim + 4
    assert int8.block_bytes / fp32.block_bytes == (head_dim + 4) / (4 * head_dim)
    assert int8.num_kv_blocks == (4 << 20) // int8.block_bytes > 3 * fp32.num_kv_blocks


@pytest.mark.parametrize("transport", KV_TRANSPORTS)
def test_int8_pair_serves_and_mostly_agrees_with_fp32(tmp_path: Path, transport: str) -> None:
    share = cache_pair_agreement(tiny_model_dir("llama"), tmp_path, transport, "int8")
    # Random weights: near-ties everywhere, so a floor against a broken path.
    assert share >= 0.5  # the figure itself: loadtest/engine/kv_cache_dtype.py


def test_spill_store_refuses_a_handoff_between_unlike_caches(tmp_path: Path) -> None:
    sender, receiver = (ShmConnector(tmp_path, 1 << 30, 300.0) for _ in range(2))
    sender.register_kv_cache(torch.zeros(2, 2, 4, 16, 2, 36, dtype=torch.int8))
    receiver.register_kv_cache(torch.zeros(2, 2, 4, 16, 2, 32))
    desc = sender.send("r", [1], 16)
    with pytest.raises(ValueError, match="BATON_KV_CACHE_DTYPE must match"):
        receiver.load(desc, [0], 0)
