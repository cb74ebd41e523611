"""The local multi-node rig: two "nodes" on one machine, as Linux network namespaces joined by a
veth pair, and a client for the engine node processes (``tests/multinode/node.py``) run in them.

The namespaces share nothing but the veth link: each has its own loopback and its own address on
a private /30 (``10.213.X.Y``, random per run), no default route, and reaches the other only over
the link. The filesystem is shared (this is one machine), so each node gets its own spill folder
and the test checks that no KV went through a file. The broker is not reachable from inside the
namespaces (RabbitMQ listens on the root namespace's loopback), so the test drives both engines
itself over their stdin/stdout, as the shells would over the broker — plumbing only.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from shared.config import REPO_ROOT


@dataclass(frozen=True)
class Netns:
    name: str
    addr: str  # this node's address on the link


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def netns_unavailable() -> str | None:
    """Why the rig cannot start here (no ``ip``, not root, no netns support), or None."""
    probe = f"btprobe{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
    except (OSError, subprocess.SubprocessError) as exc:
        err = getattr(exc, "stderr", "") or exc
        return f"`ip netns add` fails here ({str(err).strip()}): the multi-node rig needs root"
    _ip("netns", "del", probe)
    return None


@contextmanager
def netns_pair() -> Iterator[tuple[Netns, Netns]]:
    """Two fresh namespaces joined by a veth pair; deleted on exit, whatever happened."""
    tag = secrets.token_hex(3)
    names = (f"baton-{tag}-a", f"baton-{tag}-b")
    links = (f"bt{tag}a", f"bt{tag}b")  # interface names: 15 characters at most
    subnet = secrets.randbelow(256), secrets.randbelow(64) * 4
    addrs = tuple(f"10.213.{subnet[0]}.{subnet[1] + i}" for i in (1, 2))
    made: list[str] = []
    try:
        for ns in names:
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for ns, link, addr in zip(names, links, addrs, strict=True):
            _ip("link", "set", link, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", link)
            _ip("-n", ns, "link", "set", link, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield Netns(names[0], addrs[0]), Netns(names[1], addrs[1])
    finally:
        for ns in made:  # deleting a namespace deletes its end of the veth, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", links[0]], capture_output=True, timeout=30)


class Node:
    """An engine node process in a namespace: one JSON request per line in, one reply out."""

    def __init__(self, ns: Netns | None, args: list[str], log: Path) -> None:
        prefix = ["ip", "netns", "exec", ns.name] if ns is not None else []
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "MC_LOG_LEVEL": "WARNING"}
        self.log = log
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "tests.multinode.node", *args],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self.hello = self._read()

    def call(self, op: str, **kw: Any) -> Any:
        stdin: IO[str] | None = self.proc.stdin
        assert stdin is not None
        stdin.write(json.dumps({"op": op, **kw}) + "\n")
        stdin.flush()
        return self._read()

    def _read(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            tail = self.log.read_text()[-4000:]
            raise RuntimeError(f"node exited ({self.proc.returncode}):\n{tail}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"node failed: {reply['error']}")
        return reply["ok"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("quit")
                self.proc.wait(timeout=30)
            except (OSError, RuntimeError, subprocess.TimeoutExpired, ValueError):
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._log.close()
