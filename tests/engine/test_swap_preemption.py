"""Swap preemption across decode workers (``BATON_DECODE_PREEMPTION=swap``, the default).

One prefill engine and two decode engines, built as the services build them, wired as the broker
would: prefill's handoffs go to decode A, whose cache is too small for its batch; what A swaps
out goes to decode B (as ``baton.decode`` would give it to a worker with room), and back. Every
completion equals Hugging Face's greedy output; A swapped out, B swapped in, and no engine
recomputed anything (no prefill forward ran in either decode engine).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoModelForCausalLM

from shared.config import BatonConfig
from shared.engine.build import build_decode_engine, build_prefill_engine
from shared.engine.decode import DecodeEngine
from shared.engine.engine import EngineCore
from shared.engine.outputs import AddResult, Handoff, NewRequest, StepOutput
from tests.runtime.helpers import (
    ForwardLog,
    engine_config,
    greedy,
    hf_greedy,
    torch_threads,
)

PROMPTS = [[(11 * i + 7 * j) % 300 + 5 for j in range(n)] for i, n in enumerate((21, 30, 37, 18))]
MAX_TOKENS = 40


class Wiring:
    """Plumbing only: handoffs become ``add``s on the engine the test routes them to."""

    def __init__(self, prompts: list[list[int]]) -> None:
        self.prompts = dict(enumerate(prompts))
        self.tokens: dict[str, dict[int, int]] = {f"r{i}": {} for i in self.prompts}
        self.finished: set[str] = set()

    def collect(self, out: StepOutput) -> None:
        for t in out.tokens:
            for k, token in enumerate(t.token_ids):
                self.tokens[t.request_id].setdefault(t.index + k, token)
            if t.finish_reason is not None:
                self.finished.add(t.request_id)

    def deliver(
        self, handoffs: list[Handoff], to: DecodeEngine, max_tokens: int = MAX_TOKENS
    ) -> None:
        for h in handoffs:
            prompt = self.prompts[int(h.request_id[1:])]
            req = NewRequest(h.request_id, prompt, greedy(max_tokens, ignore_eos=True),
                             output_token_ids=h.output_token_ids, priority=h.priority,
                             kv=h.kv)  # fmt: skip
            assert to.add(req) is AddResult.ADDED

    def completion(self, rid: str) -> list[int]:
        got = self.tokens[rid]
        return [got[i] for i in range(len(got))]

    def completions(self) -> list[list[int]]:
        """Every request's tokens, in the prompts' order."""
        return [self.completion(f"r{i}") for i in self.prompts]


def run_ring(prefill: EngineCore, decoders: list[DecodeEngine]) -> Wiring:
    """PROMPTS through ``prefill``, which hands off to the first decoder; what a decoder swaps
    out goes to the next one (the last's to the first), until every request has finished."""
    wiring = Wiring(PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        assert prefill.add(NewRequest(f"r{i}", prompt, greedy(MAX_TOKENS, True))) is AddResult.ADDED
    with torch_threads(1):
        for _ in range(500):
            if not any(e.has_work() for e in (prefill, *decoders)):
                break
            out = prefill.step()
            wiring.collect(out)
            wiring.deliver(out.handoffs, decoders[0])
            for k, engine in enumerate(decoders):
                out = engine.step()
                wiring.collect(out)
                wiring.deliver(out.handoffs, decoders[(k + 1) % len(decoders)])
    assert wiring.finished == set(wiring.tokens)
    return wiring


def hf_completions(
    model_dir: Path, prompts: list[list[int]], max_tokens: list[int]
) -> list[list[int]]:
    """Hugging Face's greedy output of each prompt (EOS ignored), on one thread."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    with torch_threads(1):
        return [
            hf_greedy(hf, prompt, greedy(n, ignore_eos=True))
            for prompt, n in zip(prompts, max_tokens, strict=True)
        ]


def test_sequences_swapped_out_on_one_decode_worker_resume_on_the_other(
    model_dir: Path, tmp_path: Path
) -> None:
    def config(blocks: int, **kw: Any) -> BatonConfig:
        return engine_config(model_dir, blocks, spill_dir=str(tmp_path / "spill"), **kw)

    prefill = build_prefill_engine(config(64), model_dir)
    # A: 10 blocks of 16 tokens for four sequences growing to 58-77 tokens (4-5 blocks each).
    decode_a = build_decode_engine(config(10), model_dir)
    decode_b = build_decode_engine(config(64), model_dir)
    logs = ForwardLog(decode_a.runner), ForwardLog(decode_b.runner)
    wiring = run_ring(prefill, [decode_a, decode_b])
    assert decode_a.scheduler.num_swaps > 0 and decode_b.num_swaps_in > 0
    # B resumed them from the spill store on its prefetch thread, overlapped with its steps.
    assert decode_b.prefetch is not None and decode_b.prefetch.num_started == decode_b.num_swaps_in
    for engine, log in zip((decode_a, decode_b), logs, strict=True):
        assert engine.scheduler.num_preemptions == 0  # no preemption by recompute
        assert log.prefills == []  # and no KV rebuilt: every forward was a decode step
        assert engine.block_manager.num_used_blocks == 0
    assert not list((tmp_path / "spill").rglob("*.kv"))  # every swapped-out entry was read
    assert wiring.completions() == hf_completions(model_dir, PROMPTS, [MAX_TOKENS] * len(PROMPTS))


def test_recompute_mode_keeps_the_sequence_here(model_dir: Path, tmp_path: Path) -> None:
    cfg = engine_config(model_dir, 10, spill_dir=str(tmp_path), decode_preemption="recompute")
    engine = build_decode_engine(cfg, model_dir)
    assert engine.spill is None and engine.scheduler.swap_out is None
    with pytest.raises(ValueError, match="BATON_DECODE_PREEMPTION"):
        build_decode_engine(cfg.replace(decode_preemption="drop"), model_dir)
