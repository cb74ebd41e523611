"""Client cases for the fuzz: drafts from Hypothesis, made into bodies, with what each must get.

Determinism: the drafts come from ``@given`` runs under ``@seed`` (which overrides
``derandomize``), with no example database, so a seed and a count always yield the same cases
(with the same Hypothesis version: its draws depend on ``max_examples`` and its own code).
Every case's request id starts with its case id (``fz<seed>.<run>-<index>``), so ids never
collide whatever Hypothesis draws, and a reply is traced to its case by correlation id or
request id.

The oracle is the parser itself: a body :func:`parse_request` refuses must be answered with that
error code exactly; one it accepts may still be refused downstream (token ids outside the
vocabulary, a prompt over the limit once tokenized, overload, its deadline) or completed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any

import msgpack
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed

from loadtest.faults.fuzz.strategies import Bounds, Draft, drafts
from shared.config import BatonConfig
from shared.wire.errors import ProtocolError
from shared.wire.messages import RequestMsg
from shared.wire.validation import parse_request


@dataclass(frozen=True)
class Case:
    index: int
    case_id: str  # fz<seed>.<run>-<index>
    kind: str
    mode: str
    body: bytes
    correlation_id: str | None
    reply: str  # own | none | internal
    header_priority: int | None
    request_id: str | None  # the body's, when it is a string (replies may carry it)
    expected_code: str | None  # the parser's refusal; None: it accepts the body
    request: RequestMsg | None  # what the parser made of an accepted body

    def describe(self, limit: int = 200) -> str:
        amqp = f"corr={self.correlation} reply={self.reply} header_priority={self.header_priority}"
        return (
            f"case {self.index} ({self.case_id}) {self.kind}/{self.mode} {amqp} "
            f"{len(self.body)} bytes: {_preview(self.body, limit)}"
        )

    @property
    def correlation(self) -> str:
        if self.correlation_id is None:
            return "none"
        return "same" if self.correlation_id == self.request_id else "other"


def collect_drafts(n: int, seed: int, bounds: Bounds) -> list[Draft]:
    """``n`` drafts, the same for the same seed. Hypothesis may stop a run short (it skips
    drafts it has already produced), so runs repeat under derived seeds until there are ``n``."""
    out: list[Draft] = []
    for round_ in range(1000):
        if len(out) >= n:
            break

        @hypothesis_seed(seed * 1000 + round_)
        @settings(
            database=None,
            derandomize=True,
            max_examples=n - len(out),
            phases=[Phase.generate],
            deadline=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(drafts(bounds))
        def take(draft: Draft) -> None:
            out.append(draft)

        take()
    rng = random.Random(seed)
    return [with_amqp_oddities(d, rng) for d in out[:n]]


def with_amqp_oddities(d: Draft, rng: random.Random) -> Draft:
    """Rates, not edge cases, so these come from a seeded Random rather than Hypothesis (which
    favours boundary values): a few cases with no correlation id or another one, without
    reply_to or with an internal queue as reply_to, and header priorities up to 255."""
    roll = rng.random()
    correlation = "none" if roll < 0.05 else "other" if roll < 0.1 else "same"
    roll = rng.random()
    reply = "none" if roll < 0.02 else "internal" if roll < 0.03 else "own"
    priority = rng.choice([0, 1, 9, 10, 255, rng.randrange(256)]) if rng.random() < 0.2 else None
    return replace(d, correlation=correlation, reply=reply, header_priority=priority)


def client_cases(n: int, seed: int, config: BatonConfig, run: str) -> list[Case]:
    """``run`` tags the request ids: Baton rightly ignores an id it has already answered, so a
    rerun against the same services must not reuse them. Everything else depends on the seed."""
    drafts_ = collect_drafts(n, seed, Bounds.of(config))
    return [materialize(d, i, f"fz{seed}.{run}-{i}", config) for i, d in enumerate(drafts_)]


def materialize(d: Draft, index: int, case_id: str, config: BatonConfig) -> Case:
    body_map: dict[Any, Any] = dict(d.fields)
    rid: Any = {
        "plain": case_id,
        "unicode": f"{case_id}-{d.rid_value}",
        "long": case_id + "x" * 300,
        # under the 256-character limit, over AMQP's 255 bytes for a correlation id
        "long_bytes": case_id + "\u00e9" * 125,
        "empty": "",
        "wrong": d.rid_value,
    }.get(d.rid_mode)
    if d.rid_mode != "missing":
        body_map = {"request_id": rid, **body_map}
    if d.kind == "request":
        body = msgpack.packb(body_map, use_bin_type=True)
    elif d.kind == "truncated":
        full = msgpack.packb(body_map, use_bin_type=True)
        body = full[: int.from_bytes(d.raw, "big") % max(len(full), 1)]
    elif d.kind == "non_map":
        body = msgpack.packb(list(body_map.items()), use_bin_type=True)
    elif d.kind == "oversized":
        pad = "p" * (config.max_message_bytes + 1)
        body = msgpack.packb({**body_map, "prompt": pad}, use_bin_type=True)
    else:  # raw, bomb
        body = d.raw
    correlation_id = {"same": case_id if not isinstance(rid, str) or not rid else rid}.get(
        d.correlation, f"{case_id}-other" if d.correlation == "other" else None
    )
    if correlation_id is not None and len(correlation_id.encode()) > 255:
        correlation_id = case_id  # an AMQP short string: the client could not send more
    expected, request = predict(body, config, d.header_priority)
    return Case(
        index=index,
        case_id=case_id,
        kind=d.kind,
        mode=d.mode,
        body=body,
        correlation_id=correlation_id,
        reply=d.reply,
        header_priority=d.header_priority,
        request_id=rid if isinstance(rid, str) and rid else None,
        expected_code=expected,
        request=request,
    )


def predict(
    body: bytes, config: BatonConfig, header_priority: int | None
) -> tuple[str | None, RequestMsg | None]:
    """The parser's verdict. Anything but a ProtocolError escapes: the fuzz reports it as a
    parser bug (the tokenizer would answer it ``internal``)."""
    try:
        return None, parse_request(body, config, header_priority=header_priority)
    except ProtocolError as exc:
        return exc.code.value, None


def canary_case(index: int, seed: int, config: BatonConfig, run: str) -> Case:
    """A known-good request: greedy, exactly 4 tokens (``ignore_eos``), streamed."""
    case_id = f"fz{seed}.{run}-canary{index}"
    body_map = {"request_id": case_id, "prompt": "fuzz canary", "max_tokens": 4, "ignore_eos": True}
    body = msgpack.packb(body_map, use_bin_type=True)
    expected, request = predict(body, config, None)
    assert expected is None
    return Case(
        index, case_id, "canary", "valid", body, case_id, "own", None, case_id, None, request
    )


def _preview(body: bytes, limit: int) -> str:
    if len(body) > 4096:  # an oversized or long body: its head is enough to tell what it was
        return f"{body[:limit]!r}..."
    try:
        value = msgpack.unpackb(body, raw=False, strict_map_key=False)
        text = repr(value)
    except Exception:
        text = "raw " + body.hex()
    return text if len(text) <= limit else text[:limit] + "..."
