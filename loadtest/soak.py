"""Soak: a steady request rate for minutes while a random service is SIGKILLed every minute.

    python -m loadtest.soak --minutes 10 --rate 4          # spawns the services, one per process
    python -m loadtest.soak --minutes 2 --json soak.json   # shorter, with a JSON report

Every reply is read off a raw reply queue (the client library would hide duplicates); at the
end each request is classified: answered (exactly one terminal reply, and the stream cut to what
is new equals it), lost (no terminal reply within the grace period after the last send),
duplicated (more than one terminal reply) or inconsistent (a token reply disagreeing with the
terminal one). Greedy and seeded requests alternate; the victim restarts a second later. Not in
CI: it takes minutes by design.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from loadtest.reply_log import ReplyLog
from services.launcher import ServiceProcesses, fresh_vhost
from services.shell.registry import PIPELINE
from shared.client.async_client import default_amqp_url
from shared.client.dedup import stream_mismatch
from shared.wire.messages import (
    DoneReply,
    RequestMsg,
    SamplingParams,
    TokenReply,
)


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Soak:
    """The soak's requests and every reply they get (:class:`ReplyLog`)."""

    def __init__(self, url: str, max_tokens: int) -> None:
        self.log = ReplyLog(url)
        self.max_tokens = max_tokens

    async def __aenter__(self) -> Soak:
        await self.log.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.log.__aexit__(*exc)

    async def send(self, n: int) -> None:
        rid = f"soak-{n}"
        sampling = (
            SamplingParams(max_tokens=self.max_tokens, temperature=0.8, seed=n)
            if n % 2
            else SamplingParams(max_tokens=self.max_tokens)
        )
        msg = RequestMsg(rid, sampling, prompt=f"soak request {n} tells a story")
        while True:  # the broker itself may be restarting: retry until it takes the request
            try:
                await self.log.send([msg])
                return
            except Exception as exc:
                say(f"send {rid} failed ({exc}); retrying")
                await asyncio.sleep(1.0)

    def classify(self) -> Counter[str]:
        outcome: Counter[str] = Counter()
        for replies in self.log.replies.values():
            terminals = [r for r in replies if not isinstance(r, TokenReply)]
            if not terminals:
                outcome["lost"] += 1
                continue
            if len(terminals) > 1:
                outcome["duplicated"] += 1
            done = terminals[0]
            if isinstance(done, DoneReply) and stream_mismatch(done, replies) is not None:
                outcome["inconsistent"] += 1
            kind = done.finish_reason if isinstance(done, DoneReply) else done.code
            outcome[f"answered/{done.type}/{kind}"] += 1
        return outcome


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    with fresh_vhost(default_amqp_url(), prefix="baton-soak") as url:
        procs = ServiceProcesses(url)
        procs.start_all()
        try:
            await procs.wait_ready()
            async with Soak(url, args.max_tokens) as soak:
                kills: list[str] = []
                t0 = time.monotonic()
                n = 0
                next_kill = t0 + args.kill_every_s
                while time.monotonic() - t0 < args.minutes * 60:
                    await soak.send(n)
                    n += 1
                    if time.monotonic() >= next_kill:
                        victim = rng.choice(PIPELINE)
                        say(f"[{time.monotonic() - t0:6.0f}s] SIGKILL {victim}; sent {n}")
                        procs.kill(victim)
                        kills.append(victim)
                        await asyncio.sleep(1.0)
                        procs.start(victim)
                        next_kill += args.kill_every_s
                    await asyncio.sleep(1.0 / args.rate)
                say(f"sent {n}; waiting up to {args.grace_s:.0f}s for the last answers")
                deadline = time.monotonic() + args.grace_s
                while time.monotonic() < deadline and soak.classify()["lost"]:
                    await asyncio.sleep(1.0)
                await asyncio.sleep(2.0)  # any late duplicate shows up too
                outcome = soak.classify()
        finally:
            procs.stop()
    answered = sum(v for k, v in outcome.items() if k.startswith("answered/"))
    report = {
        "minutes": args.minutes,
        "rate_per_s": args.rate,
        "kills": kills,
        "sent": n,
        "answered": answered,
        "lost": outcome["lost"],
        "duplicated": outcome["duplicated"],
        "inconsistent": outcome["inconsistent"],
        "outcomes": {k: v for k, v in sorted(outcome.items()) if k.startswith("answered/")},
    }
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--rate", type=float, default=4.0, help="requests per second")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--kill-every-s", type=float, default=60.0)
    p.add_argument("--grace-s", type=float, default=180.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    report = asyncio.run(run(args))
    print(json.dumps(report, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    bad = report["lost"] + report["duplicated"] + report["inconsistent"]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
