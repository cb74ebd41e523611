"""Paged attention: store the new K/V at ``slot_mapping``, then attend over each sequence's KV.

One module per backend: common.py (the metadata protocol, the KV store), torch_backend.py with
cpu_kernels.py and int8.py, triton_backend.py; selector.py picks one.

The runner builds one metadata object per forward (tensors, masks, gather indices) through an
:class:`AttentionBackend`; every layer then calls :func:`attention` with it. Two backends:
- torch (any device, the CPU path): decode copies only K (per KV head, padded to the longest
  context) for one batched matmul and reads V in place (see :class:`TorchDecodeMetadata`); on
  CPU with an fp32 or bf16 float cache, decode goes through the C kernel of
  kernels/cpu/paged_decode_attention.py instead (:class:`CpuKernelDecodeMetadata`: K and V
  read in place, once);
  prefill runs one SDPA per sequence, causal (``is_causal``) when it has no cached prefix, else
  with a causal-with-offset mask; on CPU in fp32 the fresh prompts (no cached prefix) go through
  the C kernel of kernels/cpu/prefill_attention.py instead, all in one call. A quantised cache
  (``BATON_KV_CACHE_DTYPE=int8``, kv_codec.py) decodes through
  :class:`TorchQuantDecodeMetadata` on any device.
- triton (CUDA, when ``kernels`` imports; see triton_backend.py): the paged kernels read the
  pools in place.

Sliding windows: each layer calls ``forward`` with its own window (ModelConfig.layer_windows;
None = full attention). A query at position p sees keys ``p - window + 1 .. p`` (transformers'
mask); the metadata keeps what each window needs (which rows, masks, starts) once per forward,
built by the first layer that asks. No path reads a block below a sequence's window start: those
blocks may have been freed (the block manager's null entries).

Layer pools: ``kv_layer [2, num_blocks, block_size, Hkv, D]`` (0 = K, 1 = V), see docs/engine.md.
"""

from shared.runtime.attention.common import FLOAT_KV, AttentionMetadata, attention
from shared.runtime.attention.selector import CPU_ATTENTION_MODES, AttentionBackend, select_backend
from shared.runtime.attention.torch_backend import TorchAttentionBackend
from shared.runtime.attention.triton_backend import TritonAttentionBackend

__all__ = [
    "CPU_ATTENTION_MODES",
    "FLOAT_KV",
    "AttentionBackend",
    "AttentionMetadata",
    "TorchAttentionBackend",
    "TritonAttentionBackend",
    "attention",
    "select_backend",
]
