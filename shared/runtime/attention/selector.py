"""Which backend serves a device, a KV cache and a dtype (``BATON_CPU_ATTENTION``)."""

from __future__ import annotations

import structlog
import torch

from kernels.cpu.paged_decode_attention import load_kernel
from kernels.cpu.paged_decode_int8 import load_int8_kernel
from kernels.cpu.prefill_attention import PrefillKernel, load_prefill_kernel
from shared.runtime.attention.common import FLOAT_KV
from shared.runtime.attention.torch_backend import TorchAttentionBackend
from shared.runtime.attention.triton_backend import TritonAttentionBackend
from shared.runtime.fp_window import FpWindow
from shared.runtime.kv_codec import KVCodec

log = structlog.get_logger(__name__)


AttentionBackend = TorchAttentionBackend | TritonAttentionBackend
CPU_ATTENTION_MODES = ("auto", "torch")


def select_backend(
    device: torch.device,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    scale: float,
    codec: KVCodec = FLOAT_KV,
    dtype: torch.dtype = torch.float32,
    cpu_attention: str = "auto",
    head_dim: int | None = None,
    fp_window: FpWindow | None = None,
) -> AttentionBackend:
    """Triton kernels on CUDA when the ``kernels`` package provides them, else torch; on CPU,
    decode goes through a C kernel (over an fp32 or bf16 float cache; in fp32 also over an int8
    one and its full-precision window ``fp_window``) unless ``cpu_attention`` is ``"torch"`` (or
    the kernel cannot be built), and so does a fresh prompt's prefill (fp32 or bf16) where
    ``head_dim`` is given and the prefill kernel takes it (a multiple of 16, up to 256).

    An int8 cache on CUDA decodes through the Triton kernel's int8 specialisation, reading the
    packed rows of kv_codec.py and the full-precision window in place; its prefill is torch's
    (a fresh prompt attends to its own K/V; a chunk after a prefix dequantises it)."""
    if cpu_attention not in CPU_ATTENTION_MODES:
        raise ValueError(f"BATON_CPU_ATTENTION={cpu_attention!r}: one of {CPU_ATTENTION_MODES}")
    if device.type == "cuda":
        try:
            import kernels

            needed = ("paged_decode_attention", "prefill_attention", "store_kv")
            # kernels imports lazily: the package loads without triton, its ops would not run.
            has_triton = getattr(kernels, "triton_available", lambda: True)()
            if has_triton and all(hasattr(kernels, name) for name in needed):
                int8_prefill = None
                if codec.quantized:  # decode: the packed-row kernel; prefill: torch's
                    int8_prefill = TorchAttentionBackend(
                        num_blocks, block_size, num_kv_heads, scale, device, codec,
                        fp_window=fp_window,
                    )  # fmt: skip
                return TritonAttentionBackend(
                    kernels, block_size, scale, device, int8_prefill, fp_window
                )
            log.warning("triton kernels unavailable; using torch attention")
        except ImportError as exc:  # triton missing or broken on this host
            log.warning("triton kernels unavailable; using torch attention", error=str(exc))
    kernel = prefill_kernel = int8_kernel = None
    if device.type == "cpu" and cpu_attention == "auto":
        if not codec.quantized and dtype in (torch.float32, torch.bfloat16):
            kernel = load_kernel()
        elif codec.quantized and dtype == torch.float32:
            int8_kernel = load_int8_kernel()
        fresh_dtype = dtype in (torch.float32, torch.bfloat16)
        if fresh_dtype and head_dim is not None and PrefillKernel.supports(head_dim):
            prefill_kernel = load_prefill_kernel()  # fresh prompts: their own K/V, any cache
            if prefill_kernel is not None and not prefill_kernel.serves:
                prefill_kernel = None  # SDPA is faster on this build (PrefillKernel.serves)
    return TorchAttentionBackend(
        num_blocks, block_size, num_kv_heads, scale, device, codec, kernel, prefill_kernel,
        fp_window, int8_kernel,
    )  # fmt: skip
