"""Penalties, min_tokens and min_p against Hugging Face's logits processors on the same logits,
one batch with every row's own parameters; and through the Sampler, greedy and seeded."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
)

from shared.runtime import Sampler, SamplingParams
from shared.runtime.logits_processors import apply_min_p, apply_min_tokens, penalize

VOCAB = 300
EOS = 7


@dataclass
class Seq:
    token_ids: list[int]
    num_prompt_tokens: int


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _seqs(rows: int, seed: int = 1) -> list[Seq]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(rows):
        prompt = torch.randint(0, VOCAB, (5 + 3 * i,), generator=g).tolist()
        output = torch.randint(0, VOCAB, (2 * i,), generator=g).tolist()
        output += output[:i]  # repeats, so frequency differs from presence
        out.append(Seq(prompt + output, len(prompt)))
    return out


def _hf(processor: object, seq: Seq, row: torch.Tensor) -> torch.Tensor:
    return processor(torch.tensor([seq.token_ids]), row[None].clone())[0]  # type: ignore[operator]


def test_repetition_penalty_is_hfs_over_prompt_and_output() -> None:
    logits, seqs = _logits(4), _seqs(4)
    penalties = [1.0, 1.3, 0.7, 2.0]
    ours = penalize(logits, seqs, penalties, [0.0] * 4, [0.0] * 4)
    for i, p in enumerate(penalties):
        want = _hf(RepetitionPenaltyLogitsProcessor(p), seqs[i], logits[i]) if p != 1 else logits[i]
        assert torch.equal(ours[i], want)
    assert not torch.equal(ours[1], logits[1])


def test_presence_and_frequency_are_openais_over_the_output() -> None:
    logits, seqs = _logits(4, seed=2), _seqs(4)
    presence, frequency = [0.0, 0.5, -1.0, 2.0], [0.0, 0.25, 0.5, -2.0]
    ours = penalize(logits, seqs, [1.0] * 4, presence, frequency)
    for i, s in enumerate(seqs):
        want = logits[i].clone()
        output = s.token_ids[s.num_prompt_tokens :]
        for token in set(output):  # OpenAI's formula, written out
            want[token] -= output.count(token) * frequency[i] + presence[i]
        assert torch.allclose(ours[i], want, atol=1e-6), i
        prompt_only = set(s.token_ids[: s.num_prompt_tokens]) - set(output)
        assert all(ours[i, t] == logits[i, t] for t in prompt_only)  # the prompt does not count


def test_min_tokens_masks_eos_and_stop_ids_as_hfs_min_new_tokens() -> None:
    logits, seqs = _logits(3, seed=3), _seqs(3)
    stop_ids = (11, 12)
    masked = apply_min_tokens(logits, [(EOS, *stop_ids), (EOS,), ()])
    for i, ban in enumerate([[EOS, *stop_ids], [EOS], []]):
        if not ban:
            assert torch.equal(masked[i], logits[i])
            continue
        hf = MinNewTokensLengthLogitsProcessor(seqs[i].num_prompt_tokens, 10**6, ban)
        assert torch.equal(masked[i], _hf(hf, seqs[i], logits[i]))


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_min_p_is_hfs_min_p_warper(temperature: float) -> None:
    x = _logits(4, seed=4) / temperature
    min_p = [0.0, 0.05, 0.3, 1.0]
    ours = apply_min_p(x, torch.tensor(min_p))
    seq = Seq([1], 0)
    for i, p in enumerate(min_p):
        want = _hf(MinPLogitsWarper(p), seq, x[i]) if p else x[i]
        assert torch.equal(ours[i], want), i
    assert torch.isfinite(ours[3]).sum() == 1  # min_p 1: the most likely token alone


def test_greedy_choice_follows_the_processed_logits() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, 5] = 2.0  # the unpenalised favourite
    logits[:, 6] = 1.8
    seqs = [Seq([1, 5, 2], 3), Seq([1, 2, 3, 5], 3), Seq([1, 2, 3], 3)]
    sampler = Sampler(eos_token_ids=(5,))
    params = [
        SamplingParams(repetition_penalty=1.2),  # 5 is in the prompt: 2.0 / 1.2 < 1.8
        SamplingParams(frequency_penalty=0.5),  # 5 was output once: 1.5 < 1.8
        SamplingParams(min_tokens=1),  # 5 is EOS and no output yet
    ]
    assert sampler(logits, params, [3, 4, 3], seqs) == [6, 6, 6]
    # min_tokens reached, or EOS ignored: 5 again
    done = [Seq([1, 2, 3, 9], 3), Seq([1, 2, 3], 3)]
    later = [SamplingParams(min_tokens=1), SamplingParams(min_tokens=4, ignore_eos=True)]
    assert sampler(logits[:2], later, [4, 3], done) == [5, 5]


def test_rows_without_processing_keep_the_fast_path() -> None:
    seen: list[torch.Tensor] = []

    def argmax(x: torch.Tensor) -> list[int]:
        seen.append(x)
        return x.max(dim=-1).indices.tolist()

    logits = _logits(3)
    plain = [SamplingParams(), SamplingParams(temperature=0.5, seed=1, min_p=0.1)]
    Sampler(argmax)(logits[:2], plain, [3, 3])  # no histories needed
    assert seen[-1].data_ptr() == logits.data_ptr()  # no copy: argmax ran on the input
    penalised = [SamplingParams(), SamplingParams(repetition_penalty=1.5)]
    with pytest.raises(ValueError, match="histories"):
        Sampler(argmax)(logits[:2], penalised, [3, 3])


def test_seeded_draws_with_penalties_are_the_same_in_any_batch() -> None:
    logits, seqs = _logits(4, seed=5), _seqs(4)
    sampler = Sampler(eos_token_ids=(EOS,))
    p = SamplingParams(
        temperature=0.9, top_p=0.95, min_p=0.02, repetition_penalty=1.3, presence_penalty=0.4,
        frequency_penalty=0.2, min_tokens=50, seed=77,
    )  # fmt: skip
    positions = [len(s.token_ids) for s in seqs]
    alone = sampler(logits[2:3], [p], positions[2:3], seqs[2:3])
    mixed = [SamplingParams(), replace(p, seed=3), p, SamplingParams(repetition_penalty=2.0)]
    batched = sampler(logits, mixed, positions, seqs)
    assert batched[2] == alone[0] and sampler(logits, mixed, positions, seqs) == batched
    assert batched[0] == int(logits[0].argmax())


def test_ids_outside_the_vocabulary_are_ignored() -> None:
    logits = _logits(1)
    out = penalize(logits, [Seq([VOCAB + 5, -1, 3], 1)], [1.5], [1.0], [0.0])
    changed = (out != logits).nonzero()[:, 1].tolist()
    assert changed == [3]
    assert torch.equal(apply_min_tokens(logits, [(VOCAB, 10**6)]), logits)
