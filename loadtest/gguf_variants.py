"""Write a GGUF file's model again with its weights in another tensor type (F32, F16, BF16,
Q8_0, Q4_0, Q4_1): the same metadata (config, tokenizer, chat template), each 2-D weight
dequantized and quantized again with Baton's reference quantizer; 1-D tensors (norms) stay F32.
For the tests and the parity and speed figures of every type on one real model:

    python -m loadtest.gguf_variants IN.gguf --type q8_0 --out OUT.gguf

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

from shared.runtime.quant_formats import PACKED_TYPES, dequantize, quantize

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
        shape = [int(n) for n in reversed(t.shape)]
        weight = _as_float(t, shape)
        if len(shape) == 1 or kind == "F32":
            writer.add_tensor(t.name, weight.numpy())
        elif kind == "F16":
            writer.add_tensor(t.name, weight.to(torch.float16).numpy())
        elif kind == "BF16":
            raw = weight.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)
            writer.add_tensor(
                t.name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.BF16
            )
        else:
            qtype = PACKED_TYPES[kind]
            raw = quantize(weight, qtype).numpy()
            writer.add_tensor(t.name, raw, raw_shape=raw.shape,
                              raw_dtype=gguf.GGMLQuantizationType(qtype))  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


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


def _as_float(t: object, shape: list[int]) -> torch.Tensor:
    kind = t.tensor_type.name  # type: ignore[attr-defined]
    data = np.asarray(t.data)  # type: ignore[attr-defined]
    if kind == "F32":
        return torch.from_numpy(data.view(np.float32).reshape(shape).copy())
    if kind == "F16":
        return torch.from_numpy(data.view(np.float16).reshape(shape).astype(np.float32))
    if kind == "BF16":
        raw = torch.from_numpy(data.view(np.int16).reshape(shape).copy())
        return raw.view(torch.bfloat16).float()
    raw = torch.from_numpy(data.reshape(shape[0], -1).copy())
    return dequantize(raw, PACKED_TYPES[kind], shape[1])


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
