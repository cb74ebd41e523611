"""The work queues' declaration arguments per BATON_QUEUE_TYPE (shared/wire/queues.py), and the
topology every party declares or loads with them (broker definitions, permissions)."""

from __future__ import annotations

import re

import pytest

from deploy import permissions as perms
from services.shell.registry import PIPELINE
from shared.config import BatonConfig
from shared.wire.queues import (
    DEAD_LETTER_EXCHANGE,
    DEAD_LETTER_QUEUE,
    DEAD_QUEUE_ARGS,
    DETOK_QUEUE_ARGS,
    POISON_QUEUE,
    WORK_QUEUES,
    dead_letter_queues,
    detok_queues,
    queue_arguments,
    work_queue_args,
)

CLASSIC = BatonConfig()
QUORUM = BatonConfig(queue_type="quorum", max_delivery_failures=4)


def test_classic_work_queues_are_priority_queues() -> None:
    for name in WORK_QUEUES:
        assert queue_arguments(name, CLASSIC) == {
            "x-max-priority": 10,  # the contract's ten levels
            "x-dead-letter-exchange": DEAD_LETTER_EXCHANGE,
        }
    assert dead_letter_queues(CLASSIC) == (DEAD_LETTER_QUEUE,)


def test_quorum_work_queues_have_a_delivery_limit_and_no_priorities() -> None:
    for name in WORK_QUEUES:
        assert queue_arguments(name, QUORUM) == {
            "x-queue-type": "quorum",
            # Dead-lettered at the 4th return: 3 returns may still be delivered again.
            "x-delivery-limit": 3,
            "x-dead-letter-exchange": DEAD_LETTER_EXCHANGE,
            "x-dead-letter-strategy": "at-least-once",
            "x-overflow": "reject-publish",  # what at-least-once dead-lettering requires
        }
    assert (
        queue_arguments(WORK_QUEUES[0], QUORUM.replace(max_delivery_failures=1))["x-delivery-limit"]
        == 0
    )
    # The detokenizer's shards stay classic priority queues (their marks ride on a priority),
    # and baton.dead stays as it is; baton.poison joins it behind baton.dlx.
    for config in (CLASSIC, QUORUM):
        assert queue_arguments(detok_queues(2)[0], config) == DETOK_QUEUE_ARGS
        assert queue_arguments(DEAD_LETTER_QUEUE, config) == DEAD_QUEUE_ARGS
    assert dead_letter_queues(QUORUM) == (DEAD_LETTER_QUEUE, POISON_QUEUE)
    assert queue_arguments(POISON_QUEUE, QUORUM)["x-queue-type"] == "quorum"


def test_a_queue_type_it_does_not_know_is_refused() -> None:
    with pytest.raises(ValueError, match="BATON_QUEUE_TYPE"):
        work_queue_args(BatonConfig(queue_type="stream"))
    with pytest.raises(ValueError, match="BATON_MAX_DELIVERY_FAILURES"):
        work_queue_args(QUORUM.replace(max_delivery_failures=0))
    assert BatonConfig.from_env({"BATON_QUEUE_TYPE": "quorum"}).queue_type == "quorum"


def test_definitions_declare_what_the_services_declare() -> None:
    """The broker's definitions file (Compose) holds the same queues, arguments and bindings
    the shells declare, and every service may declare and bind all of it; only the tokenizer
    reads baton.poison."""
    topo = perms.topology("/", QUORUM)
    queues = {q["name"]: q["arguments"] for q in topo["queues"]}
    for name in (*WORK_QUEUES, POISON_QUEUE, DEAD_LETTER_QUEUE):
        assert queues[name] == queue_arguments(name, QUORUM), name
    bound = {(b["source"], b["destination"]) for b in topo["bindings"]}
    assert bound == {
        (DEAD_LETTER_EXCHANGE, DEAD_LETTER_QUEUE),
        (DEAD_LETTER_EXCHANGE, POISON_QUEUE),
    }
    for role in PIPELINE:
        p = perms.ROLES[role]
        assert all(re.search(p.configure, name) for name in queues), role
        assert re.search(p.write, POISON_QUEUE), role  # the queue side of the bind
        assert bool(re.search(p.read, POISON_QUEUE)) is (role == "tokenizer"), role
    assert POISON_QUEUE not in {q["name"] for q in perms.topology("/", CLASSIC)["queues"]}
