"""ModelConfig parsing and checkpoint loading edge cases (sharded weights, tied heads, rope)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.runtime.loader import load_model, read_checkpoint, safetensors_files
from shared.runtime.model_config import ModelConfig
from tests.runtime.helpers import tiny_model_dir

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}
# Llama 3's RoPE scaling, with an original context short enough for the tiny sizes to reach it.
LLAMA3_ROPE: dict[str, Any] = {
    "rope_theta": 5e5,
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def test_llama_defaults_and_eos_merge() -> None:
    cfg = ModelConfig.from_dict({**BASE, "eos_token_id": 2}, {"eos_token_id": [2, 7]})
    assert cfg.arch == "llama" and cfg.head_dim == 8 and cfg.num_kv_heads == 4
    assert cfg.eos_token_ids == (2, 7)
    assert not cfg.qkv_bias and not cfg.qk_norm and cfg.rope_type == "default"
    assert cfg.rope_theta == 10000.0


def test_arch_flags() -> None:
    qwen2 = ModelConfig.from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.qk_norm
    qwen3 = ModelConfig.from_dict(
        {**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 16, "eos_token_id": [5, 6]}
    )
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 16
    assert qwen3.eos_token_ids == (5, 6)
    mistral = ModelConfig.from_dict({"model_type": "mistral", **BASE, "architectures": None})
    assert mistral.arch == "llama"
    biased = ModelConfig.from_dict({**BASE, "attention_bias": True})
    assert biased.qkv_bias and biased.o_bias
    with pytest.raises(ValueError, match="unsupported model"):
        ModelConfig.from_dict({**BASE, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})


def test_sliding_window_as_transformers_applies_it() -> None:
    def window(**raw: Any) -> int | None:
        return ModelConfig.from_dict({**BASE, **raw}).sliding_window

    assert window() is None  # llama
    mistral = {"architectures": ["MistralForCausalLM"]}
    assert window(**mistral, sliding_window=4096) == 4096  # every layer
    assert window(**mistral, sliding_window=None) is None  # Mistral v0.2+
    qwen2 = {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 64}
    assert window(**qwen2, use_sliding_window=False, max_window_layers=0) is None
    assert window(**qwen2, use_sliding_window=True, max_window_layers=2) is None  # 2 layers
    assert window(**qwen2, use_sliding_window=True, max_window_layers=1) == 64
    assert window(**qwen2, layer_types=["full_attention", "sliding_attention"]) == 64
    assert window(**qwen2, layer_types=["full_attention"] * 2, use_sliding_window=True) is None
    assert ModelConfig.from_dir(tiny_model_dir("mistral")).sliding_window == 4096
    for arch in ("llama", "qwen2", "qwen3"):
        assert ModelConfig.from_dir(tiny_model_dir(arch)).sliding_window is None


def test_rope_layouts() -> None:
    old = ModelConfig.from_dict(
        {**BASE, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    )
    new = ModelConfig.from_dict(
        {**BASE, "rope_parameters": {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}}
    )
    assert old == new and old.rope_theta == 5e5
    base = ModelConfig.from_dict({**BASE, "rope_theta": 5e5})
    assert torch.allclose(new.inv_freq(), base.inv_freq() / 2)
    llama3 = ModelConfig.from_dict({**BASE, "rope_parameters": LLAMA3_ROPE})
    inv = llama3.inv_freq()
    assert inv[0] == base.inv_freq()[0]  # high frequency: untouched
    assert math.isclose(inv[-1].item(), base.inv_freq()[-1].item() / 8, rel_tol=1e-6)
    with pytest.raises(ValueError, match="unsupported rope type"):
        ModelConfig.from_dict({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_matches_transformers_rope_for_llama3() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    sizes: dict[str, Any] = {k: v for k, v in BASE.items() if k != "architectures"}
    hf_cfg = LlamaConfig(**sizes, rope_parameters=dict(LLAMA3_ROPE))
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg)
    ours = ModelConfig.from_dict({**BASE, "rope_parameters": LLAMA3_ROPE}).inv_freq()
    assert torch.equal(ours, expected)


def test_sharded_checkpoint_loads_like_the_single_file(tmp_path: Path) -> None:
    src = tiny_model_dir("qwen2")
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(tmp_path / shard))
        weight_map.update(dict.fromkeys(shard_names, shard))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for extra in ("config.json", "generation_config.json"):
        (tmp_path / extra).write_bytes((src / extra).read_bytes())
    assert len(safetensors_files(tmp_path)) == 2
    assert (
        read_checkpoint(tmp_path, torch.float32).keys()
        == read_checkpoint(src, torch.float32).keys()
    )
    _, sharded = load_model(tmp_path, torch.device("cpu"), torch.float32)
    _, single = load_model(src, torch.device("cpu"), torch.float32)
    for (name, a), (_, b) in zip(
        sharded.state_dict().items(), single.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_tied_head_is_the_embedding() -> None:
    cfg, model = load_model(tiny_model_dir("qwen3"), torch.device("cpu"), torch.float32)
    assert cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()


def test_missing_weight_is_reported(tmp_path: Path) -> None:
    src = tiny_model_dir("llama")
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_bytes((src / "config.json").read_bytes())
    with pytest.raises(KeyError, match="layers.1.mlp.up_proj.weight"):
        load_model(tmp_path, torch.device("cpu"), torch.float32)
