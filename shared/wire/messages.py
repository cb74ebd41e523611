"""The wire contract: one dataclass per message, msgpack encode/decode, explicit size limits.

Client-facing shapes (``RequestMsg`` in, ``TokenReply`` / ``DoneReply`` / ``ErrorReply`` out) follow
the client contract (docs/contract.md) exactly. Internal messages (tokenizer → prefill → decode →
detok) carry ``v`` = :data:`SCHEMA_VERSION`; a consumer refuses a version it does not know instead
of guessing. Nothing here trusts a body: :func:`unpack` bounds sizes before msgpack allocates, and
:func:`parse_request` turns every malformed request into a :class:`ProtocolError` whose ``code`` is
one of the contract's error codes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from shared.wire.codec import expect_map, pack, to_map, unpack
from shared.wire.errors import ErrorCode, ProtocolError
from shared.wire.replies import (
    DoneReply,
    ErrorReply,
    Reply,
    TokenReply,
    decode_replies,
    decode_reply,
    encode_reply_batch,
)
from shared.wire.sampling import DEFAULT_MAX_TOKENS, SamplingParams
from shared.wire.typecheck import first_mismatch

__all__ = [
    "SCHEMA_VERSION",
    "ErrorCode",
    "ProtocolError",
    "unpack",
    "pack",
    "SamplingParams",
    "RequestMsg",
    "PrefillMsg",
    "KVDescriptor",
    "KVRelease",
    "KVReleaseMsg",
    "HandoffMsg",
    "StartInfo",
    "TokenEvent",
    "StreamMark",
    "DetokMsg",
    "ControlMsg",
    "TokenReply",
    "DoneReply",
    "ErrorReply",
    "Reply",
    "decode_reply",
    "decode_replies",
    "encode_reply_batch",
    "to_map",
]

# 2: KVDescriptor became an opaque, versioned per-transport payload.
# 3: StartInfo.batch_replies (the client's reply queue takes batches, see replies.py).
# 4: DetokMsg.marks (the detokenizer's stream high-water marks), StartInfo.owner and .priority;
#    KVDescriptor.first_block / fp_first_block / fp_slots (sliding windows, int8's full-precision
#    window); a layer-wise HandoffMsg has no output token yet (kv_transfer/layerwise.py).
# Still 4: SamplingParams' additions (min_p, penalties, min_tokens, stop_token_ids, logprobs,
# prompt_logprobs, n), StartInfo's (include_stop_str_in_output, stop_token_ids, n),
# TokenEvent's (logprobs, prompt_logprobs) and the choice fields of parallel sampling
# (TokenEvent.choice_index, StreamMark.choice_index and .done, HandoffMsg.choice_index and
# .choices, ControlMsg.choice_index) have defaults and are left out of a message at them, so
# messages of requests that use none read alike on either side of an upgrade.
SCHEMA_VERSION = 4
MAX_REQUEST_ID_CHARS = 256


def _check_version(d: dict[str, Any], kind: str) -> None:
    v = d.get("v")
    if type(v) is not int or v != SCHEMA_VERSION:  # True == 1 and 1.0 == 1: not versions
        raise ProtocolError(
            ErrorCode.INTERNAL, f"{kind}: schema version {v!r}, this build speaks {SCHEMA_VERSION}"
        )


def _without_defaults(
    obj: Any, fields: tuple[str, ...], additions: dict[str, Any]
) -> dict[str, Any]:
    """``fields`` of ``obj``, and each of ``additions`` that is not at its default (a message
    leaves those out: see SCHEMA_VERSION)."""
    d = {name: getattr(obj, name) for name in fields}
    for name, default in additions.items():
        value = getattr(obj, name)
        if value != default:
            d[name] = value
    return d


# The parsing of client requests (field by field, with limits) lives in shared/wire/validation.py;
# RequestMsg is the validated result.
@dataclass(frozen=True)
class RequestMsg:
    request_id: str
    sampling: SamplingParams
    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    stop: tuple[str, ...] = ()
    stream: bool = True
    priority: int = 0
    timeout_s: float | None = None
    # An addition to the contract: this client's reply queue accepts batch messages (several
    # requests' replies in one, shared/wire/replies.py). Old servers ignore it.
    batch_replies: bool = False
    # An addition: a stop string (or the stop token's text) stays at the end of the text.
    include_stop_str_in_output: bool = False

    def encode(self) -> bytes:
        """Client side: the contract's request map."""
        body: dict[str, Any] = {"request_id": self.request_id}
        if self.prompt is not None:
            body["prompt"] = self.prompt
        if self.messages is not None:
            body["messages"] = [{"role": r, "content": c} for r, c in self.messages]
        if self.prompt_token_ids is not None:
            body["prompt_token_ids"] = list(self.prompt_token_ids)
        # The sampling fields; the contract's additions only where a request sets them.
        body.update(self.sampling.to_dict())
        body.update(
            stop=list(self.stop),
            stream=self.stream,
            priority=self.priority,
            timeout_s=self.timeout_s,
        )
        if self.batch_replies:
            body["batch_replies"] = True
        if self.include_stop_str_in_output:
            body["include_stop_str_in_output"] = True
        return pack(body)


@dataclass
class _Internal:
    KIND: ClassVar[str] = ""

    def encode(self) -> bytes:
        d = to_map(self)
        d["v"] = SCHEMA_VERSION
        d["kind"] = self.KIND
        return pack(d)

    @classmethod
    def from_map(cls, d: dict[str, Any]) -> Any:
        return cls(**d)

    @classmethod
    def decode(cls, body: bytes, max_bytes: int) -> Any:
        d = expect_map(unpack(body, max_bytes), cls.KIND)
        _check_version(d, cls.KIND)
        if d.pop("kind", None) != cls.KIND:
            raise ProtocolError(ErrorCode.INTERNAL, f"expected a {cls.KIND} message")
        d.pop("v")
        try:
            msg = cls.from_map(d)
        except (TypeError, KeyError, ValueError) as exc:
            raise ProtocolError(
                ErrorCode.INTERNAL, f"malformed {cls.KIND} message: {exc}"
            ) from None
        bad = first_mismatch(msg)
        if bad is not None:
            raise ProtocolError(ErrorCode.INTERNAL, f"malformed {cls.KIND} message: field {bad}")
        return msg


@dataclass
class PrefillMsg(_Internal):
    """tokenizer → prefill: a validated, tokenized request."""

    KIND: ClassVar[str] = "prefill"
    request_id: str
    reply_to: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    stream: bool = True
    priority: int = 0
    arrival_time: float = 0.0  # wall clock (time.time()) when the tokenizer received it
    deadline: float | None = None  # wall clock; None = no timeout

    @classmethod
    def from_map(cls, d: dict[str, Any]) -> PrefillMsg:
        d["sampling"] = SamplingParams.from_dict(d["sampling"])
        return cls(**d)


@dataclass(frozen=True)
class KVDescriptor:
    """Where a request's KV waits for decode. Only this travels through the broker.

    ``payload`` belongs to the transport named by ``transport`` and is read by nothing else;
    ``version`` is that transport's payload version, so a receiver refuses a layout it does not
    know instead of reading wrong KV. ``num_tokens`` is how many leading positions it covers;
    ``first_block``: the index (in the request's block table) of the first block it holds —
    the blocks before lie outside every layer's sliding window and were never sent. An int8
    cache's full-precision window travels after the blocks: ``fp_slots`` more block ids, the
    model-dtype copies of blocks ``fp_first_block ..`` (shared/runtime/fp_window.py).
    """

    transport: str  # "shm" | "pool" | "cuda-ipc" | "mooncake"
    version: int
    num_tokens: int
    nbytes: int
    payload: dict[str, Any]
    first_block: int = 0
    fp_first_block: int = 0
    fp_slots: int = 0

    @classmethod
    def from_map(cls, d: dict[str, Any]) -> KVDescriptor:
        if not isinstance(d, dict) or not isinstance(d.get("payload"), dict):
            raise ValueError("kv must be a map with a map payload")
        return cls(**d)


@dataclass(frozen=True)
class KVRelease:
    """Receiver → sender: the receiver is done with the sender's copy of a request's KV (loaded
    or discarded), so a transport that pinned blocks for it may free them. ``sender_id`` names the
    sending worker (its release queue); ``payload`` is the transport's, as in KVDescriptor."""

    transport: str
    sender_id: str
    request_id: str
    payload: dict[str, Any] = field(default_factory=dict)


@dataclass
class HandoffMsg(_Internal):
    """prefill → decode: a prefilled sequence and the descriptor of its KV."""

    KIND: ClassVar[str] = "handoff"
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling: SamplingParams
    kv: KVDescriptor | None  # None: decode recomputes the prompt (e.g. the store was full)
    priority: int = 0
    arrival_time: float = 0.0
    deadline: float | None = None
    # Parallel sampling (``sampling.n`` > 1). From prefill: ``choices`` holds [index, first
    # token] of each choice still running (``output_token_ids`` is empty); decode forks the one
    # prompt's KV into them. A choice swapped out of a decode worker travels alone:
    # ``choice_index`` names it (None: the message is the whole request).
    choice_index: int | None = None
    choices: list[list[int]] = field(default_factory=list)

    def encode(self) -> bytes:
        d = to_map(self)
        if self.choice_index is None:  # the additions, left out at their defaults
            del d["choice_index"]
        if not self.choices:
            del d["choices"]
        d["v"] = SCHEMA_VERSION
        d["kind"] = self.KIND
        return pack(d)

    @classmethod
    def from_map(cls, d: dict[str, Any]) -> HandoffMsg:
        d["sampling"] = SamplingParams.from_dict(d["sampling"])
        if d.get("kv") is not None:
            d["kv"] = KVDescriptor.from_map(d["kv"])
        msg = cls(**d)
        n = msg.sampling.n if isinstance(msg.sampling, SamplingParams) else 1
        indices = [c[0] for c in msg.choices if isinstance(c, list) and len(c) == 2]
        if len(indices) != len(msg.choices) or not all(
            type(i) is int and 0 <= i < n for i in indices
        ):
            raise ValueError(f"choices must be [index, token] pairs with an index below n={n}")
        if msg.choice_index is not None and not (
            type(msg.choice_index) is int and 0 <= msg.choice_index < n
        ):
            raise ValueError(f"choice_index {msg.choice_index!r} outside 0..{n - 1}")
        return msg


@dataclass
class StartInfo:
    """What the detokenizer needs to answer a request. The tokenizer publishes it (confirmed)
    before the request goes to prefill, so the detokenizer knows every accepted request — it
    enforces deadlines and answers cancels even for requests still queued upstream."""

    request_id: str
    reply_to: str
    num_prompt_tokens: int
    stop: list[str] = field(default_factory=list)
    stream: bool = True
    arrival_time: float = 0.0
    deadline: float | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    batch_replies: bool = False  # its reply queue takes batches (RequestMsg.batch_replies)
    # The broker user that published the request (its AMQP user_id, which RabbitMQ checks), or
    # None if it set none: a cancel is honoured only from the same (services/shell/control_auth.py).
    owner: str | None = None
    priority: int = 0  # the client's (goodput is counted per priority)
    # Additions, left out of the message at their defaults (to_dict), as the sampling ones are.
    # The stop string, or the text of the token that stopped it, stays in the text.
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] = field(default_factory=list)  # a done reply's stop_reason
    n: int = 1  # choices (parallel sampling): one done reply each; left out at 1

    def to_dict(self) -> dict[str, Any]:
        return _without_defaults(self, _START_FIELDS, _START_ADDITIONS)


_START_ADDITIONS: dict[str, Any] = {
    "include_stop_str_in_output": False,
    "stop_token_ids": [],
    "n": 1,
}
_START_FIELDS = tuple(
    name for name in StartInfo.__dataclass_fields__ if name not in _START_ADDITIONS
)


@dataclass
class TokenEvent:
    """New tokens of one request at output positions [index, index + len(token_ids))."""

    request_id: str
    index: int
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "timeout"
    error_code: str | None = None  # set on a terminal error (no done reply then)
    error_message: str | None = None
    scheduled_at: float | None = None  # wall clock when prefill started it (index-0 events)
    # Additions, left out of the message at their defaults (to_dict). One entry per token of
    # ``token_ids`` when the request asked for ``logprobs``; the index-0 event of a request that
    # asked for ``prompt_logprobs`` has one per prompt token (the first's logprob and rank are
    # None: nothing before it scores it). An entry: ``[token_id, logprob, rank, top_ids,
    # top_logprobs]`` (shared/runtime/logprobs.py).
    logprobs: list[list[Any]] | None = None
    prompt_logprobs: list[list[Any]] | None = None
    choice_index: int = 0  # which choice of an n > 1 request

    def to_dict(self) -> dict[str, Any]:
        return _without_defaults(self, _EVENT_FIELDS, _EVENT_ADDITIONS)


_EVENT_ADDITIONS: dict[str, Any] = {"logprobs": None, "prompt_logprobs": None, "choice_index": 0}
_EVENT_FIELDS = tuple(
    name for name in TokenEvent.__dataclass_fields__ if name not in _EVENT_ADDITIONS
)


@dataclass
class StreamMark:
    """How far a request's stream was answered: the token replies committed so far end before
    output position ``next_index`` and text offset ``text_offset``
    (services/detokenizer/marks.py). With n > 1, one mark per choice (``choice_index``);
    ``done``: that choice's done reply is committed too (the others still run). Both left out at
    their defaults."""

    request_id: str
    next_index: int
    text_offset: int
    choice_index: int = 0
    done: bool = False

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "request_id": self.request_id,
            "next_index": self.next_index,
            "text_offset": self.text_offset,
        }
        if self.choice_index:
            d["choice_index"] = self.choice_index
        if self.done:
            d["done"] = True
        return d


@dataclass
class DetokMsg(_Internal):
    """→ detokenizer: one message per batch or step, every sequence in it (starts come from the
    tokenizer, token events from prefill and decode, marks from the detokenizer itself)."""

    KIND: ClassVar[str] = "detok"
    starts: list[StartInfo] = field(default_factory=list)
    events: list[TokenEvent] = field(default_factory=list)
    sent_at: float = 0.0
    marks: list[StreamMark] = field(default_factory=list)

    @classmethod
    def from_map(cls, d: dict[str, Any]) -> DetokMsg:
        return cls(
            starts=[StartInfo(**s) for s in d.get("starts", [])],
            events=[TokenEvent(**e) for e in d.get("events", [])],
            sent_at=d.get("sent_at", 0.0),
            marks=[StreamMark(**m) for m in d.get("marks", [])],
        )


@dataclass
class KVReleaseMsg(_Internal):
    """decode → one prefill worker (its queue ``kv_release_queue(sender_id)``): the KV of these
    requests was loaded or dropped, so the sender may free the blocks it pinned for them. Losing
    one is safe: the sender's lease frees them later."""

    KIND: ClassVar[str] = "kv_release"
    releases: list[KVRelease] = field(default_factory=list)

    @classmethod
    def from_map(cls, d: dict[str, Any]) -> KVReleaseMsg:
        releases = [KVRelease(**r) for r in d.get("releases", [])]
        if not all(isinstance(r.payload, dict) for r in releases):
            raise ValueError("kv_release: payload must be a map")
        return cls(releases=releases)


CONTROL_TYPES = ("cancel", "abort", "drain")


@dataclass(frozen=True)
class ControlMsg:
    """On the fanout exchange ``baton.control``. ``cancel`` is the client's (contract);
    ``abort`` is internal (the detokenizer finished a request early, e.g. on a stop string, and
    tells the workers to drop it silently; ``choice_index``: only that choice of an n > 1
    request); ``drain`` asks workers to stop taking new work."""

    type: str
    request_id: str | None = None
    choice_index: int | None = None

    def encode(self) -> bytes:
        d: dict[str, Any] = {"type": self.type}
        if self.request_id is not None:
            d["request_id"] = self.request_id
        if self.choice_index is not None:
            d["choice_index"] = self.choice_index
        return pack(d)

    @classmethod
    def decode(cls, body: bytes, max_bytes: int) -> ControlMsg:
        d = expect_map(unpack(body, max_bytes), "control message")
        kind, rid, index = d.get("type"), d.get("request_id"), d.get("choice_index")
        if kind not in CONTROL_TYPES:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"unknown control type {kind!r}")
        if kind != "drain" and not isinstance(rid, str):
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"{kind} needs a string request_id")
        if index is not None and (kind != "abort" or type(index) is not int or index < 0):
            raise ProtocolError(ErrorCode.INVALID_REQUEST, "choice_index: an abort's, an int >= 0")
        return cls(type=kind, request_id=rid if isinstance(rid, str) else None, choice_index=index)
