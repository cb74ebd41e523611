"""BatonClient against the real RabbitMQ, without Baton's services.

Each test runs in its own throwaway vhost (created with rabbitmqctl, deleted afterwards) so it
neither sees nor disturbs a Baton running on "/". Where a request needs answering, a small
in-test responder consumes ``baton.requests`` and replies per the contract: it stands in for the
services, so these tests exercise the client's routing, timing, timeout and cancel paths only.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator

import aio_pika
import msgpack
import pytest
from aio_pika.abc import AbstractIncomingMessage

from shared.client import BatonClient, BatonUnavailable, Completion
from shared.wire.messages import ControlMsg, DoneReply, ErrorReply, TokenReply
from shared.wire.queues import CONTROL_EXCHANGE, REQUESTS_QUEUE, WORK_QUEUE_ARGS

pytestmark = pytest.mark.integration


def _rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture
def vhost_url() -> Iterator[str]:
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("rabbitmqctl not available to create a throwaway vhost")
    name = f"baton-test-client-{uuid.uuid4().hex[:8]}"
    try:
        _rabbitmqctl("add_vhost", name)
        _rabbitmqctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create a vhost: {exc.stderr.decode(errors='replace')}")
    try:
        yield f"amqp://guest:guest@127.0.0.1:5672/{name}"
    finally:
        _rabbitmqctl("delete_vhost", name)


class Responder:
    """Answers requests like Baton would: one token reply per prompt token id, then done.
    A request whose prompt is "silence" gets no reply at all."""

    def __init__(self, connection: aio_pika.abc.AbstractConnection) -> None:
        self.connection = connection
        self.seen: list[AbstractIncomingMessage] = []

    async def start(self) -> None:
        channel = await self.connection.channel()
        self.channel = channel
        queue = await channel.declare_queue(
            REQUESTS_QUEUE,
            durable=True,
            arguments=dict(WORK_QUEUE_ARGS),  # type: ignore[arg-type]
        )
        await queue.consume(self.on_request, no_ack=True)

    async def reply(self, to: str, rid: str, body: bytes) -> None:
        msg = aio_pika.Message(body, correlation_id=rid)
        await self.channel.default_exchange.publish(msg, routing_key=to)

    async def on_request(self, message: AbstractIncomingMessage) -> None:
        self.seen.append(message)
        rid, to = message.correlation_id, message.reply_to
        assert rid is not None
        if to is None:
            return
        try:
            req = msgpack.unpackb(message.body)
        except Exception:
            await self.reply(to, rid, ErrorReply(rid, "invalid_request", "not msgpack").encode())
            return
        if req.get("prompt") == "silence":
            return
        ids = list(req["prompt_token_ids"])
        for i, tok in enumerate(ids):
            await self.reply(to, rid, TokenReply(rid, f"<{tok}>", [tok], i).encode())
            await asyncio.sleep(0.001)
        text = "".join(f"<{t}>" for t in ids)
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(ids)}
        done = DoneReply(rid, text, ids, "length", usage, {"ttft_s": None})
        await self.reply(to, rid, done.encode())


@pytest.fixture
async def served(vhost_url: str) -> AsyncIterator[tuple[BatonClient, Responder]]:
    connection = await aio_pika.connect(vhost_url)
    responder = Responder(connection)
    await responder.start()
    client = await BatonClient.connect(vhost_url, default_wait_s=30.0)
    try:
        yield client, responder
    finally:
        await client.close()
        await connection.close()


async def test_publish_without_baton_raises_clear_error(vhost_url: str) -> None:
    async with await BatonClient.connect(vhost_url) as client:
        with pytest.raises(BatonUnavailable, match="is Baton running"):
            await client.generate("hello")
        # the client stays usable and holds no state for the failed request
        assert client._pending == {}
        with pytest.raises(BatonUnavailable):
            async for _ in client.stream(prompt_token_ids=[1, 2]):
                pass


async def test_unreachable_broker_is_a_clear_error() -> None:
    with pytest.raises(BatonUnavailable, match="cannot reach RabbitMQ"):
        await BatonClient.connect("amqp://guest:guest@127.0.0.1:1/")


async def test_concurrent_streams_are_routed_by_correlation_id(
    served: tuple[BatonClient, Responder],
) -> None:
    client, responder = served
    prompts = {f"req-{i}": list(range(10 * i, 10 * i + 2 + i)) for i in range(8)}

    async def one(rid: str) -> tuple[list[TokenReply], list[object]]:
        tokens: list[TokenReply] = []
        terminals: list[object] = []
        async for r in client.stream(prompt_token_ids=prompts[rid], request_id=rid, priority=3):
            if isinstance(r, TokenReply):
                tokens.append(r)
            else:
                terminals.append(r)
        return tokens, terminals

    results = await asyncio.gather(*(one(rid) for rid in prompts))
    for rid, (tokens, terminals) in zip(prompts, results, strict=True):
        assert [t.request_id for t in tokens] == [rid] * len(prompts[rid])
        assert [t.token_ids[0] for t in tokens] == prompts[rid]
        assert len(terminals) == 1 and isinstance(terminals[0], DoneReply)
        assert terminals[0].token_ids == prompts[rid]
    assert client._pending == {}
    # the request went out as the contract says
    msg = responder.seen[0]
    body = msgpack.unpackb(msg.body)
    assert msg.correlation_id == body["request_id"]
    assert msg.reply_to == client.reply_queue_name
    assert msg.priority == 3 and body["priority"] == 3
    assert msg.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    assert body["stream"] is True and body["max_tokens"] == 16


async def test_complete_measures_client_side_latencies(
    served: tuple[BatonClient, Responder],
) -> None:
    client, _ = served
    c = await client.complete(prompt_token_ids=[5, 6, 7, 8])
    assert isinstance(c, Completion) and c.ok and c.finish_reason == "length"
    assert c.text == "<5><6><7><8>" and c.num_output_tokens == 4
    assert c.ttft_s is not None and c.e2e_s is not None
    assert 0 < c.ttft_s <= c.e2e_s
    assert len(c.itl_s) == 3 and all(x >= 0 for x in c.itl_s)
    assert c.tpot_s == pytest.approx((c.e2e_s - c.ttft_s) / 3)


async def test_generate_returns_terminal_reply(served: tuple[BatonClient, Responder]) -> None:
    client, responder = served
    done = await client.generate(prompt_token_ids=[1, 2])
    assert isinstance(done, DoneReply) and done.token_ids == [1, 2]
    assert msgpack.unpackb(responder.seen[-1].body)["stream"] is False


async def test_send_raw_garbage_and_missing_reply_to(
    served: tuple[BatonClient, Responder],
) -> None:
    client, responder = served
    task = await client.send_raw(b"\xc1 not msgpack", request_id="raw-1")
    reply = await task
    assert isinstance(reply, ErrorReply) and reply.code == "invalid_request"
    assert reply.request_id == "raw-1"

    task = await client.send_raw(b"\xc1", request_id="raw-2", reply_to=False, wait_s=0.3)
    with pytest.raises(asyncio.TimeoutError):
        await task
    assert responder.seen[-1].reply_to is None
    assert responder.seen[-1].correlation_id == "raw-2"


async def test_abandoned_request_times_out_and_is_cancelled(
    served: tuple[BatonClient, Responder], vhost_url: str
) -> None:
    client, _ = served
    watcher = await aio_pika.connect(vhost_url)
    try:
        channel = await watcher.channel()
        control = await channel.declare_exchange(
            CONTROL_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True
        )
        queue = await channel.declare_queue("", exclusive=True)
        await queue.bind(control)

        with pytest.raises(asyncio.TimeoutError):
            await client.generate("silence", request_id="quiet-1", wait_s=0.3)
        assert client._pending == {}

        cancel = None
        async with queue.iterator(timeout=10) as it:
            async for message in it:
                cancel = ControlMsg.decode(message.body, 1 << 16)
                await message.ack()
                break
        assert cancel == ControlMsg("cancel", "quiet-1")
    finally:
        await watcher.close()


async def test_duplicate_request_id_in_flight_is_refused(
    served: tuple[BatonClient, Responder],
) -> None:
    client, _ = served
    task = await client.send_raw(b"\xc1", request_id="dup", reply_to=False, wait_s=5)
    with pytest.raises(ValueError, match="already in flight"):
        await client.generate(prompt_token_ids=[1], request_id="dup")
    task.cancel()
