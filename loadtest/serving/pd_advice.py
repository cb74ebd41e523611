"""Prefill or decode: which one limits the observed workload, and how many of each to run.

    python -m loadtest pd-advice --metrics-port 9100    # a local `python -m services up`
    python -m loadtest pd-advice --prefill http://p1:9101/metrics \\
        --prefill http://p2:9101/metrics --decode http://d1:9102/metrics --duration 30

It scrapes every prefill and decode replica's ``/metrics`` every ``--every`` seconds for
``--duration`` seconds and reads, per stage:
- load: prefill, the share of wall time its replicas spend in forwards (a prefill forward is
  compute-bound: busy time is used capacity); decode, how full its running batches are, in
  sequences (``num_requests_running`` / ``max_num_seqs``) or KV blocks
  (``kv_cache_usage_perc``), whichever is fuller: decode's throughput grows with the batch, so a
  full batch, not a busy loop, is used capacity;
- backlog: ``baton:queue_depth`` of ``baton.prefill`` / ``baton.decode`` (plus decode's
  waiting sequences). A backlog that stands through the window means the stage runs at its
  capacity (load 1); one that grows means the demand is that times (1 + growth / rate served).

The stage with the larger demand per replica is the bottleneck; the advice is the replica counts
that bring each stage's demand to ``--target`` utilization, as a ratio (``P:D``). The arithmetic
(:func:`advise`) is pure and unit-tested with synthetic numbers (``tests/test_pd_advice.py``).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from shared.config import BatonConfig
from shared.observability.http_server import read_metrics_url

Scrape = Mapping[str, float]  # "name{label=value}" -> value, as read_metrics gives it
FORWARD_S = "baton:forward_seconds_sum"
GENERATED = "baton:generation_tokens_total"  # prefill: first tokens, one per prompt
RUNNING = "baton:num_requests_running"
WAITING = "baton:num_requests_waiting"
KV_USAGE = "baton:kv_cache_usage_perc"
PREFILL_DEPTH = "baton:queue_depth{queue=baton.prefill}"
DECODE_DEPTH = "baton:queue_depth{queue=baton.decode}"
MAX_RATIO_TERM = 8  # the advised ratio uses small numbers (at most 8 replicas per side)


@dataclass(frozen=True)
class Stage:
    """One stage over the window, summed over its replicas."""

    replicas: int
    load: float  # used capacity per replica, 0..1 (see the module docstring)
    rate: float  # what it served per second (prompts for prefill, tokens for decode)
    backlog_start: float
    backlog_end: float
    seconds: float

    @property
    def growth(self) -> float:
        """Backlog growth per second, relative to what the stage serves (0 when it shrinks)."""
        grew = (self.backlog_end - self.backlog_start) / self.seconds
        return max(0.0, grew) / self.rate if self.rate > 0 else (1.0 if grew > 0 else 0.0)

    @property
    def saturated(self) -> bool:
        """A backlog stood through the window: the stage worked at its capacity, whatever its
        load reading says (prefill's forward share leaves out the rest of its loop)."""
        return self.backlog_start >= 1 and self.backlog_end >= 1

    @property
    def demand(self) -> float:
        """Capacity the workload asks of one replica (above 1: more than it has)."""
        used = 1.0 if self.saturated else self.load
        return used * (1.0 + self.growth)


@dataclass(frozen=True)
class Advice:
    bottleneck: str | None  # "prefill" | "decode"; None: neither is near its capacity
    prefill_replicas: int
    decode_replicas: int

    @property
    def ratio(self) -> str:
        return f"{self.prefill_replicas}:{self.decode_replicas}"


def advise(prefill: Stage, decode: Stage, target: float = 0.8) -> Advice:
    """Replicas that bring each stage's demand to ``target`` utilization, as the ratio of small
    terms (at most MAX_RATIO_TERM) closest to the ratio of the needs; the bottleneck is the
    stage with the larger demand per replica, if it is at least half of ``target``."""
    need_p = prefill.replicas * prefill.demand / target
    need_d = decode.replicas * decode.demand / target
    worst = max(prefill.demand, decode.demand)
    bottleneck = None
    if worst >= target / 2:
        bottleneck = "prefill" if prefill.demand >= decode.demand else "decode"
    if need_p <= 0 or need_d <= 0:
        return Advice(bottleneck, max(1, math.ceil(need_p)), max(1, math.ceil(need_d)))
    p, d = closest_ratio(need_p / need_d)
    return Advice(bottleneck, p, d)


def closest_ratio(ratio: float) -> tuple[int, int]:
    """The p:d (both 1..MAX_RATIO_TERM) closest to ``ratio`` in relative terms; of equals, the
    one with the smallest terms."""
    terms = range(1, MAX_RATIO_TERM + 1)
    return min(
        ((p, d) for p in terms for d in terms),
        key=lambda pd: (abs(math.log(pd[0] / pd[1] / ratio)), pd[0] + pd[1]),
    )


def stage_windows(
    prefill: Sequence[Sequence[Scrape]],
    decode: Sequence[Sequence[Scrape]],
    seconds: float,
    max_num_seqs: int,
) -> tuple[Stage, Stage]:
    """Both stages from their scrapes: ``prefill[i]`` / ``decode[i]`` are replica i's scrapes
    over the window, in time order (at least two each)."""

    def delta(samples: Sequence[Scrape], name: str) -> float:
        return samples[-1].get(name, 0.0) - samples[0].get(name, 0.0)

    def mean(samples: Sequence[Scrape], name: str) -> float:
        return sum(s.get(name, 0.0) for s in samples) / len(samples)

    def depth(name: str, at: int) -> float:  # any replica that reports it (they agree)
        readings = [r[at][name] for r in (*prefill, *decode) if name in r[at]]
        return max(readings, default=0.0)

    p_busy = sum(delta(r, FORWARD_S) for r in prefill) / seconds / max(1, len(prefill))
    p_rate = sum(delta(r, GENERATED) for r in prefill) / seconds
    d_seqs = sum(mean(r, RUNNING) for r in decode) / max(1, len(decode)) / max(1, max_num_seqs)
    d_kv = sum(mean(r, KV_USAGE) for r in decode) / max(1, len(decode))
    d_fill = max(d_seqs, d_kv)
    d_waiting = [sum(r[at].get(WAITING, 0.0) for r in decode) for at in (0, -1)]
    # Decode's backlog counts handoffs; its rate counts tokens: its growth is in handoffs per
    # handoff taken, with handoffs taken = handoffs made (prefill's rate) - backlog growth.
    d_start = depth(DECODE_DEPTH, 0) + d_waiting[0]
    d_end = depth(DECODE_DEPTH, -1) + d_waiting[1]
    taken = max(0.0, p_rate - (d_end - d_start) / seconds)
    return (
        Stage(len(prefill), min(1.0, p_busy), p_rate, depth(PREFILL_DEPTH, 0),
              depth(PREFILL_DEPTH, -1), seconds),
        Stage(len(decode), min(1.0, d_fill), taken, d_start, d_end, seconds),
    )  # fmt: skip


def report(prefill: Stage, decode: Stage, advice: Advice, decode_tokens_s: float) -> str:
    def backlog(stage: Stage) -> str:
        per_s = (stage.backlog_end - stage.backlog_start) / stage.seconds
        return f"backlog {stage.backlog_start:.0f} -> {stage.backlog_end:.0f} ({per_s:+.1f}/s)"

    lines = [
        f"window {prefill.seconds:.1f} s; {prefill.replicas} prefill, {decode.replicas} decode",
        f"prefill: busy {prefill.load:.0%}, {prefill.rate:.1f} prompts/s, baton.prefill "
        f"{backlog(prefill)}; demand {prefill.demand:.2f} per replica",
        f"decode:  batches {decode.load:.0%} full, {decode_tokens_s:.0f} tokens/s, baton.decode "
        f"+ waiting {backlog(decode)}; demand {decode.demand:.2f} per replica",
    ]
    if advice.bottleneck is None:
        lines.append("bottleneck: neither stage is near its capacity; no change needed")
        return "\n".join(lines)
    lines.append(f"bottleneck: {advice.bottleneck}")
    lines.append(
        f"for this workload run prefill:decode = {advice.ratio} "
        f"(e.g. {advice.prefill_replicas} prefill, {advice.decode_replicas} decode)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest pd-advice",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--prefill", action="append", default=[], help="a prefill /metrics URL")
    parser.add_argument("--decode", action="append", default=[], help="a decode /metrics URL")
    parser.add_argument(
        "--metrics-port", type=int, help="BATON_METRICS_PORT of a local `services up`"
    )
    parser.add_argument("--duration", type=float, default=10.0, help="seconds to observe")
    parser.add_argument("--every", type=float, default=1.0, help="seconds between scrapes")
    parser.add_argument("--target", type=float, default=0.8, help="utilization to plan for")
    parser.add_argument("--max-num-seqs", type=int, default=BatonConfig.from_env().max_num_seqs)
    args = parser.parse_args(argv)
    if args.metrics_port:  # `services up`: tokenizer +0, prefill +1, decode +2
        args.prefill.append(f"http://127.0.0.1:{args.metrics_port + 1}/metrics")
        args.decode.append(f"http://127.0.0.1:{args.metrics_port + 2}/metrics")
    if not args.prefill or not args.decode:
        parser.error("give --metrics-port, or at least one --prefill and one --decode URL")
    urls = [*args.prefill, *args.decode]
    samples: list[list[dict[str, float]]] = [[] for _ in urls]
    t0 = time.monotonic()
    while True:
        for i, url in enumerate(urls):
            samples[i].append(read_metrics_url(url))
        if time.monotonic() - t0 >= args.duration:
            break
        time.sleep(args.every)
    seconds = time.monotonic() - t0
    n = len(args.prefill)
    prefill, decode = stage_windows(samples[:n], samples[n:], seconds, args.max_num_seqs)
    tokens_s = sum(r[-1].get(GENERATED, 0.0) - r[0].get(GENERATED, 0.0) for r in samples[n:])
    print(report(prefill, decode, advise(prefill, decode, args.target), tokens_s / seconds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
