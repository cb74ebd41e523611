"""Logprobs through the production engines, against Hugging Face on the same weights (fp32).

A sampled token's logprob, its rank and its alternatives, and each prompt token's logprob, must
be ``log_softmax`` of HF's logits at the position before it, within 1e-4: through chunked
prefill (the prompt is scored chunk by chunk), a prefill -> decode handoff, and for a sampled
request with penalties (vLLM's default ``raw_logprobs``: the model's own distribution, before
penalties and temperature). A prompt asking for its logprobs is computed whole even when its
prefix is cached (vLLM's rule), and a request asking nothing gets no entries.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from shared.wire.sampling import SamplingParams
from tests.runtime.helpers import EnginePair, tiny_model_dir, torch_threads

TOL = 1e-4


@pytest.fixture(scope="module")
def model() -> Iterator[tuple[Path, Any]]:
    path = tiny_model_dir("llama")
    with torch_threads(1):
        yield path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logprobs(hf: Any, ids: list[int]) -> torch.Tensor:
    """``[len(ids), V]``: row ``p`` scores the token at position ``p + 1``."""
    with torch.inference_mode(), torch_threads(1):
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check(entry: list[Any], row: torch.Tensor, token: int, num_top: int) -> None:
    token_id, logprob, rank, top_ids, top_lps = entry
    assert token_id == token
    assert abs(logprob - row[token].item()) < TOL
    assert rank == int((row >= row[token]).sum())
    want = row.topk(num_top)
    assert top_ids == want.indices.tolist()
    diffs = [abs(a - b) for a, b in zip(top_lps, want.values.tolist(), strict=True)]
    assert max(diffs, default=0.0) < TOL


def test_sampled_and_prompt_logprobs_equal_hf(model: tuple[Path, Any], tmp_path: Path) -> None:
    path, hf = model
    vocab = hf.config.vocab_size
    prompt = [(i * 37 + 5) % (vocab - 3) + 3 for i in range(40)]
    asks = {
        "greedy": SamplingParams(max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=3),
        # raw logprobs: penalties and temperature change the draw, not what is reported
        "sampled": SamplingParams(
            max_tokens=5,
            ignore_eos=True,
            temperature=0.8,
            seed=7,
            repetition_penalty=1.3,
            logprobs=2,
        ),
        "plain": SamplingParams(max_tokens=4, ignore_eos=True),
    }
    # 16-token prefill steps: the 40-token prompt is scored in three chunks.
    with EnginePair.build(path, tmp_path, prefill={"max_num_batched_tokens": 16}) as pair:
        for rid, sampling in asks.items():
            pair.add(rid, prompt, sampling)
        tokens = pair.run()
        pair.assert_clean()
    assert "plain" not in pair.logprobs and "plain" not in pair.prompt_logprobs
    assert "sampled" not in pair.prompt_logprobs
    for rid in ("greedy", "sampled"):
        out = tokens[rid]
        rows = hf_logprobs(hf, prompt + out)
        entries = pair.logprobs[rid]
        assert len(entries) == len(out)
        for i, (entry, token) in enumerate(zip(entries, out, strict=True)):
            check(entry, rows[len(prompt) + i - 1], token, asks[rid].logprobs or 0)
    assert all(e[2] == 1 for e in pair.logprobs["greedy"])  # greedy: always the most likely
    scored = pair.prompt_logprobs["greedy"]
    assert len(scored) == len(prompt)
    assert scored[0] == [prompt[0], None, None, [], []]  # nothing scores the first token
    rows = hf_logprobs(hf, prompt)
    for p in range(1, len(prompt)):
        check(scored[p], rows[p - 1], prompt[p], 3)


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(
    model: tuple[Path, Any], tmp_path: Path
) -> None:
    path, hf = model
    prompt = list(range(10, 60))
    with EnginePair.build(path, tmp_path) as pair:
        pair.add("first", prompt, SamplingParams(max_tokens=1))
        pair.run()
        pair.add("again", prompt, SamplingParams(max_tokens=1))  # a prefix hit
        pair.add("scored", prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))
        pair.run()
        pair.assert_clean()
    assert pair.prefill_log.cached("again") > 0
    assert pair.prefill_log.cached("scored") == 0
    rows = hf_logprobs(hf, prompt)
    scored = pair.prompt_logprobs["scored"]
    for p in range(1, len(prompt)):
        check(scored[p], rows[p - 1], prompt[p], 0)
