"""The local launcher's helpers (services/launcher.py): port blocks and readiness."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from services.launcher import ephemeral_range_start, free_port_block, wait_served


def test_a_port_block_is_free_and_below_the_ephemeral_range() -> None:
    """Below it, no outgoing connection can be handed one of the ports before a service binds
    it (what took prefill's metrics port in a CI run)."""
    n = 6
    base = free_port_block(n)
    assert base + n <= ephemeral_range_start()
    for port in range(base, base + n):
        with socket.socket() as s:
            s.bind(("", port))


async def test_waiting_for_readiness_fails_at_once_when_a_service_exits() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    dead.wait()
    with pytest.raises(RuntimeError, match="prefill exited with 3"):
        # An unreachable broker: only the exited process can end the wait within the test.
        await wait_served("amqp://guest:guest@127.0.0.1:1/", 600.0, {"prefill": dead})
