"""The deterministic tiny models: real HF config and tokenizer files, random weights."""

from shared.models.tiny.builder import ARCHS, PRESETS, build_tiny_model, ensure_tiny_model

__all__ = ["ARCHS", "PRESETS", "build_tiny_model", "ensure_tiny_model"]
