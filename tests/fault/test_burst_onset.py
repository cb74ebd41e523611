"""The first high-priority request into a burst, every service a real process on the real RabbitMQ.

400 priority-0 requests (32-token prompts, 128 output tokens, not streamed) are published at
once; 1.5 s later, or once a quarter of them is answered if that comes first (it did on this
machine: 273-300 of 400 unanswered), one priority-9 request (32 tokens, 8 out). The issue
measured it waiting 0.8-0.9 s (62-92x its idle p99) at 1.5 s; on this machine it waited 0.1-3.2 s
only when the burst was younger (0.5 s) — by 1.5 s the burst's prompts are prefilled
(docs/scheduling.md, "Depth and the burst onset").

What is checked is ordering, not speed, against the flood requests still unanswered when the
priority-9 request was sent (a request queued behind the burst's prefetched prompts would come
after hundreds of them): its first token comes before half of them have finished; before the
first tenth is the target, a non-strict xfail — on two shared cores the flood finishes in waves
(128 sequences decoded together), and a first token that falls on a wave waits while the
detokenizer, the broker and the client handle a few dozen done replies (95-115 ms against a
first tenth at 90 ms in two runs of 2026-12-05; 22 ms against 222 ms in a third). (Its last
token is decode's: with decode's batch full of the flood it waits for a slot, issue 28 item 1.)
The ratio of its first token to the idle median is printed (``loadtest/faults/burst_onset.py``
reports
it over runs).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import pytest
import pytest_asyncio

from loadtest.faults.burst_onset import BURST_LEAD_S, FLOOD, FLOOD_OUTPUT, VIP_OUTPUT, burst_lead
from loadtest.faults.burst_onset import request as make_request
from loadtest.faults.reply_log import TimedReplies
from shared.wire.messages import DoneReply
from tests.fault.harness import service_processes

pytestmark = [pytest.mark.integration, pytest.mark.slow]

IDLE_SAMPLES = 10
# The flood must still be mostly in the system when the priority-9 request comes, or there is
# nothing to overtake: at least this many of its requests unanswered at that moment.
MIN_OUTSTANDING = 40


@dataclass
class BurstOnset:
    log: TimedReplies
    vip: str
    outstanding: list[str]  # flood requests unanswered when the priority-9 one was sent

    def finished_by(self, fraction: float) -> float:
        """When ``fraction`` of the outstanding flood had finished (monotonic)."""
        finished = sorted(self.log.last[rid] for rid in self.outstanding)
        return finished[int(len(finished) * fraction)]


@pytest_asyncio.fixture(scope="module")
async def run() -> BurstOnset:
    with service_processes({"BATON_DETOK_STANDBY_DELAY_S": "0.1"}) as procs:
        await procs.wait_ready()
        log = TimedReplies(procs.amqp_url)
        async with log:
            await log.one(make_request("warm", 9, VIP_OUTPUT, True))
            idle = [
                await log.one(make_request("idle", 9, VIP_OUTPUT, True))
                for _ in range(IDLE_SAMPLES)
            ]
            flood = await log.send(
                make_request("flood", 0, FLOOD_OUTPUT, False) for _ in range(FLOOD)
            )
            await burst_lead(log, flood, BURST_LEAD_S)
            [vip] = await log.send([make_request("vip", 9, VIP_OUTPUT, True)])
            outstanding = [rid for rid in flood if not log.terminals(rid)]
            await log.wait([vip, *flood], timeout_s=300)
    for rid in flood:
        [done] = log.terminals(rid)
        assert isinstance(done, DoneReply) and len(done.token_ids) == FLOOD_OUTPUT, done
    [done] = log.terminals(vip)
    assert isinstance(done, DoneReply) and len(done.token_ids) == VIP_OUTPUT, done
    idle_p50 = statistics.median(log.ttft(rid) for rid in idle)
    r = BurstOnset(log, vip, outstanding)
    print(
        f"\nfirst priority-9 TTFT into the burst {log.ttft(vip) * 1e3:.1f} ms = "
        f"{log.ttft(vip) / idle_p50:.2f}x the idle median ({idle_p50 * 1e3:.1f} ms); "
        f"{len(outstanding)} of {FLOOD} flood requests outstanding when it was sent; their "
        f"first tenth finished {(r.finished_by(0.1) - log.sent[vip]) * 1e3:.0f} ms after it, "
        f"half {(r.finished_by(0.5) - log.sent[vip]) * 1e3:.0f} ms"
    )
    assert len(outstanding) >= MIN_OUTSTANDING, "the flood was served before the burst test"
    return r


def test_first_priority_9_token_into_a_burst_comes_before_half_the_flood(run: BurstOnset) -> None:
    assert run.log.first[run.vip] < run.finished_by(0.5)


@pytest.mark.xfail(
    strict=False,
    reason="the target; on two shared cores a first token that falls on a wave of the flood's "
    "done replies waits for them (see the module docstring)",
)
def test_first_priority_9_token_into_a_burst_comes_before_its_first_tenth(run: BurstOnset) -> None:
    assert run.log.first[run.vip] < run.finished_by(0.1)
