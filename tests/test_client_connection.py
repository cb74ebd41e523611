"""Broker address lists (shared/client/connection.py): parsing, and a connection that skips a
dead node and keeps its queues across a move (the node-kill test under load is
tests/multinode/test_broker_cluster.py)."""

from __future__ import annotations

import pytest

from services.launcher import fresh_vhost
from shared.client import BatonClient
from shared.client.connection import FailoverConnection, connect_robust, split_urls, url_username
from tests.multinode.cluster import free_port


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("amqp://u:p@a:1/", ["amqp://u:p@a:1/"]),
        ("amqp://u:p@a:1,b:2, c:3/v?heartbeat=5",
         ["amqp://u:p@a:1/v?heartbeat=5", "amqp://u:p@b:2/v?heartbeat=5",
          "amqp://u:p@c:3/v?heartbeat=5"]),
        ("amqp://u:p@a/,amqp://u:p@b/ ,amqps://u:p@c/", ["amqp://u:p@a/", "amqp://u:p@b/",
                                                        "amqps://u:p@c/"]),
        ("amqp://a,b", ["amqp://a", "amqp://b"]),
    ],
)  # fmt: skip
def test_split_urls(given: str, expected: list[str]) -> None:
    assert split_urls(given) == expected


@pytest.mark.parametrize("bad", ["", " , ", "rabbit:5672"])
def test_split_urls_refuses_what_is_no_address(bad: str) -> None:
    with pytest.raises(ValueError):
        split_urls(bad)


def test_username_of_a_list() -> None:
    assert url_username("amqp://baton-decode:pw@a,b/") == "baton-decode"
    assert url_username("amqp://a/") is None


@pytest.mark.integration
async def test_a_dead_first_address_is_skipped() -> None:
    with fresh_vhost(prefix="baton-failover") as url:
        live = url.split("://", 1)[1].split("@", 1)[1].split("/", 1)[0]  # host:port
        urls = url.replace(live, f"127.0.0.1:{free_port()},{live}", 1)
        connection = await connect_robust(urls)
        try:
            assert isinstance(connection, FailoverConnection)
            assert connection.url.port == int(live.rsplit(":", 1)[1])  # moved on to the live one
            channel = await connection.channel()
            await channel.declare_queue("", exclusive=True)
        finally:
            await connection.close()
        async with await BatonClient.connect(urls) as client:  # the client library takes lists
            assert client.reply_queue_name.startswith("baton.reply.")
