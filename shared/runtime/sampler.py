"""Token selection: greedy rows in one argmax, sampled rows reproducibly per (seed, position).

Rows with penalties, or with ``min_tokens`` not reached yet, first have their logits reshaped
(logits_processors.py, vLLM's order; greedy rows too, so prefill's first token and decode's
tokens see the same rules). Rows with none of that cost nothing more than before.

Sampled rows go through temperature, min-p, top-k and top-p (masks; the draw then
renormalises over the survivors), then inverse-CDF sampling over the survivors in vocabulary
order, with a uniform ``u`` derived from ``(seed, position)`` alone. So the same request at the
same position with the same logits always draws the same token, in any batch, any process,
after a crash or a recompute; a row needs no random-generator state, only one hashed 64-bit
number.

Rows that ask for ``logprobs`` get them from :meth:`Sampler.logprobs`, over the logits as the
model gave them (logprobs.py), after the draw; the others never pay for a ``log_softmax``.

No full-vocabulary sort unless it is needed: top-k rows work on their ``k`` best candidates;
top-p rows first look for the nucleus among the best ``NUCLEUS_GUESS`` tokens and sort the whole
row only when it is not there. The candidate sets are bitwise the same either way, and which
path a row takes depends on its own parameters and logits, never on its batch neighbours.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from kernels.cpu.argmax import torch_argmax
from shared.runtime.logits_processors import History, apply_min_p, apply_min_tokens, penalize
from shared.runtime.logprobs import Entry, logprob_entries
from shared.runtime.sequence import SamplingParams

_MASK64 = (1 << 64) - 1
NEG_INF = float("-inf")
NUCLEUS_GUESS = 256


def mix_seed(seed: int, position: int, index: int = 0) -> int:
    """splitmix64 over (seed, position, index): a stable 63-bit value. ``index``: the choice of
    an n > 1 request, added above the position's bits (positions never reach 2**32), so the
    choices of one seed draw apart at every position and choice 0 draws as n = 1 does."""
    z = (seed * 0x9E3779B97F4A7C15 + position + (index << 32) + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def uniform(seed: int, position: int, index: int = 0) -> float:
    """A uniform draw in [0, 1) with 53 random bits, fixed by (seed, position, index)."""
    return (mix_seed(seed, position, index) >> 10) * 2.0**-53


def nucleus_mask(
    sorted_logits: torch.Tensor, log_norm: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """True where a token falls outside the nucleus: the smallest prefix of the descending
    ``sorted_logits`` whose probability (``exp(logit - log_norm)``) reaches ``top_p``. The
    first token always stays. Prefix sums only: a prefix of the columns gives the same bits."""
    probs = (sorted_logits - log_norm).exp()
    drop = (probs.cumsum(-1) - probs) >= top_p[:, None]
    drop[:, 0] = False
    return drop


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """``logits [N, V]`` with tokens outside each row's top-k / top-p set to -inf: the reference
    (full-sort) form of the filters. ``top_k [N]`` (V = off), ``top_p [N]`` (1 = off), or None
    when no row uses the filter. :class:`Sampler` keeps the same sets without the full sort."""
    if top_k is not None:
        kth = logits.topk(int(top_k.max()), dim=-1).values.gather(1, (top_k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        log_norm = logits.logsumexp(-1, keepdim=True)
        drop = torch.empty_like(sorted_logits, dtype=torch.bool)
        drop.scatter_(1, order, nucleus_mask(sorted_logits, log_norm, top_p))
        logits = logits.masked_fill(drop, NEG_INF)
    return logits


class Sampler:
    def __init__(
        self,
        argmax: Callable[[torch.Tensor], list[int]] | None = None,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        """``argmax``: the greedy rows' answer for ``logits [N, V]`` (the C kernel of
        kernels/cpu/argmax.py on CPU); default torch's ``max().indices``. ``eos_token_ids``: the
        model's, masked with a row's stop_token_ids until it has ``min_tokens`` outputs."""
        self._argmax = argmax or torch_argmax
        self.eos_token_ids = tuple(eos_token_ids)

    def __call__(
        self,
        logits: torch.Tensor,
        sampling: list[SamplingParams],
        positions: list[int],
        histories: Sequence[History] | None = None,
        indices: Sequence[int] | None = None,
    ) -> list[int]:
        """``logits [N, V]`` (fp32) -> one token per row; ``positions[i]`` is where row i's token
        will sit in its sequence (its ``num_tokens`` before appending); ``histories[i]``, its
        sequence: needed only by rows with penalties or ``min_tokens``; ``indices[i]``: the
        choice row i samples for (parallel sampling; default 0)."""
        if any(p.processes_logits for p in sampling):
            logits = self._process(logits, sampling, histories)
        tokens = self._argmax(logits)
        vocab = logits.shape[-1]
        top_k_rows: list[int] = []
        top_p_rows: list[int] = []
        plain_rows: list[int] = []
        for i, p in enumerate(sampling):
            if p.greedy:
                continue
            if 0 < p.top_k < vocab:
                top_k_rows.append(i)
            elif p.top_p < 1.0:
                top_p_rows.append(i)
            else:
                plain_rows.append(i)
        for draw, rows in (
            (_sample_top_k, top_k_rows),
            (_sample_top_p, top_p_rows),
            (_sample_plain, plain_rows),
        ):
            if not rows:
                continue
            params = [sampling[i] for i in rows]
            u = [
                uniform(p.seed or 0, positions[i], indices[i] if indices else 0)
                for p, i in zip(params, rows, strict=True)
            ]
            x = logits[rows].float() / _column([p.temperature for p in params], logits.device)
            min_p = [p.min_p for p in params]
            if any(min_p):
                x = apply_min_p(x, torch.tensor(min_p, device=x.device))
            for i, token in zip(rows, draw(x, params, u), strict=True):
                tokens[i] = token
        return tokens

    def logprobs(
        self, logits: torch.Tensor, tokens: list[int], sampling: list[SamplingParams]
    ) -> dict[int, Entry]:
        """The chosen tokens' logprobs (and each row's ``logprobs`` alternatives) of the rows
        that ask, by row, from the same ``logits`` the tokens were sampled from, as the model
        gave them (logprobs.py: vLLM's ``raw_logprobs``). Nothing is computed when no row asks."""
        rows = [i for i, p in enumerate(sampling) if p.logprobs is not None]
        if not rows:
            return {}
        entries = logprob_entries(
            logits[rows], [tokens[i] for i in rows], [sampling[i].logprobs or 0 for i in rows]
        )
        return dict(zip(rows, entries, strict=True))

    def _process(
        self,
        logits: torch.Tensor,
        sampling: list[SamplingParams],
        histories: Sequence[History] | None,
    ) -> torch.Tensor:
        """A copy of ``logits`` with each row's ``min_tokens`` mask and penalties applied."""
        if histories is None or len(histories) != len(sampling):
            raise ValueError("penalties and min_tokens need every row's sequence (histories)")
        banned: list[tuple[int, ...]] = []
        ban_rows: list[int] = []
        penalized: list[int] = []
        for i, p in enumerate(sampling):
            h = histories[i]
            if p.min_tokens and len(h.token_ids) - h.num_prompt_tokens < p.min_tokens:
                ids = p.stop_token_ids if p.ignore_eos else self.eos_token_ids + p.stop_token_ids
                if ids:
                    ban_rows.append(i)
                    banned.append(ids)
            if p.penalized:
                penalized.append(i)
        if not ban_rows and not penalized:
            return logits
        logits = logits.clone()
        if ban_rows:
            idx = torch.tensor(ban_rows, device=logits.device)
            logits[idx] = apply_min_tokens(logits[idx], banned)
        if penalized:
            idx = torch.tensor(penalized, device=logits.device)
            params = [sampling[i] for i in penalized]
            logits[idx] = penalize(
                logits[idx],
                [histories[i] for i in penalized],
                [p.repetition_penalty for p in params],
                [p.presence_penalty for p in params],
                [p.frequency_penalty for p in params],
            )
        return logits


# Each _sample_* takes temperature-scaled logits of its rows and returns one token per row.


def _sample_plain(x: torch.Tensor, params: list[SamplingParams], u: list[float]) -> list[int]:
    return _inverse_cdf(x, u).tolist()


def _sample_top_k(x: torch.Tensor, params: list[SamplingParams], u: list[float]) -> list[int]:
    """Top-k, then top-p renormalised over the k survivors: never more than k columns."""
    dev = x.device
    ks = torch.tensor([p.top_k for p in params], device=dev)
    top_p = torch.tensor([min(p.top_p, 1.0) for p in params], device=dev)
    vals, ids = x.topk(int(ks.max()), dim=-1)
    beyond_k = torch.arange(vals.shape[1], device=dev)[None, :] >= ks[:, None]
    vals = vals.masked_fill(beyond_k, NEG_INF)
    vals = vals.masked_fill(nucleus_mask(vals, vals.logsumexp(-1, keepdim=True), top_p), NEG_INF)
    return _draw_from(vals, ids, u)


def _sample_top_p(x: torch.Tensor, params: list[SamplingParams], u: list[float]) -> list[int]:
    """Top-p alone: the nucleus is usually inside the best few hundred tokens; a row whose
    nucleus reaches past them (a flat distribution) has its whole row sorted."""
    top_p = torch.tensor([p.top_p for p in params], device=x.device)
    log_norm = x.logsumexp(-1, keepdim=True)
    vals, ids = x.topk(min(NUCLEUS_GUESS, x.shape[-1]), dim=-1)
    covered = ((vals - log_norm).exp().sum(-1) >= top_p).tolist()
    inside = [i for i, c in enumerate(covered) if c]
    outside = [i for i, c in enumerate(covered) if not c]
    picked = [0] * len(params)
    for rows, candidates in (
        (inside, lambda rows: (vals[rows], ids[rows])),
        (outside, lambda rows: x[rows].sort(dim=-1, descending=True)),
    ):
        if not rows:
            continue
        v, v_ids = candidates(rows)
        v = v.masked_fill(nucleus_mask(v, log_norm[rows], top_p[rows]), NEG_INF)
        for i, token in zip(rows, _draw_from(v, v_ids, [u[i] for i in rows]), strict=True):
            picked[i] = token
    return picked


def _draw_from(vals: torch.Tensor, ids: torch.Tensor, u: list[float]) -> list[int]:
    """Inverse CDF over candidates ``ids`` (logits ``vals``), taken in vocabulary order."""
    order = ids.argsort(dim=-1)
    picked = _inverse_cdf(vals.gather(1, order), u)
    return ids.gather(1, order).gather(1, picked[:, None])[:, 0].tolist()


def _inverse_cdf(logits: torch.Tensor, u: list[float]) -> torch.Tensor:
    """Column drawn from softmax(logits) per row by inverse CDF at ``u``.

    Unnormalised weights and an fp64 running sum: a row's CDF depends only on its surviving
    logits and their order. A -inf logit has weight 0 and repeats the previous CDF value, so
    ``right=True`` never lands on it.
    """
    weights = (logits - logits.max(dim=-1, keepdim=True).values).exp()
    cdf = weights.cumsum(-1, dtype=torch.float64)
    target = torch.tensor(u, dtype=torch.float64, device=logits.device) * cdf[:, -1]
    picked = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
    return picked.clamp_max_(logits.shape[-1] - 1)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, device=device)[:, None]
