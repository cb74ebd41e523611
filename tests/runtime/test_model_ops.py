"""The native model's functional ops give transformers' exact bits, and the CPU runner's weight
and KV-cache placement keeps the values the checkpoint holds."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from shared.runtime.loader import load_model
from shared.runtime.model import apply_rope, rms_norm, rope_tables
from tests.runtime.helpers import make_runner, tiny_model_dir, torch_threads


@pytest.fixture
def hf() -> ModuleType:
    """transformers' Llama ops, imported at test time: the import loads triton, which
    test_triton_backend.py must configure (TRITON_INTERPRET) before anything loads it."""
    from transformers.models.llama import modeling_llama

    return modeling_llama


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_bit_identical_to_transformers(hf: ModuleType, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    head_dim, num_tokens = 32, 37
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    positions = torch.randint(0, 4096, (num_tokens,), generator=g)
    x = torch.randn(num_tokens, 6, head_dim, generator=g).to(dtype)

    freqs = positions[None, :, None].float() * inv_freq  # transformers' rotary embedding
    emb = torch.cat((freqs, freqs), dim=-1)
    hf_cos, hf_sin = emb.cos().to(dtype), emb.sin().to(dtype)
    # transformers applies it on [batch, heads, tokens, head_dim].
    want, _ = hf.apply_rotary_pos_emb(x.transpose(0, 1)[None], x[:1, :1], hf_cos, hf_sin)

    cos, sin = rope_tables(positions, inv_freq, dtype)
    got = apply_rope(x, cos, sin)
    assert torch.equal(got, want[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_bit_identical_to_transformers(hf: ModuleType, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    norm = hf.LlamaRMSNorm(256, eps=1e-6)
    norm.weight.data = torch.randn(256, generator=g)
    norm = norm.to(dtype)
    x = (3 * torch.randn(19, 256, generator=g)).to(dtype)
    with torch.inference_mode():
        assert torch.equal(rms_norm(x, norm.weight, 1e-6), norm(x))
        # A strided view (the per-head q/k norm of Qwen3 reads one out of the fused qkv).
        heads = (3 * torch.randn(19, 12, 32, generator=g)).to(dtype)[:, :8]
        head_norm = hf.LlamaRMSNorm(32, eps=1e-6).to(dtype)
        assert torch.equal(rms_norm(heads, head_norm.weight, 1e-6), head_norm(heads))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied and tied (qwen2 tiny) heads
def test_cpu_runner_keeps_checkpoint_values(arch: str) -> None:
    path = tiny_model_dir(arch)
    with torch_threads(1):
        runner = make_runner(path, num_kv_blocks=8)
    _, fresh = load_model(path, torch.device("cpu"), torch.float32)
    ours = dict(runner.model.named_parameters(remove_duplicate=False))
    for name, param in fresh.named_parameters(remove_duplicate=False):
        assert torch.equal(ours[name], param), name
    model = runner.model
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module.weight is not model.embed_tokens.weight:
            assert module.weight.t().is_contiguous(), name  # [in, out]; maybe packed too
    tied = model.config.tie_word_embeddings
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    assert model.embed_tokens.weight.is_contiguous()

    cache = runner.kv_cache
    assert cache.is_contiguous() and cache.dtype == torch.float32
    assert not cache.any()
    cache[-1, 1, -1].fill_(2.0)  # writable to its last element
    assert cache.sum().item() == 2.0 * cache[-1, 1, -1].numel()
