"""The Docker side of ``make compose-check``: the engine, the images, one Compose project.

Nothing here knows Baton's protocol; :mod:`deploy.compose_check` drives the stack it brings up.
Compose is whichever of ``docker compose`` (v2) and ``docker-compose`` (v1) is installed: the
same files and the same commands work with both.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The images Compose uses by default (the Dockerfile's and compose.yaml's), by the variable that
# replaces each.
OFFICIAL = {
    "BATON_BASE_IMAGE": "python:3.11-slim",
    "BATON_RABBITMQ_IMAGE": "rabbitmq:3.13-management",
}
DOCKERD_LOG = Path(tempfile.gettempdir()) / "baton-dockerd.log"


def log(msg: str) -> None:
    print(f"[compose-check] {msg}", file=sys.stderr, flush=True)


def sh(argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 600,
       check: bool = True, quiet: bool = False) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """Run a command from the repository root; its output is returned (and shown unless quiet)."""
    done = subprocess.run(
        list(argv), cwd=REPO, env=dict(env or os.environ), capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    if not quiet and (done.stdout.strip() or done.stderr.strip()):
        sys.stderr.write(done.stdout + done.stderr)
    if check and done.returncode != 0:
        tail = (done.stdout + done.stderr)[-4000:]
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}:\n{tail}")
    return done


def engine_answers() -> bool:
    return sh(["docker", "info"], check=False, quiet=True, timeout=30).returncode == 0


def ensure_dockerd(wait_s: float = 60.0) -> None:
    """The Docker engine, started (in the background, left running) if installed and down."""
    if shutil.which("docker") is None:
        raise RuntimeError("no docker CLI: apt-get install docker.io docker-compose")
    if engine_answers():
        return
    if shutil.which("dockerd") is None:
        raise RuntimeError("the Docker engine does not answer and dockerd is not installed")
    log(f"starting dockerd (log: {DOCKERD_LOG})")
    with DOCKERD_LOG.open("ab") as out:
        daemon = subprocess.Popen(["dockerd"], stdout=out, stderr=out, start_new_session=True)
    deadline = time.monotonic() + wait_s
    while not engine_answers():
        if daemon.poll() is not None:  # not root, no cgroups, ...: no use waiting
            tail = DOCKERD_LOG.read_text(errors="replace").strip().splitlines()[-1:]
            raise RuntimeError(f"dockerd exited {daemon.returncode}: {' '.join(tail)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"dockerd did not answer within {wait_s:.0f}s; see {DOCKERD_LOG}")
        time.sleep(1)


def compose_command() -> list[str]:
    """``docker compose`` where the v2 plugin works, else Debian's ``docker-compose`` (v1)."""
    if sh(["docker", "compose", "version"], check=False, quiet=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise RuntimeError("no Compose: apt-get install docker-compose (or the compose plugin)")


def _have_image(image: str) -> bool:
    return sh(["docker", "image", "inspect", image], check=False, quiet=True).returncode == 0


def _reachable(image: str) -> bool:
    """Present, or pulled now (an unreachable registry fails fast: no DNS, or refused)."""
    if _have_image(image):
        return True
    log(f"pulling {image}")
    return sh(["docker", "pull", image], check=False, quiet=True, timeout=600).returncode == 0


def build_inputs(
    wheels: Sequence[Path], ca_bundle: Path | None, model: Path | None = None
) -> dict[str, str]:
    """Base images (the official ones where the registry answers, else deploy/base-images.sh's),
    a local torch wheel, the CA bundle and the default model's file for the build: the variables
    Compose needs for them."""
    env = {k: os.environ[k] for k in (*OFFICIAL, "BATON_TORCH_WHEEL") if os.environ.get(k)}
    need_local = not all(_reachable(env.get(k, image)) for k, image in OFFICIAL.items())
    argv = ["bash", "deploy/base-images.sh"]
    for directory in wheels:
        if "BATON_TORCH_WHEEL" not in env and any(directory.glob("torch-*-cp311-*.whl")):
            argv += ["--wheels", str(directory)]
            break
    if ca_bundle is not None:
        argv += ["--ca-bundle", str(ca_bundle)]
    if model is not None:
        argv += ["--model", str(model)]
    if not need_local:
        argv.append("--no-images")
    else:
        log("Docker Hub not reachable: local base images from Debian's packages")
    for line in sh(argv).stdout.splitlines():
        key, _, value = line.partition("=")
        if key in (*OFFICIAL, "BATON_TORCH_WHEEL"):
            env.setdefault(key, value)
    return env


def pip_wheel_dirs() -> list[Path]:
    """The local wheel directories pip is configured with (find-links): where a fresh virtualenv
    gets its torch on a machine that keeps one on disk."""
    found = os.environ.get("PIP_FIND_LINKS", "").split()
    listed = sh([sys.executable, "-m", "pip", "config", "list"], check=False, quiet=True).stdout
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            found += value.strip("'\"").split()
    return [Path(d) for d in dict.fromkeys(found) if Path(d).is_dir()]


@dataclass
class Stack:
    """One Compose project (its own name: a stack of the user's is never touched)."""

    compose: list[str]
    project: str
    files: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def run(self, *args: str, timeout: float = 600, check: bool = True,
            quiet: bool = True) -> subprocess.CompletedProcess[str]:  # fmt: skip
        argv = [*self.compose, "-p", self.project, *(a for f in self.files for a in ("-f", f))]
        return sh([*argv, *args], env={**os.environ, **self.env}, timeout=timeout, check=check,
                  quiet=quiet)  # fmt: skip

    def containers(self, service: str | None = None, *, all_: bool = False) -> list[str]:
        labels = [f"label=com.docker.compose.project={self.project}"]
        if service:
            labels.append(f"label=com.docker.compose.service={service}")
        argv = ["docker", "ps", "-q", *(["-a"] if all_ else [])]
        argv += [a for label in labels for a in ("--filter", label)]
        return sh(argv, quiet=True).stdout.split()

    def inspect(self, container: str) -> dict:
        return json.loads(sh(["docker", "inspect", container], quiet=True).stdout)[0]

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        """Until every container of the project is healthy (or, one-shot, exited 0)."""
        deadline = time.monotonic() + timeout_s
        while True:
            waiting = []
            for cid in self.containers(all_=True):
                info = self.inspect(cid)
                name, state = info["Name"].lstrip("/"), info["State"]
                health = (state.get("Health") or {}).get("Status")
                if state["Status"] == "exited" and state["ExitCode"] == 0 and health is None:
                    continue  # broker-init
                if state["Status"] == "exited" or health == "unhealthy":
                    raise RuntimeError(f"{name} is {health or state['Status']}:\n{self.logs(name)}")
                if health != "healthy":
                    waiting.append(f"{name}: {health or state['Status']}")
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"not healthy after {timeout_s:.0f}s: {', '.join(waiting)}")
            time.sleep(2)

    def logs(self, container: str, lines: int = 40) -> str:
        done = sh(["docker", "logs", "--tail", str(lines), container], check=False, quiet=True)
        return done.stdout + done.stderr

    def leftovers(self) -> list[str]:
        """Containers, volumes and networks of the project still there."""
        label = f"label=com.docker.compose.project={self.project}"
        found = [f"container {c}" for c in self.containers(all_=True)]
        for kind in ("volume", "network"):
            names = sh(["docker", kind, "ls", "-q", "--filter", label], quiet=True).stdout.split()
            found += [f"{kind} {n}" for n in names]
        return found
