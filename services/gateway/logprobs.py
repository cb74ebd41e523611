"""Logprobs and echo: the request fields that ask for them, and Baton's entries in OpenAI's and
vLLM's response shapes.

Requests. Completions: ``logprobs: k`` (the chosen token and the ``k`` most likely, OpenAI's
``logprobs``; vLLM allows up to 20), ``echo`` (the prompt before the completion; with
``logprobs`` the prompt's tokens are scored too, the first one ``null``; with ``max_tokens: 0``
the prompt alone, as vLLM: what lm-evaluation-harness's log-likelihood requests send). Chat:
``logprobs: true`` with ``top_logprobs: k``. Both: vLLM's ``prompt_logprobs: k`` (not with
``stream``, as vLLM) and ``return_tokens_as_token_ids``. Ranges are the tokenizer service's.

Responses. A Baton entry (shared/wire/replies.py) is ``[token_id, token, logprob, rank, top]``.
Completions get ``{tokens, token_logprobs, top_logprobs, text_offset}``: ``top_logprobs[i]``
maps the chosen token and the ``k`` most likely to their logprobs, ``text_offset`` adds up the
tokens' texts (vLLM's rule; a stream carries it on). Chat gets ``{content: [{token, logprob,
bytes, top_logprobs}]}``, ``top_logprobs`` the ``k`` most likely, best first. ``prompt_logprobs``
is vLLM's list: ``null`` for the first token, then ``{token_id: {logprob, rank,
decoded_token}}`` of the prompt's token and its alternatives. A logprob of ``-inf`` is sent as
``-9999.0`` (JSON has no infinity; vLLM's value).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.gateway.errors import flag, invalid

MIN_LOGPROB = -9999.0


@dataclass(frozen=True)
class ResponseOptions:
    """What a request asked of its answer beyond the text."""

    logprobs: int | None = None  # alternatives per output token shown; None: no logprobs
    prompt_logprobs: int | None = None  # vLLM's field: the prompt's, in its own shape
    echo: bool = False  # completions: the prompt's text (and tokens) before the completion
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone, nothing generated
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: "token_id:<id>" for texts

    @property
    def scores_prompt(self) -> bool:
        return self.prompt_logprobs is not None or (self.echo and self.logprobs is not None)


def parse_options(body: dict[str, Any], chat: bool, stream: bool) -> ResponseOptions:
    """The fields' types and combinations; ``max_tokens: 0`` is checked by the caller."""
    if chat:
        wanted = flag(body, "logprobs")
        top = _count(body, "top_logprobs")
        if top and not wanted:
            raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (top or 0) if wanted else None
        echo = False
    else:
        value = body.get("logprobs")
        logprobs = None if value is False else _count(body, "logprobs")
        echo = flag(body, "echo")
    prompt = _count(body, "prompt_logprobs")
    if prompt is not None and stream:
        raise invalid("prompt_logprobs are not available when stream is true", "prompt_logprobs")
    return ResponseOptions(logprobs, prompt, echo, False, flag(body, "return_tokens_as_token_ids"))


def baton_fields(options: ResponseOptions) -> dict[str, int]:
    """The Baton request fields: one ``prompt_logprobs`` serves both echo and vLLM's field."""
    out: dict[str, int] = {}
    if options.logprobs is not None:
        out["logprobs"] = options.logprobs
    if options.scores_prompt:
        out["prompt_logprobs"] = max(
            n for n in (options.prompt_logprobs, options.logprobs if options.echo else None)
            if n is not None
        )  # fmt: skip
    return out


class LogprobsFormat:
    """Baton entries in the response's shape, for one request (``text_offset`` runs on)."""

    def __init__(self, options: ResponseOptions) -> None:
        self.options = options
        self.k = options.logprobs or 0
        self.offset = 0  # characters of the token texts so far (completions' text_offset)

    def completion(self, entries: list[list[Any]]) -> dict[str, Any]:
        """A completion's ``logprobs`` object (an echoed prompt's first token has no logprob:
        null)."""
        tokens: list[str] = []
        logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token_id, text, logprob, _rank, top in entries:
            token = self._token(token_id, text)
            tokens.append(token)
            offsets.append(self.offset)
            self.offset += len(token)
            if logprob is None:
                logprobs.append(None)
                tops.append(None)
                continue
            logprobs.append(_finite(logprob))
            chosen = {token: _finite(logprob)}
            for i, t, lp in top[: self.k]:
                chosen[self._token(i, t)] = _finite(lp)
            tops.append(chosen)
        return {
            "text_offset": offsets,
            "token_logprobs": logprobs,
            "tokens": tokens,
            "top_logprobs": tops,
        }

    def chat(self, entries: list[list[Any]]) -> dict[str, Any]:
        """A chat choice's ``logprobs`` object."""
        content = []
        for token_id, text, logprob, _rank, top in entries:
            item = self._item(token_id, text, logprob)
            item["top_logprobs"] = [self._item(i, t, lp) for i, t, lp in top[: self.k]]
            content.append(item)
        return {"content": content}

    def prompt(self, entries: list[list[Any]] | None) -> list[dict[str, Any] | None] | None:
        """vLLM's ``prompt_logprobs``: per prompt token, its own and its alternatives'."""
        if entries is None or self.options.prompt_logprobs is None:
            return None
        k = self.options.prompt_logprobs
        out: list[dict[str, Any] | None] = []
        for token_id, text, logprob, rank, top in entries:
            if logprob is None:
                out.append(None)
                continue
            scored = {str(token_id): _vllm(logprob, rank, self._token(token_id, text))}
            for place, (i, t, lp) in enumerate(top[:k], start=1):
                scored.setdefault(str(i), _vllm(lp, place, self._token(i, t)))
            out.append(scored)
        return out

    def _item(self, token_id: int, text: str, logprob: float) -> dict[str, Any]:
        token = self._token(token_id, text)
        return {"token": token, "logprob": _finite(logprob), "bytes": _bytes(token)}

    def _token(self, token_id: int, text: str) -> str:
        return f"token_id:{token_id}" if self.options.tokens_as_ids else text


def _vllm(logprob: float, rank: int, text: str) -> dict[str, Any]:
    return {"logprob": _finite(logprob), "rank": rank, "decoded_token": text}


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def _count(body: dict[str, Any], name: str) -> int | None:
    """An integer (its range is the tokenizer's), or None when absent."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{name} must be an integer, got {type(value).__name__}", name)
    if not -(1 << 63) <= value < (1 << 64):  # what the wire (msgpack) carries
        raise invalid(f"{name} is out of range (beyond 64 bits)", name)
    return value
