"""Sampling settings: one type from the wire to the sampler.

Validated once, at the tokenizer (``shared/wire/validation.py``); every later hop and the engine's
sampler use the same frozen object. Keyword-only, so no two places can disagree on field order.
Names and meanings are vLLM's ``SamplingParams``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar

# The contract's default for a request that does not say (docs/contract.md).
DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None  # the tokenizer fixes one for sampled requests (replays sample alike)
    ignore_eos: bool = False
    # Additions to the contract (docs/contract.md); each default changes nothing.
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one; 0 = off
    # > 1 discourages every token of the prompt and the output so far (HF's and vLLM's rule:
    # a positive logit is divided by it, a negative one multiplied); 1 = off.
    repetition_penalty: float = 1.0
    # OpenAI's: subtracted from the logit of each token the output holds already (presence)
    # and once per time it occurs there (frequency); 0 = off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the output before this many tokens
    stop_token_ids: tuple[int, ...] = ()  # more tokens that end it (finish_reason "stop")
    # Log-probabilities returned with each output token: the chosen token's and this many most
    # likely alternatives (0: the chosen token's alone); None = none. ``prompt_logprobs``: the
    # same for each prompt token after the first. vLLM's default ``raw_logprobs``: the model's
    # own distribution, before penalties, temperature and the top-k / top-p / min-p filters.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Parallel sampling: n continuations of the one prompt, its KV computed once and shared
    # (docs/engine.md); each choice samples with its index mixed into the seed.
    n: int = 1
    # Whether the sampler reshapes this request's logits (penalties, min_tokens): not a field.
    processes_logits: ClassVar[bool]

    def __post_init__(self) -> None:
        # Read by the sampler for every row of every step: worked out once.
        object.__setattr__(self, "processes_logits", self.penalized or self.min_tokens > 0)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:
        """Whether any penalty reshapes the logits (greedy rows included)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def to_dict(self) -> dict[str, Any]:
        """The wire map. The additions are left out at their defaults: a request that uses none
        of them travels exactly as before, and a consumer built before them reads it."""
        d = asdict(self)
        for name, default in _ADDITIONS.items():
            if d[name] == default:
                del d[name]
        if "stop_token_ids" in d:
            d["stop_token_ids"] = list(d["stop_token_ids"])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        if not isinstance(d, dict):
            raise TypeError(f"sampling must be a map, got {type(d).__name__}")
        ids = d.get("stop_token_ids")
        if isinstance(ids, list):  # msgpack's arrays; anything else fails the type check
            d = {**d, "stop_token_ids": tuple(ids)}
        return cls(**d)


_ADDITIONS: dict[str, Any] = {
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_tokens": 0,
    "stop_token_ids": (),
    "logprobs": None,
    "prompt_logprobs": None,
    "n": 1,
}
