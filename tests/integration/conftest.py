"""A real Baton (every service, real RabbitMQ in a fresh vhost) shared by the integration tests,
once per KV transport: ``shm`` (the spill store) and ``pool`` (decode copies from prefill's
shared-memory KV pool). Each system is started once per session and stopped before the next."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from services.launcher import LocalSystem, free_port_block, fresh_vhost
from services.shell.registry import METRICS_ENDPOINTS
from shared.client import BatonClient

pytestmark = pytest.mark.integration

KV_TRANSPORTS = ("shm", "pool")


@contextlib.asynccontextmanager
async def running_system(
    transport: str, env: dict[str, str] | None = None, tag: str = ""
) -> AsyncIterator[LocalSystem]:
    """``python -m services up`` in a fresh vhost on ``transport``, ready; stopped after."""
    with fresh_vhost(prefix=f"baton-test{tag}-{transport}") as url:
        env = {
            "BATON_KV_CACHE_MB": "64",
            "BATON_METRICS_PORT": str(free_port_block(len(METRICS_ENDPOINTS))),
            "BATON_KV_TRANSPORT": transport,
            **(env or {}),
        }
        sys_ = LocalSystem(url, env=env)
        sys_.start()
        try:
            await sys_.wait_ready()
            yield sys_
        finally:
            code = sys_.stop()
            print(f"baton ({transport}{tag}) exited with {code}; log at {sys_.log_path}")


@pytest_asyncio.fixture(scope="session", params=KV_TRANSPORTS)
async def system(request: pytest.FixtureRequest) -> AsyncIterator[LocalSystem]:
    async with running_system(str(request.param)) as sys_:
        yield sys_


@pytest.fixture
def transport(system: LocalSystem) -> str:
    """The KV transport of the system under test."""
    return system.env["BATON_KV_TRANSPORT"]


@pytest.fixture
def metrics_port(system: LocalSystem) -> int:
    """Where ``services up`` serves the first service's /metrics (the rest follow)."""
    return int(system.env["BATON_METRICS_PORT"])


@pytest_asyncio.fixture
async def client(system: LocalSystem) -> AsyncIterator[BatonClient]:
    async with await BatonClient.connect(system.amqp_url, default_wait_s=60) as c:
        yield c
