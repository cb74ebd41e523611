"""A GGUF file's tensors under the Hugging Face checkpoint's names, for the loader.

Tensor types: F32, F16 and BF16 are read as tensors of the model's dtype. Q8_0, Q4_0 and Q4_1
are kept packed in GGML's block bytes (:class:`QuantWeight`, run by the C kernels of
kernels/cpu/quant_linear.py) when ``packed``, else dequantized to the model's dtype (exact: the
values gguf-py and transformers compute). Any other type (the K-quants, IQ-quants, ...) is refused
at load with its name and the tensor's.

llama.cpp's converter permutes the rows of a Llama ``attn_q`` / ``attn_k`` weight for its
interleaved RoPE; they are permuted back here (as transformers does), on the packed bytes too:
a row permutation moves whole rows of blocks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from kernels.cpu.quant_formats import PACKED_TYPES
from kernels.cpu.quant_linear import QuantWeight
from shared.runtime.gguf_file import read_tensor_index
from shared.runtime.model_config import ModelConfig

# GGUF tensor name (after ``blk.N.``) -> the HF name (after ``layers.N.``).
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
FLOAT_TYPES = {"F32": np.float32, "F16": np.float16}

Weight = torch.Tensor | QuantWeight


def hf_name(name: str) -> str:
    stem, _, kind = name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        if part not in LAYER_NAMES:
            raise ValueError(f"GGUF tensor {name!r} is not one the model has")
        return f"layers.{layer}.{LAYER_NAMES[part]}.{kind}"
    if stem not in TOP_NAMES:
        raise ValueError(f"GGUF tensor {name!r} is not one the model has")
    return f"{TOP_NAMES[stem]}.{kind}"


def read_gguf(path: Path, cfg: ModelConfig, dtype: torch.dtype, packed: bool) -> dict[str, Weight]:
    """Every tensor of the file as ``{hf_name: tensor or QuantWeight}``, each read from the file
    into memory of its own (gguf_file.py: the file is not left mapped)."""
    out: dict[str, Weight] = {}
    for t in read_tensor_index(path):
        name = hf_name(t.name)
        weight = tensor_of(t, dtype, packed)
        if cfg.arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = unpermute_rows(weight, cfg.num_heads)
        elif cfg.arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = unpermute_rows(weight, cfg.num_kv_heads)
        out[name] = weight
    return out


def stays_packed(kind: str, ndim: int, packed: bool) -> bool:
    """Whether a tensor of GGUF type ``kind`` is held in its block bytes (a QuantWeight)."""
    return packed and ndim == 2 and kind in PACKED_TYPES


def decode_weight_bytes(path: Path, dtype: torch.dtype, packed: bool) -> tuple[int, bool]:
    """The bytes of the file's matrices a decode step reads, as the engine holds them (packed
    ones as packed, the rest in ``dtype``): every layer's, and the head's (the embedding where
    no ``output`` tensor is: a tied head); and whether any of them stays packed. From the
    tensor index alone (the bench's floors: loadtest/engine/roofline.py)."""
    index = read_tensor_index(path)
    tied = not any(t.name == "output.weight" for t in index)
    elem = torch.empty((), dtype=dtype).element_size()
    total, any_packed = 0, False
    for t in index:
        if len(t.shape) != 2 or (t.name == "token_embd.weight" and not tied):
            continue  # norms and biases (negligible); an untied embedding (B rows a step)
        if stays_packed(t.tensor_type.name, 2, packed):
            total, any_packed = total + t.nbytes, True
        else:
            total += t.shape[0] * t.shape[1] * elem
    return total, any_packed


def tensor_of(t: Any, dtype: torch.dtype, packed: bool) -> Weight:
    """One tensor of a file (gguf_file.GgufTensor, or gguf-py's ReaderTensor: then copied out
    of its mapping): a tensor of ``dtype``, or a :class:`QuantWeight` for a packed type when
    ``packed`` (2-D only)."""
    kind = t.tensor_type.name
    shape = [int(n) for n in reversed(t.shape)]  # GGUF lists the fastest dimension first
    data = np.asarray(t.data)
    if not data.flags.owndata:
        data = data.copy()
    if kind in FLOAT_TYPES:
        return torch.from_numpy(data.view(FLOAT_TYPES[kind]).reshape(shape)).to(dtype)
    if kind == "BF16":
        bits = torch.from_numpy(data.view(np.int16).reshape(shape))
        return bits.view(torch.bfloat16).to(dtype)
    if kind in PACKED_TYPES:
        quant = QuantWeight(torch.from_numpy(data.reshape(shape[0], -1)),
                            PACKED_TYPES[kind], shape[1])  # fmt: skip
        return quant if stays_packed(kind, len(shape), packed) else quant.dequantize().to(dtype)
    raise ValueError(
        f"GGUF tensor {t.name!r} has type {kind}, which Baton does not run "
        f"(F32, F16, BF16, {', '.join(PACKED_TYPES)}): requantize the file to one of them"
    )


def unpermute_rows(weight: Weight, num_heads: int) -> Weight:
    """Undo llama.cpp's Q/K row order: within each head, rows (0, 2, 4, ..., 1, 3, ...) of
    the HF order were written interleaved; this is transformers' ``reverse_permute_weights``."""
    rows = weight.out_features if isinstance(weight, QuantWeight) else weight.shape[0]
    half = rows // num_heads // 2
    order = torch.arange(rows).view(num_heads, half, 2).transpose(1, 2).reshape(rows)
    if isinstance(weight, QuantWeight):
        return weight.select_rows(order)
    return weight[order].contiguous()


def cat_rows(parts: list[Weight], dtype: torch.dtype) -> Weight:
    """The fused projection of ``parts`` (q/k/v, gate/up): packed if all share one packed type,
    else in the model's dtype."""
    if all(isinstance(p, QuantWeight) for p in parts):
        quants = [p for p in parts if isinstance(p, QuantWeight)]
        if len({q.qtype for q in quants}) == 1:
            return QuantWeight.cat(quants)
    return torch.cat([p.dequantize().to(dtype) if isinstance(p, QuantWeight) else p for p in parts])
