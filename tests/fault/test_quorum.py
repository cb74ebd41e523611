"""Quorum work queues (BATON_QUEUE_TYPE=quorum) on the real RabbitMQ, every service its own process
in a fresh vhost: the services declare the work queues as quorum queues with a delivery limit,
serve requests end to end, and a message that keeps coming back unfinished is set aside by the
broker (dead-lettered to baton.dead at x-delivery-limit) and its request answered ``internal`` by
the tokenizer from baton.poison (services/tokenizer/poison.py) — on an internal queue
(baton.prefill, answered through the detokenizer) and on baton.requests (answered on reply_to,
by a tokenizer started after the fact). The crashing worker is played by the test: it takes the
message and closes its channel unacked, which is what a worker's death looks like to the broker.
"""

from __future__ import annotations

import asyncio
import subprocess

import aio_pika
import pytest

from services.launcher import ServiceProcesses
from shared.wire.messages import ErrorReply, RequestMsg, SamplingParams
from shared.wire.queues import (
    DEAD_LETTER_QUEUE,
    POISON_QUEUE,
    PREFILL_QUEUE,
    REQUESTS_QUEUE,
    WORK_QUEUES,
)
from tests.fault.harness import ReplyLog, scrape, service_processes

pytestmark = pytest.mark.integration

FAILURES = 3
ENV = {"BATON_QUEUE_TYPE": "quorum", "BATON_MAX_DELIVERY_FAILURES": str(FAILURES)}


def queue_types(url: str) -> dict[str, str]:
    vhost = url.rsplit("/", 1)[1]
    listed = subprocess.run(
        ["rabbitmqctl", "-q", "list_queues", "-p", vhost, "--no-table-headers", "name", "type"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    return dict(line.split("\t")[:2] for line in listed.splitlines() if "\t" in line)


async def state(url: str, queue: str) -> tuple[int, int]:
    """(ready messages, consumers) of ``queue``."""
    conn = await aio_pika.connect(url)
    async with conn:
        result = (
            await (await conn.channel()).declare_queue(queue, passive=True)
        ).declaration_result
        return result.message_count or 0, result.consumer_count or 0


async def depth(url: str, queue: str) -> int:
    return (await state(url, queue))[0]


async def kill(procs: ServiceProcesses, name: str, queue: str) -> None:
    """SIGKILL ``name`` and wait until the broker has dropped its consumer of ``queue`` (a message
    published before that may still go to the dead consumer, and come back counted)."""
    procs.kill(name)
    for _ in range(600):
        if (await state(procs.amqp_url, queue))[1] == 0:
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"{queue} still has a consumer")


async def take_and_die(url: str, queue: str, times: int) -> None:
    """A worker of ``queue`` that dies holding its message, ``times`` times over."""
    conn = await aio_pika.connect(url)
    async with conn:
        for _ in range(times):
            channel = await conn.channel()
            source = await channel.get_queue(queue, ensure=False)
            for _ in range(600):
                if await source.get(no_ack=False, fail=False) is not None:
                    break
                await asyncio.sleep(0.05)
            else:
                raise TimeoutError(f"nothing to take on {queue}")
            await channel.close()  # unacked: back in the queue, one more delivery counted


def set_aside(log: ReplyLog, rid: str) -> None:
    [terminal] = log.terminals(rid)
    assert isinstance(terminal, ErrorReply) and terminal.code == "internal", terminal
    assert f"{FAILURES} times" in terminal.message and "set aside" in terminal.message


async def test_quorum_work_queues_serve_and_answer_what_the_broker_sets_aside() -> None:
    short = SamplingParams(max_tokens=8, ignore_eos=True)
    with service_processes(ENV, metrics=True) as procs:
        await procs.wait_ready()
        url = procs.amqp_url
        types = queue_types(url)
        assert {q: types[q] for q in (*WORK_QUEUES, POISON_QUEUE)} == dict.fromkeys(
            (*WORK_QUEUES, POISON_QUEUE), "quorum"
        ), types
        assert types[DEAD_LETTER_QUEUE] == "classic" and types["baton.detok.0"] == "classic"
        async with ReplyLog(url) as log:
            served = [RequestMsg(f"served-{i}", short, prompt=f"hello {i}") for i in range(4)]
            ids = await log.send(served)
            await log.wait(ids, 120)
            assert all(log.check_stream(rid).finish_reason == "length" for rid in ids)

            await kill(procs, "prefill", PREFILL_QUEUE)  # the test: its only worker now
            [rid] = await log.send([RequestMsg("poison-prefill", short, prompt="again")])
            await take_and_die(url, PREFILL_QUEUE, FAILURES)
            await log.wait([rid], 60)
            set_aside(log, rid)
            tokenizer = scrape(procs.metrics_port("tokenizer"))
            assert tokenizer["baton:poison_messages_total{queue=baton.prefill}"] == 1

            await kill(procs, "tokenizer", REQUESTS_QUEUE)  # and baton.requests' too
            [rid] = await log.send([RequestMsg("poison-request", short, prompt="once more")])
            await take_and_die(url, REQUESTS_QUEUE, FAILURES)
            assert await depth(url, POISON_QUEUE) == 1  # kept until a tokenizer answers it
            procs.start("tokenizer")
            await log.wait([rid], 120)
            set_aside(log, rid)
            assert await depth(url, DEAD_LETTER_QUEUE) == 2  # both kept for operators
            assert await depth(url, POISON_QUEUE) == 0
        text = procs.tail(3000)
    assert text.count("poison message answered") == 2
