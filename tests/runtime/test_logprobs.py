"""The sampler's logprobs: vLLM's default (``raw_logprobs``) from the logits the tokens were
sampled from, only for the rows that ask; and the prompt scorer's chunking."""

from __future__ import annotations

import pytest
import torch

from shared.runtime import Sampler, SamplingParams
from shared.runtime import logprobs as logprobs_module
from shared.runtime import sampler as sampler_module
from shared.runtime.logprobs import logprob_entries, prompt_entries


class History:
    def __init__(self, token_ids: list[int], num_prompt_tokens: int) -> None:
        self.token_ids, self.num_prompt_tokens = token_ids, num_prompt_tokens


def test_entries_are_log_softmax_rank_and_top_k() -> None:
    logits = torch.tensor([[2.0, 1.0, 3.0, 0.0], [0.0, 0.0, 1.0, -1.0]])
    (a, b) = logprob_entries(logits, [1, 0], [2, 0])
    lp = logits.log_softmax(-1)
    assert a[0] == 1 and a[1] == pytest.approx(lp[0, 1].item()) and a[2] == 3
    assert a[3] == [2, 0] and a[4] == pytest.approx(lp[0, [2, 0]].tolist())
    # ties: the rank counts every token at least as likely (vLLM's count)
    assert b[:3] == [0, pytest.approx(lp[1, 0].item()), 3] and b[3:] == [[], []]


def test_rows_asking_get_raw_logprobs_of_the_sampled_token() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 64, generator=gen)
    params = [
        SamplingParams(logprobs=3),  # greedy
        SamplingParams(),  # asks nothing
        SamplingParams(temperature=0.7, top_k=5, seed=1, logprobs=0),
        SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, logprobs=1),
    ]
    histories = [History([1, 2, 3], 2) for _ in params]
    sampler = Sampler()
    tokens = sampler(logits, params, [3] * 4, histories)
    got = sampler.logprobs(logits, tokens, params)
    assert sorted(got) == [0, 2, 3]
    lp = logits.log_softmax(-1)
    for row, entry in got.items():
        # the model's own distribution: penalties and temperature reshape only the draw
        assert entry[0] == tokens[row]
        assert entry[1] == pytest.approx(lp[row, tokens[row]].item(), abs=1e-6)
        assert entry[3] == lp[row].topk(params[row].logprobs or 0).indices.tolist()
    assert got[0][2] == 1  # greedy: the most likely


def test_nothing_is_computed_when_no_row_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_: object) -> None:
        raise AssertionError("log_softmax for rows that did not ask")

    monkeypatch.setattr(sampler_module, "logprob_entries", fail)
    logits = torch.randn(3, 32)
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=2), SamplingParams()]
    tokens = Sampler()(logits, params, [0] * 3)
    assert Sampler().logprobs(logits, tokens, params) == {}


def test_prompt_entries_are_scored_a_bounded_chunk_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    head = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(11, 8)
    calls: list[int] = []

    def compute_logits(h: torch.Tensor) -> torch.Tensor:
        calls.append(h.shape[0])
        return h @ head

    targets = list(range(11))
    whole = prompt_entries(compute_logits, hidden, targets, 2, vocab_size=50)
    monkeypatch.setattr(logprobs_module, "PROMPT_CHUNK_ELEMENTS", 4 * 50)
    chunked = prompt_entries(compute_logits, hidden, targets, 2, vocab_size=50)
    assert calls == [11, 4, 4, 3]
    for a, b in zip(whole, chunked, strict=True):
        assert (a[0], a[2], a[3]) == (b[0], b[2], b[3])
        assert a[1] == pytest.approx(b[1], abs=1e-6)
    lp = (hidden @ head).log_softmax(-1)
    assert [e[1] for e in whole] == pytest.approx([lp[i, i].item() for i in targets], abs=1e-6)
