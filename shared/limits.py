"""The length rules, derived once, and the one stop rule.

``Limits`` is built once per process from :class:`BatonConfig` and the model's
``max_position_embeddings`` — and, in an engine, from its KV cache's capacity (the runner builds
it) — so the tokenizer, the gateway, prefill and decode apply the same arithmetic.

``max_tokens`` is clamped once, by the tokenizer (``Limits.clamp``), to what fits after the
prompt; engines trust it. An engine's own bound still holds whatever a message asks: it refuses a
sequence that cannot take another step (``Limits.fits``) and :class:`StopRule` ends a sequence
that reaches its ``max_model_len`` — so a handoff from a worker with a larger cache, a replay or a
hand-made internal message never grows a sequence past what this engine holds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from shared.config import BatonConfig
from shared.wire.errors import ErrorCode, ProtocolError
from shared.wire.sampling import SamplingParams

# What one position's logprobs cost in a reply at most, as msgpack packs them (replies.py): the
# chosen token's entry, and each alternative with its text. Generous: a token's text is a few
# bytes on average.
LOGPROB_POSITION_BYTES = 32
LOGPROB_ALTERNATIVE_BYTES = 28


@dataclass(frozen=True)
class Limits:
    max_model_len: int  # longest sequence (prompt + output) this process serves
    max_prompt_tokens: int  # longest prompt: always leaves room for one output token
    # Bytes a reply's logprobs (prompt's and output's) may take: three quarters of the bound
    # every reader puts on a message (max_message_bytes), the rest for the text and token ids.
    max_logprob_bytes: int = (BatonConfig.max_message_bytes * 3) // 4

    @classmethod
    def build(
        cls,
        config: BatonConfig,
        max_position_embeddings: int,
        num_cache_tokens: int | None = None,
    ) -> Limits:
        bounds = [config.max_model_len, max_position_embeddings]
        if num_cache_tokens is not None:
            bounds.append(num_cache_tokens)
        max_model_len = min(bounds)
        if max_model_len < 2:
            raise ValueError(f"max_model_len {max_model_len} leaves no room for a prompt")
        return cls(
            max_model_len=max_model_len,
            max_prompt_tokens=min(config.max_prompt_tokens, max_model_len - 1),
            max_logprob_bytes=(config.max_message_bytes * 3) // 4,
        )

    @classmethod
    def for_model_dir(cls, config: BatonConfig, model_dir: Path) -> Limits:
        """For processes without the model loaded (tokenizer, gateway): reads ``config.json``."""
        raw = json.loads((Path(model_dir) / "config.json").read_text())
        return cls.build(config, int(raw.get("max_position_embeddings", config.max_model_len)))

    def fits(self, num_tokens: int) -> bool:
        """Can a sequence of ``num_tokens`` still produce a token here?"""
        return num_tokens < self.max_model_len

    def clamp(self, sampling: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """``max_tokens`` cut to what fits after the prompt (at least 1), and, with
        ``logprobs``, to what the reply's logprobs budget holds after the prompt's."""
        room = max(1, self.max_model_len - num_prompt_tokens)
        if sampling.logprobs is not None:
            left = self.max_logprob_bytes - self.prompt_logprob_bytes(sampling, num_prompt_tokens)
            room = min(room, max(1, left // _position_bytes(sampling.logprobs)))
        if sampling.max_tokens <= room:
            return sampling
        return replace(sampling, max_tokens=room)

    def prompt_logprob_bytes(self, sampling: SamplingParams, num_prompt_tokens: int) -> int:
        """What the prompt's logprobs take of a reply (0 without ``prompt_logprobs``)."""
        if sampling.prompt_logprobs is None:
            return 0
        return (num_prompt_tokens - 1) * _position_bytes(sampling.prompt_logprobs)

    def check_prompt_logprobs(self, sampling: SamplingParams, num_prompt_tokens: int) -> None:
        """Refuse ``prompt_logprobs`` whose reply would exceed the logprobs budget (an output
        is clamped to it; a prompt cannot be)."""
        need = self.prompt_logprob_bytes(sampling, num_prompt_tokens)
        if need > self.max_logprob_bytes:
            raise ProtocolError(
                ErrorCode.INVALID_REQUEST,
                f"prompt_logprobs={sampling.prompt_logprobs} over {num_prompt_tokens} prompt "
                f"tokens exceeds what a reply carries (~{need} of {self.max_logprob_bytes} "
                "bytes): ask for fewer alternatives, or raise BATON_MAX_MESSAGE_BYTES",
            )


def _position_bytes(num_alternatives: int) -> int:
    return LOGPROB_POSITION_BYTES + num_alternatives * LOGPROB_ALTERNATIVE_BYTES


@dataclass(frozen=True)
class StopRule:
    """Whether a sequence ends with its newest token: EOS (unless ``ignore_eos``) or one of
    its ``stop_token_ids``, once it has ``min_tokens`` outputs → ``stop``; ``max_tokens``
    reached, or the engine's ``max_model_len`` → ``length``. The sampler already masks those
    tokens before ``min_tokens``; the rule says so too, so that it holds on its own."""

    eos_token_ids: frozenset[int]
    max_model_len: int

    def __call__(
        self, token_id: int, num_tokens: int, num_output_tokens: int, sampling: SamplingParams
    ) -> str | None:
        """The finish reason once ``token_id`` became output token number ``num_output_tokens``
        and the sequence holds ``num_tokens`` (prompt and output)."""
        if num_output_tokens >= sampling.min_tokens and (
            (token_id in self.eos_token_ids and not sampling.ignore_eos)
            or token_id in sampling.stop_token_ids
        ):
            return "stop"
        if num_output_tokens >= sampling.max_tokens or num_tokens >= self.max_model_len:
            return "length"
        return None
