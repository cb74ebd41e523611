"""Priority under a saturating flood, every service a real process on the real RabbitMQ.

A flood of priority-0 requests (short prompts, 256 output tokens each: several seconds of decode
work even on a fast machine; with 128 a Zen 5 served it in 3.3 s, too briefly to measure) is
published at once; while it is served, a trickle of priority-9 requests arrives. The
scenario runs once (the ``run`` fixture prints its figures); the checks:
- every priority-0 request still finishes, with exactly one terminal reply (no starvation);
- the backlog waits in the broker (decode's prefetch is its free slots), not inside decode;
- once the flood stands in the pipeline (every flood prompt prefilled, hundreds of handoffs
  queued for decode), priority-9 requests overtake it: each is done long before the flood's
  typical request, and its median time to first token stays within 4x of its idle median (a
  request that waited behind the backlog would take seconds, 100x and more);
- the targets, median and p99 within 2x of idle (same requests, same client, measured first):
  kept as non-strict xfails, because on two shared cores the flood's decode steps take the CPU
  that the four hops of a first token need: the median ratio measured 1.3x to 2.2x (2.14x in a
  CI run), the p99 ratio 2.0x to 4.2x, far more with other work on the machine (2.1x to 9.4x in
  eight runs of 2026-12-04: outliers of 70-150 ms that a per-hop trace put inside the broker);
  5x to 12x before the scheduling policy (docs/perf-log.md, "Priority under a flood").

Priority-9 requests sent while the flood is still being taken in (tokenized, registered,
prefilled) are measured and printed, not checked: there they share every hop with the flood's own
messages, and the broker confirms persistent messages on busy queues in batches.

The flood does not stream (``stream=false``): what is measured is scheduling, not this test's
own handling of thousands of token replies per second on two cores. Everything else runs with
its default settings.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass

import aio_pika
import pytest
import pytest_asyncio

from loadtest.faults.burst_onset import request
from loadtest.faults.reply_log import TimedReplies
from shared.wire.messages import DoneReply
from shared.wire.queues import DECODE_QUEUE
from tests.fault.harness import scrape, service_processes

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FLOOD = 800
FLOOD_OUTPUT = 256
VIP_OUTPUT = 8
TRICKLE_EVERY_S = 0.1
IDLE_SAMPLES = 40
ENV = {
    # One detokenizer: take every shard at once (the standby delay only matters with replicas).
    "BATON_DETOK_STANDBY_DELAY_S": "0.1",
}
FIRST_TOKENS = "baton:generation_tokens_total"  # at prefill: one per prefilled prompt


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def ms(values: list[float]) -> str:
    return (
        f"n={len(values)} p50 {statistics.median(values) * 1e3:.1f} ms, "
        f"p99 {p99(values) * 1e3:.1f} ms, max {max(values) * 1e3:.1f} ms"
    )


@dataclass
class FloodRun:
    log: TimedReplies
    idle: list[str]  # priority-9, the system idle
    ingest: list[str]  # priority-9, sent while the flood was being taken in
    standing: list[str]  # priority-9, sent once every flood prompt was prefilled
    flood: list[str]  # priority-0
    flood_s: float
    max_backlog: int  # deepest baton.decode seen

    def ttft(self, ids: list[str]) -> list[float]:
        return [self.log.ttft(rid) for rid in ids]

    def e2e(self, ids: list[str]) -> list[float]:
        return [self.log.e2e(rid) for rid in ids]


@pytest_asyncio.fixture(scope="module")
async def run() -> FloodRun:
    """The scenario, once for every check below; prints its figures."""
    with service_processes(ENV, metrics=True) as procs:
        await procs.wait_ready()
        prefill_port = procs.metrics_port("prefill")
        log = TimedReplies(procs.amqp_url)
        async with log:
            idle = []
            for _ in range(IDLE_SAMPLES):
                [rid] = await log.send([request("idle", 9, VIP_OUTPUT, stream=True)])
                deadline = time.monotonic() + 30
                while not log.terminals(rid):
                    assert time.monotonic() < deadline, f"{rid} unanswered"
                    await asyncio.sleep(0.002)
                idle.append(rid)

            connection = await aio_pika.connect(procs.amqp_url)
            channel = await connection.channel()
            decode_queue = await channel.declare_queue(DECODE_QUEUE, passive=True)
            prefilled_before = scrape(prefill_port)[FIRST_TOKENS]
            t0 = time.monotonic()
            flood = await log.send(request("flood", 0, FLOOD_OUTPUT, False) for _ in range(FLOOD))
            ingest: list[str] = []
            standing: list[str] = []
            max_backlog = 0
            prefilled = 0.0
            while not all(log.terminals(rid) for rid in flood):
                assert time.monotonic() - t0 < 120, "the flood was not served in 120 s"
                if prefilled < FLOOD:  # off the event loop: replies keep their timestamps
                    now = (await asyncio.to_thread(scrape, prefill_port)).get(FIRST_TOKENS, 0.0)
                    prefilled = now - prefilled_before
                vip = await log.send([request("vip", 9, VIP_OUTPUT, stream=True)])
                (standing if prefilled >= FLOOD else ingest).extend(vip)
                await decode_queue.declare()
                max_backlog = max(max_backlog, decode_queue.declaration_result.message_count or 0)
                await asyncio.sleep(TRICKLE_EVERY_S)
            flood_s = time.monotonic() - t0
            await connection.close()
            await log.wait(flood + ingest + standing, timeout_s=60)
    r = FloodRun(log, idle, ingest, standing, flood, flood_s, max_backlog)
    idle_ttft, busy_ttft = r.ttft(idle), r.ttft(standing)
    p50_ratio = statistics.median(busy_ttft) / statistics.median(idle_ttft)
    print(
        f"\npriority-9 TTFT, idle system: {ms(idle_ttft)}"
        f"\npriority-9 TTFT, flood of {FLOOD} priority-0 requests standing: {ms(busy_ttft)}"
        f"\n  ratio flood / idle: p50 {p50_ratio:.2f}, p99 {p99(busy_ttft) / p99(idle_ttft):.2f}"
        f"\npriority-9 TTFT while the flood was taken in: {ms(r.ttft(ingest))}"
        f"\npriority-9 end to end ({VIP_OUTPUT} tokens): idle {ms(r.e2e(idle))}; "
        f"flood standing {ms(r.e2e(standing))}"
        f"\nflood: served in {flood_s:.1f} s, end to end p50 "
        f"{statistics.median(r.e2e(flood)):.2f} s; deepest baton.decode backlog {max_backlog}"
    )
    return r


def test_every_request_is_answered_once_and_priority_0_is_not_starved(run: FloodRun) -> None:
    for rid in run.flood:
        [done] = run.log.terminals(rid)
        assert isinstance(done, DoneReply) and len(done.token_ids) == FLOOD_OUTPUT, done
    for rid in run.idle + run.ingest + run.standing:
        [done] = run.log.terminals(rid)
        assert isinstance(done, DoneReply) and len(done.token_ids) == VIP_OUTPUT, done


def test_the_flood_saturated_the_system_and_waited_in_the_broker(run: FloodRun) -> None:
    """Decode's prefetch is its free slots: most of the flood queued in the broker (where
    priority orders it and any replica could take it), for seconds."""
    assert run.max_backlog > FLOOD // 2 and len(run.standing) >= 20, run.max_backlog


def test_priority_9_overtakes_the_backlog(run: FloodRun) -> None:
    """Each priority-9 request, first token and last, is done long before the flood's typical
    request (queued ahead of it): its AMQP priority is its effective priority on every hop."""
    flood_p50 = statistics.median(run.e2e(run.flood))
    assert max(run.e2e(run.standing)) < flood_p50 / 2
    idle, busy = run.ttft(run.idle), run.ttft(run.standing)
    assert statistics.median(busy) <= 4 * statistics.median(idle)


HOPS_SHARE_THE_CPU = pytest.mark.xfail(
    strict=False,
    reason="the target; on 2 shared cores the flood's decode steps take the CPU the hops need "
    "(and the broker confirms persistent messages in batches): median 1.3x-2.2x, p99 2.0x-4.2x "
    "measured, more on a busy machine; see docs/scheduling.md",
)


@HOPS_SHARE_THE_CPU
def test_priority_9_ttft_median_is_within_twice_its_idle_median(run: FloodRun) -> None:
    busy, idle = run.ttft(run.standing), run.ttft(run.idle)
    assert statistics.median(busy) <= 2 * statistics.median(idle)


@HOPS_SHARE_THE_CPU
def test_priority_9_ttft_p99_is_within_twice_its_idle_p99(run: FloodRun) -> None:
    busy, idle = run.ttft(run.standing), run.ttft(run.idle)
    assert p99(busy) <= 2 * p99(idle), (p99(busy), p99(idle))
