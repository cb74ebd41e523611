"""Property tests of the parsing layer, no broker: on any bytes or any map, ``unpack`` and
``parse_request`` either accept, within every documented limit, or raise ``ProtocolError`` with
a contract error code — never anything else (the tokenizer would answer that ``internal``).

The inputs are the request fuzz's own strategies (``loadtest/faults/fuzz/strategies.py``), plus raw
bytes and byte-flipped valid bodies. Derandomized: the same examples on every run.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loadtest.faults.fuzz.cases import materialize
from loadtest.faults.fuzz.strategies import KNOWN_FIELDS, Bounds, Draft, drafts, junk
from shared.config import BatonConfig
from shared.wire.errors import ErrorCode, ProtocolError
from shared.wire.messages import RequestMsg, unpack
from shared.wire.priority import MAX_PRIORITY
from shared.wire.validation import parse_request

CONFIG = BatonConfig()
PARSER_CODES = {ErrorCode.INVALID_REQUEST, ErrorCode.PROMPT_TOO_LONG}
PROPERTY = settings(
    derandomize=True,
    database=None,
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# Whole fuzz drafts are slower to draw: fewer of them keep the file under ten seconds.
DRAFTS = settings(PROPERTY, max_examples=150)


def parse(body: bytes, header_priority: int | None = None) -> RequestMsg | None:
    """The request, or None when refused with a contract code and a message."""
    try:
        req = parse_request(body, CONFIG, header_priority=header_priority)
    except ProtocolError as exc:
        assert exc.code in PARSER_CODES and exc.message
        return None
    check_limits(req)
    return req


def check_limits(req: RequestMsg) -> None:
    rid = req.request_id
    assert isinstance(rid, str) and rid and len(rid.encode()) <= 255
    given_ = [f for f in (req.prompt, req.messages, req.prompt_token_ids) if f is not None]
    assert len(given_) == 1
    if req.prompt is not None:
        assert isinstance(req.prompt, str) and req.prompt
    if req.messages is not None:
        assert req.messages and all(
            isinstance(r, str) and r and isinstance(c, str) for r, c in req.messages
        )
    if req.prompt_token_ids is not None:
        ids = req.prompt_token_ids
        assert 0 < len(ids) <= CONFIG.max_prompt_tokens and all(type(t) is int for t in ids)
    s = req.sampling
    assert type(s.max_tokens) is int and 1 <= s.max_tokens <= CONFIG.max_tokens_limit
    assert type(s.temperature) is float and math.isfinite(s.temperature)
    assert 0.0 <= s.temperature <= 100.0
    assert type(s.top_p) is float and 0.0 < s.top_p <= 1.0
    assert type(s.top_k) is int and 0 <= s.top_k <= 1 << 20
    assert s.seed is None or (type(s.seed) is int and 0 <= s.seed < 2**63)
    assert type(s.ignore_eos) is bool and type(req.stream) is bool
    assert len(req.stop) <= CONFIG.max_stop_strings
    assert all(isinstance(x, str) and 0 < len(x) <= CONFIG.max_stop_chars for x in req.stop)
    assert type(req.priority) is int and 0 <= req.priority <= MAX_PRIORITY
    assert req.timeout_s is None or (
        type(req.timeout_s) is float and 0.0 < req.timeout_s <= 24 * 3600
    )


@PROPERTY
@given(st.binary(max_size=512))
def test_unpack_refuses_only_with_invalid_request(body: bytes) -> None:
    try:
        unpack(body, 256)
    except ProtocolError as exc:
        assert exc.code is ErrorCode.INVALID_REQUEST
    parse(body)


@DRAFTS
@given(drafts(Bounds.of(CONFIG)), st.one_of(st.none(), st.integers(0, 255)))
def test_fuzz_cases_parse_or_refuse(draft: Draft, header_priority: int | None) -> None:
    case = materialize(draft, 0, "fz-prop-0", CONFIG)  # parses it, as the fuzz's oracle
    req = parse(case.body, header_priority)
    assert (req is None) == (case.expected_code is not None)
    if req is not None and "priority" not in draft.fields and header_priority is not None:
        assert req.priority == min(header_priority, MAX_PRIORITY)


@PROPERTY
@given(st.integers(0, 300), st.text(st.characters(min_codepoint=0x80), max_size=100))
def test_request_ids_fit_an_amqp_correlation_id(ascii_chars: int, wide: str) -> None:
    """Replies carry the id as their correlation_id, an AMQP short string (255 bytes)."""
    parse(msgpack.packb({"request_id": "r" * ascii_chars + wide, "prompt": "hi"}))


KEYS = st.one_of(
    st.sampled_from(KNOWN_FIELDS), st.text(max_size=8), st.integers(-(2**63), 2**64 - 1)
)


@PROPERTY
@given(st.dictionaries(KEYS, junk(), max_size=8))
def test_any_map_parses_or_is_refused(fields: dict[Any, Any]) -> None:
    parse(msgpack.packb(fields, use_bin_type=True))


@DRAFTS
@given(drafts(Bounds.of(CONFIG)), st.lists(st.tuples(st.integers(0), st.integers(0, 255))))
def test_byte_flipped_bodies_parse_or_are_refused(
    draft: Draft, flips: list[tuple[int, int]]
) -> None:
    body = bytearray(materialize(draft, 0, "fz-prop-0", CONFIG).body)
    for at, value in flips:
        if body:
            body[at % len(body)] = value
    parse(bytes(body))
