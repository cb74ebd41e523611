"""Exactly one terminal reply under every single fault (issue: reliability).

One system, services as separate processes; for each fault, 32 streams of 300 tokens (half
greedy, half seeded sampling) are under way when it strikes:

- each of the four services SIGKILLed and restarted (the tokenizer with half the batch still
  queued before it);
- two detokenizer replicas, one SIGKILLed and not restarted: the other takes over its shard;
- the broker's app stopped and started (``rabbitmqctl stop_app`` / ``start_app``).

Every request gets exactly one terminal reply, a ``done`` whose tokens equal an undisturbed run's;
its token replies, read raw, cover each position once, in order, and add up to the done reply
exactly (``ReplyLog.check_stream``): no replay reaches the client, a detokenizer's included.
Afterwards no KV block is in use and the spill store is empty.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
from collections.abc import AsyncIterator, Iterator

import aio_pika
import pytest

from services.launcher import ServiceProcesses, rabbitmqctl
from shared.wire.queues import WORK_QUEUES
from tests.fault.harness import (
    NUM_REQUESTS,
    ReplyLog,
    batch,
    check,
    check_nothing_leaked,
    service_processes,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def system() -> Iterator[ServiceProcesses]:
    # A spill entry whose handoff was never published (prefill killed after writing it) is an
    # orphan; decode reclaims those after this timeout.
    with service_processes({"BATON_SPILL_ORPHAN_TIMEOUT_S": "20"}, metrics=True) as procs:
        yield procs


@pytest.fixture(scope="module")
async def reference(system: ServiceProcesses) -> list[list[int]]:
    await system.wait_ready()
    async with ReplyLog(system.amqp_url) as log:
        return await log.reference_tokens(batch("reference"), 240)


@pytest.fixture
async def log(system: ServiceProcesses) -> AsyncIterator[ReplyLog]:
    async with ReplyLog(system.amqp_url) as reply_log:
        yield reply_log


async def run_with_fault(
    procs: ServiceProcesses, log: ReplyLog, tag: str, fault: object, *, split: bool = False
) -> list[str]:
    """Send the batch, let generation get under way, apply ``fault`` (a callable, maybe async);
    with ``split`` the second half is sent just before it (still queued when it strikes)."""
    msgs = batch(tag)
    first = msgs[: NUM_REQUESTS // 2] if split else msgs
    ids = await log.send(first)
    await log.wait_streaming(ids, min_tokens=20, timeout_s=120)
    if split:
        ids += await log.send(msgs[NUM_REQUESTS // 2 :])
    # The fault strikes mid-stream: requests are still generating (a slow start can let some
    # finish first; those must simply stay answered once).
    assert any(not log.terminals(rid) for rid in ids), "all finished before the fault"
    result = fault()  # type: ignore[operator]
    if asyncio.iscoroutine(result):
        await result
    await log.wait(ids, 300)
    return ids


@pytest.mark.parametrize("victim", ["tokenizer", "prefill", "decode", "detokenizer"])
async def test_a_service_killed_mid_stream_loses_nothing(
    system: ServiceProcesses, reference: list[list[int]], log: ReplyLog, victim: str
) -> None:
    async def kill_and_restart() -> None:
        system.kill(victim)
        await asyncio.sleep(0.5)
        system.start(victim)

    ids = await run_with_fault(
        system, log, f"kill-{victim}", kill_and_restart, split=victim == "tokenizer"
    )
    check(log, ids, reference)
    assert log.num_repeated(ids) == 0
    await check_nothing_leaked(system)


async def test_two_detokenizer_replicas_one_killed_the_other_takes_over(
    system: ServiceProcesses, reference: list[list[int]], log: ReplyLog
) -> None:
    # Restart the detokenizer with a home shard, then a second replica homed on the other.
    system.kill("detokenizer")
    system.start("detokenizer", env={"BATON_DETOK_HOME_SHARD": "0"})
    system.start("detokenizer", instance="detokenizer-2", env={"BATON_DETOK_HOME_SHARD": "1"})
    await asyncio.sleep(3 * system.config().detok_standby_delay_s)  # both are consuming
    ids = await run_with_fault(system, log, "replicas", lambda: system.kill("detokenizer"))
    check(log, ids, reference)
    text = system.tail(5000)
    assert "intake channel lost" not in text  # the survivor never lost its own state
    # Both replicas answered (shard 0 by the first until it died, then by the second).
    system.start("detokenizer")
    system.kill("detokenizer-2")
    await check_nothing_leaked(system)


async def test_queues_deleted_under_load_are_declared_again_and_consumed(
    system: ServiceProcesses, reference: list[list[int]], log: ReplyLog
) -> None:
    """An operator deletes every work queue mid-stream. The services get the broker's consumer
    cancel, declare the queues again and consume them; messages that were waiting in a deleted
    queue are gone, and those requests are answered ``timeout`` at their deadline. (Not the
    detokenizer's shards: they hold every unanswered request's registration, and deleting one
    can lose them — docs/reliability.md, "Not covered".)"""
    queues = list(WORK_QUEUES)

    async def delete_queues() -> None:
        conn = await aio_pika.connect(system.amqp_url)
        async with conn:
            channel = await conn.channel()
            for name in queues:
                await channel.queue_delete(name)

    msgs = [dataclasses.replace(m, timeout_s=30.0) for m in batch("deleted")]
    ids = await log.send(msgs)
    await log.wait_streaming(ids, min_tokens=20, timeout_s=120)
    await delete_queues()
    await log.wait(ids, 120)
    for rid, ref in zip(ids, reference, strict=True):
        [terminal] = log.terminals(rid)
        if terminal.type == "done" and terminal.finish_reason == "length":  # type: ignore[union-attr]
            assert log.check_stream(rid).token_ids == ref, rid
        else:
            assert terminal.finish_reason == "timeout" or terminal.code == "timeout", terminal  # type: ignore[union-attr]
    # Every queue is back, with its consumers, and serves.
    after = await log.send(batch("after-delete")[:8])
    await log.wait(after, 120)
    for rid, ref in zip(after, reference[:8], strict=True):
        assert log.check_stream(rid).token_ids == ref, rid
    conn = await aio_pika.connect(system.amqp_url)
    async with conn:
        channel = await conn.channel()
        for name in queues:
            declared = await channel.declare_queue(name, passive=True)
            assert (declared.declaration_result.consumer_count or 0) >= 1, name
    await check_nothing_leaked(system)


@pytest.mark.skipif(os.geteuid() != 0, reason="restarting the broker needs rabbitmqctl as root")
async def test_broker_restart_mid_stream_loses_nothing(
    system: ServiceProcesses, reference: list[list[int]], log: ReplyLog
) -> None:
    async def restart_broker() -> None:
        assert await asyncio.to_thread(rabbitmqctl, "stop_app")
        await asyncio.sleep(1.0)
        assert await asyncio.to_thread(rabbitmqctl, "start_app")
        await asyncio.to_thread(subprocess.run, ["rabbitmqctl", "await_startup"], check=False)

    ids = await run_with_fault(system, log, "broker", restart_broker)
    check(log, ids, reference)
    await check_nothing_leaked(system)
