"""Token selection: greedy rows in one argmax, sampled rows reproducibly per (seed, position).

A sampled row draws with a generator seeded from ``mix(seed, position)``, so a request replayed
(after a crash, a preemption with recompute, or in another batch) emits the same tokens: the
draw depends on the request's seed, the token's position and its logits, never on the batch.
The draw is an exponential race (``argmax(p / E)``, ``E ~ Exp(1)``), which picks token i with
probability ``p_i`` and needs only one generator call of fixed size.
"""

from __future__ import annotations

import torch

from shared.engine.sequence import SamplingParams

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, position: int) -> int:
    """splitmix64 over (seed, position): a stable 63-bit generator seed."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set every logit outside the top-k and outside the top-p nucleus to -inf (1-D row).

    The nucleus is the smallest set of most likely tokens whose probability reaches ``top_p``;
    the most likely token always stays.
    """
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p.
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.empty_like(drop_sorted).scatter_(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class Sampler:
    def __call__(
        self, logits: torch.Tensor, sampling: list[SamplingParams], positions: list[int]
    ) -> list[int]:
        """``logits [N, V]`` (fp32) -> one token per row; ``positions[i]`` is where row i's token
        will sit in its sequence (its ``num_tokens`` before appending)."""
        # max().indices is argmax (first index among ties, as torch.argmax and HF), ~3x faster.
        tokens = logits.max(dim=-1).indices.tolist()
        for i, params in enumerate(sampling):
            if not params.greedy:
                tokens[i] = self.sample_row(logits[i], params, positions[i])
        return tokens

    @staticmethod
    def sample_row(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
        row = apply_top_k_top_p(logits.float() / params.temperature, params.top_k, params.top_p)
        probs = row.softmax(-1)
        generator = torch.Generator(device=logits.device)
        generator.manual_seed(mix_seed(params.seed or 0, position))
        noise = torch.empty_like(probs).exponential_(generator=generator)
        return int((probs / noise).argmax())
