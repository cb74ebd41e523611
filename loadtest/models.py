"""The models the benchmarks run: the tiny builder's PRESETS (shared/models/tiny/builder.py, the
one place a shape is defined), random weights, built once under ``models/``.

- ``tiny``: tests and the demo; ``bench``: the serving benchmarks (3.6M matmul params);
- ``bench-long``: the bench shape with 16k positions (long prompts);
- ``qwen2-0.5b``: a real size, Qwen2-0.5B's layer shapes (built as arch qwen2).

A bench takes ``--preset`` where its figures depend on the shape; the KV a preset's model holds
per block is :func:`kv_block_bytes`.
"""

from __future__ import annotations

from pathlib import Path

from shared.config import REPO_ROOT
from shared.models.tiny.builder import PRESETS, Preset, ensure_tiny_model, model_dir_name

MODELS_DIR = REPO_ROOT / "models"
# The layout a preset is built in when none is named: the real size is Qwen2's.
ARCH_OF = {"qwen2-0.5b": "qwen2"}


def arch_of(preset: str) -> str:
    return ARCH_OF.get(preset, "llama")


def preset_model(preset: str, arch: str | None = None, window: int | None = None) -> Path:
    """``models/<name>`` holding the preset's model (built on first use)."""
    arch = arch or arch_of(preset)
    name = model_dir_name(preset, arch, window)
    return ensure_tiny_model(MODELS_DIR / name, preset=preset, arch=arch, window=window)


def shape(preset: str) -> Preset:
    if preset not in PRESETS:
        raise SystemExit(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    return PRESETS[preset]


def kv_block_bytes(preset: str, block_size: int, itemsize: int) -> int:
    """Bytes of one KV block (K and V, every layer) of the preset's model."""
    p = shape(preset)
    return p.num_hidden_layers * 2 * block_size * p.num_key_value_heads * p.head_dim * itemsize
