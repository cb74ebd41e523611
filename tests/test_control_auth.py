"""Control from the right party only (services/shell/control_auth.py).

With the per-role broker users of ``python -m deploy.permissions``, a client tries what
used to stop the whole system or another client's request: ``drain`` (only the operator's is
honoured) and ``cancel`` of a request it did not publish (only the publisher's is honoured).
Both are logged and ignored; the operator's drain then drains the workers. The rule itself is
checked without a broker first.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import aio_pika
import pytest

from deploy import permissions as perms
from services.detokenizer.core import DetokenizerCore, Output
from services.launcher import ServiceProcesses, fresh_vhost, wait_served
from services.shell.control_auth import ControlAuth
from services.shell.registry import PIPELINE
from shared.client import BatonClient
from shared.config import BatonConfig
from shared.wire.messages import ControlMsg, DoneReply, StartInfo
from shared.wire.queues import CONTROL_EXCHANGE

SHARDS = 2


def test_the_rule() -> None:
    dev = ControlAuth(BatonConfig())  # one shared user: nobody to tell apart
    assert dev.may_drain("guest") and dev.may_drain(None) and dev.may_abort(None)
    assert dev.may_cancel("guest", None) and dev.may_cancel(None, None)
    auth = ControlAuth(BatonConfig(trusted_publishers="b-detok,b-decode", operators="b-ops"))
    assert auth.may_drain("b-ops") and not auth.may_drain("b-client") and not auth.may_drain(None)
    assert auth.may_abort("b-detok") and not auth.may_abort("b-client")
    assert auth.may_cancel("alice", "alice")
    assert not auth.may_cancel("alice", "bob") and not auth.may_cancel("alice", None)
    assert not auth.may_cancel(None, None)  # an unstamped request is nobody's to cancel
    operators_only = ControlAuth(BatonConfig(operators="b-ops"))
    assert operators_only.may_abort("guest")  # no trusted publishers named: aborts as before
    assert not operators_only.may_drain("guest")


def test_the_detokenizer_core_honours_only_the_owners_cancel() -> None:
    auth = ControlAuth(BatonConfig(operators="ops"))
    core = DetokenizerCore(lambda ids: "x" * len(ids), may_cancel=auth.may_cancel)
    out = Output()
    core.start(StartInfo("r", "q", 3, owner="alice"), 1.0, out)
    core.cancel("r", 2.0, out, sender="bob")
    assert not out.finished
    core.cancel("r", 3.0, out, sender="alice")
    assert [reply.finish_reason for _, reply in out.finished] == ["cancelled"]  # type: ignore[union-attr]
    # A cancel that comes before its request is kept with its sender and checked at the start.
    out = Output()
    core.cancel("early", 4.0, out, sender="bob")
    core.start(StartInfo("early", "q", 3, owner="alice"), 5.0, out)
    assert not out.finished and core.is_live("early")


@pytest.fixture(scope="module")
def urls() -> Iterator[dict[str, str]]:
    prefix = f"baton-test-{uuid.uuid4().hex[:6]}-"
    with fresh_vhost(prefix="baton-test-ctl") as base:
        vhost = base.rsplit("/", 1)[1]
        if not vhost:
            pytest.skip("could not create a fresh vhost")
        passwords = {role: uuid.uuid4().hex for role in perms.ROLES}
        try:
            perms.apply(
                perms.definitions(vhost, passwords, BatonConfig(detok_shards=SHARDS), prefix)
            )
        except RuntimeError as exc:  # no rabbitmqctl: a remote broker
            pytest.skip(str(exc))
        try:
            yield {r: perms.url_for(base, prefix + r, pw, vhost) for r, pw in passwords.items()}
        finally:
            perms.remove([prefix + r for r in perms.ROLES])


def _user(url: str) -> str:
    return url.split("://", 1)[1].split(":", 1)[0]


async def _control(url: str, msg: ControlMsg, *, stamp: bool = True) -> None:
    conn = await aio_pika.connect(url)
    async with conn:
        channel = await conn.channel()
        exchange = await channel.declare_exchange(
            CONTROL_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True
        )
        user = _user(url) if stamp else None
        await exchange.publish(aio_pika.Message(msg.encode(), user_id=user), routing_key="")


async def _logged(procs: ServiceProcesses, text: str, count: int, timeout_s: float = 30) -> None:
    for _ in range(int(timeout_s * 10)):
        if procs.tail(5000).count(text) >= count:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{text!r} not logged {count} times:\n{procs.tail(40)}")


@pytest.mark.integration
@pytest.mark.slow
async def test_a_client_can_neither_drain_nor_cancel_anothers_request(
    urls: dict[str, str],
) -> None:
    prefix = _user(urls["tokenizer"]).removesuffix("tokenizer")
    env = {
        "BATON_DETOK_SHARDS": str(SHARDS),
        "BATON_TRUSTED_PUBLISHERS": perms.trusted_publishers(prefix),
        "BATON_OPERATORS": perms.operators(prefix),
    }
    procs = ServiceProcesses(urls["tokenizer"], env=env)
    for name in PIPELINE:
        procs.start(name, env={"BATON_AMQP_URL": urls[name]})
    try:
        await wait_served(urls["client"], 240.0, tail=procs.tail)
        # drain, as a client: stamped with its own user, and not stamped at all.
        await _control(urls["client"], ControlMsg("drain"))
        await _control(urls["client"], ControlMsg("drain"), stamp=False)
        await _logged(procs, "drain from a user that is not an operator ignored", 2 * 4)
        async with (
            await BatonClient.connect(urls["gateway"], default_wait_s=120) as owner,
            await BatonClient.connect(urls["client"], default_wait_s=120) as other,
        ):
            reply = await other.generate("still served", max_tokens=4)
            assert isinstance(reply, DoneReply), reply  # nothing was drained
            # cancel, as another client, of a request under way: ignored, it goes on; then
            # the owner's: honoured.
            replies: list[object] = []

            async def consume() -> None:
                async for r in owner.stream(
                    "a long story", max_tokens=4000, ignore_eos=True, request_id="r1"
                ):
                    replies.append(r)

            theirs = asyncio.create_task(consume())
            while not replies:
                await asyncio.sleep(0.01)
            await other.cancel("r1")
            await _logged(procs, "cancel from another user ignored", 1)
            assert not theirs.done(), "r1 went on after the foreign cancel"
            await owner.cancel("r1")
            await theirs
            done = replies[-1]
            assert isinstance(done, DoneReply) and done.finish_reason == "cancelled", done
            assert 0 < len(done.token_ids) < 4000
        # drain, as the operator: the three drainable workers drain and exit.
        await _control(urls["operator"], ControlMsg("drain"))
        await _logged(procs, '"event": "drained"', 3, timeout_s=60)
    finally:
        procs.stop()
