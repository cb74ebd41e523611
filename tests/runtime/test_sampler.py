"""Sampler: greedy rows, top-k / top-p masks, reproducible draws keyed by (seed, position)."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from shared.runtime import Sampler, SamplingParams
from shared.runtime.sampler import apply_top_k_top_p, mix_seed, uniform


def kept(logits: list[float], top_k: int = 0, top_p: float = 1.0) -> list[bool]:
    """Which tokens of one row survive the (batched) filter."""
    row = torch.tensor([logits])
    vocab = row.shape[-1]
    k = torch.tensor([top_k]) if 0 < top_k < vocab else None
    p = torch.tensor([top_p]) if top_p < 1.0 else None
    return torch.isfinite(apply_top_k_top_p(row, k, p))[0].tolist()


def test_top_k_keeps_the_k_largest() -> None:
    logits = [0.1, 3.0, -1.0, 2.0, 0.5]
    assert kept(logits, top_k=2) == [False, True, False, True, False]
    assert kept(logits, top_k=1) == [False, True, False, False, False]
    assert kept(logits) == [True] * 5


def test_top_p_keeps_the_smallest_nucleus() -> None:
    logits = torch.tensor([0.05, 0.5, 0.1, 0.3, 0.05]).log().tolist()
    # 0.5 + 0.3 = 0.8 reaches 0.75: tokens 1 and 3.
    assert kept(logits, top_p=0.75) == [False, True, False, True, False]
    # 0.8 < 0.85: token 2 (0.1) is needed too.
    assert kept(logits, top_p=0.85) == [False, True, True, True, False]
    # A tiny (or zero) top_p still keeps the most likely token.
    assert kept(logits, top_p=1e-6) == [False, True, False, False, False]
    assert kept(logits, top_p=0.0) == [False, True, False, False, False]


def test_per_row_filters_in_one_batch() -> None:
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 3).log()
    out = apply_top_k_top_p(logits, torch.tensor([1, 4, 3]), torch.tensor([1.0, 0.5, 0.6]))
    assert torch.isfinite(out).tolist() == [
        [True, False, False, False],  # top-1
        [True, True, False, False],  # top-p 0.5: 0.4 alone does not reach it
        [True, True, False, False],  # top-3 renormalised: 0.44, 0.33 reach 0.6
    ]
    assert math.isclose(out[2].softmax(-1)[0].item(), 0.4 / 0.7, rel_tol=1e-6)


def test_greedy_rows_are_argmax_and_ignore_seed() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(seed=s) for s in range(5)]
    assert Sampler()(logits, params, [3] * 5) == logits.argmax(-1).tolist()


def test_same_seed_and_position_draw_the_same_token_in_any_batch() -> None:
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(1))
    sampler = Sampler()
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234)
    alone = sampler(logits[2:3], [p], [17])
    mixed = [SamplingParams(), SamplingParams(temperature=1.0, seed=9), p, p]
    batched = sampler(logits, mixed, [5, 6, 17, 18])
    assert batched[2] == alone[0]
    assert batched[0] == int(logits[0].argmax())
    assert sampler(logits, mixed, [5, 6, 17, 18]) == batched


def test_draws_follow_the_distribution_and_never_pick_masked_tokens() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0])
    logits = probs.clamp_min(1e-30).log()[None]
    sampler = Sampler()
    n = 3000
    counts = [0] * 5
    for seed in range(n):
        counts[sampler(logits, [SamplingParams(temperature=1.0, seed=seed)], [0])[0]] += 1
    assert counts[3] == counts[4] == 0
    assert all(abs(c / n - p) < 0.04 for c, p in zip(counts, probs.tolist(), strict=True))
    # top_k=2 renormalises over {0, 1}: 0.625 / 0.375.
    top2 = SamplingParams(temperature=1.0, top_k=2)
    picks = [sampler(logits, [replace(top2, seed=s)], [0])[0] for s in range(n)]
    assert set(picks) == {0, 1} and abs(picks.count(0) / n - 0.625) < 0.04


def test_draw_varies_with_seed_and_position() -> None:
    logits = torch.zeros(1, 64)  # uniform over 64 tokens
    sampler = Sampler()
    by_position = {
        sampler(logits, [SamplingParams(temperature=1.0, seed=5)], [p])[0] for p in range(40)
    }
    by_seed = {
        sampler(logits, [SamplingParams(temperature=1.0, seed=s)], [7])[0] for s in range(40)
    }
    assert len(by_position) > 20 and len(by_seed) > 20


def test_low_temperature_approaches_greedy() -> None:
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=1e-4, seed=s) for s in range(8)]
    assert Sampler()(logits, params, list(range(8))) == logits.argmax(-1).tolist()


def test_uniform_and_mix_seed_are_pinned() -> None:
    seeds = {mix_seed(s, p) for s in range(30) for p in range(30)}
    assert len(seeds) == 900 and all(0 <= x < 2**63 for x in seeds)
    assert all(0.0 <= uniform(s, p) < 1.0 for s in range(20) for p in range(20))
    # Pinned: a (seed, position) must draw the same token in every release and process.
    assert mix_seed(1234, 17) == 4390300814818178609
    assert uniform(1234, 17) == (4390300814818178609 >> 10) * 2.0**-53


def test_draws_stay_inside_the_reference_filter_sets() -> None:
    g = torch.Generator().manual_seed(4)
    vocab = 1000
    peaked = torch.randn(vocab, generator=g) * 4  # nucleus inside the best NUCLEUS_GUESS
    flat = torch.randn(vocab, generator=g) * 0.1  # nucleus of ~900 tokens: full-sort fallback
    logits = torch.stack([peaked, flat, peaked, flat])
    sampler = Sampler()
    rows = [
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.7, top_k=40, top_p=0.8),
        SamplingParams(temperature=1.0, top_k=600),
    ]
    reference = apply_top_k_top_p(
        logits / torch.tensor([1.0, 1.0, 0.7, 1.0])[:, None],
        torch.tensor([vocab, vocab, 40, 600]),
        torch.tensor([0.9, 0.9, 0.8, 1.0]),
    )
    allowed = [set(torch.isfinite(r).nonzero()[:, 0].tolist()) for r in reference]
    assert len(allowed[1]) > 256 and len(allowed[0]) < 256  # both top-p paths are exercised
    draws: list[set[int]] = [set(), set(), set(), set()]
    for seed in range(300):
        params = [replace(p, seed=seed) for p in rows]
        for i, token in enumerate(sampler(logits, params, [seed] * 4)):
            draws[i].add(token)
    for got, want in zip(draws, allowed, strict=True):
        assert got <= want
    rank = flat.argsort(descending=True).tolist()
    assert max(rank.index(t) for t in draws[1]) >= 256  # the fallback drew past the guess


def test_choices_draw_apart_and_choice_0_draws_as_n_1() -> None:
    assert mix_seed(1234, 17, 0) == mix_seed(1234, 17) == 4390300814818178609
    per_choice = {mix_seed(1234, p, i) for p in range(50) for i in range(16)}
    assert len(per_choice) == 800  # no two (position, choice) of one seed share a draw
    logits = torch.zeros(16, 64)  # uniform: every choice at one position
    params = [SamplingParams(temperature=1.0, seed=5)] * 16
    drawn = Sampler()(logits, params, [9] * 16, None, list(range(16)))
    assert len(set(drawn)) > 8
    assert drawn[0] == Sampler()(logits[:1], params[:1], [9])[0]
    assert drawn == Sampler()(logits, params, [9] * 16, None, list(range(16)))  # reproducible
