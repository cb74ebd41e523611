"""Start a whole local Baton (``python -m services up``) in its own RabbitMQ vhost.

Used by the integration and fault tests and the benchmark (``loadtest/serving/bench.py``): each run
gets
a fresh vhost, so runs never see each other's queues, and the vhost (with everything in it) is
deleted afterwards. Without ``rabbitmqctl`` (e.g. a remote broker) the given URL is used as is.
The services started are the registry's (``services/shell/registry.py``).
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from services.shell.registry import PIPELINE, port_offset, spec
from shared.config import DEFAULT_AMQP_URL, REPO_ROOT, BatonConfig

FIRST_BLOCK_PORT = 20_000


def free_port_block(n: int) -> int:
    """A base port with ``n`` consecutive free ports (``up`` gives each service with a metrics
    endpoint one, at base + its registry offset).

    Taken below the kernel's ephemeral range: a port from that range can be handed, before the
    service gets to bind it, to any outgoing connection as its local port — a CI run lost a test
    to exactly that (prefill's metrics port became some connection's, prefill exited at start).
    Ports below the range are only ever taken by an explicit bind. (An unusual range with no
    room below it: bases the kernel picks, as before.)"""
    low = ephemeral_range_start()
    below = low - n > FIRST_BLOCK_PORT
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(FIRST_BLOCK_PORT, low - n) if below else _kernel_port()
        if base + n < 65535 and all(_is_free(base + i) for i in range(n)):
            return base
    raise RuntimeError("no block of free ports")


def ephemeral_range_start() -> int:
    """The first port of Linux's ephemeral range (32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _kernel_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _is_free(port: int) -> bool:
    """Free on every address, as the services bind their metrics servers."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def rabbitmqctl(*args: str) -> bool:
    if shutil.which("rabbitmqctl") is None:
        return False
    done = subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True, timeout=120)
    return done.returncode == 0


@contextmanager
def fresh_vhost(base_url: str = DEFAULT_AMQP_URL, prefix: str = "baton-test") -> Iterator[str]:
    """Yield an AMQP URL of a new vhost (deleted on exit), or ``base_url`` if one can't be made.

    A vhost already in ``base_url`` is replaced (the new one sits beside it on the same broker)."""
    vhost = f"{prefix}-{uuid.uuid4().hex[:8]}"
    scheme, rest = base_url.split("://", 1)
    server = rest.split("/", 1)[0]  # user:password@host:port
    user = server.split(":", 1)[0]
    made = rabbitmqctl("add_vhost", vhost) and rabbitmqctl(
        "set_permissions", "-p", vhost, user, ".*", ".*", ".*"
    )
    try:
        yield f"{scheme}://{server}/{vhost}" if made else base_url
    finally:
        if made:
            rabbitmqctl("delete_vhost", vhost)


class LocalSystem:
    """Every service as one ``python -m services up`` child process (its own session, so a stop
    that has to kill takes the services with it)."""

    def __init__(
        self, amqp_url: str, env: dict[str, str] | None = None, log_path: Path | None = None
    ):
        self.amqp_url = amqp_url
        self.spill_dir = tempfile.mkdtemp(
            prefix="baton-spill-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None
        )
        self.env = {
            **os.environ,
            "BATON_AMQP_URL": amqp_url,
            "BATON_SPILL_DIR": self.spill_dir,
            "BATON_LOG_FORMAT": "json",
            "BATON_GATEWAY_PORT": "0",  # any free port: never a clash with a real gateway
            **(env or {}),
        }
        self.log_path = log_path or Path(tempfile.mkstemp(prefix="baton-system-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None
        self.killed = False  # stop() had to SIGKILL

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 - owned by the child for its lifetime
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services", "up"],
            cwd=REPO_ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    async def wait_ready(self, timeout_s: float = 180.0) -> None:
        """Until a real request is answered end to end (every service is up)."""
        procs = {"services up": self.proc} if self.proc is not None else {}
        await wait_served(self.amqp_url, timeout_s, procs, self.tail)

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM (the services stop cleanly), SIGKILL to the whole group after ``timeout_s``."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.killed = True
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.spill_dir, ignore_errors=True)
        return self.proc.returncode

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


async def wait_served(
    amqp_url: str,
    timeout_s: float,
    procs: Mapping[str, subprocess.Popen[bytes]] | None = None,
    tail: Callable[[], str] = lambda: "",
) -> None:
    """Until a real request is answered end to end (every pipeline service is up). Any of
    ``procs`` (name -> process) exiting meanwhile fails at once, not at the timeout."""
    from shared.client import BatonClient, BatonUnavailable

    deadline = time.monotonic() + timeout_s
    while True:
        for name, proc in (procs or {}).items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail()}")
        try:
            async with await BatonClient.connect(amqp_url) as client:
                reply = await client.generate("ready?", max_tokens=2, wait_s=10)
                if reply.type == "done":
                    return
        except (BatonUnavailable, asyncio.TimeoutError, ConnectionError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"baton not ready after {timeout_s}s:\n{tail()}")
        await asyncio.sleep(1.0)


class ServiceProcesses:
    """Each service as its own process, so a test can kill, restart or drain one of them."""

    def __init__(self, amqp_url: str, env: dict[str, str] | None = None):
        self._system = LocalSystem(amqp_url, env)  # shares its env, spill dir and log file
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def amqp_url(self) -> str:
        return self._system.amqp_url

    @property
    def spill_dir(self) -> str:
        return self._system.spill_dir

    def config(self) -> BatonConfig:
        """The configuration the child services run with (to run one in this process)."""
        return BatonConfig.from_env(self._system.env)

    def metrics_port(self, name: str) -> int:
        """Where ``name`` serves /metrics, /health, /ready (0: none), as ``services up`` does."""
        base = self.config().metrics_port
        return base + port_offset(name) if base and spec(name).metrics_endpoint else 0

    def start(
        self, name: str, *, instance: str | None = None, env: dict[str, str] | None = None
    ) -> None:
        """Start service ``name`` as process ``instance`` (default: the service's name; give a
        second instance its own, e.g. ``detokenizer-2``, to run replicas). ``env`` overrides the
        system's environment for this process alone (a per-service broker user, say). A replica
        serves no metrics endpoint of its own: the ports are one per service."""
        log = open(self._system.log_path, "ab")  # noqa: SIM115 - owned by the child
        key = instance or name
        port = self.metrics_port(name) if key == name else 0
        child_env = {**self._system.env, "BATON_METRICS_PORT": str(port), **(env or {})}
        self.procs[key] = subprocess.Popen(
            [sys.executable, "-m", "services", name],
            cwd=REPO_ROOT,
            env=child_env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def start_all(self, names: Iterable[str] = PIPELINE) -> None:
        for name in names:
            self.start(name)

    def kill(self, name: str) -> None:
        """SIGKILL process ``name`` (a service or an instance name): no cleanup, no acks — what a
        crash looks like to the broker."""
        proc = self.procs.pop(name)
        proc.kill()
        proc.wait()

    async def wait_ready(self, timeout_s: float = 180.0) -> None:
        await wait_served(self.amqp_url, timeout_s, dict(self.procs), self.tail)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(self._system.spill_dir, ignore_errors=True)

    def tail(self, lines: int = 40) -> str:
        return self._system.tail(lines)
