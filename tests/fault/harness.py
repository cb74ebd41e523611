"""The services as separate processes in a fresh vhost, so a fault test can kill one; plus what
the KV-transport fault tests read: each service's /metrics, and every reply a request got."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from loadtest.faults.reply_log import ReplyLog
from services.launcher import ServiceProcesses, free_port_block, fresh_vhost
from services.shell.registry import METRICS_ENDPOINTS, PIPELINE
from shared.observability.http_server import read_metrics
from shared.wire.messages import (
    DoneReply,
    Reply,
    RequestMsg,
    SamplingParams,
    TokenReply,
)

ALL_SERVICES = PIPELINE  # the broker pipeline; the HTTP gateway plays no part in these tests
FAULT_ENV = {"BATON_KV_CACHE_MB": "32", "BATON_METRICS_PORT": "0"}
# The standard faulted batch: 32 streams of 300 tokens, half greedy, half seeded sampling.
NUM_REQUESTS = 32
MAX_TOKENS = 300


@contextmanager
def service_processes(
    env: dict[str, str] | None = None,
    start: tuple[str, ...] = ALL_SERVICES,
    *,
    metrics: bool = False,
) -> Iterator[ServiceProcesses]:
    """``metrics``: every service serves /metrics on its own free port
    (``procs.metrics_port(name)``; a restarted service gets the same one)."""
    env = {**FAULT_ENV, **(env or {})}
    if metrics:
        env["BATON_METRICS_PORT"] = str(free_port_block(len(METRICS_ENDPOINTS)))
    with fresh_vhost(prefix="baton-fault") as url:
        procs = ServiceProcesses(url, env=env)
        for name in start:
            procs.start(name)
        try:
            yield procs
        finally:
            procs.stop()


def start_replica(procs: ServiceProcesses, name: str, instance: str) -> int:
    """Start another process of service ``name``, with /metrics on a free port of its own
    (returned)."""
    port = free_port_block(1)
    procs.start(name, instance=instance, env={"BATON_METRICS_PORT": str(port)})
    return port


def scrape(port: int) -> dict[str, float]:
    """A service's /metrics as ``{"name{label=value,...}": value}`` ({} while it is down)."""
    try:
        return read_metrics(port)
    except OSError:
        return {}


async def poll_metric(
    port: int, name: str, until: Callable[[float], bool], timeout_s: float, every_s: float = 0.1
) -> tuple[float, float]:
    """Scrape until ``until(value)``; returns (value, seconds waited). TimeoutError if never."""
    t0 = time.monotonic()
    while True:
        value = scrape(port).get(name)
        if value is not None and until(value):
            return value, time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{name} on :{port} is {value} after {timeout_s}s")
        await asyncio.sleep(every_s)


async def check_nothing_leaked(procs: ServiceProcesses, ports: Iterable[int] = ()) -> None:
    """No KV block in use in prefill, decode or the engines on ``ports`` (replicas), and the
    spill store empty (within a minute: orphans go at BATON_SPILL_ORPHAN_TIMEOUT_S)."""
    for port in (procs.metrics_port("prefill"), procs.metrics_port("decode"), *ports):
        await poll_metric(port, "baton:kv_blocks_used", lambda v: v == 0, timeout_s=60)
    spill = Path(procs.spill_dir)
    for _ in range(120):
        entries = [p for p in spill.rglob("*") if p.is_file()] if spill.exists() else []
        if not entries:
            return
        await asyncio.sleep(0.5)
    raise AssertionError(f"spill entries left after 60 s: {entries}")


async def streamed_done(replies: AsyncIterator[Reply], seen: list[int], i: int) -> DoneReply:
    """The ``done`` reply that ends a client's stream, its tokens counted into ``seen[i]`` as
    they come (for a test to strike while generation is under way)."""
    done = None
    async for r in replies:
        if isinstance(r, TokenReply):
            seen[i] += len(r.token_ids)
        else:
            done = r
    assert isinstance(done, DoneReply), done
    return done


def batch(tag: str) -> list[RequestMsg]:
    msgs = []
    for i in range(NUM_REQUESTS):
        seeded = dict(temperature=0.8, seed=1000 + i) if i % 2 else {}
        sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **seeded)  # type: ignore[arg-type]
        msgs.append(RequestMsg(f"{tag}-{i}", sampling, prompt=f"story {i}: once upon a time"))
    return msgs


def check(log: ReplyLog, ids: list[str], reference: list[list[int]]) -> None:
    for rid, ref in zip(ids, reference, strict=True):
        done = log.check_stream(rid)
        assert done.finish_reason == "length" and done.token_ids == ref, rid
