"""One robust AMQP connection over a list of broker addresses (a RabbitMQ cluster).

``BATON_AMQP_URL`` (and every ``url`` the client library takes) may name several nodes of one
cluster: as hosts of one URL, ``amqp://u:p@rabbit-1:5672,rabbit-2:5672,rabbit-3:5672/vhost``
(what compose's cluster profile sets through ``BATON_AMQP_HOSTS``), or as whole URLs,
comma-separated: ``amqp://u:p@rabbit-1:5672/,amqp://u:p@rabbit-2:5672/``. The nodes share
credentials, vhost and query options (TLS files: the first address's apply to every attempt);
a comma inside a password must be percent-encoded (``%2C``), as URLs require anyway.

aio-pika's :class:`RobustConnection` restores channels, queues and consumers after a reconnect,
but always to the one URL it was given: with that node dead it retries it forever. Here each
attempt (the first connect and every reconnect) tries the current address and, if it refuses,
the next ones in turn, then sleeps the reconnect interval and goes round again; whichever node
answers gets the restored channels. Which node holds a queue does not matter to a client: the
cluster's queue mirroring (or quorum queues) keeps the queue and its messages alive on the
nodes that remain (docs/deploy.md "Broker cluster").
"""

from __future__ import annotations

import functools
import re
from typing import Any, cast
from urllib.parse import unquote, urlsplit

import aio_pika
from aio_pika.abc import AbstractConnection, AbstractRobustConnection
from aio_pika.robust_connection import CONNECTION_EXCEPTIONS, RobustConnection
from yarl import URL

_NEXT_URL = re.compile(r",\s*(?=[a-z][a-z0-9+.-]*://)", re.IGNORECASE)
_URL = re.compile(r"^(?P<scheme>[^:/]+://)(?:(?P<creds>[^@/?#]*)@)?(?P<hosts>[^/?#]*)(?P<rest>.*)$")


def split_urls(urls: str) -> list[str]:
    """One URL per broker address (see the module): ``"amqp://u@a,b/v"`` and ``"amqp://u@a/v,
    amqp://u@b/v"`` both give ``["amqp://u@a/v", "amqp://u@b/v"]``."""
    out = []
    for url in _NEXT_URL.split(urls.strip()):
        m = _URL.match(url.strip())
        if m is None:
            raise ValueError(f"not an AMQP URL: {url.strip()!r}")
        creds = f"{m['creds']}@" if m["creds"] is not None else ""
        for host in m["hosts"].split(","):
            if host.strip():
                out.append(f"{m['scheme']}{creds}{host.strip()}{m['rest']}")
    if not out:
        raise ValueError("no AMQP address given")
    return out


def url_username(urls: str) -> str | None:
    """The user every address connects as (they share credentials)."""
    user = urlsplit(split_urls(urls)[0]).username
    return unquote(user) if user else None


class FailoverConnection(RobustConnection):
    """A :class:`RobustConnection` that moves to the next address when the current one refuses.

    aio-pika's reconnect loop calls its private ``__connect_transport`` step once per attempt
    (aio-pika 9 to 10); this class overrides that step by its mangled name, trying each
    address once per attempt. ``tests/multinode/test_broker_cluster.py`` kills a node under
    load, so a change in that private hook fails a test rather than a deployment.
    """

    def __init__(self, url: URL, *args: Any, addresses: list[URL], **kwargs: Any) -> None:
        super().__init__(url, *args, **kwargs)
        self.addresses = addresses
        self._index = 0  # the address this attempt tries first: the last one that answered

    async def _RobustConnection__connect_transport(self) -> None:  # noqa: N802  (aio-pika's name)
        connect_once = RobustConnection._RobustConnection__connect_transport  # type: ignore[attr-defined]
        last: BaseException | None = None
        for _ in range(len(self.addresses)):
            try:
                await connect_once(self)
                return
            except CONNECTION_EXCEPTIONS as exc:
                last = exc
                self._advance()
        assert last is not None
        raise last

    def _advance(self) -> None:
        self._index = (self._index + 1) % len(self.addresses)
        self.url = self.addresses[self._index]


async def connect_robust(urls: str, **kwargs: Any) -> AbstractRobustConnection:
    """Like ``aio_pika.connect_robust`` over every address in ``urls`` (see the module)."""
    addresses = split_urls(urls)
    if len(addresses) == 1:
        return await aio_pika.connect_robust(addresses[0], **kwargs)
    factory = functools.partial(FailoverConnection, addresses=[URL(u) for u in addresses])
    connection_class = cast(type[AbstractRobustConnection], factory)
    return await aio_pika.connect_robust(addresses[0], connection_class=connection_class, **kwargs)


async def connect(urls: str, **kwargs: Any) -> AbstractConnection:
    """A plain (not robust) connection to the first address that answers."""
    last: BaseException | None = None
    for url in split_urls(urls):
        try:
            return await aio_pika.connect(url, **kwargs)
        except CONNECTION_EXCEPTIONS as exc:
            last = exc
    assert last is not None
    raise last
