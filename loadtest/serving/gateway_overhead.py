"""What the HTTP gateway adds: the same requests through the queue and through the gateway.

    python -m loadtest gateway-overhead --spawn          # start Baton + a gateway, measure, stop
    python -m loadtest gateway-overhead                  # against BATON_AMQP_URL and --url

Two workloads, each request sent once per path, the paths alternating so drift (a warming cache,
a busy core) hits both alike:
- latency: N (default 100) sequential 1-token greedy requests, end to end, non-streaming:
  ``BatonClient.generate`` vs ``POST /v1/completions`` (httpx, one kept-alive connection);
- TTFT: M (default 20) sequential streaming requests of a few tokens: the first token reply vs
  the first SSE event.
The difference of the percentiles is the gateway's cost as a client sees it (an HTTP hop, one
more process on the cores, and httpx's own time). The gateway's own account of its part,
``baton:gateway_overhead_seconds`` (parse + publish + first bytes out), is read from its
/metrics before and after, and printed beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest.serving.workload import Stat
from services.launcher import LocalSystem, fresh_vhost
from shared.client import BatonClient, default_amqp_url
from shared.config import REPO_ROOT
from shared.wire.messages import DoneReply, TokenReply

PROMPT_IDS = [101, 102, 103, 104, 105, 106, 107, 108]


async def _timed(fn: Callable[[], Awaitable[float | None]]) -> float:
    t0 = time.perf_counter()
    first = await fn()
    return first if first is not None else time.perf_counter() - t0


class Paths:
    """One request through each path; each call returns seconds (e2e, or TTFT if streaming)."""

    def __init__(self, baton: BatonClient, http: httpx.AsyncClient, model: str) -> None:
        self.baton, self.http, self.model = baton, http, model

    async def queue_e2e(self) -> float | None:
        reply = await self.baton.generate(prompt_token_ids=PROMPT_IDS, max_tokens=1, wait_s=60)
        assert isinstance(reply, DoneReply), reply
        return None

    async def http_e2e(self) -> float | None:
        body = {"model": self.model, "prompt": PROMPT_IDS, "max_tokens": 1, "temperature": 0}
        r = await self.http.post("/v1/completions", json=body)
        r.raise_for_status()
        return None

    async def queue_ttft(self, tokens: int) -> float | None:
        ttft = None
        async for t in self.baton.stream_timed(
            prompt_token_ids=PROMPT_IDS, max_tokens=tokens, ignore_eos=True, wait_s=60
        ):
            if ttft is None and isinstance(t.reply, TokenReply):
                ttft = t.elapsed_s
        return ttft

    async def http_ttft(self, tokens: int) -> float | None:
        body = {"model": self.model, "prompt": PROMPT_IDS, "max_tokens": tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        t0 = time.perf_counter()
        ttft = None
        async with self.http.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if ttft is None and line.startswith("data: "):
                    ttft = time.perf_counter() - t0
        return ttft


async def _gateway_overhead(http: httpx.AsyncClient) -> tuple[float, float]:
    """(sum, count) of baton:gateway_overhead_seconds as the gateway reports it."""
    text = (await http.get("/metrics")).text
    got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return got.get("baton:gateway_overhead_seconds_sum", 0.0), got.get(
        "baton:gateway_overhead_seconds_count", 0.0
    )


async def measure(amqp_url: str, gateway_url: str, args: argparse.Namespace) -> None:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with (
        await BatonClient.connect(amqp_url) as baton,
        httpx.AsyncClient(base_url=gateway_url, headers=headers, timeout=60) as http,
    ):
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        paths = Paths(baton, http, model)
        for _ in range(args.warmup):
            await paths.queue_e2e()
            await paths.http_e2e()
        before = await _gateway_overhead(http)
        queue, gateway = [], []
        for _ in range(args.n):
            queue.append(await _timed(paths.queue_e2e))
            gateway.append(await _timed(paths.http_e2e))
        after = await _gateway_overhead(http)
        queue_ttft, gateway_ttft = [], []
        for _ in range(args.ttft_n):
            queue_ttft.append(await _timed(lambda: paths.queue_ttft(args.ttft_tokens)))
            gateway_ttft.append(await _timed(lambda: paths.http_ttft(args.ttft_tokens)))
    inside = (after[0] - before[0]) / max(1.0, after[1] - before[1])
    report(queue, gateway, queue_ttft, gateway_ttft, inside, args)


def report(
    queue: list[float], gateway: list[float], queue_ttft: list[float], gateway_ttft: list[float],
    inside_s: float, args: argparse.Namespace,
) -> None:  # fmt: skip
    ms = 1000.0
    rows = [
        (f"1-token e2e, queue (n={args.n})", Stat.of(queue)),
        (f"1-token e2e, gateway (n={args.n})", Stat.of(gateway)),
        (f"TTFT {args.ttft_tokens}-token stream, queue", Stat.of(queue_ttft)),
        (f"TTFT {args.ttft_tokens}-token stream, gateway", Stat.of(gateway_ttft)),
    ]
    print(f"\n{'':<36}{'p50 ms':>10}{'p99 ms':>10}{'mean ms':>10}")
    for name, st in rows:
        print(f"{name:<36}{st.p50 * ms:>10.2f}{st.p99 * ms:>10.2f}{st.mean * ms:>10.2f}")
    for label, (q, g) in (("e2e", rows[0:2]), ("TTFT", rows[2:4])):
        a, b = q[1], g[1]
        diffs = ((b.p50 - a.p50) * ms, (b.p99 - a.p99) * ms, (b.mean - a.mean) * ms)
        print(f"{'gateway overhead, ' + label:<36}" + "".join(f"{d:>10.2f}" for d in diffs))
    print(f"{'inside the gateway (its metric)':<36}{'':>20}{inside_s * ms:>10.3f}")


@contextlib.asynccontextmanager
async def spawned(log_dir: Path) -> AsyncIterator[tuple[str, str]]:
    """Baton (``services up``) in a fresh vhost and a gateway process on a free port."""
    with fresh_vhost(prefix="baton-gwbench") as url:
        system = LocalSystem(url, log_path=log_dir / "gateway_overhead.services.log")
        system.start()
        gateway = None
        try:
            await system.wait_ready()
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            env = {**system.env, "BATON_GATEWAY_PORT": str(port)}
            log = open(log_dir / "gateway_overhead.gateway.log", "ab")  # noqa: SIM115
            gateway = subprocess.Popen(
                [sys.executable, "-m", "services.gateway"], cwd=REPO_ROOT, env=env,
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
            gateway_url = f"http://127.0.0.1:{port}"
            await _wait_http(gateway_url + "/health", gateway)
            yield url, gateway_url
        finally:
            if gateway is not None:
                gateway.terminate()
                gateway.wait(timeout=20)
            system.stop()


async def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as http:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the gateway exited with {proc.returncode}")
            with contextlib.suppress(httpx.TransportError):
                if (await http.get(url)).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer from {url} after {timeout_s}s")
            await asyncio.sleep(0.2)


async def main_async(args: argparse.Namespace) -> None:
    if not args.spawn:
        await measure(default_amqp_url(), args.url, args)
        return
    log_dir = REPO_ROOT / "loadtest" / "results"
    log_dir.mkdir(parents=True, exist_ok=True)
    async with spawned(log_dir) as (amqp_url, gateway_url):
        await measure(amqp_url, gateway_url, args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest gateway-overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the running gateway")
    parser.add_argument("--api-key", default=os.environ.get("BATON_API_KEY", ""))
    parser.add_argument("--spawn", action="store_true", help="start Baton and a gateway")
    parser.add_argument("-n", "--n", type=int, default=100, help="1-token requests per path")
    parser.add_argument("--ttft-n", type=int, default=20, help="streaming requests per path")
    parser.add_argument("--ttft-tokens", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=5)
    asyncio.run(main_async(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
