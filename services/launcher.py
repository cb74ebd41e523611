"""Start a whole local Baton (``python -m services up``) in its own RabbitMQ vhost.

Used by the integration tests and the benchmark: each run gets a fresh vhost, so runs never see
each other's queues, and the vhost (with everything in it) is deleted afterwards. Without
``rabbitmqctl`` (e.g. a remote broker) the given URL is used as is.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shared.config import DEFAULT_AMQP_URL, REPO_ROOT, BatonConfig


def rabbitmqctl(*args: str) -> bool:
    if shutil.which("rabbitmqctl") is None:
        return False
    done = subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True, timeout=120)
    return done.returncode == 0


@contextmanager
def fresh_vhost(base_url: str = DEFAULT_AMQP_URL, prefix: str = "baton-test") -> Iterator[str]:
    """Yield an AMQP URL of a new vhost (deleted on exit), or ``base_url`` if one can't be made."""
    vhost = f"{prefix}-{uuid.uuid4().hex[:8]}"
    user = base_url.split("://", 1)[1].split(":", 1)[0]
    made = rabbitmqctl("add_vhost", vhost) and rabbitmqctl(
        "set_permissions", "-p", vhost, user, ".*", ".*", ".*"
    )
    try:
        yield base_url.rstrip("/") + "/" + vhost if made else base_url
    finally:
        if made:
            rabbitmqctl("delete_vhost", vhost)


class LocalSystem:
    """The four services as one ``python -m services up`` child process."""

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
            **(env or {}),
        }
        self.log_path = log_path or Path(tempfile.mkstemp(prefix="baton-system-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services", "up"],
            cwd=REPO_ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    async def wait_ready(self, timeout_s: float = 180.0) -> None:
        """Until a real request is answered end to end (every service is up)."""
        from shared.client import BatonClient, BatonUnavailable

        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"baton exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                async with await BatonClient.connect(self.amqp_url) as client:
                    reply = await client.generate("ready?", max_tokens=2, wait_s=10)
                    if reply.type == "done":
                        return
            except (BatonUnavailable, asyncio.TimeoutError, ConnectionError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"baton not ready after {timeout_s}s:\n{self.tail()}")
            await asyncio.sleep(1.0)

    def stop(self, timeout_s: float = 20.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.spill_dir, ignore_errors=True)
        return self.proc.returncode

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


class ServiceProcesses:
    """The four services as separate processes, so a test can kill and restart one of them."""

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

    def start(self, name: str) -> None:
        log = open(self._system.log_path, "ab")  # noqa: SIM115 - owned by the child
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "services", name],
            cwd=REPO_ROOT,
            env=self._system.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def start_all(self) -> None:
        for name in ("tokenizer", "prefill", "decode", "detokenizer"):
            self.start(name)

    def kill(self, name: str) -> None:
        """SIGKILL: no cleanup, no acks — what a crash looks like to the broker."""
        proc = self.procs.pop(name)
        proc.kill()
        proc.wait()

    async def wait_ready(self, timeout_s: float = 180.0) -> None:
        await self._system.wait_ready(timeout_s)

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
