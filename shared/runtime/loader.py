"""Load a checkpoint straight into the native :class:`CausalLM`: a Hugging Face directory
(safetensors) or a GGUF file (through the directory shared/models/gguf_model.py writes for it).

Weights are renamed and fused on the way in (q/k/v -> qkv_proj, gate/up -> gate_up_proj); the
transformers model class is never instantiated. A GGUF file's Q8_0 / Q4_0 / Q4_1 weights stay
packed where the weight format says so (:class:`QuantWeight`; the projection runs them through
its C kernel, the embedding gathers rows from them), each held once.
"""

from __future__ import annotations

import json
from pathlib import Path

import structlog
import torch
from safetensors import safe_open

from kernels.cpu import cpu_isa
from kernels.cpu.quant_linear import QuantWeight
from shared.models.gguf_model import gguf_path_of
from shared.runtime.gguf_file import read_tensor_index
from shared.runtime.gguf_weights import Weight, cat_rows, read_gguf, stays_packed
from shared.runtime.model import CausalLM, Projection
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
WEIGHT_FORMATS = ("auto", "packed", "dequantized")
# Checkpoint entries that carry nothing the native model needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; one of {sorted(DTYPES)}") from None


def resolve_dtype(name: str, model_dir: Path, device: torch.device) -> torch.dtype:
    """``BATON_DTYPE``: a dtype by name, or ``auto``: the checkpoint's dtype where the device
    computes it natively, else fp32 (the exact mode). On a CPU: bf16 only with bf16
    instructions (named or auto: without them bf16 weights are computed in fp32), never fp16
    by auto; a GGUF file computes in fp32 (its packed weights are dequantized in registers
    either way)."""
    if name.lower() != "auto":
        dtype = parse_dtype(name)
        if dtype == torch.bfloat16 and device.type == "cpu" and not cpu_isa.computes_bf16():
            # Emulated bf16 GEMMs ran at a few GFLOP/s: a prompt took minutes. fp32 holds every
            # bf16 value exactly and is this CPU's fast path.
            log.warning(
                "BATON_DTYPE=bfloat16 on a CPU without bf16 instructions: the weights are "
                "computed in float32 here (bf16 would be emulated, far slower)"
            )
            return torch.float32
        return dtype
    if gguf_path_of(model_dir) is not None:
        return torch.float32
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    declared = str(raw.get("torch_dtype") or raw.get("dtype") or "float32")
    dtype = DTYPES.get(declared.lower(), torch.float32)
    if device.type == "cpu" and (
        dtype == torch.float16 or (dtype == torch.bfloat16 and not cpu_isa.computes_bf16())
    ):
        return torch.float32
    return dtype


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
                tensor = f.get_tensor(name)
                # A copy, also in the file's own dtype: get_tensor's tensor maps the file, and
                # any one of them kept (a norm) would keep every page read resident (each
                # engine's RSS would then hold the file beside its weights).
                weights[short] = tensor.to(dtype) if tensor.dtype != dtype else tensor.clone()
    return weights


def to_native_state_dict(
    cfg: ModelConfig, weights: dict[str, Weight], dtype: torch.dtype | None = None
) -> dict[str, Weight]:
    """Rename to the native module's names and fuse the projections that share an input
    (``weights`` is emptied as it goes, so no tensor is held twice)."""
    w = weights
    out: dict[str, Weight] = {}
    fuse_dtype = dtype or torch.float32

    def take(name: str) -> Weight:
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
            out[p + f"self_attn.qkv_proj.{kind}"] = cat_rows(
                [take(p + f"self_attn.{x}_proj.{kind}") for x in ("q", "k", "v")], fuse_dtype
            )
        out[p + "self_attn.o_proj.weight"] = take(p + "self_attn.o_proj.weight")
        if cfg.o_bias:
            out[p + "self_attn.o_proj.bias"] = take(p + "self_attn.o_proj.bias")
        if cfg.qk_norm:
            out[p + "self_attn.q_norm.weight"] = take(p + "self_attn.q_norm.weight")
            out[p + "self_attn.k_norm.weight"] = take(p + "self_attn.k_norm.weight")
        for kind in ["weight"] + (["bias"] if cfg.mlp_bias else []):
            out[p + f"mlp.gate_up_proj.{kind}"] = cat_rows(
                [take(p + f"mlp.gate_proj.{kind}"), take(p + f"mlp.up_proj.{kind}")], fuse_dtype
            )
            out[p + f"mlp.down_proj.{kind}"] = take(p + f"mlp.down_proj.{kind}")
        out[p + "input_layernorm.weight"] = take(p + "input_layernorm.weight")
        out[p + "post_attention_layernorm.weight"] = take(p + "post_attention_layernorm.weight")
    if w:
        log.warning("checkpoint tensors not used", names=sorted(w)[:8], count=len(w))
    return out


def packs_weights(weight_format: str, device: torch.device) -> bool:
    """Whether quantized weights stay packed: ``auto`` and ``packed`` on a CPU (the kernels
    are C), ``dequantized`` never."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight format {weight_format!r}: one of {WEIGHT_FORMATS}")
    if weight_format == "packed" and device.type != "cpu":
        raise ValueError("BATON_WEIGHT_FORMAT=packed runs on a CPU only; use dequantized")
    return weight_format != "dequantized" and device.type == "cpu"


def keeps_packed(model_dir: Path, weight_format: str, device: torch.device) -> bool:
    """Whether any of the model's matrices stays packed (:func:`packs_weights`, a GGUF file
    with quantized ones): from the file's tensor index alone, before any weight is read."""
    gguf = gguf_path_of(Path(model_dir))
    if gguf is None or not packs_weights(weight_format, device):
        return False
    return any(stays_packed(t.tensor_type.name, len(t.shape), True)
               for t in read_tensor_index(gguf))  # fmt: skip


def load_model(
    model_dir: Path, device: torch.device, dtype: torch.dtype, weight_format: str = "auto"
) -> tuple[ModelConfig, CausalLM]:
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    packed = packs_weights(weight_format, device)
    with torch.device("meta"):
        model = CausalLM(cfg)
    gguf = gguf_path_of(model_dir)
    weights: dict[str, Weight] = (
        read_gguf(gguf, cfg, dtype, packed)
        if gguf is not None
        else dict(read_checkpoint(model_dir, dtype))
    )
    state = to_native_state_dict(cfg, weights, dtype)
    quants: dict[str, QuantWeight] = {}
    for name in [n for n, t in state.items() if isinstance(t, QuantWeight)]:
        quant = state.pop(name)
        assert isinstance(quant, QuantWeight)
        quants[name] = quant
    tensors = {n: t.to(device) for n, t in state.items() if isinstance(t, torch.Tensor)}
    if cfg.tie_word_embeddings and "embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["embed_tokens.weight"]
    missing, _ = model.load_state_dict(tensors, strict=False, assign=True)
    if set(missing) != set(quants):
        raise KeyError(f"checkpoint lacks {sorted(set(missing) - set(quants))[:4]}")
    for name, quant in quants.items():
        module = model.get_submodule(name.rsplit(".", 1)[0])
        if isinstance(module, Projection):
            module.packed = quant  # its weight stays on the meta device: never read
        else:
            model.embed_packed = quant  # the embedding, and a head tied to it
            if cfg.tie_word_embeddings:
                model.lm_head.packed = quant
    # RoPE frequencies stay fp32 whatever the weights' dtype (as in transformers).
    model.inv_freq = cfg.inv_freq().to(device)
    model.eval().requires_grad_(False)
    log.info(
        "model loaded",
        model_dir=str(model_dir),
        arch=cfg.arch,
        layers=cfg.num_layers,
        params=sum(p.numel() for p in model.parameters()),
        weight_bytes=model.weight_bytes(),
        packed=len(quants),
        dtype=str(dtype),
        device=str(device),
    )
    return cfg, model
