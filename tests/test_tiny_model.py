"""The tiny-model builder: real HF files that transformers loads offline, deterministic bytes,
confident greedy logits, a byte-level tokenizer with a ChatML template, atomic ensure."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from shared.models.tiny.builder import (
    ARCHS,
    MARKER_FILE,
    PRESETS,
    _make_config,
    build_tiny_model,
    count_params,
    ensure_tiny_model,
    main,
)
from shared.models.tiny.tokenizer import ENDOFTEXT, IM_END, IM_START

HF_FILES = (
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    MARKER_FILE,
)
CHATS = [
    [{"role": "user", "content": "Hello! Who are you?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "héllo wörld — 你好 🙂"},
    ],
]
PLAIN_PROMPTS = ["The river town woke slowly.", "def foo(x):"]
NON_ASCII = ["héllo wörld — 你好 🙂", "Zürich straße naïve café", "Москва 中文模型 ✨🚀 x"]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module", params=ARCHS)
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp(request.param), "tiny", request.param)


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return model.eval(), tokenizer


def test_files_and_config(model_dir: Path) -> None:
    for name in HF_FILES:
        assert (model_dir / name).is_file(), name
    marker = json.loads((model_dir / MARKER_FILE).read_text())
    arch = marker["arch"]
    config = json.loads((model_dir / "config.json").read_text())
    p = PRESETS["tiny"]
    assert config["model_type"] == arch
    assert config["vocab_size"] == p.vocab_size
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA
    assert config["head_dim"] == p.head_dim
    assert config["tie_word_embeddings"] == (arch == "qwen3")
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == p.rope_theta
    # Mistral's window is set (the engine's sliding-window rule applies) and covers every position.
    window = p.max_position_embeddings if arch == "mistral" else None
    assert config.get("sliding_window") == window
    assert marker["num_params"] == count_params(p, arch)["total"]


def test_hf_loads_weights_as_built(model_dir: Path, hf) -> None:
    model, _ = hf
    arch = model.config.model_type
    state = model.state_dict()
    norms = [v for k, v in state.items() if k.endswith("norm.weight")]
    # Norm weights are random, so an implementation that ignores them produces other tokens.
    assert all(w.std() > 0.05 for w in norms)
    biases = [k for k in state if k.endswith("_proj.bias")]
    if arch == "qwen2":
        assert len(biases) == 3 * model.config.num_hidden_layers
        assert all(state[k].abs().mean() > 0.05 for k in biases)
    else:
        assert not biases
    if arch == "qwen3":
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        assert any(k.endswith("q_norm.weight") for k in state)
    else:
        assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def _greedy_prompts(tokenizer) -> list[list[int]]:
    chats = [
        tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in CHATS
    ]
    return [tokenizer(p).input_ids for p in chats + PLAIN_PROMPTS]


def test_greedy_margins_clear_fp32_noise(hf) -> None:
    """Every greedy step's top-1 beats top-2 by far more than fp32 rounding moves a logit, so a
    correct native engine reproduces HF greedy output token for token. The floor is relative
    (1e-4 of the largest logit; fp32 error is ~1e-6 of it) and absolute against the measured
    fp32-vs-fp64 logit error at that very step."""
    model, tokenizer = hf
    model64 = AutoModelForCausalLM.from_pretrained(model.name_or_path, local_files_only=True)
    model64 = model64.double().eval()
    for prompt in _greedy_prompts(tokenizer):
        ids = torch.tensor([prompt])
        out = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None)
        generated = out[0, len(prompt) :]
        with torch.no_grad():
            logits = model(out).logits[0, len(prompt) - 1 : -1]
            logits64 = model64(out).logits[0, len(prompt) - 1 : -1]
        assert torch.equal(logits.argmax(-1), generated)
        top2 = logits.topk(2, dim=-1).values
        gap = (top2[:, 0] - top2[:, 1]).double()
        fp32_error = (logits.double() - logits64).abs().amax(-1)
        assert (gap > 1e-4 * logits.abs().amax(-1)).all(), gap
        assert (gap > 100 * fp32_error).all(), (gap, fp32_error)
        # Confident, yet not one token repeated forever.
        assert logits.softmax(-1).amax(-1).median() > 0.5
        assert len(set(generated.tolist())) >= 8, tokenizer.decode(generated)


def test_generation_config_and_special_tokens(model_dir: Path, hf) -> None:
    model, tokenizer = hf
    eos, im_start, im_end = (
        tokenizer.convert_tokens_to_ids(t) for t in (ENDOFTEXT, IM_START, IM_END)
    )
    assert (eos, im_start, im_end) == (0, 1, 2)
    assert tokenizer.eos_token == tokenizer.pad_token == ENDOFTEXT
    assert set(model.generation_config.eos_token_id) == {eos, im_end}
    assert model.generation_config.pad_token_id == eos
    special_map = json.loads((model_dir / "special_tokens_map.json").read_text())
    assert special_map["additional_special_tokens"] == [IM_START, IM_END]
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert raw.get_vocab_size() == model.config.vocab_size
    text = f"{IM_START}user\nhi{IM_END}\n"
    assert raw.encode(text).ids == tokenizer(text).input_ids  # raw and HF agree, no BOS added


def test_chat_template(hf) -> None:
    _, tokenizer = hf
    messages = CHATS[1] + [{"role": "assistant", "content": "ok"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert rendered == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nhéllo wörld — 你好 🙂<|im_end|>\n"
        "<|im_start|>assistant\nok<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer(prompt).input_ids
    assert ids.count(tokenizer.convert_tokens_to_ids(IM_START)) == 2  # one token each


def test_non_ascii_round_trip_and_split_pieces(hf) -> None:
    _, tokenizer = hf
    for text in NON_ASCII:
        ids = tokenizer(text).input_ids
        assert tokenizer.decode(ids) == text
    # Some characters span several tokens, so detokenizing a prefix can end mid-character:
    # the case incremental detokenization must hold back.
    ids = tokenizer(NON_ASCII[0]).input_ids
    prefixes = [tokenizer.decode(ids[:n]) for n in range(1, len(ids))]
    assert any(p.endswith("\ufffd") for p in prefixes)


def test_build_is_deterministic(model_dir: Path, tmp_path: Path) -> None:
    arch = json.loads((model_dir / MARKER_FILE).read_text())["arch"]
    again = build_tiny_model(tmp_path / "again", "tiny", arch)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert _sha256(again / name) == _sha256(model_dir / name), name
    other = build_tiny_model(tmp_path / "seed1", "tiny", arch, seed=1)
    assert _sha256(other / "model.safetensors") != _sha256(model_dir / "model.safetensors")
    assert _sha256(other / "tokenizer.json") == _sha256(model_dir / "tokenizer.json")


def test_build_leaves_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m", "tiny", "llama")
    assert torch.equal(torch.rand(4), expected)


def test_ensure_builds_once_and_replaces_stale(tmp_path: Path) -> None:
    target = tmp_path / "models" / "tiny"
    results: list[Path] = []
    racers = [
        threading.Thread(target=lambda: results.append(ensure_tiny_model(target))) for _ in range(2)
    ]
    for t in racers:
        t.start()
    for t in racers:
        t.join()
    assert results == [target, target]
    marker = json.loads((target / MARKER_FILE).read_text())
    assert (marker["preset"], marker["arch"], marker["seed"]) == ("tiny", "llama", 0)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["tiny"]  # no temp left
    assert (target.stat().st_mode & 0o777) == 0o755

    inode = (target / "model.safetensors").stat().st_ino
    assert ensure_tiny_model(target) == target
    assert (target / "model.safetensors").stat().st_ino == inode  # not rebuilt

    marker["format_version"] = 0  # a directory from an older builder
    (target / MARKER_FILE).write_text(json.dumps(marker))
    ensure_tiny_model(target)
    assert json.loads((target / MARKER_FILE).read_text())["format_version"] != 0

    ensure_tiny_model(target, arch="qwen3")  # a different model is asked for: rebuilt
    assert json.loads((target / "config.json").read_text())["model_type"] == "qwen3"


def test_ensure_refuses_foreign_dir(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileExistsError):
        ensure_tiny_model(tmp_path)
    with pytest.raises(FileExistsError):
        build_tiny_model(tmp_path)
    assert (tmp_path / "config.json").read_text() == "{}"


@pytest.mark.parametrize("arch", ARCHS)
def test_count_params_matches_hf(arch: str) -> None:
    for name, p in PRESETS.items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(_make_config(p, arch, 2, 0))
        assert count_params(p, arch)["total"] == sum(t.numel() for t in model.parameters()), name
    bench = count_params(PRESETS["bench"], arch)["matmul"]
    assert 3.0e6 < bench < 4.0e6  # 64 x (128 + 64) tokens ~ 90 GFLOP


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["--preset", "tiny", "--arch", "qwen2", "--out", str(tmp_path / "m")])
    out = capsys.readouterr().out
    assert "tiny/qwen2" in out and "vocab: 512" in out and "params:" in out
    assert (tmp_path / "m" / "model.safetensors").is_file()
