"""Broker users with the least permissions each party needs: the one source of truth.

RabbitMQ grants a user three regexes per vhost, matched against queue *and* exchange names:
configure (declare, delete), write (publish to an exchange; the queue side of a bind), read
(consume or get from a queue; the exchange side of a bind). What each party does, from the code:

- every service shell (``services/shell/broker.py``): declares the whole topology on connect, so
  configure on all of it; binds ``baton.dead`` (and with quorum work queues ``baton.poison``) to
  ``baton.dlx`` (write the queue, read the exchange); declares an unnamed exclusive queue
  (``amq_<hex>``), binds it to ``baton.control`` and consumes it; publishes through the default
  exchange (``amq.default``); reads queue depths by passive declares (which need no permission);
- tokenizer, prefill, decode, detokenizer consume ``baton.requests``, ``baton.prefill``,
  ``baton.decode``, ``baton.detok[.<n>]``; the tokenizer also ``baton.poison``; prefill also
  declares and consumes its release queue ``baton.kv_release.<worker>``; the detokenizer
  publishes aborts to ``baton.control``;
- the client library (``shared/client``; the gateway is one): declares, consumes and deletes its
  reply queue ``baton.reply.<hex>``, declares ``baton.control`` and publishes cancels there, and
  publishes requests through the default exchange;
- an operator declares ``baton.control`` and publishes ``drain`` there; the services honour a
  drain only from the users in ``BATON_OPERATORS`` (``services/shell/control_auth.py``).

Declaring a queue that has a dead-letter exchange *creates* it only with read on that queue, so
the topology is declared beforehand (``apply``, or the definitions file Compose loads); after
that a re-declare needs configure alone and a tokenizer never gets read on ``baton.decode``.
What the model cannot express (write on ``amq.default`` reaches every queue): docs/security.md.

``python -m deploy.permissions show|definitions|apply|remove|env`` (``--help``).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from shared.config import DEFAULT_AMQP_URL, BatonConfig
from shared.wire.queues import (
    CONTROL_EXCHANGE,
    DEAD_LETTER_EXCHANGE,
    DEAD_LETTER_QUEUE,
    DECODE_QUEUE,
    DETOK_QUEUE_PREFIX,
    POISON_QUEUE,
    PREFILL_QUEUE,
    REQUESTS_QUEUE,
    WORK_QUEUES,
    dead_letter_queues,
    detok_queues,
    kv_release_queue,
    queue_arguments,
)


def lit(name: str) -> str:
    """A queue or exchange name as a regex (names are ``[A-Za-z0-9._-]``: only dots matter)."""
    return name.replace(".", r"\.")


def any_of(*patterns: str) -> str:
    """Anchored: RabbitMQ searches, so an unanchored ``baton\\.decode`` would match more."""
    return "^(" + "|".join(patterns) + ")$"


# An unnamed exclusive queue (the control subscription): aio-pika's robust channel names it
# itself, amq_<uuid hex>, so that it can re-declare the same queue after a reconnect; a plain
# channel gets the broker's amq.gen-<...>.
ANONYMOUS = r"amq_[0-9a-f]{32}|amq\.gen-.*"
DEFAULT_EXCHANGE = r"amq\.default"  # how RabbitMQ names the default exchange in permission checks
# The client library's reply queues (shared/client/async_client.py): the name is a capability,
# unguessable, so one client cannot consume or delete another's replies.
REPLY_QUEUE_PREFIX = "baton.reply."
# The single queue of old and the shards of now (baton.detok.0 ... baton.detok.<n-1>).
DETOK = lit(DETOK_QUEUE_PREFIX.rstrip(".")) + r"(\.[0-9]+)?"
KV_RELEASE = lit(kv_release_queue("")) + ".+"
REPLY = lit(REPLY_QUEUE_PREFIX) + ".+"
TOPOLOGY = (
    lit(DEAD_LETTER_EXCHANGE),
    lit(DEAD_LETTER_QUEUE),
    lit(POISON_QUEUE),
    *(lit(q) for q in WORK_QUEUES),
    DETOK,
    lit(CONTROL_EXCHANGE),
)


@dataclass(frozen=True)
class Permissions:
    configure: str
    write: str
    read: str


def _service(
    reads: tuple[str, ...], configure: tuple[str, ...] = (), writes: tuple[str, ...] = ()
) -> Permissions:
    return Permissions(
        configure=any_of(*TOPOLOGY, ANONYMOUS, *configure),
        write=any_of(
            DEFAULT_EXCHANGE, lit(DEAD_LETTER_QUEUE), lit(POISON_QUEUE), ANONYMOUS, *writes
        ),
        read=any_of(lit(DEAD_LETTER_EXCHANGE), lit(CONTROL_EXCHANGE), ANONYMOUS, *reads),
    )


_CLIENT = Permissions(
    configure=any_of(REPLY, lit(CONTROL_EXCHANGE)),
    write=any_of(DEFAULT_EXCHANGE, lit(CONTROL_EXCHANGE)),
    read=any_of(REPLY),
)
ROLES: dict[str, Permissions] = {
    "tokenizer": _service((lit(REQUESTS_QUEUE), lit(POISON_QUEUE))),
    "prefill": _service((lit(PREFILL_QUEUE), KV_RELEASE), configure=(KV_RELEASE,)),
    "decode": _service((lit(DECODE_QUEUE),)),
    "detokenizer": _service((DETOK,), writes=(lit(CONTROL_EXCHANGE),)),
    "gateway": _CLIENT,
    "client": _CLIENT,  # any program on shared.client: the CLI, Locust, your own
    # Drains the workers (docs/deploy.md); its user is BATON_OPERATORS.
    "operator": Permissions(
        configure=any_of(lit(CONTROL_EXCHANGE)), write=any_of(lit(CONTROL_EXCHANGE)), read="^$"
    ),
}
USER_PREFIX = "baton-"
PASSWORD_ENV = "BATON_{ROLE}_AMQP_PASSWORD"


# The roles whose users publish work between services (the tokenizer into prefill and the
# detokenizer shards, prefill into decode, the detokenizer its stream marks into its shards and
# aborts to the workers, and each into its own queue when it counts a redelivery). Services set
# BATON_TRUSTED_PUBLISHERS to their user names and refuse internal work from anyone else: the
# default exchange lets any user with write on it reach any queue.
PUBLISHERS = ("tokenizer", "prefill", "decode", "detokenizer")
OPERATORS = ("operator",)


def trusted_publishers(prefix: str = USER_PREFIX) -> str:
    return ",".join(prefix + role for role in PUBLISHERS)


def operators(prefix: str = USER_PREFIX) -> str:
    return ",".join(prefix + role for role in OPERATORS)


def password_env(role: str, template: str = PASSWORD_ENV) -> str:
    return template.format(ROLE=role.upper(), role=role)


def password_hash(password: str) -> str:
    """RabbitMQ's ``rabbit_password_hashing_sha256``: base64(salt + sha256(salt + password))."""
    salt = secrets.token_bytes(4)
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()


# Every classic baton.* queue (work, detok shards, replies, dead letters) mirrored on every node
# of a cluster, synced at once: the queue and its messages outlive the node that held it
# (compose.cluster.yaml). Quorum queues (BATON_QUEUE_TYPE=quorum) replicate by themselves and
# ignore it. No effect on a single node.
MIRROR_POLICY: dict[str, Any] = {
    "name": "baton-ha",
    "pattern": r"^baton\.",
    "apply-to": "queues",
    "definition": {"ha-mode": "all", "ha-sync-mode": "automatic"},
    "priority": 0,
}


def topology(vhost: str, config: BatonConfig) -> dict[str, list[dict[str, Any]]]:
    """Queues, exchanges, the bindings and the mirroring policy, with the arguments every
    declarer uses (the work queues' type and delivery limit, the shards: ``config``)."""
    dead = dead_letter_queues(config)
    names = (*WORK_QUEUES, *detok_queues(config.detok_shards), *dead)
    queue = {"vhost": vhost, "durable": True, "auto_delete": False}
    fanout = {"vhost": vhost, "type": "fanout", "durable": True, "auto_delete": False}
    return {
        "queues": [{"name": q, **queue, "arguments": queue_arguments(q, config)} for q in names],
        "exchanges": [
            {"name": x, **fanout, "internal": False, "arguments": {}}
            for x in (DEAD_LETTER_EXCHANGE, CONTROL_EXCHANGE)
        ],
        "bindings": [dict(source=DEAD_LETTER_EXCHANGE, vhost=vhost, destination=q,
                          destination_type="queue", routing_key="", arguments={}) for q in dead],
        "policies": [{"vhost": vhost, **MIRROR_POLICY}],
    }  # fmt: skip


def definitions(
    vhost: str,
    passwords: dict[str, str],
    config: BatonConfig,
    prefix: str = USER_PREFIX,
    admin: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """A RabbitMQ definitions document: the vhost, one user per role in ``passwords`` (hashed),
    their permissions, an optional administrator and the topology."""
    everything = Permissions(".*", ".*", ".*")
    accounts: list[tuple[str, str, list[str], Permissions]] = [
        (prefix + role, pw, [], ROLES[role]) for role, pw in passwords.items()
    ]
    if admin is not None:
        accounts.append((admin[0], admin[1], ["administrator"], everything))
    algorithm = "rabbit_password_hashing_sha256"
    return {
        "users": [
            {"name": u, "password_hash": password_hash(pw), "hashing_algorithm": algorithm,
             "tags": tags}
            for u, pw, tags, _ in accounts
        ],
        "vhosts": [{"name": vhost}],
        "permissions": [
            {"user": u, "vhost": vhost, "configure": p.configure, "write": p.write, "read": p.read}
            for u, _, _, p in accounts
        ],
        **topology(vhost, config),
    }  # fmt: skip


def url_for(base_url: str, user: str, password: str, vhost: str) -> str:
    """``base_url`` with another user, password and vhost; scheme, host, port and query (TLS
    settings) kept as they are."""
    parts = urlsplit(base_url)
    host = parts.netloc.rsplit("@", 1)[-1]
    creds = f"{quote(user, safe='')}:{quote(password, safe='')}"
    path = "/" if vhost == "/" else "/" + quote(vhost, safe="")
    return urlunsplit((parts.scheme, f"{creds}@{host}", path, parts.query, ""))


# --- rabbitmqctl (a local broker: `python -m services up`, the tests) -----------------------------
def rabbitmqctl(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    if shutil.which("rabbitmqctl") is None:
        raise RuntimeError("rabbitmqctl not found: apply works on the broker's own machine")
    return subprocess.run(
        ["rabbitmqctl", "-q", *args], input=stdin, capture_output=True, text=True, timeout=120
    )


def apply(defs: dict[str, Any], timeout_s: float = 60.0) -> None:
    """Import ``defs`` into the local broker and wait until they are in force. The document goes
    through stdin: no password or hash on a command line or in a file."""
    done = rabbitmqctl("import_definitions", "--format", "json", stdin=json.dumps(defs))
    if done.returncode != 0:
        raise RuntimeError(f"rabbitmqctl import_definitions failed: {done.stderr.strip()}")
    vhost = defs["vhosts"][0]["name"]
    users = {p["user"] for p in defs["permissions"]}
    queues = {q["name"] for q in defs["queues"]}
    deadline = time.monotonic() + timeout_s
    while True:  # the import runs asynchronously on the node
        granted = _column(rabbitmqctl("list_permissions", "-p", vhost))
        present = _column(rabbitmqctl("list_queues", "-p", vhost, "name"))
        if users <= granted and queues <= present:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"definitions not in force after {timeout_s}s")
        time.sleep(0.2)


def remove(users: list[str]) -> None:
    for user in users:
        rabbitmqctl("delete_user", user)  # absent already is fine


def _column(done: subprocess.CompletedProcess[str]) -> set[str]:
    return {line.split("\t", 1)[0] for line in done.stdout.splitlines()[1:] if line}


# --- CLI ------------------------------------------------------------------------------------------
def _passwords(args: argparse.Namespace, generate: bool) -> dict[str, str]:
    out = {}
    for role in args.roles:
        var = password_env(role, args.password_env)
        value = os.environ.get(var) or (secrets.token_hex(16) if generate else "")
        if not value:
            sys.exit(f"{var} is not set (python -m deploy.permissions env makes them)")
        out[role] = value
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.permissions", description=(
        "Per-party RabbitMQ users with least permissions. show: the regexes; definitions: a "
        "definitions file (Compose loads it at boot); apply: create/update the users on the "
        "local broker and print each one's URL; remove: delete them; env: fresh passwords "
        "for .env."))  # fmt: skip
    parser.add_argument("command", choices=("show", "definitions", "apply", "remove", "env"))
    parser.add_argument("--vhost", default="/")
    parser.add_argument("--roles", nargs="+", default=list(ROLES), choices=list(ROLES))
    parser.add_argument("--user-prefix", default=USER_PREFIX)
    parser.add_argument("--password-env", default=PASSWORD_ENV, help="{ROLE}: the role name")
    parser.add_argument("--admin-user", help="also an administrator (password: BATON_RABBITMQ_"
                        "PASSWORD), for the management UI")  # fmt: skip
    parser.add_argument("--detok-shards", type=int, default=BatonConfig.from_env().detok_shards)
    parser.add_argument("--url", default=os.environ.get("BATON_AMQP_URL") or DEFAULT_AMQP_URL,
                        help="apply: host, port, scheme and query of the URLs printed")  # fmt: skip
    parser.add_argument("--output", help="definitions: write here, not to stdout")
    parser.add_argument("--mode", default="600", help="definitions --output: octal file mode")
    args = parser.parse_args(argv)
    # The queues' arguments follow BATON_QUEUE_TYPE and BATON_MAX_DELIVERY_FAILURES.
    config = BatonConfig.from_env(detok_shards=args.detok_shards)

    if args.command == "show":
        for role, p in ROLES.items():
            print(f"{role}\n  configure {p.configure}\n  write     {p.write}\n  read      {p.read}")
    elif args.command == "env":
        for var in ["BATON_RABBITMQ_PASSWORD", *(password_env(r) for r in ROLES)]:
            print(f"{var}={secrets.token_hex(16)}")
        print(f"BATON_ERLANG_COOKIE={secrets.token_hex(32)}")  # compose.cluster.yaml's nodes
    elif args.command == "remove":
        remove([args.user_prefix + role for role in args.roles])
    elif args.command == "definitions":
        admin = None
        if args.admin_user:
            admin = (args.admin_user, os.environ.get("BATON_RABBITMQ_PASSWORD", ""))
            if not admin[1]:
                sys.exit("BATON_RABBITMQ_PASSWORD is not set (the --admin-user's password)")
        defs = definitions(args.vhost, _passwords(args, False), config, args.user_prefix,
                           admin)  # fmt: skip
        text = json.dumps(defs, indent=2) + "\n"
        if args.output is None:
            sys.stdout.write(text)
        else:  # atomically: a broker starting meanwhile never reads half a file
            tmp = f"{args.output}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, int(args.mode, 8))
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.chmod(tmp, int(args.mode, 8))  # the umask may have taken bits the broker needs
            os.replace(tmp, args.output)
    else:  # apply
        passwords = _passwords(args, True)
        apply(definitions(args.vhost, passwords, config, args.user_prefix))
        for role, pw in passwords.items():
            url = url_for(args.url, args.user_prefix + role, pw, args.vhost)
            print(f"export BATON_{role.upper()}_AMQP_URL={shlex.quote(url)}")
        print(f"export BATON_TRUSTED_PUBLISHERS={trusted_publishers(args.user_prefix)}")
        print(f"export BATON_OPERATORS={operators(args.user_prefix)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
