"""The client library (and so the gateway, which is one) bounds a reply before unpacking it, like
every service bounds its input: a reply queue is reachable by anyone who may publish to the
default exchange and knows its name. No broker needed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from shared.client import async_client
from shared.client.async_client import BatonClient, TimedReply
from shared.wire.messages import DoneReply, ProtocolError


def _client() -> Any:
    # Only _on_reply is exercised: the broker objects are never touched.
    return BatonClient(None, None, None, None, 1.0)  # type: ignore[arg-type]


def _done(text: str) -> bytes:
    usage = {"prompt_tokens": 1, "completion_tokens": 1}
    return DoneReply("r", text, [1], "length", usage, {}).encode()


async def _deliver(client: Any, body: bytes) -> TimedReply | BaseException:
    pending = async_client._Pending(asyncio.Queue())
    client._pending["r"] = pending
    await client._on_reply(SimpleNamespace(correlation_id="r", body=body))
    return pending.queue.get_nowait()


async def test_a_reply_over_the_bound_is_refused_unread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_MAX_MESSAGE_BYTES", "4096")
    client = _client()
    assert client.max_reply_bytes == 4096
    ok = await _deliver(client, _done("short"))
    assert isinstance(ok, TimedReply) and ok.reply.text == "short"
    refused = await _deliver(client, _done("x" * 5000))
    assert isinstance(refused, ProtocolError) and "exceeds 4096" in str(refused.message)


def test_the_default_bound_is_the_services_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATON_MAX_MESSAGE_BYTES", raising=False)
    assert _client().max_reply_bytes == 1 << 20  # BatonConfig.max_message_bytes
