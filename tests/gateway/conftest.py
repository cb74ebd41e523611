"""Gateways for the tests: over a scripted Baton (no broker needed), and over a real one.

The real system follows tests/integration/conftest.py: ``python -m services up`` in a fresh
RabbitMQ vhost (deleted afterwards), metrics on consecutive ports so the detokenizer's counters
can be read. Beside it, in a second vhost, a lone tokenizer with ``BATON_MAX_PREFILL_BACKLOG=0``
answers every request ``overloaded`` (the only way to get that reply on demand). Both start
together, and the gateways run in the test's own event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import pytest_asyncio

from services.gateway.service import GatewayService
from services.launcher import LocalSystem, ServiceProcesses, free_port_block, fresh_vhost
from shared.client import BatonClient, BatonUnavailable
from shared.config import BatonConfig
from shared.wire.messages import ErrorReply
from tests.gateway.fakes import FakeBaton

API_KEY = "test-key-0123456789"
OFFLINE_MAX_BODY = 64 * 1024


async def _started(service: GatewayService) -> str:
    await service.start()
    return f"http://127.0.0.1:{service.port}"


# --- over a scripted Baton --------------------------------------------------------------------


@pytest.fixture(scope="session")
def fake() -> FakeBaton:
    return FakeBaton()


@pytest.fixture
def baton(fake: FakeBaton) -> FakeBaton:
    """The scripted Baton, reset for this test."""
    fake.reset()
    return fake


@pytest_asyncio.fixture(scope="session")
async def offline(fake: FakeBaton) -> AsyncIterator[GatewayService]:
    config = BatonConfig(gateway_port=0, gateway_max_body_bytes=OFFLINE_MAX_BODY)
    service = GatewayService(config, client=fake)  # type: ignore[arg-type]
    await service.start()
    yield service
    await service.stop()


@pytest_asyncio.fixture(scope="session")
async def offline_keyed(fake: FakeBaton) -> AsyncIterator[str]:
    service = GatewayService(BatonConfig(gateway_port=0, api_key=API_KEY), client=fake)  # type: ignore[arg-type]
    url = await _started(service)
    yield url
    await service.stop()


@pytest.fixture
def offline_url(offline: GatewayService) -> str:
    return f"http://127.0.0.1:{offline.port}"


# --- over a real Baton ------------------------------------------------------------------------


@dataclass
class Live:
    system: LocalSystem
    metrics_port: int  # each pipeline service at + registry.port_offset(name)
    gateway: GatewayService
    keyed_url: str  # the same system behind API_KEY
    overloaded_url: str  # the lone tokenizer that refuses everything

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.port}"


@pytest_asyncio.fixture(scope="session")
async def live() -> AsyncIterator[Live]:
    port = free_port_block(4)
    # BATON_GATEWAY_PORT=0: should `up` start a gateway of its own, it takes a free port.
    env = {"BATON_KV_CACHE_MB": "64", "BATON_METRICS_PORT": str(port), "BATON_GATEWAY_PORT": "0"}
    services: list[GatewayService] = []
    with contextlib.ExitStack() as stack:
        # The system starts before the second vhost is made: its start-up hides that time.
        main_url = stack.enter_context(fresh_vhost(prefix="baton-gw"))
        system = LocalSystem(main_url, env=env)
        system.start()
        stack.callback(lambda: print(f"baton exited with {system.stop()}; log {system.log_path}"))
        full_url = stack.enter_context(fresh_vhost(prefix="baton-gw-full"))
        full = ServiceProcesses(
            full_url, env={"BATON_MAX_PREFILL_BACKLOG": "0", "BATON_METRICS_PORT": "0"}
        )
        full.start("tokenizer")
        stack.callback(full.stop)
        try:
            await asyncio.gather(system.wait_ready(), _wait_refusing(full_url, full))
            config = BatonConfig.from_env(system.env).replace(gateway_port=0, api_key="")
            for c in (config, config.replace(api_key=API_KEY), config.replace(amqp_url=full_url)):
                services.append(GatewayService(c))
                await services[-1].start()
            yield Live(
                system, port, services[0],
                f"http://127.0.0.1:{services[1].port}", f"http://127.0.0.1:{services[2].port}",
            )  # fmt: skip
        finally:
            for service in services:
                await service.stop()


async def _wait_refusing(url: str, procs: ServiceProcesses, timeout_s: float = 120.0) -> None:
    """Until the lone tokenizer consumes and answers (``overloaded``)."""
    deadline = time.monotonic() + timeout_s
    async with await BatonClient.connect(url) as client:
        while True:
            try:
                reply = await client.generate("ready?", max_tokens=1, wait_s=10)
                assert isinstance(reply, ErrorReply) and reply.code == "overloaded", reply
                return
            except (BatonUnavailable, asyncio.TimeoutError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tokenizer not answering:\n{procs.tail()}") from None
                await asyncio.sleep(0.5)
