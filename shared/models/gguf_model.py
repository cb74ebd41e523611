"""A GGUF file as a model directory: its config, generation config and tokenizer written out once.

The services read a model through a Hugging Face directory (``config.json``, the tokenizer
files). For a ``.gguf`` file that directory is made from the file's own metadata, once, into
``$BATON_CACHE_DIR/gguf/<name>-<key>/`` (the key covers the file's path, size and mtime): the
config from the ``<arch>.*`` keys, the tokenizer — with its chat template and special tokens —
converted by ``transformers`` from the ``tokenizer.ggml.*`` keys. The weights are never copied:
the directory's marker (:data:`MARKER_FILE`) names the file, and the weight loader
(shared/runtime/gguf_weights.py) reads the tensors from it.

Architectures: GGUF's ``llama`` (Llama and Mistral), ``qwen2`` and ``qwen3``. Anything else, and
rope scalings other than none and linear, are refused with the reason.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import structlog

from shared.config import default_cache_dir

log = structlog.get_logger(__name__)

MARKER_FILE = "baton_gguf.json"
# Bump when the files written change: older directories are rebuilt.
FORMAT_VERSION = 2
# The sampling settings a GGUF file may carry (llama.cpp's general.sampling.*), by their name in
# generation_config.json.
SAMPLING_FIELDS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
# GGUF general.architecture -> (HF architectures entry, model_type).
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}


def gguf_path_of(model_dir: Path) -> Path | None:
    """The GGUF file behind a directory made by :func:`gguf_model_dir`; None for any other."""
    marker = Path(model_dir) / MARKER_FILE
    if not marker.is_file():
        return None
    return Path(json.loads(marker.read_text())["gguf"])


def gguf_model_dir(path: Path, cache_dir: Path | None = None) -> Path:
    """The model directory of the GGUF file at ``path``, written on first use (atomically:
    services starting together never see half of it)."""
    path = Path(path).resolve()
    stat = path.stat()
    key = hashlib.sha256(
        f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{FORMAT_VERSION}".encode()
    ).hexdigest()[:16]
    root = (cache_dir or default_cache_dir()) / "gguf"
    out = root / f"{path.stem}-{key}"
    if (out / MARKER_FILE).is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.build-", dir=root))
    try:
        write_model_dir(path, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp is 0700; services may run as other users
        try:
            os.rename(tmp, out)
        except OSError:  # another process installed it first
            if not (out / MARKER_FILE).is_file():
                raise
        log.info("gguf model directory written", gguf=str(path), model_dir=str(out))
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_model_dir(path: Path, out: Path) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    fields = {name: _value(field) for name, field in reader.fields.items()}
    tensors = {t.name: [int(n) for n in t.shape] for t in reader.tensors}
    config = hf_config(fields, tensors)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation: dict[str, Any] = {
        k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config
    }
    generation.update(
        {hf: fields[key] for key, hf in SAMPLING_FIELDS.items() if fields.get(key) is not None}
    )
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    _write_tokenizer(path, out)
    (out / MARKER_FILE).write_text(json.dumps({"gguf": str(path), "version": FORMAT_VERSION}))


def hf_config(fields: dict[str, Any], tensors: dict[str, list[int]]) -> dict[str, Any]:
    """A Hugging Face ``config.json`` from GGUF metadata (``fields``) and tensor shapes (GGUF
    order: the fastest dimension first)."""
    arch = str(fields.get("general.architecture", ""))
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        )

    def get(key: str, default: Any = None) -> Any:
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF file lacks {arch}.{key}")
        return value

    if "rope_freqs.weight" in tensors:
        raise ValueError("GGUF rope_freqs (Llama 3.1 rope scaling) is not supported")
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    vocab = tensors["token_embd.weight"][1]
    architecture, model_type = ARCHITECTURES[arch]
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if arch == "llama" and "blk.0.attn_q.bias" in tensors:
        config["attention_bias"] = True
    window = fields.get(f"{arch}.attention.sliding_window")
    if window:
        config["sliding_window"] = int(window)
    scaling = fields.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ValueError(f"GGUF rope scaling {scaling!r} is not supported (none, linear)")
        config["rope_scaling"] = {"type": "linear", "factor": float(get("rope.scaling.factor"))}
    for name in ("bos", "eos", "padding"):
        value = fields.get(f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            config["pad_token_id" if name == "padding" else f"{name}_token_id"] = int(value)
    return config


def _write_tokenizer(path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(str(out))


def _value(field: Any) -> Any:
    try:
        return field.contents()
    except Exception:  # a field gguf-py cannot decode: not one we read
        return None
