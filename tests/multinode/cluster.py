"""A three-node RabbitMQ cluster on this machine, for the broker-failover test.

Each node is a ``rabbitmq-server -detached`` of its own: node name ``baton-c<i>-<pid>@localhost``,
free AMQP and distribution ports, its own data, log and pid files, no plugins (no clash on
15672), and one Erlang cookie shared by the three (and by the ``rabbitmqctl`` calls) through a
private HOME. Nodes 2 and 3 join node 1 (classic peer discovery by ``join_cluster``, as the
compose profile's nodes do by config), and a policy mirrors every ``baton.*`` queue on all nodes
with automatic sync: the deploy's choice on RabbitMQ 3.x, where quorum queues do not carry
message priorities (docs/deploy.md "Broker cluster"). The main node on 5672 is left alone.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from deploy.permissions import MIRROR_POLICY

START_TIMEOUT_S = 60.0
# Debian's /usr/sbin wrappers re-run everything as the rabbitmq user with its HOME (and cookie);
# the scripts behind them run as whoever calls them, with the environment given here.
SBIN = Path("/usr/lib/rabbitmq/bin")
HA_POLICY = json.dumps(MIRROR_POLICY["definition"])  # what the definitions give compose's nodes


def tool(name: str) -> str | None:
    return str(SBIN / name) if (SBIN / name).exists() else shutil.which(name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class ClusterNode:
    name: str
    port: int
    env: dict[str, str]
    pid_file: Path

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def start(self) -> None:
        server = tool("rabbitmq-server")
        assert server is not None
        subprocess.run([server, "-detached"], env=self.env, capture_output=True, timeout=60)

    def ctl(self, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        ctl = tool("rabbitmqctl")
        assert ctl is not None
        return subprocess.run(
            [ctl, "-q", "-n", self.name, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def wait_listening(self, timeout_s: float = START_TIMEOUT_S) -> bool:
        deadline = time.monotonic() + timeout_s
        while not listening(self.port):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)
        return True

    def kill(self) -> None:
        """SIGKILL the node's VM: no goodbye to its peers or its clients."""
        os.kill(int(self.pid_file.read_text().split()[0]), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while listening(self.port) and time.monotonic() < deadline:
            time.sleep(0.2)

    def running_nodes(self) -> int:
        done = self.ctl("eval", "length(rabbit_nodes:all_running()).")
        return int(done.stdout.strip()) if done.returncode == 0 else 0


def cluster_unavailable() -> str | None:
    if tool("rabbitmq-server") is None or tool("rabbitmqctl") is None:
        return "needs rabbitmq-server and rabbitmqctl on this machine"
    return None


@contextmanager
def rabbitmq_cluster(size: int = 3) -> Iterator[list[ClusterNode]]:
    """``size`` joined nodes; every one stopped and its files removed on exit. Raises
    RuntimeError (with the nodes' logs' tail) when a node cannot start or join."""
    d = Path(tempfile.mkdtemp(prefix="baton-cluster-"))
    os.chmod(d, 0o755)  # the node may run as another user than the test (a root CI)
    home = d / "home"
    home.mkdir()
    (home / ".erlang.cookie").write_text(os.urandom(16).hex())
    os.chmod(home / ".erlang.cookie", 0o400)
    (d / "enabled_plugins").write_text("[].\n")
    (d / "env.conf").write_text("")  # not the system's rabbitmq-env.conf (its NODENAME)
    nodes = []
    for i in range(1, size + 1):
        nd = d / f"n{i}"
        nd.mkdir()
        port = free_port()
        (nd / "rabbitmq.conf").write_text(f"listeners.tcp.1 = 127.0.0.1:{port}\n")
        name = f"baton-c{i}-{os.getpid()}@localhost"
        env = {
            **os.environ, "HOME": str(home), "RABBITMQ_NODENAME": name,
            "RABBITMQ_NODE_PORT": str(port), "RABBITMQ_DIST_PORT": str(free_port()),
            "RABBITMQ_CONFIG_FILE": str(nd / "rabbitmq.conf"),
            "RABBITMQ_MNESIA_BASE": str(nd / "db"), "RABBITMQ_LOG_BASE": str(nd / "log"),
            "RABBITMQ_PID_FILE": str(nd / "pid"), "RABBITMQ_CONF_ENV_FILE": str(d / "env.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
        }  # fmt: skip
        nodes.append(ClusterNode(name, port, env, nd / "pid"))
    try:
        for node in nodes:
            node.start()
        for node in nodes:
            if not node.wait_listening():
                raise RuntimeError(f"{node.name} did not start: {_log_tail(d)}")
        first = nodes[0]
        for node in nodes[1:]:
            for step in (("stop_app",), ("join_cluster", first.name), ("start_app",)):
                done = node.ctl(*step)
                if done.returncode != 0:
                    raise RuntimeError(f"{node.name} {step[0]}: {done.stderr} {done.stdout}")
        policy = MIRROR_POLICY["name"], MIRROR_POLICY["pattern"], HA_POLICY
        done = first.ctl("set_policy", "--apply-to", "queues", *policy)
        if done.returncode != 0:
            raise RuntimeError(f"set_policy: {done.stderr}")
        if first.running_nodes() != size:
            raise RuntimeError(f"the cluster has {first.running_nodes()} of {size} nodes")
        yield nodes
    finally:
        for node in nodes:
            node.ctl("stop", timeout_s=60)
        shutil.rmtree(d, ignore_errors=True)


@contextmanager
def cluster_or_skip(size: int) -> Iterator[list[ClusterNode]]:
    """:func:`rabbitmq_cluster` for a test fixture: the test is skipped, with the reason, where
    ``size`` nodes cannot start on this machine."""
    import pytest

    why = cluster_unavailable()
    if why:
        pytest.skip(why)
    try:
        context = rabbitmq_cluster(size)
        nodes = context.__enter__()
    except RuntimeError as exc:
        pytest.skip(f"{size} RabbitMQ node(s) cannot start here: {exc}")
    try:
        yield nodes
    finally:
        context.__exit__(None, None, None)


def _log_tail(d: Path, chars: int = 2000) -> str:
    logs = sorted(d.rglob("*.log"))
    return " | ".join(p.read_text(errors="replace")[-chars:] for p in logs[-3:])
