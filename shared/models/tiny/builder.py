"""Deterministic tiny Hugging Face models, built locally (Baton never downloads a model).

A built directory holds real HF files (config.json, model.safetensors, generation_config.json,
tokenizer.json, tokenizer_config.json with a ChatML chat_template, special_tokens_map.json) that
``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained(dir)`` load offline, plus a marker
(baton_tiny.json) recording what was built so a stale directory is rebuilt.

Weights are random but not HF's default init (std 0.02 gives near-uniform logits and attention):
every parameter is drawn from its own generator seeded by (seed, parameter name), so the bytes
do not depend on HF's init order, and scaled so attention is sharp and the softmax confident.
Norm weights and qwen2's q/k/v biases are random too, so a wrong norm or a missing bias changes
the output. Greedy parity with a native engine: fp32 rounding moves a logit by ~1e-6 of the
largest logit (tiny; ~6e-6 bench) while the top-1/top-2 gap is below 1e-4 of it on ~0.1% of
steps (a random model always has some near ties), so a greedy flip is a ~1e-5-per-step event.

CLI: ``python -m shared.models.tiny --preset tiny --arch llama --out models/tiny``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch
from tokenizers import Tokenizer

from shared.models.tiny.tokenizer import (
    ENDOFTEXT,
    IM_END,
    save_tokenizer,
    train_tokenizer,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

logger = structlog.get_logger(__name__)

# Bump whenever the produced files change; ensure_tiny_model rebuilds older directories.
FORMAT_VERSION = 2
MARKER_FILE = "baton_tiny.json"
DEFAULT_SEED = 0

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
WINDOWED_ARCHS = ("mistral", "qwen2")  # the archs built with a shorter sliding window on request


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6


PRESETS: dict[str, Preset] = {
    # Tests and the demo.
    "tiny": Preset(64, 2, 4, 2, 16, 128, 512),
    # Benchmarks: 3.6M matmul params, so 64 requests x (128 + 64) tokens is ~88 GFLOP plus
    # attention. intermediate 576 = 9 x 64 keeps every matmul dim a multiple of 64.
    "bench": Preset(256, 4, 8, 4, 32, 576, 4096),
    # The bench shape with room for long prompts (loadtest/engine/longctx.py: 8k-token prompts).
    "bench-long": Preset(256, 4, 8, 4, 32, 576, 4096, max_position_embeddings=16384),
    # A real size: Qwen2-0.5B's layer shapes (24 layers, d=896, ffn 4864, 14 query / 2 KV heads
    # of 64) with a 4k vocabulary, ~360M matmul params. Build with arch="qwen2" for its layout.
    "qwen2-0.5b": Preset(896, 24, 14, 2, 64, 4864, 4096, rope_theta=1000000.0),
    # Past a billion parameters (1.05B; Llama-3.2-1B's layer shapes, one layer more): what an
    # engine's memory is measured on (loadtest/engine/engine_memory.py). 4.2 GB in fp32.
    "llama-1b": Preset(2048, 17, 32, 8, 64, 8192, 4096, rope_theta=500000.0),
}

# Init scales (std = gain / sqrt(fan_in) for projections), tuned by measuring greedy output.
# - Attention must be sharp (q/k gains, or q/k-norm weights for qwen3): with HF's broad init
#   attention averages the whole context and greedy decoding collapses into one repeated token.
# - The embedding is small next to what the layers add to the residual stream, so the next token
#   is not mostly a function of the current one (the tied qwen3 head otherwise echoes its input).
# - Logits have std ~LOGIT_SCALE: a confident softmax (median top-1 probability ~0.8).
# - Single-byte rows of the head are smaller, so greedy text is mostly multi-byte pieces (word
#   salad rather than mojibake) yet still emits split UTF-8. Special tokens keep full rows so
#   greedy output sometimes ends on EOS.
EMBED_STD = 0.1
QK_GAIN = 2.0
QK_NORM_GAIN = 2.0
PROJ_GAIN = 1.0
RESIDUAL_GAIN = 2.0
BIAS_STD = 0.15
NORM_RANGE = (0.6, 1.4)
LOGIT_SCALE = 8.0
BYTE_ROW_SCALE = 0.6


def _make_config(
    p: Preset, arch: str, eos_token_id: int, pad_token_id: int, window: int | None = None
) -> PretrainedConfig:
    """``window``: a sliding window shorter than the positions (mistral: every layer; qwen2:
    the upper half of the layers, ``max_window_layers``); None: the arch's default."""
    if window is not None and arch not in WINDOWED_ARCHS:
        raise ValueError(f"a sliding window needs one of {WINDOWED_ARCHS}, not {arch!r}")
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = dict(
        vocab_size=p.vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads,
        head_dim=p.head_dim,
        max_position_embeddings=p.max_position_embeddings,
        rope_theta=p.rope_theta,
        rms_norm_eps=p.rms_norm_eps,
        hidden_act="silu",
        bos_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    if arch == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False, attention_bias=False)
    if arch == "qwen2":  # q/k/v projections carry biases; no flag needed
        if window is not None:  # hybrid: the lower layers attend to everything
            return Qwen2Config(
                **common,
                tie_word_embeddings=False,
                use_sliding_window=True,
                sliding_window=window,
                max_window_layers=p.num_hidden_layers // 2,
            )
        return Qwen2Config(**common, tie_word_embeddings=False, use_sliding_window=False)
    if arch == "qwen3":  # per-head q/k RMSNorm, tied head
        return Qwen3Config(
            **common, tie_word_embeddings=True, attention_bias=False, use_sliding_window=False
        )
    if arch == "mistral":
        # Llama's layers plus an attention window: by default as long as the positions (the
        # window rule runs, and equals full attention at any length); ``window`` shortens it.
        return MistralConfig(
            **common,
            tie_word_embeddings=False,
            sliding_window=p.max_position_embeddings if window is None else window,
        )
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


def _param_generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _init_std(name: str, fan_in: int) -> float:
    if name.endswith(".bias"):
        return BIAS_STD
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        return QK_GAIN / math.sqrt(fan_in)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return RESIDUAL_GAIN / math.sqrt(fan_in)
    return PROJ_GAIN / math.sqrt(fan_in)


@torch.no_grad()
def _init_weights(model: PreTrainedModel, seed: int, byte_rows: torch.Tensor) -> None:
    """Overwrite every parameter. ``byte_rows``: bool [vocab], the single-byte tokens."""
    tied = model.config.tie_word_embeddings
    hidden = model.config.hidden_size
    # The head's base std; tied, the head is the (small) embedding and the final norm makes up
    # the difference so logits have the same scale either way.
    head_std = EMBED_STD if tied else LOGIT_SCALE / math.sqrt(hidden)
    final_norm_scale = LOGIT_SCALE / (EMBED_STD * math.sqrt(hidden)) if tied else 1.0
    for name, param in sorted(model.named_parameters()):
        g = _param_generator(seed, name)
        if name.endswith("norm.weight"):  # input/post_attention/final norm, q_norm/k_norm
            lo, hi = NORM_RANGE
            value = lo + (hi - lo) * torch.rand(param.shape, generator=g)
            if name == "model.norm.weight":
                value *= final_norm_scale
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                value *= QK_NORM_GAIN  # after q/k norm, scores scale with these weights
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            is_head = tied or name.endswith("lm_head.weight")
            std = head_std if is_head else EMBED_STD
            value = torch.randn(param.shape, generator=g) * std
            if is_head:
                value[byte_rows] *= BYTE_ROW_SCALE
        else:
            value = torch.randn(param.shape, generator=g) * _init_std(name, param.shape[-1])
        param.copy_(value)


def count_params(p: Preset, arch: str) -> dict[str, int]:
    """Stored params, and matmul params (weights a forward multiplies: the layers and the head;
    not the embedding lookup, norms or biases) which set the FLOPs: 2 x matmul per token."""
    q_out, kv_out = p.num_attention_heads * p.head_dim, p.num_key_value_heads * p.head_dim
    layer_matmul = (
        p.hidden_size * (2 * q_out + 2 * kv_out) + 3 * p.hidden_size * p.intermediate_size
    )
    layer_other = 2 * p.hidden_size
    layer_other += q_out + 2 * kv_out if arch == "qwen2" else 0  # q/k/v biases
    layer_other += 2 * p.head_dim if arch == "qwen3" else 0  # q_norm, k_norm
    head = p.vocab_size * p.hidden_size
    matmul = p.num_hidden_layers * layer_matmul + head
    embed = 0 if arch == "qwen3" else head  # tied: the head is the embedding
    total = matmul + p.num_hidden_layers * layer_other + p.hidden_size + embed
    return {"total": total, "matmul": matmul}


# transformers is imported inside the builders: it takes seconds, and ensure_tiny_model's fast
# path (the model is already there) should not pay for it.
def build_tiny_model(
    out_dir: Path,
    preset: str = "tiny",
    arch: str = "llama",
    seed: int = DEFAULT_SEED,
    window: int | None = None,
) -> Path:
    """Build the model into ``out_dir`` (created; a previous build there is overwritten).
    ``window``: a sliding window (see ``_make_config``); the weights do not depend on it."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    p = PRESETS[preset]
    out_dir = Path(out_dir)
    _refuse_foreign(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer(p.vocab_size)
    eos_id, pad_id = _token_id(tokenizer, IM_END), _token_id(tokenizer, ENDOFTEXT)
    config = _make_config(p, arch, eos_token_id=eos_id, pad_token_id=pad_id, window=window)
    # HF's own init draws from the global RNG; fork it so the caller's stream is untouched.
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, seed, _byte_rows(tokenizer))
    model.generation_config = GenerationConfig(
        bos_token_id=pad_id,
        eos_token_id=[eos_id, pad_id],
        pad_token_id=pad_id,
        do_sample=False,
    )
    model.save_pretrained(out_dir)
    _add_legacy_config_fields(out_dir / "config.json", p)
    save_tokenizer(tokenizer, out_dir, p.max_position_embeddings)

    num_params = sum(t.numel() for t in model.parameters())
    marker = {
        "format_version": FORMAT_VERSION,
        "preset": preset,
        "arch": arch,
        "seed": seed,
        "window": window,
        "num_params": num_params,
        "preset_config": asdict(p),
    }
    (out_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    logger.info("tiny_model_built", path=str(out_dir), preset=preset, arch=arch, params=num_params)
    return out_dir


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise KeyError(token)
    return token_id


def _byte_rows(tokenizer: Tokenizer) -> torch.Tensor:
    rows = torch.zeros(tokenizer.get_vocab_size(), dtype=torch.bool)
    for token, token_id in tokenizer.get_vocab().items():
        rows[token_id] = len(token) == 1  # byte-level alphabet: one char per byte
    rows[list(tokenizer.get_added_tokens_decoder())] = False  # EOS stays reachable
    return rows


def _add_legacy_config_fields(path: Path, p: Preset) -> None:
    # transformers 5 nests rope_theta under rope_parameters; keep the flat v4 key as well so
    # readers of either layout (and older transformers) see the same value.
    config = json.loads(path.read_text())
    config.setdefault("rope_theta", p.rope_theta)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _read_marker(model_dir: Path) -> dict | None:
    try:
        return json.loads((model_dir / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None


def _is_current(model_dir: Path, preset: str, arch: str, window: int | None = None) -> bool:
    marker = _read_marker(model_dir) or {}
    expected = {"format_version": FORMAT_VERSION, "preset": preset, "arch": arch, "window": window}
    return all(marker.get(k) == v for k, v in expected.items()) and "seed" in marker


def ensure_tiny_model(
    out_dir: Path, preset: str = "tiny", arch: str = "llama", window: int | None = None
) -> Path:
    """Return ``out_dir`` holding the (preset, arch, window) model, building it once if needed.

    Built into a temp dir beside ``out_dir`` and renamed into place, so readers never see a
    half-written model. Racing builders are safe: the rename fails for all but one and the
    losers use the winner's directory. A directory from an older builder is replaced; one
    without our marker is someone else's model and is never touched.
    """
    out_dir = Path(out_dir)
    if _is_current(out_dir, preset, arch, window):
        return out_dir
    _refuse_foreign(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.build-", dir=out_dir.parent))
    try:
        build_tiny_model(tmp, preset=preset, arch=arch, seed=DEFAULT_SEED, window=window)
        _make_readable(tmp)  # mkdtemp is 0700; services may run as other users
        for _ in range(3):
            if _is_current(out_dir, preset, arch, window):
                return out_dir  # another process won the race
            _move_aside(out_dir)
            try:
                os.rename(tmp, out_dir)
                return out_dir
            except OSError:  # someone renamed theirs in between; re-check theirs
                continue
        raise RuntimeError(f"could not install tiny model at {out_dir}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _refuse_foreign(model_dir: Path) -> None:
    """Never overwrite a directory this module did not build (it may be a real model)."""
    if model_dir.is_dir() and any(model_dir.iterdir()) and _read_marker(model_dir) is None:
        raise FileExistsError(
            f"{model_dir} is not empty and has no {MARKER_FILE}: not built by shared.models.tiny"
            " (or an interrupted build; delete it to rebuild)"
        )


def _make_readable(model_dir: Path) -> None:
    model_dir.chmod(0o755)
    for path in model_dir.iterdir():
        path.chmod(0o644)


def _move_aside(model_dir: Path) -> None:
    """Remove a stale (or empty) model dir without ever exposing a half-deleted one."""
    if not model_dir.exists():
        return
    trash = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.stale-", dir=model_dir.parent))
    try:
        os.rename(model_dir, trash / "old")
    except FileNotFoundError:
        pass  # another process already moved it
    shutil.rmtree(trash, ignore_errors=True)


def model_dir_name(preset: str, arch: str, window: int | None = None) -> str:
    """models/<name>: tiny + llama is the built-in model BatonConfig points at by default."""
    name = preset if arch == "llama" else f"{preset}-{arch}"
    return name if window is None else f"{name}-w{window}"


def _default_out(preset: str, arch: str, window: int | None = None) -> Path:
    from shared.config import TINY_RANDOM_DIR

    return TINY_RANDOM_DIR.parent / model_dir_name(preset, arch, window)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build a deterministic tiny HF model.")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument(
        "--window", type=int, default=None, help=f"a sliding window ({', '.join(WINDOWED_ARCHS)})"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="default: models/tiny, models/<preset>[-<arch>][-w<window>]",
    )
    args = parser.parse_args(argv)
    out = args.out or _default_out(args.preset, args.arch, args.window)
    build_tiny_model(out, preset=args.preset, arch=args.arch, seed=args.seed, window=args.window)
    p = PRESETS[args.preset]
    counts = count_params(p, args.arch)
    gflop = 2 * counts["matmul"] * 64 * (128 + 64) / 1e9
    print(f"built {args.preset}/{args.arch} (seed {args.seed}) at {out}")
    print(f"  params: {counts['total']:,} total, {counts['matmul']:,} in matmuls")
    print(f"  vocab: {p.vocab_size}, hidden {p.hidden_size}, layers {p.num_hidden_layers}")
    print(f"  64 requests x (128 prompt + 64 output) tokens ~ {gflop:.1f} GFLOP (no attention)")


if __name__ == "__main__":
    main()
