"""The deployment files, resolved by Compose itself (`docker-compose config`), not re-parsed.

Runs every Compose found: Debian's `docker-compose` (v1, what CI installs with apt) and the
`docker compose` plugin (v2) where it works. No Docker engine is needed: `config` only merges,
interpolates and validates.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.permissions import ROLES, password_env
from services.shell.registry import SERVICES

tomllib = pytest.importorskip("tomllib", reason="stdlib from Python 3.11")

REPO = Path(__file__).resolve().parent.parent
# The registry is the one service list: every registered service is a Compose service of the
# same name; the pipeline ones are plain workers (metrics port, no host port, scalable).
REGISTERED = tuple(spec.name for spec in SERVICES)
WORKERS = tuple(spec.name for spec in SERVICES if spec.pipeline)
GPU_WORKERS = ("prefill", "decode")
SECRET = "test-only-3f9a1c"
# One broker user per party of deploy/permissions.py, each with its own password.
PASSWORDS = {"BATON_RABBITMQ_PASSWORD": SECRET} | {
    password_env(role): f"test-only-{role}" for role in ROLES
}
SPILL_DIR = "/dev/shm/baton"  # the shared tmpfs volume; the services keep their files below it

# (id, -f files); None = no -f, so Compose also merges compose.override.yaml by itself.
VARIANTS = {
    "gpu-default": None,
    "gpu-explicit": ["compose.yaml", "compose.override.yaml"],
    "cpu": ["compose.yaml", "compose.cpu.yaml"],
}


def _runners() -> list[Any]:
    found = []
    if shutil.which("docker-compose"):
        found.append(pytest.param(["docker-compose"], id="docker-compose"))
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            found.append(pytest.param(["docker", "compose"], id="docker-compose-v2"))
    if not found:
        reason = "no Compose binary: apt-get install -y docker-compose (CI does)"
        found.append(pytest.param([], id="no-compose", marks=pytest.mark.skip(reason=reason)))
    return found


RUNNERS = _runners()


@functools.cache
def _empty_env() -> Path:
    """An empty env file (Compose refuses /dev/null: "not a file")."""
    path = Path(tempfile.gettempdir()) / f"baton-test-empty-{os.getuid()}.env"
    path.write_text("")
    return path


def _compose(runner: list[str], files: list[str] | None, **env: str) -> subprocess.CompletedProcess:
    # Only what we pass: a developer's BATON_* / COMPOSE_FILE, or the .env that docs/deploy.md
    # has them write beside compose.yaml, must not change the result.
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("BATON_", "COMPOSE_"))}
    clean.update(env)
    argv = [*runner, "--env-file", str(_empty_env()), *(a for f in files or [] for a in ("-f", f))]
    argv.append("config")
    return subprocess.run(argv, cwd=REPO, env=clean, capture_output=True, text=True, timeout=60)


def _resolved(runner: list[str], variant: str, **env: str) -> dict[str, Any]:
    for var, value in PASSWORDS.items():
        env.setdefault(var, value)
    stdout = _resolved_text(tuple(runner), variant, tuple(sorted(env.items())))
    return yaml.safe_load(stdout)  # a fresh dict per call: tests may not share mutations


@functools.cache
def _resolved_text(runner: tuple[str, ...], variant: str, env: tuple[tuple[str, str], ...]) -> str:
    result = _compose(list(runner), VARIANTS[variant], **dict(env))
    assert result.returncode == 0, result.stderr
    return result.stdout


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def _gpu_devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    reservations = ((service.get("deploy") or {}).get("resources") or {}).get("reservations") or {}
    return [d for d in reservations.get("devices") or [] if "gpu" in d.get("capabilities", [])]


def _volume_mounts(service: dict[str, Any]) -> dict[str, str]:
    """target -> named-volume source (bind mounts left out), short or long syntax."""
    mounts = {}
    for v in service.get("volumes") or []:
        if isinstance(v, str):
            source, target = v.split(":")[:2]
            if not source.startswith(("/", ".")):
                mounts[target] = source
        elif v.get("type") == "volume":
            mounts[v["target"]] = v["source"]
    return mounts


@pytest.fixture(params=RUNNERS)
def runner(request) -> list[str]:
    return request.param


@pytest.mark.parametrize("variant", VARIANTS)
def test_stack_shape(runner: list[str], variant: str) -> None:
    config = _resolved(runner, variant)
    services = config["services"]
    # A second detokenizer replica (docs/reliability.md): the standby of the first's shard.
    assert set(services) == {"broker-init", "rabbitmq", *REGISTERED, "detokenizer-2", "loadtest"}
    assert services["detokenizer-2"]["command"] == ["detokenizer"]
    homes = {
        services[n]["environment"]["BATON_DETOK_HOME_SHARD"]
        for n in ("detokenizer", "detokenizer-2")
    }
    assert homes == {"0", "1"}

    broker = services["rabbitmq"]
    assert broker["image"].startswith("rabbitmq:3.13-management")
    assert "rabbitmq-diagnostics" in " ".join(broker["healthcheck"]["test"])
    published = {str(p.get("target") if isinstance(p, dict) else p).split(":")[-1] for p in
                 broker.get("ports", [])}  # fmt: skip
    assert {"5672/tcp", "15672/tcp"} <= published or {"5672", "15672"} <= published

    images = {services[name]["image"] for name in (*WORKERS, "loadtest", "broker-init")}
    assert len(images) == 1, f"one image for the whole stack, got {images}"
    for name in WORKERS:
        service = services[name]
        assert service["depends_on"]["rabbitmq"]["condition"] == "service_healthy", name
        assert service["command"] == [name]
        env = _env(service)
        assert env["BATON_SPILL_DIR"].startswith(SPILL_DIR + "/"), "a private subdirectory"
        assert env["BATON_LOG_FORMAT"] == "json"
        assert int(env["BATON_METRICS_PORT"]) > 0, "the healthcheck needs the metrics server"
        # Scalable with --scale: nothing may pin a name or a host port.
        assert "container_name" not in service, name
        assert not service.get("ports"), f"{name} publishes a host port"


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_and_decode_share_the_spill_store(runner: list[str], variant: str) -> None:
    config = _resolved(runner, variant)
    sources = {_volume_mounts(config["services"][n]).get(SPILL_DIR) for n in GPU_WORKERS}
    assert len(sources) == 1 and None not in sources, sources
    volume = config["volumes"][sources.pop()]
    # RAM-backed and shared: a tmpfs named volume, not each container's private /dev/shm.
    assert volume["driver_opts"]["type"] == "tmpfs"
    assert "mode=1777" in volume["driver_opts"]["o"], "the services run as a non-root user"


@pytest.mark.parametrize("variant", ["gpu-default", "gpu-explicit"])
def test_gpu_variant(runner: list[str], variant: str) -> None:
    services = _resolved(runner, variant)["services"]
    for name in GPU_WORKERS:
        service = services[name]
        devices = _gpu_devices(service)
        assert len(devices) == 1 and devices[0]["driver"] == "nvidia", name
        assert devices[0]["device_ids"] == ["0"]
        # CUDA IPC across containers needs the shared PID and IPC namespaces.
        assert service["ipc"] == "host" and service["pid"] == "host", name
        env = _env(service)
        assert env["BATON_DEVICE"] == "cuda"
        assert env["BATON_KV_TRANSPORT"] == "cuda-ipc"
    for name in ("rabbitmq", "tokenizer", "detokenizer", "loadtest"):
        assert not _gpu_devices(services[name]), f"{name} must not hold a GPU"
        assert "pid" not in services[name] and "ipc" not in services[name], name


def test_gpu_devices_are_chosen_by_env(runner: list[str]) -> None:
    services = _resolved(runner, "gpu-default", BATON_DECODE_GPUS="1", BATON_KV_TRANSPORT="shm")
    assert _gpu_devices(services["services"]["prefill"])[0]["device_ids"] == ["0"]
    assert _gpu_devices(services["services"]["decode"])[0]["device_ids"] == ["1"]
    assert _env(services["services"]["decode"])["BATON_KV_TRANSPORT"] == "shm"


def test_cpu_variant_has_no_gpu(runner: list[str]) -> None:
    services = _resolved(runner, "cpu")["services"]
    for name, service in services.items():
        assert not _gpu_devices(service), name
        assert "pid" not in service and "ipc" not in service, name
    for name in WORKERS:
        env = _env(services[name])
        assert env["BATON_DEVICE"] == "cpu"
        assert env["BATON_KV_TRANSPORT"] == "pool"
        assert env["BATON_MODEL"] == "", "the CPU stack runs the built-in tiny model"
        assert services[name]["build"]["args"]["TORCH_INDEX"].endswith("/whl/cpu")
    # A separate tag: building the CPU stack must not overwrite the GPU image.
    gpu_image = _resolved(runner, "gpu-default")["services"]["decode"]["image"]
    assert services["decode"]["image"] != gpu_image


@pytest.mark.parametrize("variant", VARIANTS)
def test_credentials(runner: list[str], variant: str) -> None:
    """Every party its own broker user and password; the broker gets them as a definitions file
    written by broker-init (hashes), never as a default user, and there is no guest."""
    services = _resolved(runner, variant, BATON_RABBITMQ_USER="ops")["services"]
    broker = services["rabbitmq"]
    assert not {k for k in _env(broker) if k.startswith("RABBITMQ_DEFAULT_")}
    assert broker["depends_on"]["broker-init"]["condition"] == "service_completed_successfully"
    mounts = [
        v if isinstance(v, str) else f"{v['source']}:{v['target']}" for v in broker["volumes"]
    ]
    assert any(
        m.endswith("deploy/rabbitmq/20-baton.conf:/etc/rabbitmq/conf.d/20-baton.conf:ro")
        or m.endswith(":/etc/rabbitmq/conf.d/20-baton.conf")
        for m in mounts
    ), mounts
    conf = (REPO / "deploy/rabbitmq/20-baton.conf").read_text()
    assert "load_definitions = /etc/rabbitmq/baton/definitions.json" in conf
    assert "loopback_users.guest = true" in conf

    init = services["broker-init"]
    command = init["command"] if isinstance(init["command"], str) else " ".join(init["command"])
    assert "definitions --admin-user ops" in command and "/definitions/definitions.json" in command
    assert " ".join(init["entrypoint"]) == "python -m deploy.permissions"
    assert _volume_mounts(init)["/definitions"] == _volume_mounts(broker)["/etc/rabbitmq/baton"]
    assert {k: v for k, v in _env(init).items() if k in PASSWORDS} == PASSWORDS

    for name in (*WORKERS, "gateway", "loadtest"):
        role = "client" if name == "loadtest" else name
        url = _env(services[name])["BATON_AMQP_URL"]
        assert url == f"amqp://baton-{role}:test-only-{role}@rabbitmq:5672/", name


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_default_password(runner: list[str], variant: str) -> None:
    result = _compose(runner, VARIANTS[variant])  # no password set
    assert result.returncode != 0
    assert "BATON_RABBITMQ_PASSWORD" in result.stderr


@pytest.mark.parametrize("missing", sorted(PASSWORDS))
def test_every_password_is_required(runner: list[str], missing: str) -> None:
    env = {k: v for k, v in PASSWORDS.items() if k != missing}
    result = _compose(runner, VARIANTS["cpu"], **env)
    assert result.returncode != 0 and missing in result.stderr


def test_loadtest_profile(runner: list[str]) -> None:
    services = _resolved(runner, "cpu", USERS="3", DURATION="5s", BATON_MODEL="tiny-random")
    services = services["services"]
    loadtest = services["loadtest"]
    assert loadtest["profiles"] == ["loadtest"]
    # Its prompts are drawn from the served model's vocabulary.
    assert (
        _env(loadtest)["BATON_MODEL"] == _env(services["prefill"])["BATON_MODEL"] == "tiny-random"
    )
    command = loadtest["command"]
    command = command if isinstance(command, str) else " ".join(command)
    entrypoint = " ".join(loadtest["entrypoint"])
    assert entrypoint == "locust"
    assert re.search(r"-f loadtest/serving/locustfile\.py --headless -u 3 -r 4 -t 5s", command), (
        command
    )
    assert "--csv /results/baton" in command
    assert "/results" in {
        (v.split(":")[1] if isinstance(v, str) else v["target"]) for v in loadtest["volumes"]
    }
    for name in WORKERS:
        assert loadtest["depends_on"][name]["condition"] == "service_healthy"
    # The image's HEALTHCHECK probes a Baton service; Locust serves none.
    assert loadtest["healthcheck"].get("disable") or loadtest["healthcheck"]["test"] == ["NONE"]


def test_dockerfile() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    assert dockerfile.startswith("#")
    # The base is a build argument whose default is the official image (deploy/base-images.sh
    # builds a replacement where Docker Hub cannot be reached).
    froms = re.findall(r"^FROM\s+(\S+)", dockerfile, re.M)
    assert froms[0] == "${BASE_IMAGE:-python:3.11-slim}", froms
    assert re.search(r"^ARG BASE_IMAGE\s*$", dockerfile, re.M), "declared before the first FROM"
    # The local wheels and CA bundle are copied in a build stage only, never into the image.
    final = dockerfile.rsplit("\nFROM ", 1)[1]
    assert "deploy/local" not in final and "COPY --from=deps /opt/venv" in final
    assert "ARG TORCH_WHEEL" in dockerfile and "--no-build-isolation" in final
    users = re.findall(r"^USER\s+(\S+)", dockerfile, re.M)
    assert users and users[-1] not in ("root", "0"), "the services must not run as root"
    healthcheck = re.search(r"^HEALTHCHECK .*\n(.*\n)*?\s*CMD (.*)$", dockerfile, re.M)
    assert healthcheck and "shared.observability.http_server" in healthcheck.group(2)
    assert "/health" in healthcheck.group(2)
    assert "ARG TORCH_INDEX" in dockerfile
    ignored = (REPO / ".dockerignore").read_text().split()
    for entry in ("models/", ".git/", "out/", "**/__pycache__/", "deploy/*", "!deploy/local/"):
        assert entry in ignored, entry
    # Every package the project installs is copied into the image (and nothing else is needed).
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    for pattern in packages["packages"]["find"]["include"]:
        assert f"COPY {pattern.rstrip('*')}/ " in final, pattern


def test_dockerfile_reads_requirements_from_pyproject(tmp_path: Path) -> None:
    """Run the Dockerfile's own extraction step against the real pyproject.toml."""
    joined = re.sub(r"\\\n", "", (REPO / "Dockerfile").read_text())
    (run,) = [line for line in joined.splitlines() if line.startswith("RUN EXTRAS=")]
    step = run.removeprefix("RUN ").split(" && ")[0].strip()
    assert step.endswith("> /tmp/requirements.txt"), step
    out = tmp_path / "requirements.txt"
    step = step.replace("/tmp/requirements.txt", shlex.quote(str(out)))
    step = step.replace(" python -c ", f" {shlex.quote(sys.executable)} -c ", 1)
    env = {**os.environ, "EXTRAS": "loadtest"}
    subprocess.run(["sh", "-c", step], cwd=REPO, env=env, check=True, timeout=60)
    requirements = out.read_text().splitlines()
    names = {re.split(r"[<>=;! ]", r, maxsplit=1)[0] for r in requirements}
    assert requirements[0].startswith("torch"), "the TORCH_INDEX step installs the first torch line"
    assert {"torch", "aio-pika", "prometheus-client", "locust"} <= names


@pytest.mark.parametrize("variant", VARIANTS)
def test_gateway_service(runner: list[str], variant: str) -> None:
    """The OpenAI gateway: same image as the workers, its own broker user, published on loopback
    by default, healthy when its own /health answers, no GPU."""
    services = _resolved(runner, variant)["services"]
    gateway = services["gateway"]
    assert gateway["command"] == ["gateway"]
    assert gateway["image"] == services["tokenizer"]["image"]
    env = _env(gateway)
    assert env["BATON_AMQP_URL"].startswith("amqp://baton-gateway:"), "its own broker user"
    assert env["BATON_GATEWAY_HOST"] == "0.0.0.0" and env["BATON_GATEWAY_PORT"] == "8000"
    ports = [str(p) for p in gateway["ports"]] if "ports" in gateway else []
    published = gateway["ports"][0]
    if isinstance(published, dict):  # Compose v2's long syntax
        assert published["host_ip"] == "127.0.0.1" and int(published["target"]) == 8000
    else:
        assert ports[0].startswith("127.0.0.1:") and ports[0].split("/")[0].endswith(":8000")
    assert "8000" in gateway["healthcheck"]["test"] and "/health" in gateway["healthcheck"]["test"]
    assert not _gpu_devices(gateway)


def test_images_without_a_registry(runner: list[str]) -> None:
    """deploy/base-images.sh's variables: the base and the broker image are replaced, the torch
    wheel named, host ports moved; the official images stay the defaults (test_stack_shape)."""
    services = _resolved(
        runner, "cpu", BATON_BASE_IMAGE="baton-python:3.11-bookworm",
        BATON_RABBITMQ_IMAGE="baton-rabbitmq:bookworm", BATON_TORCH_WHEEL="torch-x.whl",
        BATON_AMQP_HOST_PORT="25672", BATON_MANAGEMENT_HOST_PORT="35672",
    )["services"]  # fmt: skip
    assert services["rabbitmq"]["image"] == "baton-rabbitmq:bookworm"
    for name in (*WORKERS, "broker-init", "gateway", "loadtest"):
        args = services[name]["build"]["args"]
        assert args["BASE_IMAGE"] == "baton-python:3.11-bookworm", name
        assert args["TORCH_WHEEL"] == "torch-x.whl", name
    published = " ".join(str(p) for p in services["rabbitmq"]["ports"])
    assert "25672" in published and "35672" in published, published
    default = _resolved(runner, "cpu")["services"]
    assert default["decode"]["build"]["args"]["BASE_IMAGE"] == "", "the Dockerfile's default"
    # A local wheel is the CPU image's: the GPU stack never installs it.
    gpu = _resolved(runner, "gpu-default", BATON_TORCH_WHEEL="torch-x.whl")["services"]
    assert "TORCH_WHEEL" not in gpu["decode"]["build"]["args"]


def test_local_rabbitmq_image_matches_compose() -> None:
    """The broker image deploy/base-images.sh builds is checked healthy by the same command as
    compose.yaml's, and has the management plugin on."""
    dockerfile = (REPO / "deploy/images/rabbitmq.Dockerfile").read_text()
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    test = compose["services"]["rabbitmq"]["healthcheck"]["test"]
    healthcheck = re.search(r"^HEALTHCHECK .*\n\s*CMD (.*)$", dockerfile, re.M)
    assert healthcheck and json.loads(healthcheck.group(1)) == test[1:], test
    assert "rabbitmq-plugins enable --offline rabbitmq_management" in dockerfile
    script = (REPO / "deploy/base-images.sh").read_text()
    assert "debootstrap --variant=minbase bookworm" in script and "docker import" in script
    assert subprocess.run(["bash", "-n", str(REPO / "deploy/base-images.sh")]).returncode == 0


def test_gateway_needs_auth_when_published(runner: list[str]) -> None:
    services = _resolved(runner, "cpu", BATON_API_KEY="k3y", BATON_GATEWAY_ALLOW_NO_AUTH="false")
    env = _env(services["services"]["gateway"])
    assert env["BATON_API_KEY"] == "k3y" and env["BATON_GATEWAY_ALLOW_NO_AUTH"] == "false"


def test_broker_cluster_overlay(runner: list[str]) -> None:
    """compose.cluster.yaml: three broker nodes with one cookie from the environment and the
    classic peer-discovery config, every service given every node (BATON_AMQP_HOSTS) and
    started once all three are up; BATON_QUEUE_TYPE reaches every service and broker-init."""
    files = ["compose.yaml", "compose.cpu.yaml", "compose.cluster.yaml"]
    hosts = "rabbitmq:5672,rabbitmq-2:5672,rabbitmq-3:5672"
    env = {**PASSWORDS, "BATON_ERLANG_COOKIE": "c00k1e", "BATON_AMQP_HOSTS": hosts,
           "BATON_QUEUE_TYPE": "quorum"}  # fmt: skip
    result = _compose(runner, files, **env)
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    nodes = ("rabbitmq", "rabbitmq-2", "rabbitmq-3")
    conf = (REPO / "deploy/rabbitmq/30-cluster.conf").read_text()
    for i, name in enumerate(nodes, 1):
        node = services[name]
        assert _env(node)["RABBITMQ_ERLANG_COOKIE"] == "c00k1e"
        assert node.get("hostname", "rabbitmq") == name  # the node names of 30-cluster.conf
        assert f"cluster_formation.classic_config.nodes.{i} = rabbit@{name}" in conf
        mounts = " ".join(v if isinstance(v, str) else v["target"] for v in node["volumes"])
        assert "conf.d/30-cluster.conf" in mounts and "conf.d/20-baton.conf" in mounts
        assert _volume_mounts(node)["/etc/rabbitmq/baton"] == "broker-definitions"
    data = {_volume_mounts(services[n])["/var/lib/rabbitmq"] for n in nodes}
    assert len(data) == 3  # a data directory each
    assert "cluster_formation.target_cluster_size_hint = 3" in conf  # queues made on all three
    for name in (*WORKERS, "gateway"):
        assert _env(services[name])["BATON_AMQP_URL"].endswith(f"@{hosts}/"), name
        assert set(services[name]["depends_on"]) >= set(nodes), name
    for name in (*WORKERS, "gateway", "broker-init"):
        assert _env(services[name])["BATON_QUEUE_TYPE"] == "quorum", name
    without_cookie = {k: v for k, v in env.items() if k != "BATON_ERLANG_COOKIE"}
    refused = _compose(runner, files, **without_cookie)
    assert refused.returncode != 0 and "BATON_ERLANG_COOKIE" in refused.stderr


def test_compose_check_in_make_test_skips_where_docker_cannot_run(tmp_path: Path) -> None:
    """``make test`` ends with the Compose check, which says in one line that it is skipped where
    Docker cannot run (here: no docker on PATH) and exits 0; run by hand, it fails there."""
    make = (REPO / "Makefile").read_text()
    recipe = make.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "-m pytest" in recipe and "-m deploy.compose_check --skip-without-docker" in recipe
    run = [sys.executable, "-m", "deploy.compose_check"]
    env = {**os.environ, "PATH": str(tmp_path)}
    skipped = subprocess.run([*run, "--skip-without-docker"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    assert skipped.stdout.startswith("compose-check SKIPPED: Docker cannot run here (no docker")
    failed = subprocess.run(run, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert failed.returncode != 0 and "no docker CLI" in failed.stderr
