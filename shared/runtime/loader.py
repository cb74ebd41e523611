"""Load a Hugging Face checkpoint (safetensors) straight into the native :class:`CausalLM`.

Weights are renamed and fused on the way in (q/k/v -> qkv_proj, gate/up -> gate_up_proj); the
transformers model class is never instantiated.
"""

from __future__ import annotations

import json
from pathlib import Path

import structlog
import torch
from safetensors import safe_open

from shared.runtime.model import CausalLM
from shared.runtime.model_config import ModelConfig

log = structlog.get_logger(__name__)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
# Checkpoint entries that carry nothing the native model needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; one of {sorted(DTYPES)}") from None


def safetensors_files(model_dir: Path) -> list[Path]:
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def read_checkpoint(model_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint on CPU, names without the ``model.`` prefix."""
    weights: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                short = name.removeprefix("model.")
                weights[short] = f.get_tensor(name).to(dtype)
    return weights


def to_native_state_dict(
    cfg: ModelConfig, weights: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Rename to the native module's names and fuse the projections that share an input."""
    w = dict(weights)
    out: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        try:
            return w.pop(name)
        except KeyError:
            raise KeyError(f"checkpoint lacks {name!r}") from None

    out["embed_tokens.weight"] = take("embed_tokens.weight")
    out["norm.weight"] = take("norm.weight")
    if cfg.tie_word_embeddings:
        w.pop("lm_head.weight", None)
        out["lm_head.weight"] = out["embed_tokens.weight"]
    else:
        out["lm_head.weight"] = take("lm_head.weight")
    params = ["weight"] + (["bias"] if cfg.qkv_bias else [])
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        for kind in params:
            out[p + f"self_attn.qkv_proj.{kind}"] = torch.cat(
                [take(p + f"self_attn.{x}_proj.{kind}") for x in ("q", "k", "v")]
            )
        out[p + "self_attn.o_proj.weight"] = take(p + "self_attn.o_proj.weight")
        if cfg.o_bias:
            out[p + "self_attn.o_proj.bias"] = take(p + "self_attn.o_proj.bias")
        if cfg.qk_norm:
            out[p + "self_attn.q_norm.weight"] = take(p + "self_attn.q_norm.weight")
            out[p + "self_attn.k_norm.weight"] = take(p + "self_attn.k_norm.weight")
        for kind in ["weight"] + (["bias"] if cfg.mlp_bias else []):
            out[p + f"mlp.gate_up_proj.{kind}"] = torch.cat(
                [take(p + f"mlp.gate_proj.{kind}"), take(p + f"mlp.up_proj.{kind}")]
            )
            out[p + f"mlp.down_proj.{kind}"] = take(p + f"mlp.down_proj.{kind}")
        out[p + "input_layernorm.weight"] = take(p + "input_layernorm.weight")
        out[p + "post_attention_layernorm.weight"] = take(p + "post_attention_layernorm.weight")
    if w:
        log.warning("checkpoint tensors not used", names=sorted(w)[:8], count=len(w))
    return out


def load_model(
    model_dir: Path, device: torch.device, dtype: torch.dtype
) -> tuple[ModelConfig, CausalLM]:
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = CausalLM(cfg)
    state = to_native_state_dict(cfg, read_checkpoint(model_dir, dtype))
    state = {name: t.to(device) for name, t in state.items()}
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    # RoPE frequencies stay fp32 whatever the weights' dtype (as in transformers).
    model.inv_freq = cfg.inv_freq().to(device)
    model.eval().requires_grad_(False)
    log.info(
        "model loaded",
        model_dir=str(model_dir),
        arch=cfg.arch,
        layers=cfg.num_layers,
        params=sum(p.numel() for p in model.parameters()),
        dtype=str(dtype),
        device=str(device),
    )
    return cfg, model
