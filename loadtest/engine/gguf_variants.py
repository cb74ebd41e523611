"""Write a GGUF file's model again with its weights in another tensor type (F32, F16, BF16,
Q8_0, Q4_0, Q4_1): the same metadata (config, tokenizer, chat template), each 2-D weight
dequantized and quantized again with Baton's reference quantizer; 1-D tensors (norms) stay F32.
For the tests and the parity and speed figures of every type on one real model:

    python -m loadtest.engine.gguf_variants IN.gguf --type q8_0 --out OUT.gguf

:func:`export_hf_dir` writes a GGUF model's dequantized weights as a plain Hugging Face
directory (what ``transformers`` loads from the file, saved): the baselines that cannot read
GGUF (vLLM's CPU backend) run that.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
import torch

from kernels.cpu.quant_formats import PACKED_TYPES, quantize
from shared.runtime.gguf_weights import tensor_of

TYPES = ("F32", "F16", "BF16", *PACKED_TYPES)


def write_variant(src: Path, dst: Path, kind: str) -> Path:
    """``src`` rewritten into ``dst`` with every 2-D weight as ``kind``."""
    import gguf

    kind = kind.upper()
    if kind not in TYPES:
        raise ValueError(f"type {kind!r}: one of {TYPES}")
    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), value_type, sub_type=sub_type)
    for t in reader.tensors:
        weight = tensor_of(t, torch.float32, packed=False)
        assert isinstance(weight, torch.Tensor)
        _add(writer, t.name, weight, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
             "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}  # fmt: skip


def write_from_hf(hf_dir: Path, dst: Path, kind: str = "F32") -> Path:
    """A Hugging Face directory (Llama, Mistral, Qwen2, Qwen3; a byte-level BPE tokenizer) as
    a GGUF file the way llama.cpp's converter writes one: its metadata keys and tensor names,
    Llama's Q/K rows interleaved for its RoPE, the tokenizer as ``gpt2`` tokens and merges with
    the chat template. For tests: every architecture through the GGUF loader."""
    import gguf
    from safetensors.torch import load_file

    from shared.models.gguf_model import SAMPLING_FIELDS
    from shared.runtime.gguf_weights import LAYER_NAMES, TOP_NAMES

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCH[cfg["architectures"][0]]
    if cfg.get("use_sliding_window") or (cfg.get("sliding_window") and arch != "llama"):
        raise ValueError("GGUF has no key for Qwen2's per-layer windows")
    heads, kv_heads = (
        cfg["num_attention_heads"],
        cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
    )
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(dst), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg.get("max_position_embeddings", 2048))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    vocab.update(special)
    size = cfg["vocab_size"]
    tokens = [f"[PAD{i}]" for i in range(size)]
    for text, i in vocab.items():
        tokens[i] = text
    types = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    gen = json.loads((hf_dir / "generation_config.json").read_text())
    eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
    w.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    if cfg.get("bos_token_id") is not None:
        w.add_bos_token_id(cfg["bos_token_id"])
    w.add_add_bos_token(False)
    for key, hf_name in SAMPLING_FIELDS.items():  # as llama.cpp's converter: general.sampling.*
        if gen.get(hf_name) is not None:
            kind_of = gguf.GGUFValueType.INT32 if hf_name == "top_k" else gguf.GGUFValueType.FLOAT32
            w.add_key_value(key, gen[hf_name], kind_of)
    template = json.loads((hf_dir / "tokenizer_config.json").read_text()).get("chat_template")
    if template:
        w.add_chat_template(template)
    to_gguf = {v: k for k, v in {**LAYER_NAMES, **TOP_NAMES}.items()}
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        name = name.removeprefix("model.")
        stem, _, suffix = name.rpartition(".")
        if stem.startswith("layers."):
            _, layer, part = stem.split(".", 2)
            gguf_name = f"blk.{layer}.{to_gguf[part]}.{suffix}"
        else:
            gguf_name = f"{to_gguf[stem]}.{suffix}"
        if arch == "llama" and part_of(name) in ("q_proj", "k_proj"):
            n = heads if part_of(name) == "q_proj" else kv_heads
            tensor = tensor.reshape(n, 2, tensor.shape[0] // n // 2, *tensor.shape[1:])
            tensor = tensor.swapaxes(1, 2).reshape(-1, *tensor.shape[3:])
        _add(w, gguf_name, tensor.float(), kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def part_of(name: str) -> str:
    """``q_proj`` of ``layers.0.self_attn.q_proj.weight``."""
    parts = name.split(".")
    return parts[-2] if len(parts) >= 2 else ""


def _add(writer: object, name: str, weight: torch.Tensor, kind: str) -> None:
    """``weight`` into the file as ``kind`` (1-D tensors as F32, as llama.cpp keeps norms)."""
    import gguf

    w: gguf.GGUFWriter = writer  # type: ignore[assignment]
    if weight.dim() == 1 or kind == "F32":
        w.add_tensor(name, weight.numpy())
    elif kind == "F16":
        w.add_tensor(name, weight.to(torch.float16).numpy())
    elif kind == "BF16":
        raw = weight.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
    else:
        qtype = PACKED_TYPES[kind]
        raw = quantize(weight, qtype).numpy()
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType(qtype))


def export_hf_dir(model_dir: Path) -> Path:
    """``model_dir`` if it holds safetensors; for a GGUF model's directory, the HF directory of
    its dequantized fp32 weights, written once beside it (``<model_dir>/hf``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.models.gguf_model import gguf_path_of

    gguf_file = gguf_path_of(model_dir)
    if gguf_file is None:
        return model_dir
    out = model_dir / "hf"
    if (out / "model.safetensors").is_file():
        return out
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    )
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None  # type: ignore[assignment]
    tmp = model_dir / ".hf.tmp"
    model.save_pretrained(str(tmp))
    config = json.loads((tmp / "config.json").read_text())
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    AutoTokenizer.from_pretrained(str(model_dir)).save_pretrained(str(tmp))
    os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("--type", required=True, choices=[t.lower() for t in TYPES])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    write_variant(args.src, args.out, args.type)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB, {args.type})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
