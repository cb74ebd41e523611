"""The pooled KV transport (``BATON_KV_TRANSPORT=pool``) when a worker dies mid-handoff.

Decode runs at most 8 sequences (``BATON_MAX_NUM_SEQS``) and holds 2 handoffs more (its prefetch
headroom; it reads their KV ahead), so of 32 requests 22 wait in the broker with their KV still
pinned in prefill's pool: each test kills one side while they wait.

- Prefill dies: its pool's owner is gone, so decode never reads those blocks (the mapping is
  refused, ``kv_map_failures_total``) and recomputes them; a new prefill starts and serves.
- Decode dies: nobody will release the pins, so prefill's lease frees them
  (``kv_leases_expired_total``, ``kv_blocks_pinned`` back to 0 within the lease); a new decode
  gets the handoffs redelivered, refuses their expired KV and recomputes.

Either way every request gets exactly one terminal reply whose tokens equal an undisturbed
run's (greedy: the model's argmax), and no KV block is left in use anywhere.
"""

from __future__ import annotations

import asyncio
import time

import aio_pika
import pytest

from services.launcher import ServiceProcesses
from shared.wire.messages import DoneReply, RequestMsg, SamplingParams
from shared.wire.queues import DECODE_QUEUE
from tests.fault.harness import ReplyLog, poll_metric, scrape, service_processes

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NUM_REQUESTS = 32
# Long enough that decode's first wave (8 sequences) cannot finish between the moment the other
# 22 are seen waiting in the broker and the kill: had it, some of them would be loaded from the
# live pool before the kill and never meet the dead one (CI saw 14 of 24 refused at 200 tokens).
MAX_TOKENS = 600
DECODE_BATCH = 8
HEADROOM = 2  # handoffs decode holds beyond its batch (and loads ahead)
IN_BROKER = NUM_REQUESTS - DECODE_BATCH - HEADROOM
POOL_ENV = {
    "BATON_KV_TRANSPORT": "pool",
    "BATON_MAX_NUM_SEQS": str(DECODE_BATCH),
    "BATON_DECODE_PREFETCH_HEADROOM": str(HEADROOM),
}
PINNED = "baton:kv_blocks_pinned"
USED = "baton:kv_blocks_used"
EXPIRED = "baton:kv_leases_expired_total"
LEASE_RECLAIMED = "baton:kv_orphans_reclaimed_total{kind=pool_blocks,reason=lease_expired}"
POOL_REAPED = "baton:kv_orphans_reclaimed_total{kind=pool_files,reason=owner_dead}"


def batch(tag: str) -> list[RequestMsg]:
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)  # greedy
    return [
        RequestMsg(f"{tag}-{i}", sampling, prompt=f"request number {i} tells a long story")
        for i in range(NUM_REQUESTS)
    ]


async def reference_run(log: ReplyLog) -> list[list[int]]:
    """The undisturbed tokens of ``batch``, on the same system."""
    ids = await log.send(batch("reference"))
    await log.wait(ids, 120)
    return [done_tokens(log, rid) for rid in ids]


def done_tokens(log: ReplyLog, request_id: str) -> list[int]:
    """The request's one terminal reply: done, full length, streamed tokens matching it."""
    terminals = log.terminals(request_id)
    assert len(terminals) == 1, (request_id, terminals)
    done = terminals[0]
    assert isinstance(done, DoneReply) and done.finish_reason == "length", done
    assert len(done.token_ids) == MAX_TOKENS
    streamed = [t for r in log.replies[request_id] if r.type == "token" for t in r.token_ids]
    assert streamed == done.token_ids, request_id  # each position once, in order
    return done.token_ids


async def kill_with_handoffs_pinned(
    procs: ServiceProcesses, log: ReplyLog, name: str
) -> tuple[list[str], int]:
    """Send the batch; once every handoff decode does not hold waits in the broker (pinned in
    prefill's pool) and decode generates, SIGKILL ``name``. Returns the request ids and how many
    handoffs waited in the broker at the kill: those were certainly never read."""
    ids = await log.send(batch(f"{name}-killed"))
    connection = await aio_pika.connect(procs.amqp_url)
    async with connection:
        queue = await (await connection.channel()).declare_queue(DECODE_QUEUE, passive=True)

        async def in_broker() -> int:
            await queue.declare()
            return int(queue.declaration_result.message_count or 0)

        deadline = time.monotonic() + 60
        while await in_broker() < IN_BROKER:
            assert time.monotonic() < deadline, f"{await in_broker()} handoffs in the broker"
            await asyncio.sleep(0.02)
        await log.wait_streaming(ids, min_tokens=2, timeout_s=10)
        assert scrape(procs.metrics_port("prefill"))[PINNED] >= IN_BROKER
        assert max(log.num_streamed(rid) for rid in ids) < MAX_TOKENS, "raise MAX_TOKENS"
        waiting = await in_broker()
        procs.kill(name)
    return ids, waiting


async def assert_no_block_in_use(procs: ServiceProcesses) -> None:
    prefill, decode = procs.metrics_port("prefill"), procs.metrics_port("decode")
    await poll_metric(prefill, PINNED, lambda v: v == 0, timeout_s=10)
    await poll_metric(prefill, USED, lambda v: v == 0, timeout_s=5)
    await poll_metric(decode, USED, lambda v: v == 0, timeout_s=5)


async def test_prefill_killed_with_handoffs_pinned_loses_nothing() -> None:
    # A lease longer than the test: on a slow machine the last wave waits in decode past the
    # default 30 s, and a handoff refused for its lease (``kv_stale_loads``) would not exercise
    # the dead-pool path this test is about.
    env = {**POOL_ENV, "BATON_KV_LEASE_S": "600"}
    with service_processes(env, metrics=True) as procs:
        await procs.wait_ready()
        async with ReplyLog(procs.amqp_url) as log:
            reference = await reference_run(log)
            ids, in_broker = await kill_with_handoffs_pinned(procs, log, "prefill")
            procs.start("prefill")  # a new pool (new worker id and generation)
            await log.wait(ids, 120)
            after = await log.send(
                [RequestMsg("after", SamplingParams(max_tokens=8), prompt="after")]
            )
            await log.wait(after, 60)  # the new prefill serves
            await assert_no_block_in_use(procs)
            decode = scrape(procs.metrics_port("decode"))
            prefill = scrape(procs.metrics_port("prefill"))
        text = procs.tail(2000)

    for rid, ref in zip(ids, reference, strict=True):
        assert done_tokens(log, rid) == ref, rid
    assert log.terminals("after")[0].type == "done"
    # The handoffs pinned in the dead pool were never read: refused and recomputed by decode.
    assert decode["baton:kv_map_failures_total"] >= in_broker
    assert decode.get("baton:kv_stale_loads_total", 0) == 0
    assert "kv pool cannot be mapped; recomputing" in text
    assert prefill["baton:handoff_bytes_total{transport=pool}"] > 0  # the new prefill's sends
    assert decode.get("baton:handoff_bytes_total{transport=shm}", 0) == 0
    assert prefill[POOL_REAPED] >= 1  # the new prefill removed the dead one's pool file


async def test_decode_killed_holding_handoffs_the_lease_frees_them() -> None:
    lease_s = 3.0
    env = {**POOL_ENV, "BATON_KV_LEASE_S": str(lease_s)}
    with service_processes(env, metrics=True) as procs:
        prefill_port = procs.metrics_port("prefill")
        await procs.wait_ready()
        async with ReplyLog(procs.amqp_url) as log:
            reference = await reference_run(log)
            await poll_metric(prefill_port, PINNED, lambda v: v == 0, timeout_s=lease_s + 2)
            expired_before = scrape(prefill_port)[EXPIRED]
            reclaimed_before = scrape(prefill_port).get(LEASE_RECLAIMED, 0)
            ids, in_broker = await kill_with_handoffs_pinned(procs, log, "decode")
            # Nobody will release those pins: the lease (counted from each send, which came
            # before the kill) frees them, and prefill's blocks go back.
            _, waited = await poll_metric(prefill_port, PINNED, lambda v: v == 0, lease_s + 5)
            assert waited <= lease_s + 2.0, waited  # the sweep runs each step; CI may be slow
            prefill = scrape(prefill_port)
            assert prefill[EXPIRED] - expired_before >= in_broker
            # Prefill reclaimed its own blocks after the decode death, and counted them.
            assert prefill[LEASE_RECLAIMED] - reclaimed_before >= in_broker
            assert prefill[USED] == 0
            assert prefill["baton:handoff_bytes_total{transport=pool}"] > 0
            assert prefill.get("baton:handoff_bytes_total{transport=shm}", 0) == 0
            procs.start("decode")  # the unacked handoffs are redelivered to it
            await log.wait(ids, 120)
            await assert_no_block_in_use(procs)
            decode = scrape(procs.metrics_port("decode"))

    for rid, ref in zip(ids, reference, strict=True):
        assert done_tokens(log, rid) == ref, rid
    # The new decode refused the expired descriptors (their blocks may be reused) and
    # recomputed; it never mapped a dead pool, and nothing went through the spill store.
    assert decode["baton:kv_stale_loads_total"] >= in_broker
    assert decode.get("baton:kv_map_failures_total", 0) == 0
    assert decode.get("baton:handoff_bytes_total{transport=shm}", 0) == 0
