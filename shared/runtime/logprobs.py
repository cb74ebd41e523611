"""Log-probabilities of chosen and prompt tokens, computed only for the rows that ask.

What they describe is vLLM's default (``logprobs_mode=raw_logprobs``): ``log_softmax`` of the
model's own logits in fp32, before ``min_tokens`` masking, penalties, temperature and the
top-k / top-p / min-p filters. A sampled request's logprobs are the model's distribution, not
the filtered one it drew from; a greedy request's chosen token is the most likely one.

An entry, as it travels to the detokenizer (shared/wire/messages.py, ``TokenEvent``):
``[token_id, logprob, rank, top_ids, top_logprobs]``. ``rank`` counts the tokens at least as
likely as this one (1 = the most likely; vLLM's count), ``top_*`` are the ``num_top`` most likely
tokens, best first. A prompt's first token, which nothing scores, has logprob and rank None.
Rows that ask nothing cost nothing: no ``log_softmax`` runs for them, and a forward in which no
row asks runs none at all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

Entry = list[Any]

# Prompt positions are scored this many logits at a time ([rows, vocab] fp32, ~64 MiB), so a
# long prompt never holds a full [prompt, vocab] matrix.
PROMPT_CHUNK_ELEMENTS = 1 << 24


@dataclass
class StepLogprobs:
    """What one engine step's forwards found: the entry of the token sampled for each
    (request id, choice) — a prompt with n > 1 draws one first token per choice —, and by
    request id the entries of the prompt positions computed (position -> entry). Filled by the
    runner; a forward run again (isolating a failure) writes the same values again."""

    sampled: dict[tuple[str, int], Entry] = field(default_factory=dict)
    prompt: dict[str, dict[int, Entry]] = field(default_factory=dict)


def unscored(token_id: int) -> Entry:
    """The entry of a token nothing scored (a prompt's first): its id alone."""
    return [token_id, None, None, [], []]


def logprob_entries(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[Entry]:
    """One entry per row of ``logits [R, V]``: of ``token_ids[i]``, with ``num_top[i]``
    alternatives."""
    lp = logits.float().log_softmax(dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=lp.device)[:, None]
    chosen = lp.gather(1, ids)
    # Summed as int32: the default (int64 over a bool tensor) is much slower on CPU.
    ranks = lp.ge(chosen).sum(dim=-1, dtype=torch.int32).tolist()
    k = min(max(num_top, default=0), lp.shape[-1])
    top_lps: list[list[float]] = [[] for _ in token_ids]
    top_ids: list[list[int]] = [[] for _ in token_ids]
    if k > 0:  # one alternative (log-likelihood scoring asks for it): max is cheaper than topk
        values, indices = lp.max(dim=-1, keepdim=True) if k == 1 else lp.topk(k, dim=-1)
        top_lps, top_ids = values.tolist(), indices.tolist()
    return [
        [t, c, r, i[:n], v[:n]]
        for t, c, r, i, v, n in zip(
            token_ids, chosen[:, 0].tolist(), ranks, top_ids, top_lps, num_top, strict=True
        )
    ]


def prompt_entries(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    target_ids: list[int],
    num_top: int,
    vocab_size: int,
) -> list[Entry]:
    """Entries of prompt tokens ``target_ids``, each scored by the logits of the position
    before it (``hidden[i]`` predicts ``target_ids[i]``), a bounded number of rows at a time."""
    step = max(1, PROMPT_CHUNK_ELEMENTS // max(1, vocab_size))
    out: list[Entry] = []
    for a in range(0, len(target_ids), step):
        ids = target_ids[a : a + step]
        logits = compute_logits(hidden[a : a + len(ids)])
        out += logprob_entries(logits, ids, [num_top] * len(ids))
    return out
