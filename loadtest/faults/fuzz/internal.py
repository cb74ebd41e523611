"""Internal-queue cases: malformed work messages published straight to the queues between the
services. Each must be dead-lettered (``baton.dead`` grows by one) with a log line, and the
system must go on serving (the caller sends a known-good request afterwards).

Cases run one at a time, so each is attributed exactly: a case whose message is not
dead-lettered within ``DEAD_WAIT_S`` is a violation. The queues are whatever the topology names
now (``internal_queues``), so sharding a stage's queue needs no change here.

"Leaf" cases (``leaf_types=True``, the default: right shape, a wrong type deep inside, e.g. an
int request id, or a token id outside the vocabulary) must be refused too: the decoders check
every field's type (``shared/wire/typecheck.py``) and the engine services the token ids.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aio_pika
import msgpack

from loadtest.faults.fuzz.client import ClientFuzzer, dead_count
from shared.config import BatonConfig
from shared.wire import queues
from shared.wire.messages import (
    SCHEMA_VERSION,
    DetokMsg,
    HandoffMsg,
    PrefillMsg,
    SamplingParams,
    StartInfo,
    TokenEvent,
    pack,
)

DEAD_WAIT_S = 5.0
LOG_WAIT_S = 3.0
# What the services log for a message they drop: "unreadable work message", "unreadable detok
# message dead-lettered", "work from an untrusted publisher dead-lettered" (BATON_TRUSTED_...).
LOG_MARKERS = ("unreadable", "dead-lettered")
NOWHERE = "baton.fuzz.nowhere"  # a reply queue nobody declared: replies to it are dropped


@dataclass(frozen=True)
class InternalCase:
    index: int
    queue: str
    name: str
    body: bytes

    def describe(self) -> str:
        return f"internal case {self.index} {self.queue}/{self.name} ({len(self.body)} bytes)"


def internal_queue_names(config: BatonConfig) -> list[str]:
    """Every queue between services: ``WORK_QUEUES`` but the client's, plus the topology's own
    list where it has one (sharded stages are not in ``WORK_QUEUES``)."""
    names = [q for q in queues.WORK_QUEUES if q != queues.REQUESTS_QUEUE]
    listed = getattr(queues, "internal_queues", None)
    if listed is not None:
        names += listed(getattr(config, "detok_shards", 1))
    return list(dict.fromkeys(names))


def _valid(kind: str, rid: str) -> dict[str, Any]:
    """A well-formed message of ``kind`` as a map, from the real encoders."""
    sampling = SamplingParams(max_tokens=2)
    msg: Any
    if kind == "prefill":
        msg = PrefillMsg(rid, NOWHERE, [1, 2, 3], sampling)
    elif kind == "handoff":
        msg = HandoffMsg(rid, [1, 2, 3], [4], sampling, kv=None)
    else:
        msg = DetokMsg(starts=[StartInfo(rid, NOWHERE, 3)], events=[TokenEvent(rid, 0, [4])])
    return dict(msgpack.unpackb(msg.encode(), raw=False))


def _kind_of(queue: str) -> str | None:
    if queue == queues.PREFILL_QUEUE:
        return "prefill"
    if queue == queues.DECODE_QUEUE:
        return "handoff"
    return "detok" if queue.startswith("baton.detok") else None


def _mutations(kind: str, base: dict[str, Any], max_bytes: int) -> list[tuple[str, Any]]:
    """(name, map or bytes): every one must fail decoding. Top-level keys the detok decoder
    ignores, so its structural faults go inside ``starts``/``events``."""
    other = "handoff" if kind == "prefill" else "prefill"
    out: list[tuple[str, Any]] = [
        ("truncated", pack(base)[: len(pack(base)) // 2]),
        ("trailing_bytes", pack(base) + b"\xc1"),
        ("non_map", pack(list(base.items()))),  # type: ignore[arg-type]
        ("no_kind", {k: v for k, v in base.items() if k != "kind"}),
        ("wrong_kind", {**base, "kind": other}),
        ("kind_not_str", {**base, "kind": 7}),
        ("other_message", _valid(other, str(base.get("request_id", "x")))),
        ("no_version", {k: v for k, v in base.items() if k != "v"}),
        ("oversized", {**base, "pad": "p" * (max_bytes + 1)}),
    ]
    v = SCHEMA_VERSION  # its neighbours and look-alikes (True == 1, 3.0 == 3 in Python)
    bad_versions = (v - 1, v + 1, str(v), float(v), True, None)
    out += [(f"version={b!r}", {**base, "v": b}) for b in bad_versions]
    if kind == "detok":
        start, event = base["starts"][0], base["events"][0]
        out += [
            ("start_missing_reply_to", {**base, "starts": [{"request_id": start["request_id"]}]}),
            ("start_extra_field", {**base, "starts": [{**start, "bogus": 1}]}),
            ("event_missing_index", {**base, "events": [{"request_id": event["request_id"]}]}),
            ("starts_not_list", {**base, "starts": 5}),
            ("events_of_ints", {**base, "events": [5]}),
        ]
    else:
        out += [
            ("missing_request_id", {k: v for k, v in base.items() if k != "request_id"}),
            ("extra_field", {**base, "bogus": 1}),
            ("sampling_not_map", {**base, "sampling": 5}),
            ("sampling_unknown_key", {**base, "sampling": {"bogus": 1}}),
        ]
        if kind == "handoff":
            out.append(("kv_not_map", {**base, "kv": [1]}))
    return out


def _leaf_mutations(kind: str, base: dict[str, Any]) -> list[tuple[str, Any]]:
    """Right shape, wrong leaf type (see the module docstring)."""
    if kind == "detok":
        start, event = base["starts"][0], base["events"][0]
        return [
            (
                "event_request_id_list",
                {**base, "starts": [], "events": [{**event, "request_id": [1]}]},
            ),
            ("event_index_str", {**base, "starts": [], "events": [{**event, "index": "x"}]}),
            ("start_stop_int", {**base, "starts": [{**start, "stop": 5}], "events": []}),
            # last: its reply can never be published (a queue name must be a string)
            ("start_reply_to_int", {**base, "starts": [{**start, "reply_to": 5, "deadline": 0.0}]}),
        ]
    return [
        ("request_id_int", {**base, "request_id": 5}),
        ("token_ids_str", {**base, "prompt_token_ids": ["a"]}),
        ("token_id_out_of_vocab", {**base, "prompt_token_ids": [10**9]}),
        ("max_tokens_str", {**base, "sampling": {**base["sampling"], "max_tokens": "x"}}),
    ]


def internal_cases(
    seed: int, config: BatonConfig, run: str, leaf_types: bool = True
) -> list[InternalCase]:
    """Every structural fault on every queue, then the leaf-type ones. The one that
    wedges the detokenizer today (a start whose reply_to is not a string) runs once, last, so
    it cannot hide the others."""
    rng = random.Random(seed)
    specs: list[tuple[str, str, Any]] = []  # (queue, name, map or bytes)
    leaf: list[tuple[str, str, Any]] = []
    for n, queue in enumerate(internal_queue_names(config)):
        kind = _kind_of(queue)
        # a map of the wrong kind, or of no fields at all (an empty detok message is valid)
        wrong = rng.choice([k for k in ("prefill", "handoff", "detok") if k != kind])
        specs += [
            (queue, "garbage", rng.randbytes(rng.randint(1, 64))),
            (queue, "empty", b""),
            (queue, "random_map", {"kind": wrong, "v": rng.choice([1, 2, 3]), "x": rng.random()}),
        ]
        if kind is not None:
            base = _valid(kind, f"fzint{seed}.{run}-{n}")
            specs += [(queue, *m) for m in _mutations(kind, base, config.max_message_bytes)]
            leaf += [(queue, *m) for m in _leaf_mutations(kind, base)]
    if leaf_types:
        last = [c for c in leaf if c[1] == "start_reply_to_int"][:1]
        specs += [c for c in leaf if c[1] != "start_reply_to_int"] + last
    return [
        InternalCase(i, queue, name, value if isinstance(value, bytes) else pack(value))
        for i, (queue, name, value) in enumerate(specs)
    ]


async def run_internal(
    fuzzer: ClientFuzzer, cases: list[InternalCase], read_log: Callable[[], str] | None
) -> None:
    report, channel = fuzzer.report, fuzzer.channel
    await _check_declared(fuzzer, {c.queue for c in cases})

    async def dead() -> int:
        return await dead_count(channel)

    async def logged() -> int:
        lines = read_log().splitlines() if read_log else []
        return sum(any(m in line for m in LOG_MARKERS) for line in lines)

    for case in cases:
        dead_before, logged_before = await dead(), await logged()
        message = aio_pika.Message(case.body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
        await channel.default_exchange.publish(message, routing_key=case.queue)
        if await _grows(dead, dead_before, DEAD_WAIT_S):
            report.outcomes[f"internal {case.queue}: dead-lettered"] += 1
        else:
            report.outcomes[f"internal {case.queue}: not dead-lettered"] += 1
            report.violations.append(f"{case.describe()}: not dead-lettered in {DEAD_WAIT_S}s")
        if read_log is not None and not await _grows(logged, logged_before, LOG_WAIT_S):
            report.violations.append(f"{case.describe()}: no dead-letter log line")


async def _check_declared(fuzzer: ClientFuzzer, names: set[str]) -> None:
    """A queue the topology names but nobody declared would drop these silently."""
    for name in sorted(names):
        channel = await fuzzer.connection.channel()  # a failed passive declare closes it
        try:
            await channel.declare_queue(name, passive=True)
        except aio_pika.exceptions.ChannelClosed:
            fuzzer.report.violations.append(f"internal queue {name} is not declared")
        finally:
            if not channel.is_closed:
                await channel.close()


async def _grows(count: Callable[[], Awaitable[int]], before: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while await count() <= before:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True
