"""The decoder (Llama / Mistral / Qwen2 / Qwen3) over flat token batches.

Inputs are flat: ``input_ids [T]`` and ``positions [T]`` hold every sequence's new tokens back to
back, with no padding; the attention metadata says which tokens belong to which sequence. The
arithmetic mirrors transformers op for op (RMSNorm in fp32, rotate-half RoPE, SiLU-gated MLP)
so greedy outputs match it token for token in fp32; q/k/v and gate/up are fused into one matmul
each at load time.

The modules only hold the weights (their names are the checkpoint's, see loader.py); the forward
is one flat loop of functional ops over them. At a decode step of a small model every op is a
few microseconds, so module dispatch, dtype round trips and per-layer RoPE set-up would cost as
much as the arithmetic.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu.dense_tiles import DenseTileWeight
from kernels.cpu.layer_ops import LayerKernels
from kernels.cpu.mkl_pack import PackedWeight
from kernels.cpu.onednn_pack import OneDnnWeight
from kernels.cpu.quant_linear import QuantWeight
from kernels.cpu.rope import RopeKernel
from shared.runtime.attention import AttentionMetadata, attention
from shared.runtime.model_config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalise in fp32, cast back, then scale. ``torch.rms_norm``
    without a weight is the same pow / mean / rsqrt chain (bit-identical in fp32); the casts are
    no-ops in fp32."""
    normed = torch.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * normed.to(x.dtype)


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and sign-folded ``sin`` ``[T, 1, D]`` for :func:`apply_rope`, once per forward.

    Computed as transformers does (fp32 outer product, ``cat(freqs, freqs)``, then cos/sin), so
    the values are its bits. ``sin``'s first half is negated: ``rotate_half(x) * sin`` equals
    ``swap_halves(x) * cat(-sin1, sin2)`` exactly (a sign flip commutes with rounding)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    half = freqs.shape[-1]
    sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` over ``x [T, H, D]`` (``sin`` from
    :func:`rope_tables`): the same products and sum as transformers, one op fewer."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * sin


# Rows from which MKL's packed weight beats its GEMV on the plain one (linear_layout.py).
PACKED_MIN_ROWS = PackedWeight.min_rows


class Projection(nn.Linear):
    """``nn.Linear`` whose weight may also be held packed, for MKL or oneDNN (linear_layout.py):
    :meth:`project` takes the packed form for the row counts it serves, ``F.linear`` for the
    rest; the same products either way, up to the last bits. A GGUF weight kept quantized
    (:class:`QuantWeight`) serves every row count, and ``weight`` is then never read."""

    packed: PackedWeight | OneDnnWeight | DenseTileWeight | QuantWeight | None = None

    def reset_parameters(self) -> None:
        """Nothing: weights come from the checkpoint. (nn.Linear's random init on the meta
        device imports torch._dynamo and Triton, which then stay resident in every engine.)"""

    def project(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed
        if packed is not None and x.dim() == 2 and packed.min_rows <= x.shape[0] <= packed.max_rows:
            return packed.linear(x, self.bias)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    # RoPE in place through C, set by the runner on CPU: fp32 (kernels/cpu/rope.py, bit-identical to
    # apply_rope) or bf16 (kernels/cpu/layer_ops.py, one rounding).
    rope_kernel: RopeKernel | LayerKernels | None = None

    def __init__(self, cfg: ModelConfig, window: int | None = None):
        super().__init__()
        self.window = window  # this layer's sliding window (ModelConfig.layer_windows)
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Projection(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias)
        self.o_proj = Projection(self.q_size, cfg.hidden_size, cfg.o_bias)
        # Qwen3 normalises each head of q and k before RoPE; the others do not.
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj.project(x)
        # q and k sit side by side in qkv: one RoPE over both heads' views.
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim)
        if self.qk_norm:
            qk[:, : self.num_heads] = self.q_norm.forward(qk[:, : self.num_heads])
            qk[:, self.num_heads :] = self.k_norm.forward(qk[:, self.num_heads :])
        # In place where the kernel takes it (qkv is this forward's own buffer), checked once.
        if self.rope_kernel is None or not self.rope_kernel.rotate(qk, cos, sin):
            qk = apply_rope(qk, cos, sin)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = attention(q, k, v, kv_layer, meta, self.window)
        return self.o_proj.project(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    # SiLU * up through C (kernels/cpu/layer_ops.py); set by the runner
    # (CausalLM.use_layer_kernels).
    kernels: LayerKernels | None = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Projection(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias)
        self.down_proj = Projection(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.project(x)
        if self.kernels is not None:
            return self.down_proj.project(self.kernels.silu_mul(gate_up))
        # In place in gate_up (this forward's own buffer): the same values as F.silu(gate) * up,
        # without two fresh [T, intermediate] tensors (whose cost is mostly page faults on fresh
        # memory at prefill's row counts).
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj.project(F.silu(gate, inplace=True).mul_(up))


class DecoderLayer(nn.Module):
    # RMSNorms (the second after the residual add) through C; see MLP.kernels.
    kernels: LayerKernels | None = None

    def __init__(self, cfg: ModelConfig, window: int | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Residual adds in place: ``hidden`` is this forward's own activation buffer."""
        k = self.kernels
        if k is not None:
            norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
            x = k.rms_norm(hidden, norm1.weight, norm1.eps)
            x = k.add_rms_norm(hidden, self.self_attn.forward(x, cos, sin, kv_layer, meta),
                               norm2.weight, norm2.eps)  # fmt: skip
            hidden += self.mlp.forward(x)
            return hidden
        x = self.input_layernorm.forward(hidden)
        hidden += self.self_attn.forward(x, cos, sin, kv_layer, meta)
        hidden += self.mlp.forward(self.post_attention_layernorm.forward(hidden))
        return hidden


class DecodeLayers(Protocol):
    """What runs a step's layers in place of the loop in :meth:`CausalLM.forward` (decode
    programs, shared/runtime/decode_program.py): their output, or None where it does not take
    the step."""

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: object,
    ) -> torch.Tensor | None: ...


class CausalLM(nn.Module):
    inv_freq: torch.Tensor  # fp32 RoPE frequencies (a non-persistent buffer)
    # A quantized embedding (GGUF), or a tied head's dense tiles in the decode engine: rows are
    # gathered (and dequantized) from it, and ``embed_tokens.weight`` stays on the meta device.
    embed_packed: QuantWeight | DenseTileWeight | None = None
    # The final RMSNorm through C; see MLP.kernels.
    kernels: LayerKernels | None = None
    # The decode step's layers as one native call where they take it (decode_program.py; set
    # by the runner); a step it does not take runs the layers below.
    decode_programs: DecodeLayers | None = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        # Given an (empty) weight, nn.Embedding skips its random init: see Projection.
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        windows = cfg.layer_windows or (None,) * cfg.num_layers
        self.layers = nn.ModuleList(DecoderLayer(cfg, w) for w in windows)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Projection(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", cfg.inv_freq(), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of every new token; writes their KV into ``kv_cache``."""
        dtype = self.norm.weight.dtype
        cos, sin = rope_tables(positions, self.inv_freq, dtype)
        if self.embed_packed is not None:
            hidden = self.embed_packed.rows(input_ids).to(dtype)
        else:
            hidden = F.embedding(input_ids, self.embed_tokens.weight)
        if self.decode_programs is not None:
            out = self.decode_programs.forward(hidden, cos, sin, kv_cache, meta)
            if out is not None:
                return out
        for layer, kv_layer in zip(self.layers, kv_cache, strict=True):
            hidden = layer.forward(hidden, cos, sin, kv_layer, meta)
        return hidden

    def weight_bytes(self) -> int:
        """Bytes of weights held, once each: packed forms as packed, tied tensors once."""
        seen: set[int] = set()  # storages (a tied head is its own Parameter on the same one)
        total = 0
        for p in self.parameters():
            if not p.is_meta and p.untyped_storage().data_ptr() not in seen:
                seen.add(p.untyped_storage().data_ptr())
                total += p.untyped_storage().nbytes()
        for m in self.modules():
            packed = m.packed if isinstance(m, Projection) else None
            if packed is not None and id(packed) not in seen:
                seen.add(id(packed))
                total += packed.nbytes
        if self.embed_packed is not None and id(self.embed_packed) not in seen:
            total += self.embed_packed.nbytes
        return total

    def use_rope_kernel(self, kernel: RopeKernel | LayerKernels | None) -> None:
        """Every attention layer's RoPE through ``kernel`` where it takes the inputs."""
        for module in self.modules():
            if isinstance(module, Attention):
                module.rope_kernel = kernel

    def use_layer_kernels(self, kernels: LayerKernels | None) -> None:
        """Every RMSNorm and SiLU * up through ``kernels`` (kernels/cpu/layer_ops.py; None: torch's
        ops); RoPE stays as :meth:`use_rope_kernel` set it."""
        for module in self.modules():
            if isinstance(module, (CausalLM, DecoderLayer, MLP)):
                module.kernels = kernels

    def use_bf16_kernels(self, kernels: LayerKernels | None) -> None:
        """A bf16 model's RMSNorms, SiLU * up and RoPE through ``kernels``."""
        self.use_layer_kernels(kernels)
        self.use_rope_kernel(kernels)

    @property
    def quantized(self) -> bool:
        """Whether projections run packed GGUF weights (int8 activations in decode)."""
        return any(
            isinstance(m, Projection) and isinstance(m.packed, QuantWeight) for m in self.modules()
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the rows given (only the tokens that sample). Norm is row-wise, so
        normalising just these rows equals normalising all and selecting after."""
        norm, k = self.norm, self.kernels
        x = norm.forward(hidden) if k is None else k.rms_norm(hidden, norm.weight, norm.eps)
        return self.lm_head.project(x).float()
