"""Replies on a client's ``reply_to`` queue: the contract's ``token`` / ``done`` / ``error`` maps,
and (an addition only for clients that ask for it) batches of them in one message."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from shared.wire.codec import expect_map, pack, to_map, unpack
from shared.wire.errors import ErrorCode, ProtocolError


@dataclass(frozen=True)
class TokenReply:
    """``index``: output position of ``token_ids[0]``. ``text_offset`` (an addition to the
    contract that old clients may ignore): characters of the completion before ``text``. The
    two are the reply's idempotency key: a reply re-sent after a crash or a lost confirm carries
    the same positions and offsets, so a client keeps only what extends what it has."""

    request_id: str
    text: str
    token_ids: list[int]
    index: int
    text_offset: int | None = None  # None: from a server that predates it
    type: str = "token"
    # Additions (absent unless the request asked): one entry per token of ``token_ids``
    # (:data:`LOGPROB_ENTRY`); the prompt's, on the reply that starts the stream; which choice
    # of a request with n > 1 the reply continues (absent for n = 1: choice 0).
    logprobs: list[list[Any]] | None = None
    prompt_logprobs: list[list[Any]] | None = None
    choice_index: int | None = None

    def encode(self) -> bytes:
        return pack(_without_nils(to_map(self), _TOKEN_ADDITIONS))


@dataclass(frozen=True)
class DoneReply:
    """The end of one choice: the request's only one for n = 1; with n > 1 one per
    ``choice_index`` (absent for n = 1)."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: dict[str, int]
    timing: dict[str, float | None]
    type: str = "done"
    # Additions (absent unless set): every output token's logprobs, the prompt's, what ended a
    # ``stop`` (the stop string, or the ``stop_token_ids`` entry; None: EOS), and the choice of
    # a request with n > 1.
    logprobs: list[list[Any]] | None = None
    prompt_logprobs: list[list[Any]] | None = None
    stop_reason: str | int | None = None
    choice_index: int | None = None

    def encode(self) -> bytes:
        return pack(_without_nils(to_map(self), _DONE_ADDITIONS))


# A logprob entry as replies carry it: ``[token_id, token, logprob, rank, top]``, ``top`` the
# most likely tokens best first, each ``[token_id, token, logprob]``; ``token`` is the token's
# own text (decoded alone, special tokens included) and ``rank`` the chosen token's place, 1
# for the most likely (docs/contract.md). A prompt's first token has logprob and rank None.
LOGPROB_ENTRY = ("token_id", "token", "logprob", "rank", "top")
_TOKEN_ADDITIONS = ("text_offset", "logprobs", "prompt_logprobs", "choice_index")
_DONE_ADDITIONS = ("logprobs", "prompt_logprobs", "stop_reason", "choice_index")


def _without_nils(d: dict[str, Any], additions: tuple[str, ...]) -> dict[str, Any]:
    """Additions at None are left out (absent, not nil): a reply that uses none reads as before."""
    for name in additions:
        if d[name] is None:
            del d[name]
    return d


@dataclass(frozen=True)
class ErrorReply:
    request_id: str
    code: str
    message: str
    type: str = "error"

    def encode(self) -> bytes:
        return pack(to_map(self))


Reply = TokenReply | DoneReply | ErrorReply
_REPLY_TYPES: dict[str, Any] = {"token": TokenReply, "done": DoneReply, "error": ErrorReply}


# A batch: replies of several requests that share one reply queue, in one message, for clients
# that asked for it (request field ``batch_replies``). Its AMQP correlation_id is unset; each
# reply inside carries its request_id. Bounded so a reader's size limit is never the surprise.
BATCH_TYPE = "batch"
MAX_BATCH_REPLIES = 1024


def encode_reply_batch(bodies: list[bytes]) -> bytes:
    """A batch from already encoded replies (``Reply.encode()``): msgpack's framing around them,
    so a reply is packed once whether it goes alone or in a batch."""
    if not 2 <= len(bodies) <= MAX_BATCH_REPLIES:
        raise ValueError(f"a batch holds 2..{MAX_BATCH_REPLIES} replies, not {len(bodies)}")
    packer = msgpack.Packer(use_bin_type=True)
    head = packer.pack_map_header(2) + packer.pack("type") + packer.pack(BATCH_TYPE)
    return b"".join((head, packer.pack("replies"), packer.pack_array_header(len(bodies)), *bodies))


def decode_reply(body: bytes, max_bytes: int) -> Reply:
    """A reply, unpacked within ``max_bytes`` (every reader names its bound)."""
    return _reply(expect_map(unpack(body, max_bytes), "reply"))


def decode_replies(body: bytes, max_bytes: int) -> list[Reply]:
    """A reply or a batch of them (for clients that send ``batch_replies``), in order."""
    d = expect_map(unpack(body, max_bytes), "reply")
    if d.get("type") != BATCH_TYPE:
        return [_reply(d)]
    items = d.get("replies")
    if not isinstance(items, list) or not 0 < len(items) <= MAX_BATCH_REPLIES:
        raise ProtocolError(ErrorCode.INTERNAL, "malformed batch: replies must be a short list")
    return [_reply(expect_map(item, "batched reply")) for item in items]


def _reply(d: dict[str, Any]) -> Reply:
    kind = d.get("type")
    cls = _REPLY_TYPES.get(kind) if isinstance(kind, str) else None  # a list is unhashable
    if cls is None:
        raise ProtocolError(ErrorCode.INTERNAL, f"unknown reply type {d.get('type')!r}")
    try:
        return cls(**d)  # type: ignore[no-any-return]
    except TypeError as exc:
        raise ProtocolError(ErrorCode.INTERNAL, f"malformed {d['type']} reply: {exc}") from None
