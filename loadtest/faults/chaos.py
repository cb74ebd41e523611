"""Chaos at the raw wire: every stage replicated, random SIGKILLs, and the client contract
checked by a client that speaks the queue contract directly.

    python -m loadtest chaos --minutes 10 --kill-every-s 30      # the long run (the soak)
    python -m loadtest chaos --minutes 0.75 --kills 20 --max-tokens 120 --requests 64 --seed 29
                                                                 # CI's run, replayed by its seed

Two processes of each service (tokenizer, prefill, decode, detokenizer) in a fresh vhost. The
client is plain aio-pika: no client library, no deduplication — it publishes request maps to
``baton.requests`` and keeps every reply in the order it came (``reply_log.ReplyLog``). First an
undisturbed run of the prompts gives the reference tokens (greedy and seeded sampling
alternate). Then requests are sent at random moments while a driver SIGKILLs a random process
at random moments and restarts it after a moment. Everything random is drawn from ``--seed``:
a failing run replays.

Per request it counts (``reply_log.Counts``): exactly one terminal reply or not, extra terminal
replies, token positions repeated, missing or out of order, text that does not continue the
stream, tokens unequal to the undisturbed run's; at the end, KV blocks still used or pinned in
any engine and spill entries left (the survivors sweep orphans after BATON_SPILL_ORPHAN_TIMEOUT_S).
Exit status 1 if any count that must be 0 is not. The short version runs in CI:
tests/fault/test_chaos.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import random
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.faults.reply_log import Counts, ReplyLog, judge
from loadtest.serving.driver import say
from services.launcher import ServiceProcesses, free_port_block, fresh_vhost
from services.shell.registry import PIPELINE
from shared.client.async_client import default_amqp_url
from shared.observability.http_server import read_metrics
from shared.wire.messages import RequestMsg, SamplingParams

ENGINES = ("prefill", "decode")
# What the chaos system runs with: orphans are swept soon (the leak check waits for them); a
# message held by several killed workers in a row is not set aside as poison (the poison path
# has its own test: tests/fault/test_poison.py).
CHAOS_ENV = {
    "BATON_KV_CACHE_MB": "32",
    "BATON_SPILL_ORPHAN_TIMEOUT_S": "10",
    "BATON_MAX_DELIVERY_FAILURES": "50",
}


@dataclass(frozen=True)
class Plan:
    """A run, drawn from its seed: when each request is sent (seconds after the start, with its
    prompt), when each kill strikes (one in each ``window / num_kills`` slice), whom, and how
    long the victim stays down."""

    seed: int
    sends: tuple[tuple[float, int], ...]  # (at, prompt index)
    kills: tuple[tuple[float, str, float], ...]  # (at, instance, down for)

    @classmethod
    def draw(
        cls,
        seed: int,
        instances: list[str],
        *,
        num_requests: int,
        num_prompts: int,
        window_s: float,
        num_kills: int,
    ) -> Plan:
        rng = random.Random(seed)
        sends = sorted(
            (rng.uniform(0, 0.75 * window_s), i % num_prompts) for i in range(num_requests)
        )
        every = window_s / max(1, num_kills)  # one kill in each slice, at a random moment
        kills = [
            ((k + rng.random()) * every, rng.choice(instances), rng.uniform(0.1, 1.5))
            for k in range(num_kills)
        ]
        return cls(seed, tuple(sends), tuple(kills))


def prompts(num_prompts: int, max_tokens: int) -> list[RequestMsg]:
    """The workload's prompts; even ones greedy, odd ones seeded sampling."""
    out = []
    for i in range(num_prompts):
        seeded = {"temperature": 0.8, "seed": 1000 + i} if i % 2 else {}
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **seeded)  # type: ignore[arg-type]
        out.append(RequestMsg(f"p{i}", sampling, prompt=f"chaos story {i}: once upon a time"))
    return out


class ReplicatedSystem:
    """Two processes of every pipeline service, each engine with /metrics of its own; a
    process killed is restarted under the same instance name, port and environment."""

    def __init__(self, url: str, replicas: int = 2) -> None:
        base = free_port_block(len(PIPELINE) * replicas)
        self.procs = ServiceProcesses(url, env=dict(CHAOS_ENV))
        self.env: dict[str, dict[str, str]] = {}
        self.service: dict[str, str] = {}
        for k in range(replicas):
            for j, name in enumerate(PIPELINE):
                instance = name if k == 0 else f"{name}-{k + 1}"
                env = {"BATON_METRICS_PORT": str(base + k * len(PIPELINE) + j)}
                if name == "detokenizer":
                    env["BATON_DETOK_HOME_SHARD"] = str(k)
                self.env[instance], self.service[instance] = env, name

    @property
    def instances(self) -> list[str]:
        return list(self.service)

    def start(self, instance: str) -> None:
        self.procs.start(self.service[instance], instance=instance, env=self.env[instance])

    def kill(self, instance: str) -> None:
        self.procs.kill(instance)

    def port(self, instance: str) -> int:
        return int(self.env[instance]["BATON_METRICS_PORT"])

    async def leaks(self, timeout_s: float) -> tuple[int, int]:
        """(KV blocks used or pinned in any engine, spill entries), once both are 0 or at the
        timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            blocks = 0
            for instance, name in self.service.items():
                if name in ENGINES:
                    m = _scrape(self.port(instance))
                    blocks += int(
                        m.get("baton:kv_blocks_used", 0) + m.get("baton:kv_blocks_pinned", 0)
                    )
            spill = Path(self.procs.spill_dir)
            entries = len([p for p in spill.rglob("*") if p.is_file()]) if spill.exists() else 0
            if (blocks == 0 and entries == 0) or time.monotonic() > deadline:
                return blocks, entries
            await asyncio.sleep(0.5)


def _scrape(port: int) -> dict[str, float]:
    try:
        return read_metrics(port)
    except OSError:
        return {}


@contextlib.contextmanager
def replicated_system(url: str | None = None) -> Iterator[ReplicatedSystem]:
    with fresh_vhost(url or default_amqp_url(), prefix="baton-chaos") as vhost_url:
        system = ReplicatedSystem(vhost_url)
        for instance in system.instances:
            system.start(instance)
        try:
            yield system
        finally:
            system.procs.stop()


async def reference_tokens(system: ReplicatedSystem, work: list[RequestMsg]) -> list[list[int]]:
    """The undisturbed run: each prompt once, every check passing."""
    async with ReplyLog(system.procs.amqp_url) as wire:
        await wire.wait(await wire.send(work), 300)
    counts = Counts()
    for msg in work:
        judge(wire.replies[msg.request_id], None, counts)
    assert not counts.problems(), f"the undisturbed run: {counts.problems()}"
    return [wire.check_stream(m.request_id).token_ids for m in work]


async def run_chaos(
    system: ReplicatedSystem,
    plan: Plan,
    work: list[RequestMsg],
    reference: list[list[int]],
    grace_s: float = 300.0,
) -> Counts:
    """Send ``plan``'s requests and strike its kills; wait for every answer; count."""
    t0 = time.monotonic()
    sent: dict[str, int] = {}

    async def at(offset: float) -> None:
        await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))

    async def sender(wire: ReplyLog) -> None:
        for offset, p in plan.sends:
            await at(offset)
            rid = f"chaos-{plan.seed}-{len(sent)}-{uuid.uuid4().hex[:6]}"
            await wire.send([dataclasses.replace(work[p], request_id=rid)])
            sent[rid] = p

    async def striker() -> None:
        for offset, instance, down_s in plan.kills:
            await at(offset)
            say(f"[{time.monotonic() - t0:6.1f}s] SIGKILL {instance}; {len(sent)} sent")
            system.kill(instance)
            await asyncio.sleep(down_s)
            system.start(instance)

    async with ReplyLog(system.procs.amqp_url) as wire:
        await asyncio.gather(sender(wire), striker())
        say(f"[{time.monotonic() - t0:6.1f}s] all sent and struck; waiting for the answers")
        with contextlib.suppress(TimeoutError):  # an unanswered request counts as no_terminal
            await wire.wait(list(sent), grace_s)
    counts = Counts()
    for rid, p in sent.items():
        judge(wire.replies[rid], reference[p], counts)
    counts.leaked_blocks, counts.leaked_spill_entries = await system.leaks(60.0)
    return counts


async def run(args: argparse.Namespace) -> dict[str, Any]:
    window_s = args.minutes * 60
    num_kills = args.kills if args.kills is not None else int(window_s // args.kill_every_s)
    work = prompts(args.prompts, args.max_tokens)
    with replicated_system() as system:
        await system.procs.wait_ready(300)
        reference = await reference_tokens(system, work)
        plan = Plan.draw(
            args.seed,
            system.instances,
            num_requests=args.requests or max(args.prompts, int(args.rate * 0.75 * window_s)),
            num_prompts=args.prompts,
            window_s=window_s,
            num_kills=num_kills,
        )
        say(f"seed {plan.seed}: {len(plan.sends)} requests, {len(plan.kills)} kills")
        t0 = time.monotonic()
        counts = await run_chaos(system, plan, work, reference)
        elapsed = time.monotonic() - t0
    return {
        "seed": plan.seed,
        "seconds": round(elapsed, 1),
        "kills": [f"{at:.1f}s {who}" for at, who, _ in plan.kills],
        "counts": dataclasses.asdict(counts),
        "problems": counts.problems(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="the window of sends and kills")
    p.add_argument("--kill-every-s", type=float, default=30.0)
    p.add_argument("--kills", type=int, default=None, help="instead of --kill-every-s")
    p.add_argument("--prompts", type=int, default=64, help="distinct prompts (the reference)")
    p.add_argument("--requests", type=int, default=None, help="default: --rate over the sends")
    p.add_argument("--rate", type=float, default=2.0, help="requests/s while sending")
    p.add_argument("--max-tokens", type=int, default=150)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    report = asyncio.run(run(args))
    print(json.dumps(report, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    sys.exit(1 if report["problems"] else 0)


if __name__ == "__main__":
    main()
