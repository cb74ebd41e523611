"""The first high-priority request into a burst: ``python -m loadtest.faults.burst_onset --runs 5``.

Each run: 30 priority-9 requests (32-token prompts, 8 output tokens) one at a time on the idle
system; then 400 priority-0 requests (128 output tokens, not streamed) published at once and,
1.5 s later or as soon as a quarter of the flood is answered, whichever comes first (on the
2-core box of 2026-12-05 the quarter came first: 273-300 of 400 unanswered), 30 priority-9
requests one at a time. Prints the first priority-9 request's TTFT
against the idle median, and p50 / p99 of each phase. Starts its own ``python -m services up``
in a fresh vhost per run (``--amqp-url`` to measure a system already running instead).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import uuid
from dataclasses import dataclass
from typing import Any

from loadtest.faults.reply_log import TimedReplies
from services.launcher import LocalSystem, fresh_vhost
from shared.wire.messages import RequestMsg, SamplingParams

FLOOD = 400
FLOOD_OUTPUT = 128
VIP_OUTPUT = 8
SAMPLES = 30
BURST_LEAD_S = 1.5


def request(tag: str, priority: int, max_tokens: int, stream: bool) -> RequestMsg:
    return RequestMsg(
        request_id=f"{tag}-{uuid.uuid4().hex[:10]}",
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        prompt_token_ids=tuple(3 + (7 * i) % 500 for i in range(32)),
        stream=stream,
        priority=priority,
    )


async def burst_lead(log: TimedReplies, flood_ids: list[str], lead_s: float) -> None:
    """The wait between the flood and the first priority-9 request: ``lead_s``, cut short once a
    quarter of the flood is answered. A fixed lead alone left a fast machine (CI, 2026-12-05)
    with 39 of 400 unanswered, too few to tell overtaking from arriving after the flood; the
    flood finishes in waves (a decode batch at a time), so a quarter still leaves most of it."""
    await log.until_unanswered(flood_ids, at_most=len(flood_ids) * 3 // 4, timeout_s=lead_s)


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


@dataclass
class BurstRun:
    log: TimedReplies
    idle: list[str]
    burst: list[str]  # priority-9, one at a time from BURST_LEAD_S after the flood
    flood: list[str]

    def ttft(self, ids: list[str]) -> list[float]:
        return [self.log.ttft(rid) for rid in ids]

    def summary(self) -> str:
        idle, burst = self.ttft(self.idle), self.ttft(self.burst)
        idle_p50 = statistics.median(idle)
        return (
            f"first p9 in burst {burst[0] * 1e3:.1f} ms = {burst[0] / idle_p50:.2f}x idle p50 "
            f"({idle_p50 * 1e3:.1f} ms); burst p50 {statistics.median(burst) * 1e3:.1f} ms, "
            f"p99 {p99(burst) * 1e3:.1f} ms (idle p99 {p99(idle) * 1e3:.1f} ms); "
            f"next four {' '.join(f'{t * 1e3:.0f}' for t in burst[1:5])} ms; "
            f"flood first tokens {_spread(self.ttft(self.flood))}, "
            f"done {_spread([self.log.e2e(r) for r in self.flood])}"
        )


def _spread(values: list[float]) -> str:
    q = statistics.quantiles(values, n=10, method="inclusive")
    return f"p10 {q[0]:.2f} / p50 {statistics.median(values):.2f} / p90 {q[8]:.2f} s"


async def measure(
    amqp_url: str,
    samples: int = SAMPLES,
    flood: int = FLOOD,
    stream: bool = False,
    lead_s: float = BURST_LEAD_S,
) -> BurstRun:
    """One run on a system already serving at ``amqp_url``; waits until the flood is answered.
    ``stream``: the flood streams its tokens."""
    log = TimedReplies(amqp_url)
    async with log:
        await log.one(request("warm", 9, VIP_OUTPUT, True))  # first-use costs, not measured
        idle = [await log.one(request("idle", 9, VIP_OUTPUT, True)) for _ in range(samples)]
        flood_ids = await log.send(request("flood", 0, FLOOD_OUTPUT, stream) for _ in range(flood))
        await burst_lead(log, flood_ids, lead_s)
        burst = [await log.one(request("vip", 9, VIP_OUTPUT, True)) for _ in range(samples)]
        await log.wait(flood_ids, timeout_s=300)
    return BurstRun(log, idle, burst, flood_ids)


async def run_once(amqp_url: str | None, env: dict[str, str], **kw: Any) -> BurstRun:
    """``kw``: :func:`measure`'s options."""
    if amqp_url is not None:
        return await measure(amqp_url, **kw)
    with fresh_vhost(prefix="baton-burst") as url:
        system = LocalSystem(url, env)
        system.start()
        try:
            await system.wait_ready()
            return await measure(url, **kw)
        finally:
            system.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--amqp-url", default=None, help="a running system (default: start one)")
    parser.add_argument("--stream", action="store_true", help="the flood streams its tokens")
    parser.add_argument("--lead", type=float, default=BURST_LEAD_S, help="flood -> first p9, s")
    args = parser.parse_args(argv)
    ratios = []
    for i in range(args.runs):
        r = asyncio.run(run_once(args.amqp_url, {}, stream=args.stream, lead_s=args.lead))
        burst0 = r.ttft(r.burst)[0]
        ratios.append(burst0 / statistics.median(r.ttft(r.idle)))
        print(f"run {i + 1}: {r.summary()}", flush=True)
    print(f"first-p9 / idle p50 per run: {' '.join(f'{x:.2f}x' for x in ratios)}")


if __name__ == "__main__":
    main()
