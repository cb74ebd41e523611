"""Shared by the scheduler tests: sequences with distinct tokens, batch plans."""

from __future__ import annotations

from shared.runtime.sequence import Sequence
from shared.scheduling import PrefillBatch
from shared.wire.sampling import SamplingParams

BS = 4
EOS = 0


def seq(
    rid: str,
    n: int | list[int],
    priority: int = 0,
    arrival: float = 0.0,
    max_tokens: int = 100,
    ignore_eos: bool = False,
    num_prompt_tokens: int | None = None,
) -> Sequence:
    """A sequence of ``n`` tokens (distinct per request, so no accidental prefix hits)."""
    base = 1000 * (1 + sum(map(ord, rid)))
    tokens = n if isinstance(n, list) else [base + i for i in range(n)]
    return Sequence(
        rid,
        tokens,
        SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
        priority=priority,
        num_prompt_tokens=num_prompt_tokens,
        arrival_time=arrival,
        block_size=BS,
    )


def plan(batch: PrefillBatch) -> list[tuple[str, int]]:
    return [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)]
