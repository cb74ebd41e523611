"""Batched logits processors: penalties, ``min_tokens`` and ``min_p``, vLLM's semantics.

Each takes ``logits [R, V]`` of the rows that use it, with per-row parameters as tensors, and
returns new logits (the caller's tensor is left alone). Token histories arrive as Python lists
(the sequences hold them so) and become one flat index tensor per call: the work is tensor ops
over the batch, never a Python loop over tokens or the vocabulary. A row whose parameter is
neutral (penalty 1, presence 0, min_p 0, no ids to mask) comes out bitwise unchanged.

The order is vLLM's (v1 sampler): ``min_tokens`` masking and the penalties on the raw logits
(greedy rows too), then temperature, then ``min_p`` on the scaled logits, then top-k / top-p.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Protocol

import torch

NEG_INF = float("-inf")


def token_counts(ids: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[R, V]`` float32: how often each token occurs in each row's ``ids``. Ids outside
    ``[0, V)`` are not counted (a message is never trusted to hold only valid ids)."""
    rows = len(ids)
    lengths = torch.tensor([len(r) for r in ids], dtype=torch.int64)
    flat = torch.tensor(list(chain.from_iterable(ids)), dtype=torch.int64)
    row_of = torch.repeat_interleave(torch.arange(rows), lengths)
    # Out-of-range ids go to a spare column V, cut off below.
    flat = torch.where((flat >= 0) & (flat < vocab), flat, vocab)
    counts = torch.zeros(rows, vocab + 1, dtype=torch.float32)
    counts.index_put_((row_of, flat), torch.ones(flat.shape[0]), accumulate=True)
    return counts[:, :vocab].to(device)


def apply_min_tokens(logits: torch.Tensor, banned: Sequence[Sequence[int]]) -> torch.Tensor:
    """Each row's ``banned`` ids (its EOS and stop_token_ids while it has fewer than
    ``min_tokens`` outputs) set to -inf: vLLM's MinTokensLogitsProcessor, HF's
    MinNewTokensLengthLogitsProcessor."""
    mask = token_counts(banned, logits.shape[-1], logits.device) > 0
    return logits.masked_fill(mask, NEG_INF)


def apply_repetition_penalty(
    logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """HF's RepetitionPenaltyLogitsProcessor (and vLLM's): every token ``seen`` (``[R, V]``
    bool, over prompt and output) has a positive logit divided by the row's ``penalty``, a
    negative one multiplied by it."""
    p = penalty[:, None].to(logits.dtype)
    penalised = torch.where(logits < 0, logits * p, logits / p)
    return torch.where(seen, penalised, logits)


def apply_presence_frequency(
    logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor
) -> torch.Tensor:
    """OpenAI's (and vLLM's) penalties over the output so far: ``counts [R, V]`` of each token
    there; ``frequency`` is subtracted per occurrence, ``presence`` once if it occurs."""
    out = logits - frequency[:, None].to(logits.dtype) * counts
    return out - presence[:, None].to(logits.dtype) * (counts > 0).to(logits.dtype)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """vLLM's (and HF's MinPLogitsWarper): drop tokens whose probability is below ``min_p``
    times the row's largest probability; the most likely token always stays. ``logits`` are
    temperature-scaled."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None].to(probs.dtype)
    return logits.masked_fill(probs < threshold, NEG_INF)


class History(Protocol):
    """What the penalties read of a sequence: its tokens and where its output begins
    (:class:`~shared.runtime.sequence.Sequence` has both)."""

    token_ids: list[int]
    num_prompt_tokens: int


def penalize(
    logits: torch.Tensor,
    histories: Sequence[History],
    repetition: Sequence[float],
    presence: Sequence[float],
    frequency: Sequence[float],
) -> torch.Tensor:
    """Repetition (over prompt and output), then frequency and presence (over the output), for
    rows whose parameters may be neutral; the counts are built once for all three."""
    vocab, dev = logits.shape[-1], logits.device
    outputs = [h.token_ids[h.num_prompt_tokens :] for h in histories]
    counts = token_counts(outputs, vocab, dev)
    if any(r != 1.0 for r in repetition):
        prompts = [h.token_ids[: h.num_prompt_tokens] for h in histories]
        seen = (token_counts(prompts, vocab, dev) > 0) | (counts > 0)
        logits = apply_repetition_penalty(logits, seen, _tensor(repetition, dev))
    if any(f != 0.0 for f in frequency) or any(p != 0.0 for p in presence):
        logits = apply_presence_frequency(
            logits, counts, _tensor(presence, dev), _tensor(frequency, dev)
        )
    return logits


def _tensor(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)
