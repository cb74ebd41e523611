"""A broker node SIGKILLed under load (issue: multi-node): a three-node RabbitMQ cluster on this
machine (tests/multinode/cluster.py), every service and the client given all three addresses
(``BATON_AMQP_URL=amqp://...:p1/,amqp://...:p2/,amqp://...:p3/``), all of them connected to the
first. 32 streams of 300 tokens (half greedy, half seeded sampling) are under way when that node
is killed: every request gets exactly one terminal reply, a ``done`` whose tokens equal an
undisturbed run's on the same cluster, and every token reply agrees with it
(``ReplyLog.check_stream``). Then the node comes back and rejoins, and the system still serves.

Skipped with the reason where three RabbitMQ nodes cannot start on this machine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from services.launcher import ServiceProcesses
from tests.fault.harness import ALL_SERVICES, FAULT_ENV, ReplyLog, batch, check
from tests.multinode.cluster import ClusterNode, cluster_or_skip, listening

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster() -> Iterator[list[ClusterNode]]:
    with cluster_or_skip(3) as nodes:
        yield nodes


async def test_a_broker_node_killed_mid_stream_loses_nothing(cluster: list[ClusterNode]) -> None:
    url = ",".join(node.url for node in cluster)
    procs = ServiceProcesses(url, env=FAULT_ENV)
    for name in ALL_SERVICES:
        procs.start(name)
    try:
        await procs.wait_ready()
        async with ReplyLog(url) as log:
            reference = await log.reference_tokens(batch("reference"), 240)

            ids = await log.send(batch("node-killed"))
            await log.wait_streaming(ids, min_tokens=20, timeout_s=120)
            assert any(not log.terminals(rid) for rid in ids), "all finished before the fault"
            await asyncio.to_thread(cluster[0].kill)
            assert not listening(cluster[0].port)
            await log.wait(ids, 300)
            check(log, ids, reference)
            # Everyone moved to the nodes that remain: each service and this log reconnected.
            # (A connection's pid names its node: <rabbit@host.N.N.N>.)
            pids = cluster[1].ctl("list_connections", "--no-table-headers", "pid").stdout.split()
            assert len(pids) >= len(ALL_SERVICES) + 1, pids
            assert not any(cluster[0].name in pid for pid in pids), pids

            cluster[0].start()  # it was a member: it rejoins on its own
            assert await asyncio.to_thread(cluster[0].wait_listening)
            deadline = time.monotonic() + 60
            while cluster[1].running_nodes() != 3:
                assert time.monotonic() < deadline, "the killed node did not rejoin"
                await asyncio.sleep(1)
            after = await log.send(batch("after-rejoin")[:8])
            await log.wait(after, 120)
            check(log, after, reference[:8])
    finally:
        procs.stop()
