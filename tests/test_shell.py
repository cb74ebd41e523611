"""The service shell: registry, drain, redelivery counting, the tokenizer's priority rule.

The drain tests run real services against a real RabbitMQ (a fresh vhost each)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import aio_pika
import msgpack
import pytest

from services.launcher import ServiceProcesses, free_port_block, fresh_vhost
from services.shell.broker import declare_topology
from services.shell.registry import METRICS_ENDPOINTS, NAMES, PIPELINE, SERVICES, build
from shared.client import BatonClient
from shared.config import BatonConfig
from shared.wire.messages import ControlMsg, DoneReply, PrefillMsg, TokenReply
from shared.wire.queues import CONTROL_EXCHANGE, DECODE_QUEUE, PREFILL_QUEUE, REQUESTS_QUEUE
from shared.wire.validation import parse_request
from tests.fault.harness import service_processes, streamed_done

CONFIG = BatonConfig()


# --- registry -------------------------------------------------------------------------------


def test_registry_lists_every_service_in_start_order() -> None:
    assert NAMES == ("tokenizer", "prefill", "decode", "detokenizer", "gateway")
    assert PIPELINE == ("tokenizer", "prefill", "decode", "detokenizer")
    assert all(s.module == f"services.{s.name}.service" for s in SERVICES)
    assert METRICS_ENDPOINTS == PIPELINE  # the gateway serves /metrics on its own HTTP port


def test_cli_help_shows_the_registry() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "services", "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    for s in SERVICES:
        assert f"  {s.name:<12} {s.summary}" in done.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "services", "nonsense"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "gateway" in bad.stderr


# --- priority -------------------------------------------------------------------------------


def _body(**fields: Any) -> bytes:
    return msgpack.packb({"request_id": "r", "prompt": "hi", **fields})


@pytest.mark.parametrize(
    ("fields", "header", "expected"),
    [
        ({"priority": 0}, 7, 0),  # a body that says 0 overrides the header
        ({"priority": 3}, 7, 3),
        ({}, 7, 7),  # no field in the body: the header
        ({"priority": None}, 7, 7),
        ({}, 200, 9),  # the header is clamped to the contract's range
        ({}, None, 0),
        ({"priority": 5}, None, 5),
    ],
)
def test_priority_is_the_bodys_when_it_has_the_field_else_the_headers(
    fields: dict[str, Any], header: int | None, expected: int
) -> None:
    assert parse_request(_body(**fields), CONFIG, header_priority=header).priority == expected


# --- against RabbitMQ ---------------------------------------------------------------------------


async def _connect(url: str) -> aio_pika.abc.AbstractRobustConnection:
    return await aio_pika.connect_robust(url)


async def _depth(url: str, queue: str) -> int:
    conn = await _connect(url)
    async with conn:
        channel = await conn.channel()
        q = await channel.declare_queue(queue, passive=True)
        return q.declaration_result.message_count or 0


async def _drain(url: str) -> None:
    conn = await _connect(url)
    async with conn:
        channel = await conn.channel()
        exchange = await channel.declare_exchange(
            CONTROL_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True
        )
        await exchange.publish(aio_pika.Message(ControlMsg("drain").encode()), routing_key="")


async def _until(what: str, check: Callable[[], Any], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        await asyncio.sleep(0.05)


@pytest.fixture
def vhost() -> Iterator[str]:
    with fresh_vhost(prefix="baton-shell") as url:
        yield url


@pytest.mark.integration
async def test_tokenizer_counts_redeliveries_and_applies_the_priority_rule(vhost: str) -> None:
    """Requests first taken by a consumer that died unacked arrive redelivered: the shell counts
    them. The tokenizer forwards each with the priority rule and ``max_tokens`` clamped once."""
    conn = await _connect(vhost)
    async with conn:
        channel = await conn.channel()
        await declare_topology(channel, CONFIG)
        reply_queue = await channel.declare_queue("", exclusive=True)
        cases = {  # request id -> (body fields, AMQP priority, expected priority)
            "body-zero": ({"priority": 0}, 7, 0),
            "header": ({}, 6, 6),
            "header-clamped": ({}, 200, 9),
        }
        for rid, (fields, header, _) in cases.items():
            body = msgpack.packb({"request_id": rid, "prompt": "hi", "max_tokens": 4000, **fields})
            message = aio_pika.Message(
                body, correlation_id=rid, reply_to=reply_queue.name, priority=header
            )
            await channel.default_exchange.publish(message, routing_key=REQUESTS_QUEUE)
        # A consumer takes all three and dies without acking: the broker redelivers them.
        doomed = await conn.channel()
        requests = await doomed.declare_queue(REQUESTS_QUEUE, passive=True)
        taken: list[Any] = []

        async def take(message: Any) -> None:
            taken.append(message)

        await requests.consume(take, no_ack=False)
        await _until("the doomed consumer got them", lambda: len(taken) == len(cases))
        await doomed.close()

        tokenizer: Any = build("tokenizer", BatonConfig.from_env(amqp_url=vhost, metrics_port=0))
        await tokenizer.start()
        try:
            forwarded: dict[str, tuple[PrefillMsg, int | None]] = {}
            prefill = await channel.declare_queue(PREFILL_QUEUE, passive=True)
            deadline = time.monotonic() + 30
            while len(forwarded) < len(cases) and time.monotonic() < deadline:
                got = await prefill.get(no_ack=True, fail=False)
                if got is None:
                    await asyncio.sleep(0.05)
                    continue
                msg = PrefillMsg.decode(got.body, CONFIG.max_message_bytes)
                forwarded[msg.request_id] = (msg, got.priority)
            registry = tokenizer.shell.metrics.metrics.registry
            counted = registry.get_sample_value(
                "baton:redelivered_messages_total", {"queue": REQUESTS_QUEUE}
            )
            assert counted == len(cases)
        finally:
            await tokenizer.stop()
    assert forwarded.keys() == cases.keys()
    max_model_len = tokenizer.limits.max_model_len
    for rid, (_, _, expected) in cases.items():
        msg, amqp_priority = forwarded[rid]
        assert msg.priority == expected and amqp_priority == expected, rid
        assert msg.sampling.max_tokens == max_model_len - len(msg.prompt_token_ids)


def _status(port: int, path: str) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


async def _exited(procs: ServiceProcesses, name: str, timeout_s: float = 60.0) -> int:
    proc = procs.procs[name]
    await _until(f"{name} exits", lambda: proc.poll() is not None, timeout_s)
    assert proc.returncode is not None
    return proc.returncode


# Output tokens: generation is still running when the drain arrives. 1,200 was not enough on a
# Zen 5 (the tiny model decoded them all before the drain, 3 runs in 8), hence a longer
# max_model_len than the default for this test.
LONG = 4000


@pytest.mark.integration
@pytest.mark.slow
async def test_drain_finishes_running_work_and_leaves_new_work_queued() -> None:
    env = {
        "BATON_METRICS_PORT": str(free_port_block(len(METRICS_ENDPOINTS))),
        "BATON_MAX_MODEL_LEN": str(LONG + 96),
    }
    with service_processes(env) as procs:
        await procs.wait_ready()
        async with await BatonClient.connect(procs.amqp_url, default_wait_s=240) as client:
            seen = [0] * 4

            async def one(i: int) -> DoneReply:
                stream = client.stream(f"story {i}", max_tokens=LONG, ignore_eos=True)
                return await streamed_done(stream, seen, i)

            running = asyncio.gather(*(one(i) for i in range(len(seen))))
            await _until("every request is decoding", lambda: min(seen) >= 20)
            await _drain(procs.amqp_url)

            decode_port = procs.metrics_port("decode")
            await _until("decode is not ready", lambda: _status(decode_port, "/ready") == 503, 10)
            assert max(seen) < LONG, "finished before the drain: raise LONG"
            assert await _exited(procs, "tokenizer") == 0
            assert await _exited(procs, "prefill") == 0

            # New work stays queued for whoever serves next: nothing takes it, nothing answers.
            late = [
                asyncio.create_task(client.generate(f"late {i}", max_tokens=3, wait_s=240))
                for i in range(3)
            ]
            await _until("late requests queued", lambda: _depth(procs.amqp_url, REQUESTS_QUEUE))
            assert await _depth(procs.amqp_url, REQUESTS_QUEUE) == 3

            # Work that was running when the drain came finishes, whole.
            for done in await asyncio.wait_for(running, 240):
                assert done.finish_reason == "length" and len(done.token_ids) == LONG
            assert await _exited(procs, "decode") == 0
            assert procs.procs["detokenizer"].poll() is None  # it answers all accepted work
            assert not any(t.done() for t in late)
            assert await _depth(procs.amqp_url, REQUESTS_QUEUE) == 3

            for name in ("tokenizer", "prefill", "decode"):
                procs.start(name)
            for reply in await asyncio.gather(*late):
                assert isinstance(reply, DoneReply) and len(reply.token_ids) == 3
        log = procs.tail(2000)
    assert log.count('"event": "drained"') == 3
    assert "drain ignored" in log


@pytest.mark.integration
@pytest.mark.slow
async def test_drained_prefill_requeues_what_it_had_not_started() -> None:
    """Prefill runs here with a forward that waits for the test: while it runs, three more
    requests arrive (received, not yet in the engine). On drain those go back to the queue,
    the batch in the forward is finished and handed off, and the service ends."""
    with service_processes(start=("tokenizer", "detokenizer")) as procs:
        prefill: Any = build("prefill", procs.config())
        entered, release = threading.Event(), threading.Event()
        real = prefill.engine.runner.prefill_choices  # the prefill engine's forward

        def gated(*args: Any) -> Any:
            entered.set()
            release.wait(60)
            return real(*args)

        prefill.engine.runner.prefill_choices = gated
        await prefill.start()
        try:
            async with await BatonClient.connect(procs.amqp_url, default_wait_s=240) as client:
                first: list[TokenReply] = []

                async def a() -> Any:
                    async for r in client.stream("in the forward", max_tokens=6, ignore_eos=True):
                        if isinstance(r, TokenReply):
                            first.append(r)
                        else:
                            return r

                started = asyncio.create_task(a())
                await asyncio.to_thread(entered.wait, 60)
                later = [
                    asyncio.create_task(client.generate(f"later {i}", max_tokens=2, wait_s=240))
                    for i in range(3)
                ]
                await _until("three in prefill's inbox", lambda: len(prefill.inbox) == 3)
                await _drain(procs.amqp_url)
                await _until(
                    "inbox given back", lambda: not prefill.inbox and prefill.shell.draining
                )
                assert not prefill.shell.ready()
                release.set()
                await asyncio.wait_for(prefill.wait_finished(), 60)
                assert await _depth(procs.amqp_url, PREFILL_QUEUE) == 3
                assert await _depth(procs.amqp_url, DECODE_QUEUE) == 1  # its handoff
                await _until("first token streamed", lambda: first, 30)
                assert first[0].index == 0 and not started.done()

                procs.start("decode")
                done = await asyncio.wait_for(started, 120)
                assert isinstance(done, DoneReply) and len(done.token_ids) == 6
                procs.start("prefill")
                for reply in await asyncio.gather(*later):
                    assert isinstance(reply, DoneReply) and len(reply.token_ids) == 2
        finally:
            release.set()
            await prefill.stop()
