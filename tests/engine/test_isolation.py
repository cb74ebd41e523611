"""One bad request fails alone: a forward that raises whenever one request is in it (a fault
bound to that request id, injected into the real model runner) fails that request and no other.
A batch of 16: 1 ``internal`` error, 15 completions token-for-token equal to Hugging Face's
greedy output — in prefill's batch and in decode's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from shared.runtime import ModelRunner
from shared.wire.errors import ErrorCode
from tests.runtime.helpers import EnginePair, greedy, hf_greedy, tiny_model_dir

MODEL = tiny_model_dir("llama")
NUM_REQUESTS = 16
POISON = "req-7"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def hf() -> Iterator[Any]:
    yield AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()


def prompt(i: int) -> list[int]:
    return [(7 * i + 13 * k) % 500 + 3 for k in range(10 + i % 5)]


def poison(monkeypatch: pytest.MonkeyPatch, runner: ModelRunner, name: str) -> list[int]:
    """``runner.<name>`` raises whenever POISON is among its sequences; returns the sizes of
    the forwards that were run."""
    real = getattr(runner, name)
    sizes: list[int] = []

    def forward(seqs: list[Any], *args: Any) -> Any:
        sizes.append(len(seqs))
        if any(s.request_id == POISON for s in seqs):
            raise RuntimeError(f"injected fault bound to {POISON}")
        return real(seqs, *args)

    monkeypatch.setattr(runner, name, forward)
    return sizes


@pytest.mark.parametrize("stage", ["prefill", "decode"])
def test_a_poisoned_request_fails_alone_in_a_batch_of_16(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hf: Any, stage: str
) -> None:
    wide = {"max_num_seqs": NUM_REQUESTS, "prefill_max_num_seqs": NUM_REQUESTS}
    pair = EnginePair.build(MODEL, tmp_path / "spill", prefill=wide, decode=wide)
    engine = pair.prefill if stage == "prefill" else pair.decode
    # The prefill engine's forward samples every choice's first token (prefill_choices).
    sizes = poison(monkeypatch, engine.runner, "prefill_choices" if stage == "prefill" else stage)
    rids = [f"req-{i}" for i in range(NUM_REQUESTS)]
    for i, rid in enumerate(rids):
        pair.add(rid, prompt(i), greedy(MAX_TOKENS, ignore_eos=True))
    pair.run()
    assert NUM_REQUESTS in sizes, f"the {stage} batch held all 16: {sizes}"
    assert list(pair.errors) == [POISON]
    error = pair.errors[POISON]
    assert error.code is ErrorCode.INTERNAL and error.message == f"{stage} failed: RuntimeError"
    for i, rid in enumerate(rids):
        if rid != POISON:
            expected = hf_greedy(hf, prompt(i), greedy(MAX_TOKENS, ignore_eos=True))
            assert pair.tokens[rid] == expected, rid
            assert pair.finish[rid] == "length"
    assert len(pair.finish) == NUM_REQUESTS - 1
    pair.assert_clean()
    pair.close()
