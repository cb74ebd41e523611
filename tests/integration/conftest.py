"""A real Baton (four services, real RabbitMQ in a fresh vhost) shared by the integration tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from services.launcher import LocalSystem, fresh_vhost
from shared.client import BatonClient

pytestmark = pytest.mark.integration


@pytest.fixture(scope="session")
def amqp_url() -> Iterator[str]:
    with fresh_vhost(prefix="baton-test") as url:
        yield url


@pytest_asyncio.fixture(scope="session")
async def system(amqp_url: str) -> AsyncIterator[LocalSystem]:
    sys_ = LocalSystem(amqp_url, env={"BATON_KV_CACHE_MB": "64", "BATON_METRICS_PORT": "0"})
    sys_.start()
    try:
        await sys_.wait_ready()
        yield sys_
    finally:
        code = sys_.stop()
        print(f"baton exited with {code}; log at {sys_.log_path}")


@pytest_asyncio.fixture
async def client(system: LocalSystem) -> AsyncIterator[BatonClient]:
    async with await BatonClient.connect(system.amqp_url, default_wait_s=60) as c:
        yield c
