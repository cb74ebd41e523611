"""The model facts the engine needs, read from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# architectures name -> arch; model_type is the fallback for configs saved without a model.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str
    # Extra rope parameters as sorted (key, value) pairs, hashable for the frozen dataclass.
    rope_params: tuple[tuple[str, float], ...]
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    # Per layer, the keys a query attends to at most (Mistral: every layer; Qwen2 with
    # use_sliding_window: the layers from max_window_layers on); None = all (full attention).
    # A query at position p sees keys p - window + 1 .. p (transformers' sliding mask).
    layer_windows: tuple[int | None, ...] = ()

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir}")
        raw = json.loads(path.read_text())
        generation = Path(model_dir) / "generation_config.json"
        gen_raw = json.loads(generation.read_text()) if generation.is_file() else {}
        return cls.from_dict(raw, gen_raw)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        arch = _arch(raw)
        _refuse_quantized(raw)
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        rope_theta, rope_type, rope_params = _rope(raw)
        eos: list[int] = []
        for source in (raw, generation or {}):
            value = source.get("eos_token_id")
            for token_id in value if isinstance(value, list) else [value]:
                if token_id is not None and int(token_id) not in eos:
                    eos.append(int(token_id))
        attention_bias = bool(raw.get("attention_bias", False))
        return cls(
            arch=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_type=rope_type,
            rope_params=rope_params,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and no o bias; Llama/Qwen3 follow attention_bias.
            qkv_bias=arch == "qwen2" or attention_bias,
            o_bias=arch != "qwen2" and attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=arch == "qwen3",
            eos_token_ids=tuple(eos),
            bos_token_id=raw.get("bos_token_id"),
            layer_windows=_layer_windows(raw),
        )

    @property
    def sliding_window(self) -> int | None:
        """The attention window if any layer uses one (the largest)."""
        windows = [w for w in self.layer_windows if w is not None]
        return max(windows) if windows else None

    @property
    def kv_window(self) -> int | None:
        """Keys the next query of a sequence may still need: the positions before
        ``p - kv_window + 1`` (p: the next position computed) are outside every layer's window,
        so their blocks may be freed. None while any layer attends to everything."""
        if not self.layer_windows or None in self.layer_windows:
            return None
        return max(w for w in self.layer_windows if w is not None)

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies, computed exactly as transformers does (fp32), on the CPU
        whatever the default device (a meta-device context would import torch._dynamo)."""
        dim = self.head_dim
        base = self.rope_theta
        steps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float()
        inv_freq = 1.0 / (base ** (steps / dim))
        params = dict(self.rope_params)
        if self.rope_type == "linear":
            inv_freq = inv_freq / params["factor"]
        elif self.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        return inv_freq


def _arch(raw: dict[str, Any]) -> str:
    for name in raw.get("architectures") or []:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    model_type = raw.get("model_type", "")
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    raise ValueError(
        f"unsupported model: architectures={raw.get('architectures')} model_type={model_type!r}; "
        f"supported: {sorted(ARCHITECTURES)}"
    )


def _refuse_quantized(raw: dict[str, Any]) -> None:
    """A checkpoint quantized by a method the loader does not run (fp8, gptq, awq,
    bitsandbytes, compressed-tensors, ...) is refused: loaded as plain weights, its values
    would be cast without their scales — a model that answers, wrongly. GGUF files are served
    (shared/models/gguf_model.py writes no quantization_config for them)."""
    quant = raw.get("quantization_config")
    if quant is None:
        return
    method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
    raise ValueError(
        f"checkpoint is quantized with {method!r} (config.json quantization_config), which "
        f"Baton does not run: serve the unquantized checkpoint, or a GGUF file (Q8_0, Q4_0, Q4_1)"
    )


def _layer_windows(raw: dict[str, Any]) -> tuple[int | None, ...]:
    """Each layer's attention window, as transformers decides it."""
    num_layers = int(raw["num_hidden_layers"])
    window = raw.get("sliding_window")
    if not window or raw.get("use_sliding_window") is False:  # qwen2 drops the window then
        return (None,) * num_layers
    layer_types = raw.get("layer_types")
    if isinstance(layer_types, list):  # transformers >= 4.54 spells it out per layer
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types names {len(layer_types)} of {num_layers} layers")
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    if "use_sliding_window" in raw:  # qwen2/qwen3: only layers from max_window_layers on
        first = int(raw.get("max_window_layers", num_layers))
        return tuple(int(window) if i >= first else None for i in range(num_layers))
    return (int(window),) * num_layers  # mistral: every layer


def _rope(raw: dict[str, Any]) -> tuple[float, str, tuple[tuple[str, float], ...]]:
    # transformers >= 5 writes "rope_parameters"; older configs "rope_theta" + "rope_scaling".
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = str(params.pop("rope_type", params.pop("type", "default")))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    if rope_type == "llama3" and "original_max_position_embeddings" not in params:
        params["original_max_position_embeddings"] = raw.get("max_position_embeddings", 8192)
    numeric = {k: float(v) for k, v in params.items() if isinstance(v, int | float)}
    return theta, rope_type, tuple(sorted(numeric.items()))


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, float]) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
