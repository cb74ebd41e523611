"""``baton serve MODEL``: vLLM's spelling of ``python -m services up``, its flags' help read from
shared/config.py's comments; and the console script that installs it."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from services.cli import build_parser, serve_config
from services.launcher import free_port_block, fresh_vhost
from shared.config import REPO_ROOT, BatonConfig
from shared.config_flags import field_help

tomllib = pytest.importorskip("tomllib", reason="stdlib from Python 3.11")


def test_every_setting_has_its_comment_as_help() -> None:
    helps = field_help(BatonConfig)
    assert set(helps) == {f.name for f in dataclasses.fields(BatonConfig)}
    assert [name for name, text in helps.items() if not text] == []
    # A comment above a group describes each field of it; a section line ends a group.
    assert (
        helps["decode_cpus"] == helps["prefill_cpus"] and "Linux CPU list" in helps["decode_cpus"]
    )
    assert helps["amqp_url"].startswith("The RabbitMQ broker")
    assert "0 = any free port" in helps["gateway_port"] and "listens" not in helps["gateway_port"]


def test_serve_help_lists_every_flag_with_its_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "serve", "--help"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    flat = " ".join(out.split())  # argparse wraps lines
    for flag in ("--host", "--port", "--served-model-name", "--cpu-share", "--no-cpu-share"):
        assert flag in flat
    for f in dataclasses.fields(BatonConfig):
        if f.name != "model":  # the positional argument
            assert "--" + f.name.replace("_", "-") in flat, f.name
        assert f"[BATON_{f.name.upper()}; default" in flat or f.name == "model", f.name
    assert "The gateway's port; 0 = any free port" in flat and "model " in flat


def test_serve_arguments_make_the_config_and_the_services_flags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BATON_MAX_NUM_SEQS", "3")
    monkeypatch.setenv("BATON_CPU_SHARE", "true")
    args = build_parser().parse_args(
        ["serve", "/some/dir", "--served-model-name", "my-model", "--port", "0",
         "--host", "0.0.0.0", "--no-cpu-share", "--kv-cache-mb", "64"]
    )  # fmt: skip
    config, flags = serve_config(args)
    assert config == BatonConfig.from_env().replace(
        model="/some/dir", served_model_name="my-model", gateway_port=0, gateway_host="0.0.0.0",
        cpu_share=False, kv_cache_mb=64,
    )  # fmt: skip
    assert config.max_num_seqs == 3  # the environment fills the rest
    assert flags == [
        "--model", "/some/dir", "--served-model-name", "my-model", "--no-cpu-share",
        "--kv-cache-mb", "64", "--gateway-host", "0.0.0.0", "--gateway-port", "0",
    ]  # fmt: skip
    with pytest.raises(SystemExit):  # the model is required
        build_parser().parse_args(["serve", "--port", "1"])


def test_the_console_script_is_declared() -> None:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"] == {"baton": "services.cli:main"}


@pytest.mark.integration
@pytest.mark.slow
def test_serve_answers_models_with_the_served_name() -> None:
    port = free_port_block(1)
    spill = tempfile.mkdtemp(
        prefix="baton-spill-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )
    log = Path(tempfile.mkstemp(prefix="baton-serve-", suffix=".log")[1])
    with fresh_vhost(prefix="baton-test-cli") as url, open(log, "wb") as out:
        env = {**os.environ, "BATON_SPILL_DIR": spill, "BATON_LOG_FORMAT": "json",
               "BATON_METRICS_PORT": "0"}  # fmt: skip
        cmd = [sys.executable, "-m", "services.cli", "serve", "tiny-random",
               "--served-model-name", "my-model", "--port", str(port), "--amqp-url", url,
               "--kv-cache-mb", "64"]  # fmt: skip
        proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            body = _models(port, proc, log)
            assert [m["id"] for m in body["data"]] == ["my-model"]
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    shutil.rmtree(spill, ignore_errors=True)
    assert proc.returncode == 0, log.read_text()[-3000:]


def _models(port: int, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            if r.status_code == 200:
                return r.json()  # type: ignore[no-any-return]
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(log.read_text()[-3000:])
