"""Per-party broker users (deploy/permissions.py): the regexes against the names the code
uses, the definitions document, and on the real RabbitMQ the whole pipeline with every service
as its own user, a client-role user served end to end, and the refusals that make it least
privilege (ACCESS_REFUSED, not just a missing queue)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import aio_pika
import pytest
from aio_pika.abc import AbstractIncomingMessage
from aiormq.exceptions import ChannelAccessRefused

from deploy import permissions as perms
from services.launcher import LocalSystem, ServiceProcesses, fresh_vhost, wait_served
from services.shell.registry import PIPELINE
from shared.client import BatonClient
from shared.config import REPO_ROOT, BatonConfig
from shared.wire.messages import PrefillMsg, SamplingParams
from shared.wire.queues import (
    CONTROL_EXCHANGE,
    DECODE_QUEUE,
    PREFILL_QUEUE,
    REQUESTS_QUEUE,
    detok_queues,
    kv_release_queue,
)

SHARDS = 2
DETOK_0 = detok_queues(SHARDS)[0]
REPLY = f"{perms.REPLY_QUEUE_PREFIX}{uuid.uuid4().hex}"
# (role, kind, resource, allowed): what the code does, and what a role must not be able to do.
CASES = [
    ("tokenizer", "read", REQUESTS_QUEUE, True),
    ("tokenizer", "read", DECODE_QUEUE, False),
    ("tokenizer", "read", PREFILL_QUEUE, False),
    ("tokenizer", "write", CONTROL_EXCHANGE, False),
    ("prefill", "read", PREFILL_QUEUE, True),
    ("prefill", "read", kv_release_queue("gpu-node.example-4242"), True),
    ("prefill", "configure", kv_release_queue("gpu-node.example-4242"), True),
    ("prefill", "read", REQUESTS_QUEUE, False),
    ("decode", "read", DECODE_QUEUE, True),
    ("decode", "read", PREFILL_QUEUE, False),
    ("decode", "configure", kv_release_queue("w"), False),
    ("detokenizer", "read", "baton.detok", True),
    ("detokenizer", "read", DETOK_0, True),
    ("detokenizer", "read", "baton.detok.17", True),
    ("detokenizer", "read", "baton.detok.x", False),
    ("detokenizer", "read", "baton.detokx", False),
    ("detokenizer", "read", DECODE_QUEUE, False),
    ("detokenizer", "write", CONTROL_EXCHANGE, True),
    ("client", "read", REPLY, True),
    ("client", "configure", REPLY, True),
    ("client", "write", "amq.default", True),
    ("client", "write", CONTROL_EXCHANGE, True),
    ("client", "read", PREFILL_QUEUE, False),
    ("client", "read", DETOK_0, False),
    ("client", "read", "amq.gen-abc", False),
    ("client", "read", f"amq_{uuid.uuid4().hex}", False),
    ("decode", "read", "amq_not-hex", False),
    ("client", "configure", REQUESTS_QUEUE, False),
    ("client", "write", "baton.dlx", False),
    ("gateway", "read", DECODE_QUEUE, False),
]


@pytest.mark.parametrize(("role", "kind", "resource", "allowed"), CASES)
def test_regexes(role: str, kind: str, resource: str, allowed: bool) -> None:
    # RabbitMQ searches (re:run), it does not fullmatch: so does this test.
    assert bool(re.search(getattr(perms.ROLES[role], kind), resource)) is allowed


def test_every_service_may_declare_the_whole_topology() -> None:
    """Each shell declares every queue and exchange on connect (services/shell/broker.py)."""
    topo = perms.topology("/", BatonConfig(detok_shards=SHARDS))
    names = [q["name"] for q in topo["queues"]] + [x["name"] for x in topo["exchanges"]]
    assert DETOK_0 in names and "baton.dead" in names
    for role in PIPELINE:
        configure = perms.ROLES[role].configure
        assert all(re.search(configure, n) for n in names), role
        for anonymous in ("amq.gen-JzTY20BRgKO-HjmUJj0wLg", f"amq_{uuid.uuid4().hex}"):
            for kind in ("configure", "write", "read"):  # declare, bind, consume
                assert re.search(getattr(perms.ROLES[role], kind), anonymous), (role, kind)


def test_definitions_document() -> None:
    passwords = {role: f"pw-{role}" for role in perms.ROLES}
    defs = perms.definitions(
        "v1", passwords, BatonConfig(detok_shards=SHARDS), "t-", admin=("ops", "root-pw")
    )
    users = {u["name"]: u for u in defs["users"]}
    assert set(users) == {f"t-{r}" for r in perms.ROLES} | {"ops"}
    assert users["ops"]["tags"] == ["administrator"] and users["t-decode"]["tags"] == []
    for role, pw in [*passwords.items(), ("ops", "root-pw")]:
        raw = base64.b64decode(users.get(f"t-{role}", users.get(role))["password_hash"])
        assert raw[4:] == hashlib.sha256(raw[:4] + pw.encode()).digest(), role
    granted = {p["user"]: p for p in defs["permissions"]}
    assert granted["t-prefill"]["read"] == perms.ROLES["prefill"].read
    assert all(p["vhost"] == "v1" for p in defs["permissions"])
    assert "pw-" not in str(defs), "passwords leave only as salted hashes"
    assert {q["name"] for q in defs["queues"]} >= {REQUESTS_QUEUE, DECODE_QUEUE, DETOK_0}
    [policy] = defs["policies"]  # mirrored on every node of a cluster (compose.cluster.yaml)
    assert policy["vhost"] == "v1" and policy["definition"]["ha-mode"] == "all"
    assert all(re.match(policy["pattern"], q["name"]) for q in defs["queues"])


def test_url_for_keeps_tls_settings() -> None:
    base = "amqps://guest:guest@broker:5671/old?cafile=/ca.pem&certfile=/c.pem&keyfile=/k.pem"
    url = perms.url_for(base, "baton-decode", "p@ss/w:rd", "prod")
    assert url == (
        "amqps://baton-decode:p%40ss%2Fw%3Ard@broker:5671/prod"
        "?cafile=/ca.pem&certfile=/c.pem&keyfile=/k.pem"
    )
    assert perms.url_for("amqp://h/", "u", "p", "/") == "amqp://u:p@h/"


def test_cli_env_and_show() -> None:
    run = [sys.executable, "-m", "deploy.permissions"]
    env = subprocess.run([*run, "env"], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    *lines, cookie = env.stdout.splitlines()
    assert len(lines) == len(perms.ROLES) + 1
    assert all(re.fullmatch(r"BATON_[A-Z]+(_AMQP)?_PASSWORD=[0-9a-f]{32}", x) for x in lines)
    assert re.fullmatch(r"BATON_ERLANG_COOKIE=[0-9a-f]{64}", cookie)  # compose.cluster.yaml
    show = subprocess.run([*run, "show"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert perms.ROLES["client"].read in show.stdout


def test_cli_definitions_file(tmp_path: Path) -> None:
    """What Compose's broker-init runs: passwords from the environment, hashes to a file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    env |= {perms.password_env(r): f"pw-{r}" for r in perms.ROLES} | {
        "BATON_RABBITMQ_PASSWORD": "a"
    }
    out = tmp_path / "definitions.json"
    argv = [sys.executable, "-m", "deploy.permissions", "definitions", "--admin-user",
            "ops", "--output", str(out), "--mode", "644"]  # fmt: skip
    subprocess.run(argv, cwd=REPO_ROOT, env=env, check=True, capture_output=True)
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    defs = json.loads(out.read_text())
    assert {u["name"] for u in defs["users"]} == {"ops", *(f"baton-{r}" for r in perms.ROLES)}
    assert "pw-" not in out.read_text()
    del env["BATON_DECODE_AMQP_PASSWORD"]
    missing = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert missing.returncode != 0 and "BATON_DECODE_AMQP_PASSWORD" in missing.stderr


# --- on the real broker -------------------------------------------------------------------------
def _vhost(url: str) -> str:
    path = url.rsplit("/", 1)[1]
    return path or "/"


@pytest.fixture(scope="module")
def urls() -> Iterator[dict[str, str]]:
    """One user per role in a fresh vhost, created with ``apply``; deleted afterwards."""
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("rabbitmqctl not found: per-user tests need the local broker's admin tool")
    prefix = f"baton-test-{uuid.uuid4().hex[:6]}-"
    with fresh_vhost(prefix="baton-test-perms") as base:
        vhost = _vhost(base)
        if vhost == "/":
            pytest.skip("could not create a fresh vhost (rabbitmqctl add_vhost failed)")
        passwords = {role: uuid.uuid4().hex for role in perms.ROLES}
        try:
            perms.apply(
                perms.definitions(vhost, passwords, BatonConfig(detok_shards=SHARDS), prefix)
            )
            yield {r: perms.url_for(base, prefix + r, pw, vhost) for r, pw in passwords.items()}
        finally:
            perms.remove([prefix + r for r in perms.ROLES])


def _user(url: str) -> str:
    return url.split("://", 1)[1].split(":", 1)[0]


def _user_prefix(urls: dict[str, str]) -> str:
    return _user(urls["tokenizer"]).removesuffix("tokenizer")


async def _ignore(message: AbstractIncomingMessage) -> None:
    pass


async def _attempt(url: str, kind: str, resource: str) -> None:
    conn = await aio_pika.connect(url)
    try:
        channel = await conn.channel(publisher_confirms=True)
        if kind == "read":
            queue = await channel.get_queue(resource, ensure=False)
            tag = await queue.consume(_ignore, no_ack=False)
            await queue.cancel(tag)
        elif kind == "write":
            exchange = await channel.get_exchange(resource, ensure=False)
            await exchange.publish(aio_pika.Message(b"{}"), routing_key="")
        else:
            await channel.declare_queue(resource, exclusive=True)
    finally:
        await conn.close()


# On the broker: every refusal beside an allowed action of the rightful owner, so a refusal is
# a permission, never a wrong password or a missing queue.
BROKER_CASES = [
    ("client", "read", PREFILL_QUEUE, False),
    ("client", "read", DETOK_0, False),
    ("gateway", "read", DECODE_QUEUE, False),
    ("client", "configure", REQUESTS_QUEUE, False),
    ("tokenizer", "read", DECODE_QUEUE, False),
    ("tokenizer", "write", CONTROL_EXCHANGE, False),
    ("decode", "read", PREFILL_QUEUE, False),
    ("prefill", "read", REQUESTS_QUEUE, False),
    ("detokenizer", "read", PREFILL_QUEUE, False),
    ("decode", "read", DECODE_QUEUE, True),
    ("prefill", "read", PREFILL_QUEUE, True),
    ("tokenizer", "read", REQUESTS_QUEUE, True),
    ("detokenizer", "read", DETOK_0, True),
    ("detokenizer", "write", CONTROL_EXCHANGE, True),
    ("client", "write", CONTROL_EXCHANGE, True),
]


@pytest.mark.integration
@pytest.mark.parametrize(("role", "kind", "resource", "allowed"), BROKER_CASES)
async def test_broker_enforces(
    urls: dict[str, str], role: str, kind: str, resource: str, allowed: bool
) -> None:
    if allowed:
        await _attempt(urls[role], kind, resource)
        return
    with pytest.raises(ChannelAccessRefused, match="ACCESS_REFUSED"):
        await _attempt(urls[role], kind, resource)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("launch", ["processes", "up"])
async def test_pipeline_with_one_user_per_service(urls: dict[str, str], launch: str) -> None:
    """Every service on its own user (pool transport: prefill's release queue too), requests
    from a client-role user and from the gateway's user. ``up``: the URLs ``apply`` prints, in
    the environment of ``python -m services up`` (the gateway runs too), whose shared
    BATON_AMQP_URL is the client's: a service that fell back to it could not even start."""
    env = {
        "BATON_KV_TRANSPORT": "pool",
        "BATON_KV_CACHE_MB": "64",
        "BATON_DETOK_SHARDS": "2",
        "BATON_TRUSTED_PUBLISHERS": perms.trusted_publishers(_user_prefix(urls)),
    }
    system: LocalSystem | ServiceProcesses
    if launch == "up":
        own = {f"BATON_{r.upper()}_AMQP_URL": url for r, url in urls.items()}
        system = LocalSystem(urls["client"], env=env | own)
        system.start()
    else:
        system = ServiceProcesses(urls["tokenizer"], env=env)
        for name in PIPELINE:
            system.start(name, env={"BATON_AMQP_URL": urls[name]})
    try:
        await wait_served(urls["client"], 240.0, tail=system.tail)
        for role in ("client", "gateway"):
            async with await BatonClient.connect(urls[role], default_wait_s=60) as client:
                reply = await client.generate("Once upon a time", max_tokens=8, temperature=0)
                assert reply.type == "done", (role, reply)
                streamed = [r async for r in client.stream("Hello", max_tokens=4)]
                assert streamed[-1].type == "done", (role, streamed[-1])
                await client.cancel("nobody")  # publishing to baton.control is allowed
        # A client may write the default exchange, and so reach an internal queue: its forged
        # work is dead-lettered by the consumer (the broker vouches for user_id).
        forged = PrefillMsg("forged", "nowhere", [1, 2, 3], SamplingParams(max_tokens=2))
        conn = await aio_pika.connect(urls["client"])
        async with conn:
            channel = await conn.channel(publisher_confirms=True)
            for queue, body in ((PREFILL_QUEUE, forged.encode()), (DETOK_0, b"forged")):
                message = aio_pika.Message(body, user_id=_user(urls["client"]))
                await channel.default_exchange.publish(message, routing_key=queue)
        for _ in range(100):
            log = system.tail(2000)
            if log.count("work from an untrusted publisher dead-lettered") >= 2:
                break
            await asyncio.sleep(0.1)
        assert log.count("work from an untrusted publisher dead-lettered") >= 2, system.tail(60)
        assert "ACCESS_REFUSED" not in log, system.tail(60)
        if launch == "up":
            assert "gateway listening" in log, "the gateway started on its own user"
    finally:
        system.stop()
