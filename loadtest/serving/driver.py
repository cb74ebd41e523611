"""Driving a Baton under test: spawn it (or point at one), warm it up, run a workload."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from loadtest.serving import stage_profile
from loadtest.serving.workload import (
    RequestResult,
    RequestSpec,
)
from services.launcher import LocalSystem, free_port_block, fresh_vhost
from services.shell.registry import METRICS_ENDPOINTS, port_offset
from shared.client import BatonClient, BatonUnavailable, default_amqp_url
from shared.wire.messages import DoneReply


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Target:
    """The Baton under test: its URL and, when known, the `services up` pid and metrics ports."""

    url: str
    up_pid: int | None = None
    metrics_ports: dict[str, int] | None = None


def metrics_ports(base: int) -> dict[str, int]:
    return {name: base + port_offset(name) for name in METRICS_ENDPOINTS}


@contextlib.contextmanager
def spawned_baton(
    model_dir: Path, log_path: Path, env: dict[str, str] | None = None
) -> Iterator[Target]:
    """`python -m services up` in its own vhost (when rabbitmqctl can make one), each service with
    a /metrics port (for the profile); ``env``: more settings (BATON_*) for every service.

    Started and stopped by ``services/launcher.py``: SIGTERM (the services drain and exit),
    SIGKILL to its process group only after 60 s."""
    base = free_port_block(len(METRICS_ENDPOINTS))
    env = {"BATON_MODEL": str(model_dir), "BATON_METRICS_PORT": str(base), **(env or {})}
    with services_up(env, log_path, vhost_prefix="baton-bench") as system:
        assert system.proc is not None
        where = system.amqp_url.split("@")[-1]
        say(f"spawned Baton (pid {system.proc.pid}) on {where}, log: {log_path}")
        yield Target(system.amqp_url, system.proc.pid, metrics_ports(base))


@contextlib.contextmanager
def services_up(env: dict[str, str], log_path: Path, vhost_prefix: str) -> Iterator[LocalSystem]:
    """`python -m services up`, started (not yet serving), in a fresh vhost of the default broker
    when rabbitmqctl can make one. On leaving: SIGTERM, SIGKILL to its process group only after
    60 s (services/launcher.py); how it ended is said, with its log's tail if not by SIGTERM."""
    with fresh_vhost(default_amqp_url(), prefix=vhost_prefix) as url:
        system = LocalSystem(url, env=env, log_path=log_path)
        system.start()
        try:
            yield system
        finally:
            code = system.stop(timeout_s=60)
            if system.killed:
                say("Baton did not stop within 60 s of SIGTERM: killing its process group")
            say(f"Baton stopped (exit code {code})")
    if code not in (0, -signal.SIGTERM):
        say(f"Baton log tail:\n{system.tail(30)}")


def target_for(
    args: argparse.Namespace, model_dir: Path, env: dict[str, str] | None = None
) -> contextlib.AbstractContextManager[Target]:
    """A spawned Baton (``env``: more BATON_* settings), or the one at ``--url``."""
    if args.spawn:
        return spawned_baton(model_dir, Path(args.out_json).with_suffix(".services.log"), env)
    ports = metrics_ports(args.metrics_port) if args.metrics_port else None
    return contextlib.nullcontext(Target(args.url or default_amqp_url(), None, ports))


async def warm_up(url: str, vocab_size: int, timeout_s: float) -> float:
    """Until one small request completes (Baton may still be loading); returns seconds taken."""
    t0 = time.perf_counter()
    while True:
        left = timeout_s - (time.perf_counter() - t0)
        if left <= 0:
            raise TimeoutError(f"Baton did not serve a warm-up request within {timeout_s}s")
        try:
            async with await BatonClient.connect(url) as client:
                reply = await client.generate(
                    prompt_token_ids=[i % vocab_size for i in range(1, 9)], max_tokens=4,
                    ignore_eos=True, wait_s=left,
                )  # fmt: skip
            if isinstance(reply, DoneReply):
                return time.perf_counter() - t0
            raise RuntimeError(f"warm-up request failed: {reply.code}: {reply.message}")
        except BatonUnavailable:
            await asyncio.sleep(1.0)


async def run_load(
    url: str, specs: list[RequestSpec], *, max_concurrency: int | None, wait_s: float, label: str
) -> tuple[list[RequestResult], float, list[list[int]]]:
    """Publish ``specs`` at their arrival times; returns results (in completion order), the
    run's duration and each spec's output token ids (in spec order)."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    run_id = uuid.uuid4().hex[:6]
    results: list[RequestResult] = []
    outputs: list[list[int]] = [[] for _ in specs]
    async with await BatonClient.connect(url, default_wait_s=wait_s) as client:
        bar = tqdm(total=len(specs), desc=label, unit="req", file=sys.stderr)
        t0 = time.perf_counter()

        async def one(i: int, spec: RequestSpec) -> None:
            await asyncio.sleep(max(0.0, t0 + spec.arrival_s - time.perf_counter()))
            async with limit or contextlib.nullcontext():
                result = RequestResult(ok=False, num_prompt_tokens=len(spec.prompt_token_ids))
                try:
                    c = await client.complete(
                        prompt_token_ids=spec.prompt_token_ids, max_tokens=spec.max_tokens,
                        temperature=0.0, ignore_eos=True, priority=spec.priority,
                        request_id=f"bench-{run_id}-{i}",
                    )  # fmt: skip
                    result.ok, result.num_output_tokens = c.ok, c.num_output_tokens
                    result.ttft, result.e2e, result.itl = c.ttft_s, c.e2e_s, c.itl_s
                    result.finish_reason = c.finish_reason
                    result.error = c.error.code if c.error else None
                    outputs[i] = list(c.token_ids)
                except asyncio.TimeoutError:
                    result.error = "client_timeout"
            results.append(result)
            bar.update(1)

        await asyncio.gather(*(one(i, s) for i, s in enumerate(specs)))
        duration = time.perf_counter() - t0
        bar.close()
    return results, duration, outputs


def finite(obj: Any) -> Any:
    """Strict JSON: NaN/inf (an empty statistic, the all-at-once rate) become null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def settle(up_pid: int | None, max_wait_s: float = 20.0, idle_share: float = 0.1) -> float:
    """Wait until the spawned services stop burning CPU (start-up work of a service that answered
    no warm-up request, e.g. the gateway importing its HTTP stack), so it does not land in the
    measured window. Returns the seconds waited."""
    if up_pid is None:
        return 0.0
    t0 = time.monotonic()
    while time.monotonic() - t0 < max_wait_s:
        procs = stage_profile.find_processes(up_pid)
        before = stage_profile.cpu_snapshot(procs)
        time.sleep(0.5)
        used = sum(stage_profile.diff(before, stage_profile.cpu_snapshot(procs)).values())
        if used < idle_share * 0.5:
            break
    return time.monotonic() - t0
