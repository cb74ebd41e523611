"""Sampling settings: one type from the wire to the sampler.

Validated once, at the tokenizer (``shared/wire/validation.py``); every later hop and the engine's
sampler use the same frozen object. Keyword-only, so no two places can disagree on field order.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# The contract's default for a request that does not say (../shared/DESIGN.md).
DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None  # the tokenizer fixes one for sampled requests (replays sample alike)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        return cls(**d)
