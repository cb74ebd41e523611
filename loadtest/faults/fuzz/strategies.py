"""Hypothesis strategies for the request fuzz (``loadtest/faults/fuzz``): drafts of client cases.

A :class:`Draft` is everything about a case except its request id, which the case's index fixes
later (``cases.materialize``), so ids are unique whatever Hypothesis generates. The field
strategies come in pairs, valid and invalid, bounded by the system's limits (:class:`Bounds`).
Valid ``max_tokens`` stays small on purpose: a thousand cases must run in minutes on two cores,
and a large valid value costs time without finding anything a small one does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from shared.config import BatonConfig

OMIT: Any = "<omit>"  # a field left out of the request map
PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
OPTION_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "ignore_eos",
    "stream",
    "priority",
    "timeout_s",
)
KNOWN_FIELDS = ("request_id", *PROMPT_FIELDS, *OPTION_FIELDS)
# How the request id is formed from the case id; only "plain" and "unicode" are valid.
RID_MODES = (
    "plain",
    "plain",
    "plain",
    "unicode",
    "long",
    "long_bytes",
    "empty",
    "wrong",
    "missing",
)
RAW_KINDS = ("raw", "raw", "truncated", "truncated", "non_map", "bomb", "bomb", "oversized")
U64 = 2**64 - 1
I64 = -(2**63)


@dataclass(frozen=True)
class Bounds:
    max_tokens: int
    max_message_bytes: int
    max_prompt_tokens: int
    max_stop_strings: int
    max_stop_chars: int

    @classmethod
    def of(cls, config: BatonConfig) -> Bounds:
        return cls(
            config.max_tokens_limit,
            config.max_message_bytes,
            config.max_prompt_tokens,
            config.max_stop_strings,
            config.max_stop_chars,
        )


@dataclass(frozen=True)
class Draft:
    kind: str  # "request" or one of RAW_KINDS
    mode: str = ""  # request: valid | one_bad(<field>) | chaos
    fields: dict[Any, Any] = field(default_factory=dict)  # the request map, without request_id
    rid_mode: str = "plain"
    rid_value: Any = None  # rid_mode "unicode": the suffix; "wrong": the value
    raw: bytes = b""  # raw / bomb bodies; truncated: the cut point as 2 bytes
    correlation: str = "same"  # same | none | other
    reply: str = "own"  # own | none (dead-lettered) | internal (an internal queue)
    header_priority: int | None = None


def junk() -> SearchStrategy[Any]:
    """Any value msgpack can carry, nested a little."""
    leaf = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(I64, U64),
        st.floats(),
        st.text(max_size=12),
        st.binary(max_size=12),
    )
    return st.recursive(
        leaf,
        lambda inner: st.one_of(
            st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
        ),
        max_leaves=6,
    )


def not_a(*types: type) -> SearchStrategy[Any]:
    # bool is an int to Python and the parser refuses it where an int is due: keep it as junk.
    return junk().filter(lambda v: isinstance(v, bool) or not isinstance(v, types))


def _bad_float(lo: float, hi: float) -> SearchStrategy[Any]:
    return st.one_of(
        st.sampled_from([math.nan, math.inf, -math.inf, lo - 1.0, hi * 2 + 1.0]),
        st.floats(max_value=lo, exclude_max=True),
        st.floats(min_value=hi, exclude_min=True),
        not_a(int, float),
    )


def option_strategies(b: Bounds) -> dict[str, tuple[SearchStrategy[Any], SearchStrategy[Any]]]:
    """(valid, invalid) per optional field."""
    flag = (st.one_of(st.booleans(), st.none()), not_a(bool, type(None)))
    return {
        "max_tokens": (
            st.one_of(st.integers(1, 8), st.none()),
            st.one_of(st.integers(I64, 0), st.integers(b.max_tokens + 1, U64), not_a(int)),
        ),
        "temperature": (
            st.one_of(st.just(0.0), st.floats(0.0, 2.0), st.integers(0, 100)),
            _bad_float(0.0, 100.0),
        ),
        "top_p": (
            st.floats(0.0, 1.0, exclude_min=True),
            st.one_of(st.just(0.0), _bad_float(0.0, 1.0)),
        ),
        "top_k": (
            st.integers(0, 1 << 20),
            st.one_of(st.integers(I64, -1), st.integers((1 << 20) + 1, U64), not_a(int)),
        ),
        "seed": (
            st.one_of(st.none(), st.integers(0, 2**63 - 1)),
            st.one_of(st.integers(I64, -1), st.integers(2**63, U64), not_a(int, type(None))),
        ),
        "stop": (
            st.one_of(
                st.none(),
                st.text(min_size=1, max_size=6),
                st.lists(st.text(min_size=1, max_size=8), max_size=4),
            ),
            st.one_of(
                st.just([""]),
                st.lists(st.text(min_size=1, max_size=3), min_size=b.max_stop_strings + 1),
                st.just(["s" * (b.max_stop_chars + 1)]),
                st.lists(not_a(str), min_size=1, max_size=3),
                not_a(str, list, type(None)),
            ),
        ),
        "ignore_eos": flag,
        "stream": flag,
        "priority": (
            st.one_of(st.integers(0, 9), st.none()),
            st.one_of(st.integers(I64, -1), st.integers(10, U64), not_a(int, type(None))),
        ),
        "timeout_s": (
            st.one_of(st.none(), st.floats(0.001, 0.05), st.floats(1.0, 60.0)),
            st.one_of(st.just(0.0), _bad_float(0.0, 24 * 3600.0)),
        ),
    }


def prompt_strategies(b: Bounds) -> dict[str, tuple[SearchStrategy[Any], SearchStrategy[Any]]]:
    """(valid, invalid) per prompt field. Valid includes long prompts; invalid includes
    prompts over the limit (``prompt_too_long``) and token ids outside any vocabulary."""
    over = b.max_prompt_tokens + 1
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=40)}
    )
    return {
        "prompt": (
            st.one_of(
                st.text(min_size=1, max_size=80),
                st.integers(100, 600).map(lambda n: "ab " * n),  # ~2 tokens per repeat
            ),
            st.one_of(
                st.just(""),
                st.integers(over, 2 * over).map(lambda n: "ab " * n),
                st.just("x" * (b.max_prompt_tokens * 64 + 1)),  # refused before tokenizing
                not_a(str, type(None)),
            ),
        ),
        "messages": (
            st.lists(message, min_size=1, max_size=3),
            st.one_of(
                st.just([]),
                st.lists(
                    st.dictionaries(st.sampled_from(["role", "content"]), junk()),
                    min_size=1,
                    max_size=2,
                ),
                st.lists(not_a(dict), min_size=1, max_size=2),
                not_a(list, type(None)),
            ),
        ),
        "prompt_token_ids": (
            st.one_of(
                st.lists(st.integers(0, 255), min_size=1, max_size=40),
                st.integers(200, b.max_prompt_tokens).map(lambda n: [i % 256 for i in range(n)]),
            ),
            st.one_of(
                st.just([]),
                st.lists(
                    st.one_of(st.integers(I64, -1), st.integers(1 << 20, U64)),
                    min_size=1,
                    max_size=4,
                ),
                st.integers(over, 2 * over).map(lambda n: [1] * n),
                st.lists(
                    st.one_of(st.floats(), st.booleans(), st.text(max_size=2)),
                    min_size=1,
                    max_size=3,
                ),
                not_a(list, type(None)),
            ),
        ),
    }


def drafts(b: Bounds) -> SearchStrategy[Draft]:
    """Mostly request maps (valid, one field bad, or chaos), some raw bodies."""
    options, prompts = option_strategies(b), prompt_strategies(b)
    every = {**prompts, **options}

    @st.composite
    def request(draw: st.DrawFn) -> Draft:
        mode = draw(st.sampled_from(["valid", "valid", "one_bad", "one_bad", "chaos"]))
        fields: dict[Any, Any] = {}
        if mode == "chaos":
            for name, (good, bad) in every.items():
                # junk may be a valid large max_tokens: slow to serve, and nothing new to find
                anything = bad if name == "max_tokens" else junk()
                fields[name] = draw(st.one_of(st.just(OMIT), good, bad, anything))
        else:
            chosen = draw(st.sampled_from(PROMPT_FIELDS))
            fields[chosen] = draw(prompts[chosen][0])
            for name, (good, _) in options.items():
                fields[name] = draw(st.one_of(st.just(OMIT), good))
        rid_mode = draw(st.sampled_from(RID_MODES)) if mode == "chaos" else "plain"
        if mode == "one_bad":
            target = draw(st.sampled_from([*every, "prompt_combo", "request_id"]))
            mode = f"one_bad({target})"
            if target == "prompt_combo":  # none of the prompt fields, or several
                given = draw(st.sets(st.sampled_from(PROMPT_FIELDS)).filter(lambda s: len(s) != 1))
                for name in PROMPT_FIELDS:
                    fields[name] = draw(prompts[name][0]) if name in given else OMIT
            elif target == "request_id":
                rid_mode = draw(st.sampled_from(RID_MODES[3:]))
            else:
                fields[target] = draw(every[target][1])
        if draw(st.integers(0, 4)) == 0:
            extra = st.text(max_size=8).filter(lambda k: k not in every and k != "request_id")
            fields.update(draw(st.dictionaries(extra, junk(), max_size=3)))
        rid_value = None
        if rid_mode == "unicode":
            rid_value = draw(st.text(min_size=1, max_size=24))
        elif rid_mode == "wrong":
            rid_value = draw(not_a(str))
        fields = {k: v for k, v in fields.items() if v is not OMIT}
        return Draft("request", mode, fields, rid_mode, rid_value)

    @st.composite
    def raw(draw: st.DrawFn) -> Draft:
        kind = draw(st.sampled_from(RAW_KINDS))
        body = b""
        if kind == "raw":
            body = draw(st.binary(max_size=256))
        elif kind == "truncated":  # a valid map's body, cut at this point
            body = draw(st.integers(0, 65535)).to_bytes(2, "big")
        elif kind == "bomb":
            body = draw(st.sampled_from(BOMBS))
        return Draft(kind, kind, draw(st.one_of(request().map(lambda d: d.fields))), raw=body)

    return st.one_of(request(), request(), request(), request(), raw())


# Bodies that claim more than they hold, nest too deep, or use types the contract never sends.
BOMBS = (
    b"\xdd\xff\xff\xff\xff",  # array32 of 4 G elements, nothing follows
    b"\xdf\xff\xff\xff\xff",  # map32 of 4 G pairs
    b"\xdb\xff\xff\xff\xf0abc",  # str32 of 4 GB
    b"\xc6\x7f\xff\xff\xff",  # bin32 of 2 GB
    b"\x91" * 100_000,  # arrays nested 100,000 deep
    b"\x81\xa1a" * 50_000 + b"\xc0",  # maps nested 50,000 deep
    b"\xd4\x01\x00",  # fixext1 (ext types are refused)
    b"\xd6\xff\x00\x00\x00\x00",  # the timestamp ext type
    b"\xc1",  # the one byte msgpack never uses
    b"\x80\xc0",  # an empty map, then trailing bytes
    b"\x81\xc0\xc0",  # a map with a nil key
    b"\x82\xa1a\x01\xa1a\x02",  # a map with a duplicated key
    b"",
)
