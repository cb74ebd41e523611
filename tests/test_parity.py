"""Greedy parity with Hugging Face: Baton's engine emits exactly transformers' tokens.

fp32 on CPU, tiny llama / qwen2 / qwen3. The engine is driven the way the services drive it:
batched and chunked prefill under a token budget, continuous-batching decode with sequences
joining mid-way, prefix-cache hits, preemption with recompute, and the disaggregated handoff
(prefill in one ModelRunner, KV moved with read_blocks -> write_blocks, decode in another).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shared.engine import BlockManager, ModelRunner, Sequence
from tests.engine.helpers import (
    MiniEngine,
    greedy,
    hf_greedy,
    make_runner,
    tiny_model_dir,
    torch_threads,
)

ARCHS = ("llama", "qwen2", "qwen3")
TEXT = (
    "The river town woke slowly. Fishermen pushed their boats into the grey water while the "
    "baker opened his shutters and the smell of warm bread drifted down the narrow streets."
)


@dataclass(frozen=True)
class Case:
    name: str
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool


@dataclass
class Model:
    arch: str
    path: Path
    hf: Any  # transformers PreTrainedModel
    cases: list[Case]
    expected: dict[str, list[int]]  # case name -> HF greedy tokens

    def reference(self, prompt: list[int], max_tokens: int, ignore_eos: bool = True) -> list[int]:
        return hf_greedy(self.hf, prompt, greedy(max_tokens, ignore_eos))


def build_cases(path: Path, vocab_size: int) -> list[Case]:
    tokenizer = AutoTokenizer.from_pretrained(path)
    rng = random.Random(1234)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(n)]

    def chat(messages: list[dict[str, str]]) -> list[int]:
        out: Any = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
        # transformers 5 returns a BatchEncoding, 4.x a plain list of ids.
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    short_chat = chat([{"role": "user", "content": "Where does the road go after the bridge?"}])
    long_chat = chat(
        [
            {"role": "system", "content": "You are a patient guide to the river town."},
            {"role": "user", "content": TEXT},
            {"role": "assistant", "content": "The baker knows every road in town."},
            {"role": "user", "content": "Then ask him where the traveller should sleep."},
        ]
    )
    cases = [
        Case("ids-1", ids(1), 24, True),
        Case("text-short", tokenizer(TEXT[:27])["input_ids"], 16, False),
        Case("chat-short", short_chat, 16, False),
        Case("ids-16", ids(16), 8, False),  # exactly one block
        Case("text-long", tokenizer(TEXT)["input_ids"], 16, False),
        Case("chat-long", long_chat, 24, False),
        Case("ids-64", ids(64), 64, True),  # block-aligned prompt, long output
        Case("ids-129", ids(129), 12, False),  # one past a budget-sized chunk
        Case("ids-300", ids(300), 20, True),  # chunked over three prefill steps
    ]
    lengths = sorted(len(c.prompt) for c in cases)
    assert lengths[0] == 1 and lengths[-1] == 300, lengths
    return cases


@pytest.fixture(scope="module", params=ARCHS)
def model(request: pytest.FixtureRequest) -> Iterator[Model]:
    arch = request.param
    with torch_threads(1):
        path = tiny_model_dir(arch)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        cases = build_cases(path, hf.config.vocab_size)
        expected = {
            c.name: hf_greedy(hf, c.prompt, greedy(c.max_tokens, c.ignore_eos)) for c in cases
        }
        yield Model(arch, path, hf, cases, expected)


@pytest.fixture
def runner(model: Model) -> Iterator[ModelRunner]:
    with torch_threads(1):
        yield make_runner(model.path, num_kv_blocks=128)


def test_continuous_batching_matches_hf(model: Model, runner: ModelRunner) -> None:
    engine = MiniEngine(runner, token_budget=128)
    for case in model.cases:
        engine.add(Sequence(case.name, case.prompt, greedy(case.max_tokens, case.ignore_eos)))
    with torch_threads(1):
        finished = engine.run()
    # The scenario really batched, chunked and joined mid-way.
    assert any(len(batch) >= 3 for batch in engine.prefill_batches)
    chunks = [n for batch in engine.prefill_batches for rid, n in batch if rid == "ids-300"]
    assert len(chunks) >= 3 and max(chunks) <= 128 and sum(chunks) == 300
    for case in model.cases:
        assert finished[case.name].output_token_ids == model.expected[case.name], case.name
    assert engine.block_manager.num_used_blocks == 0


def test_prefix_cache_hits_match_hf(model: Model, runner: ModelRunner) -> None:
    bs = runner.block_size
    rng = random.Random(99)
    vocab = runner.model_config.vocab_size
    prefix = [rng.randrange(3, vocab) for _ in range(2 * bs)]
    first = prefix + [rng.randrange(3, vocab) for _ in range(10)]
    cases = {
        "first": first,
        "shares-2-blocks": prefix + [rng.randrange(3, vocab) for _ in range(7)],
        "prefix-plus-one": first[: 2 * bs + 1],  # hit covers 2 blocks, computes 1 token
        "exact-prefix": prefix,  # full hit would leave nothing to compute: 1 block is reused
    }
    engine = MiniEngine(runner)
    with torch_threads(1):
        engine.add(Sequence("first", first, greedy(6)))
        engine.run()  # its prompt blocks are computed and published before the others arrive
        for name, prompt in list(cases.items())[1:]:
            engine.add(Sequence(name, prompt, greedy(6)))
        finished = engine.run()
        expected = {
            name: model.reference(prompt, 6, ignore_eos=False) for name, prompt in cases.items()
        }
    cached = {name: finished[name].num_cached_tokens for name in cases}
    assert cached == {
        "first": 0,
        "shares-2-blocks": 2 * bs,
        "prefix-plus-one": 2 * bs,
        "exact-prefix": bs,
    }
    assert engine.block_manager.num_prefix_hit_tokens == 5 * bs
    for name in cases:
        assert finished[name].output_token_ids == expected[name], name


def test_preempted_sequence_recomputes_to_the_same_tokens(
    model: Model, runner: ModelRunner
) -> None:
    case = next(c for c in model.cases if c.name == "ids-64")
    other = next(c for c in model.cases if c.name == "chat-long")
    engine = MiniEngine(runner)
    victim = Sequence(case.name, case.prompt, greedy(case.max_tokens, case.ignore_eos))
    engine.add(victim)
    engine.add(Sequence(other.name, other.prompt, greedy(other.max_tokens, other.ignore_eos)))
    with torch_threads(1):
        engine.prefill_step()
        for _ in range(20):
            engine.decode_step()
        engine.preempt(victim)  # 85 tokens to recompute: 80 of them are prefix-cache hits
        finished = engine.run()
    assert (
        victim.num_cached_tokens == (len(case.prompt) + 20) // runner.block_size * runner.block_size
    )
    assert finished[case.name].output_token_ids == model.expected[case.name]
    assert finished[other.name].output_token_ids == model.expected[other.name]


def test_disaggregated_handoff_matches_hf(model: Model, runner: ModelRunner) -> None:
    """Prefill in one runner, move the KV with read_blocks -> write_blocks, decode in another."""
    names = ("chat-short", "ids-129", "ids-300", "text-long")
    cases = [c for c in model.cases if c.name in names]
    with torch_threads(1):
        decode_runner = make_runner(model.path, num_kv_blocks=96)
        prefill_bm = BlockManager(runner.num_kv_blocks, runner.block_size)
        decode = MiniEngine(decode_runner)
        decode_bm = decode.block_manager
        # Occupy some decode blocks so block ids differ between the two engines.
        decode_bm.allocate_blocks(Sequence("filler", [0], greedy(1)), 5 * decode_runner.block_size)
        for case in cases:
            seq = Sequence(case.name, case.prompt, greedy(case.max_tokens, case.ignore_eos))
            prefill_bm.allocate(seq)
            first = runner.prefill([seq], [seq.num_tokens])[0]
            assert first is not None
            kv = runner.read_blocks(seq.block_table)
            prefill_bm.free(seq)
            runner.kv_cache.zero_()  # the copy must not alias the prefill pool

            received = Sequence(case.name, case.prompt, seq.sampling)
            decode_bm.allocate_blocks(received, received.num_tokens)
            decode_runner.write_blocks(received.block_table, kv)
            received.num_computed_tokens = received.num_tokens
            received.append_token(first)
            if received.num_output_tokens >= received.sampling.max_tokens:
                decode.finished[case.name] = received
            else:
                decode.running.append(received)
            decode.decode_step()  # decode batch grows while handoffs arrive
        finished = decode.run()
    for case in cases:
        assert finished[case.name].output_token_ids == model.expected[case.name], case.name
