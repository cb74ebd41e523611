"""Logprob entries as replies carry them: the engines' entries, with each token's text.

An engine's entry is ``[token_id, logprob, rank, top_ids, top_logprobs]``
(shared/runtime/logprobs.py); a reply's is ``[token_id, token, logprob, rank, top]`` with
``top`` a list of ``[token_id, token, logprob]`` (shared/wire/replies.py). A token's text is the
token decoded alone, special tokens included: vLLM's ``decoded_token``. Texts are cached by id:
the vocabulary bounds the cache, and a few thousand ids cover most text, so a request asking
for 20 alternatives per token costs dictionary lookups, not 21 decodes per token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

DecodeToken = Callable[[int], str]
MAX_CACHED_TEXTS = 1 << 17


class LogprobText:
    def __init__(self, decode_token: DecodeToken, max_cached: int = MAX_CACHED_TEXTS) -> None:
        self._text = lru_cache(maxsize=max_cached)(decode_token)

    def entry(self, e: Sequence[Any]) -> list[Any]:
        """One engine entry in the reply's form."""
        token_id, logprob, rank, top_ids, top_logprobs = e
        text = self._text
        top = [[i, text(i), lp] for i, lp in zip(top_ids, top_logprobs, strict=True)]
        return [token_id, text(token_id), logprob, rank, top]

    def entries(self, es: Sequence[Sequence[Any]]) -> list[list[Any]]:
        return [self.entry(e) for e in es]
