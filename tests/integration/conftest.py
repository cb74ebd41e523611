"""A real Baton (four services, real RabbitMQ in a fresh vhost) shared by the integration tests."""

from __future__ import annotations

import socket
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


def _free_port_block(n: int = 4) -> int:
    """A base port with ``n`` consecutive free ports (one per service in ``services up``)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n < 65535 and all(_is_free(base + i) for i in range(n)):
            return base
    raise RuntimeError("no block of free ports")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="session")
def metrics_port() -> int:
    return _free_port_block()


@pytest_asyncio.fixture(scope="session")
async def system(amqp_url: str, metrics_port: int) -> AsyncIterator[LocalSystem]:
    env = {"BATON_KV_CACHE_MB": "64", "BATON_METRICS_PORT": str(metrics_port)}
    sys_ = LocalSystem(amqp_url, env=env)
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
